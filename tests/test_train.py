"""End-to-end training on a tiny corpus: loss, resume, non-finite guard, bad inputs, arch registry."""

import json
import os
import signal

import pytest
import torch

from conftest import TINY_TRAIN
from scripts import base_train
from nag import archs
from nanochat.gpt import GPT


def train(*extra):
    return base_train.main(TINY_TRAIN + list(extra))


def tiny_main(argv):
    return base_train.main(TINY_TRAIN + list(argv))


def mtimes(run_dir):
    """Every file of a run directory but the lock, with its modification time."""
    return {f: os.stat(os.path.join(run_dir, f)).st_mtime_ns for f in os.listdir(run_dir) if f != ".lock"}


def read_metrics(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


@pytest.mark.parametrize("arch", ["gpt", "nag"])
def test_tiny_run_learns_and_records(run_base, arch):
    run_dir = train(
        "--arch", arch, "--run", "r", "--num-iterations", "24", "--eval-every", "12", "--nag-gate-log-every", "6"
    )
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
    assert cfg["git_commit"] and cfg["args"]["depth"] == 2 and cfg["optimizer"]["groups"]
    from importlib import metadata  # the versions the run trained with, as installed

    assert cfg["versions"]["torch"] == metadata.version("torch") and cfg["versions"]["numpy"] == metadata.version(
        "numpy"
    )
    assert set(cfg["versions"]) == {"torch", "triton", "numpy", "pyarrow", "tiktoken", "rustbpe"}
    assert os.path.exists(os.path.join(run_dir, "model_000024.pt"))
    if arch == "nag":
        gates = [r["gate"] for r in rows if "gate" in r]
        assert len(gates) == 4 and gates[0]["num_branches"] == 4 and "nag_config" in cfg
    else:
        assert not any("gate" in r for r in rows)


@pytest.mark.parametrize("arch", ["gpt", "nag"])
def test_exact_resume(run_base, arch):
    common = ["--arch", arch, "--run", "r", "--num-iterations", "8", "--eval-every", "4", "--save-every", "4"]
    run_dir = train(*common)
    full = read_metrics(run_dir)
    train(*common, "--resume", "4")
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed] == [r["step"] for r in full]
    for a, b in zip(full[1:], resumed[1:]):
        assert abs(a["train_loss"] - b["train_loss"]) <= 1e-6, (a["step"], a["train_loss"], b["train_loss"])
    assert abs(full[-1]["val_bpb"] - resumed[-1]["val_bpb"]) <= 1e-6


@pytest.mark.parametrize("arch,param", [("gpt", "blocks.1.mlp.c_fc.weight"), ("nag", "gates.beta_raw")])
def test_nonfinite_guard_names_step_and_params(run_base, script_error, monkeypatch, arch, param):
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
    err = script_error(
        tiny_main, "--arch", arch, "--run", "r", "--num-iterations", "6", "--save-every", "2", "--eval-every", "100"
    )
    assert "step 3" in err and param in err
    run_dir = os.path.join(run_base, "runs", "r")
    assert sorted(f for f in os.listdir(run_dir) if f.startswith("model_")) == ["model_000002.pt"]
    state = torch.load(os.path.join(run_dir, "model_000002.pt"), weights_only=False)["model"]
    assert all(torch.isfinite(v).all() for v in state.values())


