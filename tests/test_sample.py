"""Sampling with a KV cache (nanochat/engine.py, scripts/sample.py).

Cached decoding equals uncached decoding for
every arch, token for token and logit for logit; seeds reproduce samples; the script streams text and refuses
bad input in one line."""

import io
import re

import pytest
import torch

from conftest import TINY_TRAIN, linked_base, random_model
from nanochat.gpt import GPT, GPTConfig
from nanochat.engine import KVCache, LAST, Utf8Stream, context_room, generate, sample_next
from nag.model import NAGGPT, NAGConfig
from nag.mod import ModConfig
from nag.router_mod import RouterMoDGPT
from scripts import base_train, sample

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CFG = dict(sequence_len=64, vocab_size=128, n_layer=2, n_head=2, n_kv_head=2, n_embd=64)
NAG = {"nag": NAGConfig(alpha_warmup_tokens=0)}
GQA_WINDOW = {"n_head": 4, "n_kv_head": 2, "window_pattern": "SL"}  # layer 0 sees 32 positions back, not 64
# name: (class, GPTConfig changes, constructor arguments)
VARIANTS = {
    "gpt": (GPT, {}, {}),
    "gpt-gqa-window": (GPT, {"n_head": 4, "n_kv_head": 1, "window_pattern": "SL"}, {}),
    "nag": (NAGGPT, {}, NAG),
    "nag-gqa-window": (NAGGPT, GQA_WINDOW, NAG),
    "nag-mod": (NAGGPT, GQA_WINDOW, {**NAG, "mod": ModConfig("both", 0.3)}),
    "router-mod": (RouterMoDGPT, {}, {"mod": ModConfig("both", 0.3)}),
}


def build(name):
    """A variant with random weights and calibrated MoD thresholds (conftest.random_model)."""
    cls, cfg, kwargs = VARIANTS[name]
    return random_model(cls, GPTConfig(**{**CFG, **cfg}), 128, **kwargs)


def tokens(b, t, seed=0):
    return torch.randint(0, 128, (b, t), generator=torch.Generator().manual_seed(seed))


PROMPT = tokens(1, 10, seed=5)[0].tolist()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_cached_greedy_equals_uncached_up_to_a_full_context(name):
    model = build(name)
    cached = list(generate(model, PROMPT, 100, temperature=0))
    assert len(cached) == context_room(model, len(PROMPT)) == 64 - 10 + 1  # stopped at the context, past every window
    assert cached == list(generate(model, PROMPT, 100, temperature=0, use_cache=False))
    # the tokens did skip, near the target on average; the global attention threshold may pass a whole layer (here
    # nag-mod's attention 0: calibrated in training, where each row's capacity made that layer skip; docs/mod.md)
    if getattr(model, "thresholds", None) is not None:
        rates = model.thresholds.pop_rates("eval")
        skipped = [r > 0 for r in rates.values()]
        assert len(rates) == 4 and sum(skipped) >= 3 and 0.15 < sum(rates.values()) / 4 < 0.45, rates


@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_cached_step_gives_the_full_forwards_last_logits(name):
    model = build(name)
    seq = tokens(1, 64, seed=6)
    with torch.no_grad():
        full = model(seq)[0]  # one forward over the whole row: position t's logits see positions 0..t
        cache = KVCache.for_model(model)
        steps = [model(seq[:, :10], logits_at=LAST, cache=cache)]  # the prefill: the prompt in one forward
        steps += [model(seq[:, t : t + 1], logits_at=LAST, cache=cache) for t in range(10, 64)]
    assert cache.pos == 64
    got = torch.cat(steps)
    assert got.shape == (55, 128)
    assert (got - full[9:]).abs().max().item() < 1e-5


def test_context_limits():
    model = build("gpt")
    assert list(generate(model, PROMPT, 0, temperature=0)) == []
    # a full prompt: one token, never fed back
    assert len(list(generate(model, tokens(1, 64)[0].tolist(), 5, temperature=0))) == 1
    assert len(list(generate(model, tokens(1, 62)[0].tolist(), 5, temperature=0))) == 3
    for bad in ([], tokens(1, 65)[0].tolist()):
        with pytest.raises(ValueError):
            next(generate(model, bad, 5))


