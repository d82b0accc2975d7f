"""The Hugging Face export (scripts/export_hf.py, nag/hf/) against the native model, for every arch.

transformers loads the folder with trust_remote_code and gives the native logits for every arch (GPT, NAG,
NAG-MoD with GQA and a sliding window, router-MoD GPT, GPT and NAG on nanochat's recipe); greedy generate()
equals nanochat.engine's, alone and in a left-padded batch; the tokenizer gives tiktoken's ids; the model
card records the run; lm-evaluation-harness scores a local task offline and agrees with the native model's scores."""

import os
import sys
import json
import types

import pytest
import torch

from conftest import linked_base, random_model
from nanochat.gpt import GPT, GPTConfig
from nanochat.engine import context_room, generate
from nanochat import checkpoint_manager as ckpt
from nanochat.tokenizer import get_tokenizer
from nag.model import NAGGPT, NAGConfig
from nag.mod import ModConfig
from nag.router_mod import RouterMoDGPT
from nanochat.recipe import RecipeGPT
from nag.recipe import NAGRecipeGPT
from nag.rivals import LAYERROPE_INITS, LNSGPT, LayerRoPEGPT, PeriGPT
from scripts import export_hf

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

CFG = dict(sequence_len=64, vocab_size=512, n_layer=2, n_head=2, n_kv_head=2, n_embd=64)
GQA_WINDOW = {"n_head": 4, "n_kv_head": 2, "window_pattern": "SL"}  # layer 0 sees 32 positions back
# name: (class, GPTConfig changes, constructor arguments); the NAG run is mid-warm-up: α × 0.5 at its 500 tokens
VARIANTS = {
    "gpt": (GPT, {}, {}),
    "nag": (NAGGPT, {}, {"nag": NAGConfig(alpha_warmup_tokens=1000)}),
    "nag-mod": (NAGGPT, GQA_WINDOW, {"nag": NAGConfig(alpha_warmup_tokens=0), "mod": ModConfig("both", 0.3)}),
    "router-mod": (RouterMoDGPT, {}, {"mod": ModConfig("both", 0.3)}),
    # nanochat's recipe, every part on (value embeddings on layer 1, smear, backout, lambdas), GQA
    "gpt-recipe": (RecipeGPT, {"n_head": 4, "n_kv_head": 2}, {}),
    "nag-recipe": (NAGRecipeGPT, {"n_head": 4, "n_kv_head": 2}, {"nag": NAGConfig(alpha_warmup_tokens=1000)}),
    # the rival depth arms (nag/rivals.py); LayerRoPE at its depth init, whose base b = 1e4 travels as a weight
    "gpt-lns": (LNSGPT, {}, {}),
    "gpt-peri": (PeriGPT, GQA_WINDOW, {}),
    "gpt-layerrope": (LayerRoPEGPT, GQA_WINDOW, {"layerrope": LAYERROPE_INITS["depth"]}),
}
STEP, TOKENS = 5, 500
TEXTS = [
    "The model data token",
    "Héllo wörld — naïve café; 東京 данные 🙂 👩‍👩‍👧‍👦",
    "x = [1, 22, 333]\n\n  y\t\tz\r\n",
    "<|bos|>one<|user_start|>two<|assistant_end|>",
    "don't WE'LL 12345",
]


def build(name):
    """A variant with random weights and calibrated MoD thresholds (conftest.random_model), at TOKENS seen."""
    cls, cfg, kwargs = VARIANTS[name]
    model = random_model(cls, GPTConfig(**{**CFG, **cfg}), 512, **kwargs)
    model.set_tokens_seen(TOKENS)
    return model


def save_run(base, name, model, tokenizer):
    """A run directory as training and base_eval leave it: one checkpoint, config.json, eval/ of the step."""
    run_dir = os.path.join(base, "runs", name)
    fingerprints = {"tokenizer": tokenizer.fingerprint(), "data_train": "train-fp", "data_val": "val-fp"}
    meta = {
        "arch": model.arch,
        "model_config": model.config.to_dict(),
        **model.extra_meta(),
        "step": STEP,
        "tokens": TOKENS,
        "world_size": 1,
        "fingerprints": fingerprints,
    }
    os.makedirs(os.path.join(run_dir, "eval"))
    ckpt.save_checkpoint(run_dir, STEP, model, meta, {"optimizer": None})
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(
            {
                "command": f"scripts/base_train.py --run {name}",
                "git_commit": "abc123",
                "num_params": 98765,
                "args": {"arch": model.arch, "seed": 42},
                "fingerprints": fingerprints,
            },
            f,
        )
    with open(os.path.join(run_dir, "eval", f"step_{STEP:06d}.json"), "w") as f:
        json.dump(
            {
                "step": STEP,
                "val_bpb": 2.5,
                "train_bpb": 2.4,
                "core_metric": None,
                "partial_core": 0.0125,
                "partial_label": "CORE (1 of 22 tasks)",
                "tasks": {"copa": {"accuracy": 0.52, "centered": 0.04}},
            },
            f,
        )
    return run_dir