def test_data_seed_is_recorded_resumed_and_a_setting(run_base, script_error, capsys):
    common = ["--run", "r", "--num-iterations", "4", "--save-every", "2", "--eval-every", "100"]
    run_dir = train(*common, "--data-seed", "7")
    cfg = json.load(open(os.path.join(run_dir, "config.json")))
    assert cfg["seed"] == 42 and cfg["data_seed"] == 7 and cfg["args"]["data_seed"] == 7
    seeded = [r["train_loss"] for r in read_metrics(run_dir)[1:]]
    # the order of the data is another setting: a resume with another data seed is refused
    assert "--data-seed 7 → 8" in script_error(tiny_main, *common, "--resume", "2", "--data-seed", "8")
    # resumed with its own, or without the flag (a resume keeps the run's), it trains on the same batches
    for own in (["--data-seed", "7"], []):
        train(*common, "--resume", "2", *own)
        assert [r["train_loss"] for r in read_metrics(run_dir)[1:]] == seeded
    default = [r["train_loss"] for r in read_metrics(train(*common[2:], "--run", "default"))[1:]]
    assert default[0] != seeded[0]  # another order, other batches from the first step on
    # the plan names both seeds, null when the data is read in file order
    capsys.readouterr()
    for extra, data_seed in (([], None), (["--data-seed", "3"], 3)):
        base_train.main(["--preset", "published", "--arch", "gpt", "--dry-run", "8", *extra])
        out = capsys.readouterr().out
        plan = json.loads(next(l for l in out.splitlines() if l.startswith("PLAN "))[5:])
        assert plan["seed"] == 42 and plan["data_seed"] == data_seed
        assert f"data seed {3 if data_seed else 'none'}" in out


def test_bad_inputs_one_line_and_nothing_overwritten(run_base, script_error):
    assert "--depth must be positive" in script_error(tiny_main, "--depth", "0", "--run", "a", "--num-iterations", "2")
    assert "not a multiple" in script_error(
        tiny_main, "--run", "a", "--num-iterations", "2", "--total-batch-size", "300"
    )
    assert "no complete checkpoint for step 7" in script_error(
        tiny_main, "--run", "a", "--num-iterations", "2", "--resume", "7"
    )
    assert "budget gives 0 steps" in script_error(tiny_main, "--run", "a", "--target-flops", "10")
    run_dir = train("--run", "taken", "--num-iterations", "2", "--eval-every", "100")
    before = mtimes(run_dir)
    assert "--resume latest" in script_error(tiny_main, "--run", "taken", "--num-iterations", "2")
    assert "cannot resume" in script_error(
        tiny_main, "--run", "taken", "--num-iterations", "2", "--resume", "2", "--model-dim", "96"
    )
    # the same total batch in more micro-steps would read other data shards: refused, not silently different, and
    # the first line says so (it once suggested --change-settings, which a second line then refused)
    for extra in ([], ["--change-settings"]):
        err = script_error(
            tiny_main, "--run", "taken", "--num-iterations", "2", "--resume", "2", "--device-batch-size", "2", *extra
        )
        assert (
            "its data was cut into 1 shards" in err
            and "keep --device-batch-size 4" in err
            and "change-settings" not in err
        )
    from nanochat.tokenizer import Tokenizer

    real_vocab = Tokenizer.get_vocab_size
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Tokenizer, "get_vocab_size", lambda self: real_vocab(self) - 1)
        assert "does not match the tokenizer" in script_error(
            tiny_main, "--run", "taken", "--num-iterations", "3", "--resume", "2", "--change-settings"
        )
    assert before == mtimes(run_dir)


def test_missing_tokenizer_says_how_to_make_one(tmp_path, monkeypatch, script_error):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    err = script_error(tiny_main, "--run", "a", "--num-iterations", "2")
    assert "tok_train" in err


def test_nag_impl_flag_reaches_the_model(run_base, monkeypatch):
    import nag.model
    from nag.functional import nag_branch

    asked = []

    def spy(impl):
        asked.append(impl)
        return nag_branch  # the real fused kernel is tested in test_nag_kernels / test_nag_model

    monkeypatch.setattr(nag.model, "branch_function", spy)
    train("--arch", "nag", "--run", "impl", "--num-iterations", "1", "--eval-every", "100", "--nag-impl", "fused")
    assert set(asked) == {"fused"}
    cfg = json.load(open(os.path.join(run_base, "runs", "impl", "config.json")))
    assert cfg["args"]["nag_impl"] == "fused"