def test_seeds_top_k_and_modes():
    model = build("nag-mod")
    a = list(generate(model, PROMPT, 20, temperature=1.0, seed=7))
    assert a == list(generate(model, PROMPT, 20, temperature=1.0, seed=7))
    assert a != list(generate(model, PROMPT, 20, temperature=1.0, seed=8))
    greedy = list(generate(model, PROMPT, 20, temperature=0))
    assert list(generate(model, PROMPT, 20, temperature=1.0, top_k=1, seed=3)) == greedy
    model.train()  # MoD's training thresholds are batch quantiles: generation runs in eval mode and puts the mode back
    assert list(generate(model, PROMPT, 20, temperature=0)) == greedy and model.training
    # top-k draws only among the k largest logits
    logits = torch.randn(1, 128, generator=torch.Generator().manual_seed(0))
    top = set(torch.topk(logits, 3).indices[0].tolist())
    rng = torch.Generator().manual_seed(0)
    drawn = {sample_next(logits, 2.0, 3, rng).item() for _ in range(200)}
    assert drawn == top


def test_utf8_stream_prints_only_complete_characters():
    pieces = [
        b"a",
        "é".encode()[:1],
        "é".encode()[1:] + "🙂".encode()[:2],
        "🙂".encode()[2:3],
        "🙂".encode()[3:],
        b"\xe6",
    ]
    stream = Utf8Stream(lambda i: pieces[i])
    assert [stream.push(i) for i in range(len(pieces))] == ["a", "", "é", "", "🙂", ""]
    assert stream.finish() == "\ufffd"  # an unfinished character at the end


def test_prompt_file_format():
    assert sample.split_prompts("\n\nThe first\nspans two lines  \n\n \nThe second\n") == [
        "The first\nspans two lines",
        "The second",
    ]


# ---------------------------------------------------------------------------
# the script, on tiny trained checkpoints


class Recorder:
    """A stdout that remembers every write and flush, in order."""

    def __init__(self):
        self.events = []

    def write(self, s):
        self.events.append(s)

    def flush(self):
        self.events.append(None)

    def text(self):
        return "".join(e for e in self.events if e)


