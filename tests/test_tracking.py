"""Experiment tracking (nanochat/tracking.py): flag checks, rows reaching each tracker, lazy imports.

--log-to is checked up front in one line; every metrics.jsonl row,
nested time / gate / MoD dicts included, reaches TensorBoard exactly and a wandb offline run; the core training path
imports none of the optional packages."""

import os
import sys
import json
import glob
import subprocess

import numpy as np
import pytest
import torch

from nanochat import tracking
from nanochat.common import UserError
from nanochat.gpt import GPTConfig
from nag.model import NAGGPT, NAGConfig
from nag.mod import skip_summary

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIONAL = ("transformers", "safetensors", "lm_eval", "wandb", "tensorboard", "trackio", "datasets")


def metric_rows():
    """Rows shaped as base_train writes them: the initial one (None losses), plain steps with the step-time breakdown,
    and steps with val bpb, NAG gate telemetry (from a real model) and MoD skip rates."""
    model = NAGGPT(
        GPTConfig(sequence_len=16, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=32),
        nag=NAGConfig(alpha_warmup_tokens=0),
    )
    model.init_weights()
    gate = model.gate_telemetry(torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0)))
    mod = {
        **skip_summary({("attn", 0): 0.25, ("mlp", 0): 0.5, ("attn", 1): 0.125, ("mlp", 1): 0.375}),
        "flops_per_token": 123456,
    }
    rows = [
        {"step": 0, "tokens": 0, "flops": 0, "train_loss": None, "lr_mult": 0.5, "tok_per_sec": None, "val_bpb": 3.25}
    ]
    for step in range(1, 5):
        row = {
            "step": step,
            "tokens": step * 256,
            "flops": step * 256 * 30_000_000_000_000_123,
            "train_loss": 6.0 - step / 3,
            "lr_mult": 1.0,
            "data_kept": 0.9912345678901234,
            "data_epoch": 0,
            "tok_per_sec": 1234.5 + step,
            "elapsed": 0.1 * step,
            "time": {"data": 0.01 * step, "fwd_bwd": 0.08, "optim": 0.011, "sync_log": 0.0004},
        }
        if step % 2 == 0:
            row.update(val_bpb=3.0 - step / 10, gate=gate, mod=mod)
        rows.append(row)
    return rows