@pytest.fixture(scope="module")
def exported(tiny_base_dir, tmp_path_factory):
    """{name: (native model, export dir)}, every variant exported once (the export verifies its own logits)."""
    base = linked_base(tiny_base_dir, tmp_path_factory.mktemp("export") / "base")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(base))
        tokenizer = get_tokenizer()
        for name in VARIANTS:
            model = build(name)
            save_run(base, name, model, tokenizer)
            hf_dir, max_diff = export_hf.main(["--run", name, "--out", str(base / "hf" / name)])
            assert max_diff <= 1e-5
            out[name] = (model, hf_dir)
    return out


def load(hf_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_transformers_gives_the_native_logits(exported, name):
    model, hf_dir = exported[name]
    hf = load(hf_dir)
    assert type(hf).__name__ == "NagChatForCausalLM" and not hf.training
    x = torch.randint(0, 512, (3, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(x)
        out = hf(x, labels=x)
        loss = model(x[:, :-1].contiguous(), x[:, 1:].contiguous())
    assert (out.logits - want).abs().max().item() < 1e-5
    assert abs(out.loss.item() - loss.item()) < 1e-5
    if name == "nag":  # the α warm-up factor of the checkpoint's 500 tokens travelled in the config
        assert hf.config.alpha_warmup == 0.5


@pytest.fixture(scope="module")
def native_tok(tiny_base_dir):
    from nanochat.tokenizer import Tokenizer

    return Tokenizer.from_directory(os.path.join(tiny_base_dir, "tokenizer"))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_generate_equals_the_engine(exported, native_tok, name):
    model, hf_dir = exported[name]
    hf = load(hf_dir)
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir, trust_remote_code=True)
    prompt = "The model data"
    ids = native_tok.encode(prompt, prepend=native_tok.get_bos_token_id())
    enc = tok(prompt, return_tensors="pt")
    assert enc["input_ids"][0].tolist() == ids  # <|bos|> in front, as scripts.sample encodes a prompt
    room = context_room(model, len(ids))  # up to a full context: past every window
    want = list(generate(model, ids, room, temperature=0))
    # transformers stops at eos = <|bos|>, as scripts.sample
    want = want[: want.index(ids[0]) + 1] if ids[0] in want else want
    got = hf.generate(**enc, max_new_tokens=room, do_sample=False)[0, len(ids) :].tolist()
    assert got == want and len(got) > 20, (got, want)
    if name == "nag-mod":  # without the cache transformers recomputes the whole row each step: the same tokens
        assert hf.generate(**enc, max_new_tokens=room, do_sample=False, use_cache=False)[0, len(ids) :].tolist() == want


@pytest.mark.parametrize("name", ["nag-mod", "gpt-recipe", "nag-recipe"])  # the recipe's smear must skip the padding
def test_left_padded_batch_generates_as_each_prompt_alone(exported, native_tok, name):
    model, hf_dir = exported[name]
    hf = load(hf_dir)
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir, trust_remote_code=True)
    tok.padding_side = "left"
    prompts = ["The", "Gradient norm residual attention head vector matrix"]
    enc = tok(prompts, return_tensors="pt", padding=True)
    assert enc["attention_mask"][0].tolist().count(0) >= 4
    got = hf.generate(**enc, max_new_tokens=12, do_sample=False)[:, enc["input_ids"].size(1) :].tolist()
    bos = native_tok.get_bos_token_id()
    for p, g in zip(prompts, got):
        want = list(generate(model, native_tok.encode(p, prepend=bos), 12, temperature=0))
        want = want[: want.index(bos) + 1] if bos in want else want
        # a row that ended is padded
        assert g[: len(want)] == want and set(g[len(want) :]) <= {tok.pad_token_id}, (p, g, want)
    with pytest.raises(ValueError, match="trained on 64 positions"):  # never a position past the context
        hf.generate(**tok("The", return_tensors="pt"), max_new_tokens=70, do_sample=False, eos_token_id=None)


def test_tokenizer_gives_tiktokens_ids(exported, native_tok):
    tok = transformers.AutoTokenizer.from_pretrained(exported["gpt"][1], trust_remote_code=True)
    enc = native_tok.enc
    bos = enc.encode_single_token("<|bos|>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        bos,
        bos,
        enc.encode_single_token("<|output_end|>"),
    )
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert ids == [bos] + enc.encode(text, allowed_special="all")  # special tokens in text stay whole
        assert tok.decode(ids[1:]) == text
        # as training saw it
        assert tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] == native_tok.encode(text)
    assert tok.decode(tok(TEXTS[3])["input_ids"], skip_special_tokens=True) == "onetwo"