@pytest.fixture(scope="module")
def runs(tiny_base_dir, tmp_path_factory):
    """A NAG-MoD run (2 steps at a 25% skip rate) and a GPT run (1 step) in a base dir sharing the session's corpus."""
    base = linked_base(tiny_base_dir, tmp_path_factory.mktemp("sample_base"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(base))
        base_train.main(
            TINY_TRAIN
            + ["--arch", "nag", "--mod-rate", "0.25", "--run", "nag", "--num-iterations", "2", "--eval-every", "-1"]
        )
        base_train.main(TINY_TRAIN + ["--arch", "gpt", "--run", "gpt", "--num-iterations", "1", "--eval-every", "-1"])
        yield base


def run_sample(*argv, stdin=""):
    out = Recorder()
    return sample.main(list(argv), stdin=io.StringIO(stdin), out=out), out


def test_script_streams_and_matches_the_uncached_path(runs):
    prompt = "Document 3. The model"
    results, out = run_sample("--run", "nag", "--prompt", prompt, "--max-tokens", "12", "--temperature", "0")
    text = out.text()
    assert (
        text.startswith("sampling ")
        and "(nag)" in text
        and "KV cache | MoD both at rate 0.25, thresholds from training" in text
    )
    assert "MoD: skipped attn" in text
    (r,) = results
    assert r["tokens"] == 12 and r["end"] == "max tokens" and f"{prompt}{r['completion']}\n" in text
    # streamed: the completion arrives in pieces (one per complete character run), each flushed at once
    start = out.events.index(prompt)
    end = out.events.index("\n", start)
    pieces = out.events[start + 2 : end]  # after the prompt and its flush
    assert len([p for p in pieces if p]) >= 4
    assert all(p is None for p in pieces[1::2]) and "".join(p for p in pieces if p) == r["completion"]
    again, _ = run_sample("--run", "nag", "--prompt", prompt, "--max-tokens", "12", "--temperature", "0", "--no-cache")
    assert again[0]["completion"] == r["completion"]


def test_script_seeds_prompt_sources_and_mod_rate(runs, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("The model\nof the data\n\nThe layer\n")
    argv = [
        "--run",
        "nag",
        "--prompt",
        "-",
        "--prompt-file",
        str(path),
        "--max-tokens",
        "6",
        "--temperature",
        "1",
        "--num-samples",
        "2",
    ]
    a, _ = run_sample(*argv, stdin="Document 1.\n")
    assert [(r["prompt"], r["seed"]) for r in a] == [
        (p, s) for p in ("Document 1.", "The model\nof the data", "The layer") for s in (42, 43)
    ]
    b, _ = run_sample(*argv, stdin="Document 1.\n")
    assert a == b
    c, _ = run_sample(*argv, "--seed", "7", stdin="Document 1.\n")
    assert [r["completion"] for r in c] != [r["completion"] for r in a]
    # another skip rate: thresholds calibrated on train tokens, then per token
    _, out = run_sample(
        "--run",
        "nag",
        "--prompt",
        "The",
        "--max-tokens",
        "8",
        "--mod-rate",
        "0.5",
        "--mod-blocks",
        "mlp",
        "--mod-calib-tokens",
        "512",
    )
    assert (
        "MoD mlp at rate 0.5, thresholds calibrated on 512 train tokens" in out.text()
        and "MoD: skipped mlp" in out.text()
    )
    # a prompt that leaves less room than --max-tokens
    results, out = run_sample(
        "--run", "gpt", "--prompt", " ".join(["the"] * 60), "--max-tokens", "10", "--temperature", "0"
    )
    room = int(re.search(r"the context of 64 leaves room for (\d+) more", out.text()).group(1))
    assert 1 <= room < 10 and (results[0]["tokens"], results[0]["end"]) == (room, "context full")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--run", "never-trained", "--prompt", "a"], "does not exist"),
        (["--run", "gpt", "--step", "5", "--prompt", "a"], "no complete checkpoint for step 5"),
        (["--run", "gpt"], "no prompt: give --prompt"),
        (["--run", "gpt", "--prompt", " "], "prompt 1 is empty"),
        (["--run", "gpt", "--prompt", "the " * 80], "more than the model's context of 64"),
        (["--run", "gpt", "--prompt", "a", "--temperature", "-1"], "--temperature must be >= 0 (0: greedy)"),
        (["--run", "gpt", "--prompt", "a", "--temperature", "nan"], "--temperature must be >= 0 (0: greedy)"),
        (["--run", "gpt", "--prompt", "a", "--top-k", "0"], "--top-k must be positive"),
        (["--run", "gpt", "--prompt", "a", "--mod-rate", "0.2"], "has no score to skip tokens by"),
        (["--run", "nag", "--prompt", "a", "--mod-rate", "0.95"], "--mod-rate must be in [0, 0.95)"),
        (["--run", "gpt", "--prompt", "-", "--prompt-file", "-"], "stdin can be read once"),
    ],
)
def test_script_errors_are_one_line(runs, script_error, argv, message):
    assert message in script_error(sample.main, *argv)


def test_bench_sample_prints_both_modes(capsys):
    from scripts.bench import sample as bench_sample

    rows = bench_sample.main(
        [
            "--depth",
            "2",
            "--model-dim",
            "64",
            "--head-dim",
            "32",
            "--max-seq-len",
            "64",
            "--vocab-size",
            "128",
            "--prompt-tokens",
            "8",
            "--max-tokens",
            "16",
            "--repeats",
            "1",
            "--arch",
            "gpt,nag,nag-mod",
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert "uncached tok/s" in out and "speed-up" in out and out.strip().splitlines()[-1].startswith("[{")
    assert [r["model"] for r in rows] == ["gpt", "nag", "nag-mod"]
    assert all(r["same_tokens"] and r["tokens"] == 16 and r["cached_tok_s"] > 0 for r in rows)
