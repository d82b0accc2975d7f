"""End-to-end training on a tiny corpus: loss falls, exact resume, non-finite guard, bad inputs."""

import json
import os

import pytest
import torch

from scripts import base_train
from nanochat.gpt import GPT

TINY = ["--depth", "2", "--model-dim", "64", "--head-dim", "32", "--max-seq-len", "64", "--device-batch-size", "4",
        "--total-batch-size", "256", "--eval-tokens", "512", "--warmup-steps", "2", "--nag-alpha-warmup-tokens", "1024",
        # the muP batch rule scales LRs by sqrt(256 / 2^19) ≈ 0.022 at this batch: raise them back
        "--matrix-lr", "0.5", "--embedding-lr", "2.0", "--unembedding-lr", "0.1"]


@pytest.fixture
def base(tiny_base_dir, tmp_path, monkeypatch):
    """A private base dir sharing the session's corpus and tokenizer, with an empty runs/."""
    base = tmp_path / "base"
    base.mkdir()
    for name in ("base_data", "tokenizer"):
        os.symlink(os.path.join(tiny_base_dir, name), base / name)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    return base


def tiny_main(argv):
    return base_train.main(TINY + argv)


def train(*extra):
    return tiny_main(list(extra))


def read_metrics(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


@pytest.mark.parametrize("arch", ["gpt", "nag"])
def test_tiny_run_learns_and_records(base, arch):
    run_dir = train("--arch", arch, "--run", "r", "--num-iterations", "24", "--eval-every", "12",
                    "--nag-gate-log-every", "6")
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(25))
    losses = [r["train_loss"] for r in rows[1:]]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3
    bpbs = [r["val_bpb"] for r in rows if "val_bpb" in r]
    assert len(bpbs) == 3 and bpbs[-1] < bpbs[0]
    for r in rows[1:]:
        assert r["tokens"] == r["step"] * 256 and r["flops"] > 0 and r["tok_per_sec"] > 0
    cfg = json.load(open(os.path.join(run_dir, "config.json")))
    assert cfg["arch"] == arch and cfg["num_iterations"] == 24 and cfg["seed"] == 42
    assert cfg["total_flops"] == cfg["flops_per_token"] * 24 * 256
    assert cfg["git_commit"] and cfg["args"]["depth"] == 2
    assert os.path.exists(os.path.join(run_dir, "model_000024.pt"))
    if arch == "nag":
        gates = [r["gate"] for r in rows if "gate" in r]
        assert len(gates) == 4 and gates[0]["num_branches"] == 4 and "nag_config" in cfg
    else:
        assert not any("gate" in r for r in rows)


@pytest.mark.parametrize("arch", ["gpt", "nag"])
def test_exact_resume(base, arch):
    common = ["--arch", arch, "--run", "r", "--num-iterations", "8", "--eval-every", "4", "--save-every", "4"]
    run_dir = train(*common)
    full = read_metrics(run_dir)
    train(*common, "--resume-from-step", "4")
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed] == [r["step"] for r in full]
    for a, b in zip(full[1:], resumed[1:]):
        assert abs(a["train_loss"] - b["train_loss"]) <= 1e-6, (a["step"], a["train_loss"], b["train_loss"])
    assert abs(full[-1]["val_bpb"] - resumed[-1]["val_bpb"]) <= 1e-6


@pytest.mark.parametrize("arch,param", [("gpt", "blocks.1.mlp.c_fc.weight"), ("nag", "gates.0.mlp_branch.beta_raw")])
def test_nonfinite_guard_names_step_and_params(base, script_error, monkeypatch, arch, param):
    backward_calls = {"n": 0}
    original_init = GPT.init_weights

    def init_with_poison(self):
        original_init(self)
        p = dict(self.named_parameters())[param]

        def poison(g):
            backward_calls["n"] += 1
            return g * float("nan") if backward_calls["n"] == 3 else g
        p.register_hook(poison)
    monkeypatch.setattr(GPT, "init_weights", init_with_poison)
    err = script_error(tiny_main, "--arch", arch, "--run", "r", "--num-iterations", "6", "--save-every", "2", "--eval-every", "100")
    assert "step 3" in err and param in err
    run_dir = os.path.join(base, "runs", "r")
    assert sorted(f for f in os.listdir(run_dir) if f.startswith("model_")) == ["model_000002.pt"]
    state = torch.load(os.path.join(run_dir, "model_000002.pt"), weights_only=False)["model"]
    assert all(torch.isfinite(v).all() for v in state.values())


def test_bad_inputs_one_line_and_nothing_overwritten(base, script_error):
    assert "--depth must be at least 1" in script_error(tiny_main, "--depth", "0", "--run", "a", "--num-iterations", "2")
    assert "not a multiple" in script_error(tiny_main, "--run", "a", "--num-iterations", "2", "--total-batch-size", "300")
    assert "no checkpoint for step 7" in script_error(tiny_main, "--run", "a", "--num-iterations", "2", "--resume-from-step", "7")
    assert "budget gives 0 steps" in script_error(tiny_main, "--run", "a", "--target-flops", "10")
    run_dir = train("--run", "taken", "--num-iterations", "2", "--eval-every", "100")
    before = {f: os.path.getmtime(os.path.join(run_dir, f)) for f in os.listdir(run_dir)}
    assert "already holds a run" in script_error(tiny_main, "--run", "taken", "--num-iterations", "2")
    assert "cannot resume" in script_error(tiny_main, "--run", "taken", "--num-iterations", "2", "--resume-from-step", "2",
                                        "--model-dim", "96")
    # the same total batch in more micro-steps would read other data shards: refused, not silently different
    assert "grad_accum_steps" in script_error(tiny_main, "--run", "taken", "--num-iterations", "2", "--resume-from-step", "2",
                                           "--device-batch-size", "2")
    from nanochat.tokenizer import Tokenizer
    real_vocab = Tokenizer.get_vocab_size
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Tokenizer, "get_vocab_size", lambda self: real_vocab(self) - 1)
        assert "does not match the tokenizer" in script_error(tiny_main, "--run", "taken", "--num-iterations", "2", "--resume-from-step", "2")
    assert before == {f: os.path.getmtime(os.path.join(run_dir, f)) for f in os.listdir(run_dir)}


def test_missing_tokenizer_says_how_to_make_one(tmp_path, monkeypatch, script_error):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    err = script_error(tiny_main, "--run", "a", "--num-iterations", "2")
    assert "tok_train" in err


def test_nag_impl_flag_reaches_the_model(base, monkeypatch):
    import nag.model
    from nag.functional import nag_branch
    asked = []

    def spy(impl):
        asked.append(impl)
        return nag_branch  # the real fused kernel is tested in test_nag_kernels / test_nag_model
    monkeypatch.setattr(nag.model, "branch_function", spy)
    train("--arch", "nag", "--run", "impl", "--num-iterations", "1", "--eval-every", "100", "--nag-impl", "fused")
    assert set(asked) == {"fused"}
    cfg = json.load(open(os.path.join(base, "runs", "impl", "config.json")))
    assert cfg["args"]["nag_impl"] == "fused"