# ---------------------------------------------------------------------------
# the arch registry


class ToyGPT(GPT):
    """A registered arch that base_train has never heard of: a flag, a telemetry row and its own meta."""

    arch = "toy"

    @classmethod
    def extra_init_kwargs(cls, meta):
        return {"scale": meta["toy_scale"]}

    def __init__(self, config, scale=1.0, device=None):
        super().__init__(config, device=device)
        self.scale = scale

    def extra_meta(self):
        return {"toy_scale": self.scale}


TOY = archs.ArchSpec(
    ToyGPT,
    add_args=lambda p: p.add_argument("--toy-scale", type=float, default=1.0),
    init_kwargs=lambda args: {"scale": args.toy_scale},
    telemetry=lambda model, step, idx, args: ({"scale": model.scale}, f"  toy | scale {model.scale}"),
)


def test_a_registered_arch_trains_without_touching_base_train(run_base, monkeypatch):
    monkeypatch.setitem(archs.ARCHS, "toy", TOY)
    run_dir = train(
        "--arch", "toy", "--toy-scale", "2.5", "--run", "toy", "--num-iterations", "3", "--eval-every", "-1"
    )
    rows = read_metrics(run_dir)
    assert [r["gate"]["scale"] for r in rows[1:]] == [2.5] * 3
    model, meta = archs.load_model(str(run_dir))
    assert type(model) is ToyGPT and model.scale == 2.5 and meta["arch"] == "toy"


def test_unknown_arch_is_one_line(run_base, script_error):
    assert f"unknown arch 'bert' (expected one of: {', '.join(archs.ARCHS)})" in script_error(
        tiny_main, "--arch", "bert", "--run", "a", "--num-iterations", "2"
    )


# ---------------------------------------------------------------------------
# the loader off the critical path, and steps that log no row


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from a second thread and lose much of their speed when the cores are busy."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def final_weights(run_dir, step):
    return torch.load(os.path.join(run_dir, f"model_{step:06d}.pt"), weights_only=False)["model"]


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_prefetch_changes_no_batch_and_resumes_exactly(run_base, monkeypatch, one_thread):
    """Two micro-steps per step, read and packed ahead by MicroBatches' thread: the losses and weights of a run that
    reads each micro-batch on the training thread when it needs it, bit for bit; the checkpoint holds the loader
    states after the micro-batches taken (not after the ones read ahead), so a resume from it continues exactly."""
    from nanochat import checkpoint_manager as ckpt

    class InTurn:  # the reference: each micro-batch read when it is needed, nothing ahead
        def __init__(self, loaders, device):
            self.loaders, self.states, self.micro = loaders, [None] * len(loaders), 0

        def take(self):
            micro, self.micro = self.micro, (self.micro + 1) % len(self.loaders)
            x, y, self.states[micro] = next(self.loaders[micro])
            return x, y

        def close(self):
            pass

    common = ["--total-batch-size", "512", "--num-iterations", "8", "--save-every", "4", "--eval-every", "100"]
    ahead = train(*common, "--run", "ahead")
    with monkeypatch.context() as patched:
        patched.setattr(base_train, "MicroBatches", InTurn)
        plain = train(*common, "--run", "plain")
    assert [r["train_loss"] for r in read_metrics(ahead)] == [r["train_loss"] for r in read_metrics(plain)]
    assert same_weights(final_weights(ahead, 8), final_weights(plain, 8))
    states = [ckpt.load_train_state(d, 4, 0)["dataloader"] for d in (ahead, plain)]
    assert states[0] == states[1] and len(states[0]) == 2
    full = [r["train_loss"] for r in read_metrics(ahead)]
    train(*common, "--run", "ahead", "--resume", "4")
    assert [r["train_loss"] for r in read_metrics(ahead)] == full
    assert same_weights(final_weights(ahead, 8), final_weights(plain, 8))