def test_folder_and_model_card(exported):
    hf_dir = exported["nag"][1]
    assert sorted(os.listdir(hf_dir)) == [
        "README.md",
        "config.json",
        "configuration_nagchat.py",
        "generation_config.json",
        "inputs.json",
        "model.safetensors",
        "modeling_nagchat.py",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    for name in ("configuration_nagchat.py", "modeling_nagchat.py"):  # self-contained: the folder has no repo to import
        code = open(os.path.join(hf_dir, name)).read()
        assert "import nanochat" not in code and "from nanochat" not in code and "from nag" not in code
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    assert cfg["arch"] == "nag" and cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_nagchat.NagChatForCausalLM"
    assert json.load(open(os.path.join(hf_dir, "..", "..", "hf", "nag-mod", "config.json")))["mod"] == {
        "blocks": "both",
        "rate": 0.3,
    }
    card = open(os.path.join(hf_dir, "README.md")).read()
    for expected in (
        "python -m scripts.export_hf --run nag --out ",
        "# nag, step 5: NAG",
        "| n_embd | 64 |",
        "parameters | 98,765",
        "`scripts/base_train.py --run nag`",
        "- data_train: `train-fp`",
        "- tokenizer: `",
        "- val bpb: 2.5000",
        "CORE (1 of 22 tasks): 0.0125 (not CORE",
        "| copa | 0.5200 | +0.0400 |",
        "α warm-up factor at this step | 0.5",
        "largest |logit difference| against the native model at export: 0",
        "trust_remote_code=True,add_bos_token=True",
    ):
        assert expected in card, expected


def test_force_moves_an_edited_file_aside_instead_of_over_it(exported, monkeypatch, tmp_path, capsys):
    """The manifest (inputs.json) keeps the sha256 of every file written: --force over an earlier export moves a file of
    it changed since (an edited model card) to replaced/<time>/, never over it; unchanged files are simply rewritten."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", os.path.dirname(os.path.dirname(exported["gpt"][1])))
    out = tmp_path / "hf"
    export_hf.main(["--run", "gpt", "--out", str(out), "--no-verify"])
    manifest = json.load(open(out / "inputs.json"))
    assert (
        manifest["tool"] == "scripts.export_hf"
        and manifest["inputs"]["step"] == STEP
        and "README.md" in manifest["sha256"]
    )
    with open(out / "README.md", "a") as f:
        f.write("\nmy notes\n")
    capsys.readouterr()
    export_hf.main(["--run", "gpt", "--out", str(out), "--no-verify", "--force"])
    (stamp,) = os.listdir(out / "replaced")
    assert (
        os.listdir(out / "replaced" / stamp) == ["README.md"]
        and "my notes" in (out / "replaced" / stamp / "README.md").read_text()
    )
    assert "my notes" not in (out / "README.md").read_text()
    assert f"note: README.md in {out} changed since `python -m scripts.export_hf` wrote it" in capsys.readouterr().out
    # nothing changed since: nothing set aside
    export_hf.main(["--run", "gpt", "--out", str(out), "--no-verify", "--force"])
    assert os.listdir(out / "replaced") == [stamp]


def test_refusals_are_one_line(exported, script_error, monkeypatch, tmp_path):
    hf_dir = exported["gpt"][1]
    base = os.path.dirname(os.path.dirname(hf_dir))
    monkeypatch.setenv("NANOCHAT_BASE_DIR", base)
    assert "is not empty; choose another --out, or add --force" in script_error(
        export_hf.main, "--run", "gpt", "--out", hf_dir
    )
    assert "no complete checkpoint for step 7" in script_error(
        export_hf.main, "--run", "gpt", "--step", "7", "--out", str(tmp_path / "x")
    )
    monkeypatch.setitem(sys.modules, "safetensors", None)
    assert (
        script_error(export_hf.main, "--run", "gpt", "--out", str(tmp_path / "y"))
        == "error: exporting needs the safetensors package: pip install -e '.[hf]'"
    )
    assert not os.path.exists(tmp_path / "y")


def test_lm_eval_scores_a_local_task_offline(exported, native_tok, tmp_path, monkeypatch):
    """lm-evaluation-harness (its Python API, the CLI's code) on a multiple-choice task of eight local items: the same
    log-likelihoods and accuracy as the native model gives, with nothing downloaded."""
    for var, value in (
        ("HF_DATASETS_OFFLINE", "1"),
        ("HF_HUB_OFFLINE", "1"),
        ("HF_DATASETS_CACHE", str(tmp_path / "cache")),
    ):
        monkeypatch.setenv(var, value)  # read when datasets is imported, which lm_eval does
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    model, hf_dir = exported["nag"]
    items = [
        {"query": f"Document {i}. The", "choices": ["model data token", "loss layer", "café straße"], "gold": i % 3}
        for i in range(8)
    ]
    with open(tmp_path / "items.jsonl", "w") as f:
        f.writelines(json.dumps(it) + "\n" for it in items)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'items.jsonl'}\n"
        "output_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{query}}'\ndoc_to_choice: "
        "choices\ndoc_to_target: gold\nmetric_list:\n  - metric: "
        "acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    res = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": hf_dir, "trust_remote_code": True, "add_bos_token": True},
        tasks=["tiny_mc"],
        task_manager=TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False),
        batch_size=8,
        device="cpu",
        log_samples=True,
    )
    acc = res["results"]["tiny_mc"]["acc,none"]
    # the native model's log-likelihood of " choice" after <|bos|> + query,
    # the continuation's tokens as lm-eval splits them
    bos, hits = native_tok.get_bos_token_id(), 0
    for sample in res["samples"]["tiny_mc"]:
        doc, lls = sample["doc"], [r[0][0] for r in sample["resps"]]
        want = []
        for choice in doc["choices"]:
            ctx, whole = native_tok.encode(doc["query"]), native_tok.encode(doc["query"] + " " + choice)
            ids = torch.tensor([[bos] + whole])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids)[0, :-1].double(), dim=-1)
            want.append(sum(logp[t - 1, ids[0, t]].item() for t in range(1 + len(ctx), ids.size(1))))
        assert max(abs(a - b) for a, b in zip(lls, want)) < 1e-4, (lls, want)
        hits += max(range(3), key=lambda i: want[i]) == doc["gold"]
    assert len(res["samples"]["tiny_mc"]) == 8 and acc == hits / 8


@pytest.mark.parametrize("where", ["weights", "tokenizer"])
def test_a_full_disk_is_one_line_and_leaves_no_export(exported, script_error, monkeypatch, tmp_path, where):
    """ENOSPC injected where the export writes (safetensors raises its own error type, the tokenizer an OSError): one
    line naming the folder, no folder and no staging left; with --force over an earlier export, its files stay as they
    were."""
    import errno
    from safetensors import SafetensorError

    hf_dir = exported["gpt"][1]
    monkeypatch.setenv("NANOCHAT_BASE_DIR", os.path.dirname(os.path.dirname(hf_dir)))

    def full(*a, **k):
        if where == "weights":
            raise SafetensorError('Error while serializing: I/O error: No space left on device (os error 28)')
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "weights":
        monkeypatch.setattr("safetensors.torch.save_file", full)
    else:
        monkeypatch.setattr("nag.hf.tokenizer.hf_tokenizer", lambda *a: types.SimpleNamespace(save_pretrained=full))
        monkeypatch.setattr("nag.hf.tokenizer.id_mismatches", lambda *a: [])
    out = tmp_path / "hf-full"
    err = script_error(export_hf.main, "--run", "gpt", "--out", str(out))
    assert (
        err.startswith(f"error: cannot write the export to {out} (")
        and "No space left on device" in err
        and "nothing of it was kept" in err
    )
    assert os.listdir(tmp_path) == []
    before = {f: open(os.path.join(hf_dir, f), "rb").read() for f in os.listdir(hf_dir)}
    script_error(export_hf.main, "--run", "gpt", "--out", hf_dir, "--force")
    assert {f: open(os.path.join(hf_dir, f), "rb").read() for f in os.listdir(hf_dir)} == before
    assert not [f for f in os.listdir(os.path.dirname(hf_dir)) if f.startswith(".tmp-")]