def write_metrics(run_dir, rows):
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def tensorboard_scalars(log_dir):
    """{tag: {step: value}} of every scalar in a run's event files, as TensorBoard's charts read them (Scalars()),
    and the config text."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    got = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    assert acc.Tags()["tensors"] == ["config/text_summary"]  # every number a plain scalar, no tensor summary
    return got, tensor_util.make_ndarray(acc.Tensors("config/text_summary")[0].tensor_proto)[0].decode()


def metrics_as_scalars(rows):
    want = {}
    for row in rows:
        step, values = tracking.scalars(row)
        for name, v in values.items():
            want.setdefault(name, {})[step] = float(np.float32(v))  # a scalar summary holds a float32
    return want


def test_parse_log_to_checks_names_and_packages(monkeypatch):
    assert tracking.parse_log_to("") == [] and tracking.parse_log_to(None) == []
    monkeypatch.setitem(sys.modules, "tensorboard", sys.modules.get("tensorboard") or object())  # importable here
    assert tracking.parse_log_to(" tensorboard,,tensorboard ") == ["tensorboard"]
    with pytest.raises(
        UserError, match=r"^--log-to takes a comma-separated subset of tensorboard, wandb, trackio, got 'tensorbord'$"
    ):
        tracking.parse_log_to("tensorbord,wandb")
    for kind in tracking.KINDS:  # None in sys.modules: `import` raises ImportError, as for a package not installed
        with monkeypatch.context() as m:
            m.setitem(sys.modules, tracking.PACKAGES[kind], None)
            with pytest.raises(UserError) as e:
                tracking.parse_log_to(f"{kind},{kind}")
        assert str(e.value) == f"--log-to {kind} needs the {tracking.PACKAGES[kind]} package: pip install -e '.[track]'"


def test_flatten_names_every_number():
    rows = metric_rows()
    step, values = tracking.scalars(rows[2])
    assert step == 2 and "step" not in values
    assert values["time/fwd_bwd"] == 0.08 and values["train_loss"] == rows[2]["train_loss"]
    assert values["gate/branches/0.attn/u_mean"] == rows[2]["gate"]["branches"][0]["u_mean"]  # branches by name
    assert values["gate/gain_by_depth_quartile/3"] == rows[2]["gate"]["gain_by_depth_quartile"][3]
    assert (
        values["mod/skip/1.mlp"] == 0.375
        and values["mod/skip_attn"] == 0.1875
        and values["mod/flops_per_token"] == 123456
    )
    assert not any(k.endswith("/name") for k in values)
    _, first = tracking.scalars(rows[0])
    assert "train_loss" not in first and first["val_bpb"] == 3.25  # None is no point
    assert tracking.flatten({"a": True, "b": "text", "c": [1, {"d": 2}]}) == {"a": 1, "c/0": 1, "c/1/d": 2}


def test_no_trackers_is_a_no_op(tmp_path):
    trackers = tracking.open_trackers([], "r", str(tmp_path), {}, "nag-chat")
    trackers.log(metric_rows()[1])
    trackers.close()
    assert os.listdir(tmp_path) == []


def test_tensorboard_reads_back_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    run_dir = str(tmp_path / "runs" / "nag-tb")
    rows = write_metrics(run_dir, metric_rows())
    config = {"args": {"arch": "nag", "log_to": "tensorboard"}, "num_params": 123}
    trackers = tracking.open_trackers(tracking.parse_log_to("tensorboard"), "nag-tb", run_dir, config, "nag-chat")
    for row in rows:
        trackers.log(row)
    trackers.close()
    trackers.close()  # again at exit: nothing happens
    got, text = tensorboard_scalars(os.path.join(run_dir, "tensorboard"))
    assert "run nag-tb" in text and '"num_params": 123' in text
    assert got == metrics_as_scalars(rows)  # every number of every row, to float32 (metrics.jsonl keeps the double)
    assert {
        "train_loss",
        "val_bpb",
        "time/data",
        "gate/dead_relative",
        "gate/branches/1.mlp/gain_abs_mean",
        "mod/skip_mlp",
    } <= set(got)


def test_training_with_log_to_tensorboard(run_base):
    """A tiny NAG run with --log-to tensorboard: its event files hold metrics.jsonl, row for row (skipped until
    base_train has the flag)."""
    pytest.importorskip("tensorboard")
    from conftest import TINY_TRAIN
    from scripts import base_train

    if "--log-to" not in base_train.build_parser().format_help():
        pytest.skip("base_train has no --log-to yet")
    run_dir = base_train.main(
        TINY_TRAIN
        + [
            "--num-iterations",
            "4",
            "--eval-every",
            "2",
            "--save-every",
            "4",
            "--nag-gate-log-every",
            "2",
            "--arch",
            "nag",
            "--run",
            "nag-tb",
            "--log-to",
            "tensorboard",
        ]
    )
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    got, text = tensorboard_scalars(os.path.join(run_dir, "tensorboard"))
    assert (
        got == metrics_as_scalars(rows) and "time/fwd_bwd" in got and "gate/dead_relative" in got and "val_bpb" in got
    )
    assert "run nag-tb" in text and '"log_to": "tensorboard"' in text


def test_wandb_offline_without_a_key_writes_its_run_folder(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no netrc entry, no wandb settings of the machine's user
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert not tracking.wandb_has_key()
    run_dir = str(tmp_path / "runs" / "gpt-wb")
    rows = write_metrics(run_dir, metric_rows())
    trackers = tracking.open_trackers(
        tracking.parse_log_to("wandb"), "gpt-wb", run_dir, {"args": {"arch": "gpt"}}, "nag-chat"
    )
    for row in rows:
        trackers.log(row)
    trackers.close()
    wandb.teardown()  # the wandb-core service writes the run file; it has written it all once it stops (as at exit)
    runs = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(runs) == 1, os.listdir(os.path.join(run_dir, "wandb"))
    data = open(runs[0], "rb").read()
    missing = [
        k
        for k in ("gpt-wb", "train_loss", "time/fwd_bwd", "gate/dead_relative", "mod/skip_attn")
        if k.encode() not in data
    ]
    assert not missing, (missing, len(data))
    # every file of it under the run dir: the service's debug logs too, none in the user's ~/.cache
    assert glob.glob(os.path.join(run_dir, "wandb", "logs", "core-debug-*.log"))
    assert not os.path.exists(tmp_path / "home" / ".cache" / "wandb"), list((tmp_path / "home").rglob("*"))
    assert "WANDB_CACHE_DIR" not in os.environ


def test_trackio_gets_the_same_values_and_a_failed_start_is_one_line(tmp_path, monkeypatch):
    """The trackio backend's calls, against a stand-in module (the real one writes to $TRACKIO_DIR, fixed at its
    import)."""
    calls = []

    class Run:
        def log(self, metrics, step=None):
            calls.append(("log", step, metrics))

        def finish(self):
            calls.append(("finish",))

    class FakeTrackio:
        @staticmethod
        def init(project, name=None, config=None):
            calls.append(("init", project, name, config))
            return Run()

    monkeypatch.setitem(sys.modules, "trackio", FakeTrackio)
    rows = metric_rows()
    trackers = tracking.open_trackers(
        tracking.parse_log_to("trackio"), "nag-tr", str(tmp_path), {"seed": 1}, "nag-chat"
    )
    for row in rows:
        trackers.log(row)
    trackers.close()
    assert calls[0] == ("init", "nag-chat", "nag-tr", {"seed": 1}) and calls[-1] == ("finish",)
    assert [c[1] for c in calls[1:-1]] == [r["step"] for r in rows]
    assert calls[3][2] == tracking.scalars(rows[2])[1]
    # a tracker that cannot start stops the run in one line, and those already open are closed
    calls.clear()

    def unreachable(**kwargs):
        raise ConnectionError("no route\nto host")

    class Opened:
        def close(self):
            calls.append(("closed",))

    FakeTrackio.init = staticmethod(unreachable)
    monkeypatch.setitem(tracking.BACKENDS, "wandb", lambda *a: Opened())
    with pytest.raises(
        UserError, match=r"^--log-to trackio: cannot start the tracker \(ConnectionError: no route to host\)$"
    ):
        tracking.open_trackers(["wandb", "trackio"], "nag-tr", str(tmp_path), {}, "nag-chat")
    assert calls == [("closed",)]


def test_core_path_imports_no_optional_package():
    """Training, evaluation and sampling import none of the [hf] / [track] extras (checked in a fresh interpreter)."""
    code = (
        "import sys, pkgutil, importlib, nanochat, nag\n"
        "mods = [f'nanochat.{m.name}' for m in pkgutil.iter_modules(nanochat.__path__) if m.name != 'hf']\n"
        "mods += [f'nag.{m.name}' for m in pkgutil.iter_modules(nag.__path__)]\n"
        "mods += ['scripts.base_train', 'scripts.base_eval', 'scripts.sample', 'scripts.export_hf']\n"
        "for m in mods: importlib.import_module(m)\n"
        f"print(sorted(p for p in {OPTIONAL!r} if p in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