def test_log_every_4_logs_every_fourth_step_and_sigterm_still_saves(run_base, monkeypatch, one_thread):
    """--log-every 4: rows at 4, 8 and the last step, the weights of --log-every 1. A SIGTERM during step 5 reaches the
    all-reduce of step 6, which logs no row: it is read during step 7, which logs, saves a complete checkpoint and exits
    EXIT_PREEMPTED; the resumed run ends with the same weights."""
    from nanochat import checkpoint_manager as ckpt
    from nanochat.distributed import EXIT_PREEMPTED
    from nanochat.optim import MuonAdamW

    common = ["--num-iterations", "10", "--save-every", "0", "--eval-every", "100"]
    every1 = read_metrics(train(*common, "--run", "one"))
    four = train(*common, "--run", "four", "--log-every", "4")
    rows = read_metrics(four)
    assert [r["step"] for r in rows] == [0, 4, 8, 10]
    assert [r["train_loss"] for r in rows] == [every1[s]["train_loss"] for s in (0, 4, 8, 10)]
    assert rows[1]["time"]["fwd_bwd"] > 0 and rows[1]["tok_per_sec"] > 0  # the row's interval covers four steps
    one = os.path.join(run_base, "runs", "one")
    assert same_weights(final_weights(four, 10), final_weights(one, 10))

    calls, real_step = [0], MuonAdamW.step

    def step_then_sigterm(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(MuonAdamW, "step", step_then_sigterm)
        with pytest.raises(SystemExit) as stopped:
            train(*common, "--run", "stopped", "--log-every", "4")
    assert stopped.value.code == EXIT_PREEMPTED
    run_dir = os.path.join(run_base, "runs", "stopped")
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 4, 7] and ckpt.complete_steps(run_dir) == [7]
    train(*common, "--run", "stopped", "--log-every", "4", "--resume", "latest")
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 4, 7, 8, 10]
    assert same_weights(final_weights(run_dir, 10), final_weights(one, 10))


def test_log_every_still_stops_on_a_nonfinite_step(run_base, script_error, monkeypatch, one_thread):
    """A NaN gradient in step 3, which logs no row with --log-every 4: named during step 4, before any checkpoint of
    it."""
    param, backward_calls = "blocks.1.mlp.c_fc.weight", [0]
    original_init = GPT.init_weights

    def init_with_poison(self):
        original_init(self)

        def poison(g):
            backward_calls[0] += 1
            return g * float("nan") if backward_calls[0] == 3 else g

        dict(self.named_parameters())[param].register_hook(poison)

    monkeypatch.setattr(GPT, "init_weights", init_with_poison)
    err = script_error(
        tiny_main, "--run", "r", "--num-iterations", "8", "--save-every", "2", "--eval-every", "100", "--log-every", "4"
    )
    assert "non-finite gradient at step 3" in err and param in err and "seen during step 4" in err
    run_dir = os.path.join(run_base, "runs", "r")
    assert sorted(f for f in os.listdir(run_dir) if f.startswith("model_")) == ["model_000002.pt"]
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 2]


ALLOC_CHECK = """
import os, sys, runpy, contextlib, io
def start():  # the module as `python -m scripts.base_train --help` runs it: to the end of its start-up, nothing trained
    sys.argv = ["base_train", "--help"]
    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
        runpy.run_module("scripts.base_train", run_name="__main__")
os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:False"  # the user's own, under torch's newer name
start()
print("user", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
del os.environ["PYTORCH_ALLOC_CONF"]
start()
print("unset", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
"""


def test_training_process_sets_the_allocator_unless_the_user_did():
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    out = subprocess.run(
        [sys.executable, "-c", ALLOC_CHECK],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        env=dict(env, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "user None\n" in out.stdout and "unset expandable_segments:True\n" in out.stdout, out.stdout[-2000:]
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ  # importing base_train (this test session did) changes nothing
