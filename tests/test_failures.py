"""Failure cases of NAG (docs/failures.md): the NaN guard names the origin; the gate-collapse verdict."""

import json
import os

import pytest
import torch

from conftest import TINY_TRAIN
from scripts import base_train
from nag.model import NAGGPT


def tiny_main(argv):
    return base_train.main(TINY_TRAIN + list(argv))


def force_u_zero(monkeypatch, *branches):
    """Every σ of each (block, kind, beta_raw) branch underflows to exactly 0 (logits ≈ −200), so u = 0 for every
    token from step 1."""
    original_init = NAGGPT.init_weights

    def init_shut(self):
        original_init(self)
        with torch.no_grad():
            for block, kind, beta_raw in branches:
                br = self.gates.branch(2 * block + (1 if kind == "attn" else 2))
                br.m_down_bias.fill_(-200.0)
                br.beta_raw.fill_(beta_raw)

    monkeypatch.setattr(NAGGPT, "init_weights", init_shut)


def test_guard_names_the_origin_of_a_nan(run_base, script_error, monkeypatch):
    # update 2 of 4 at β = 0.99998 (init): branches before it get NaN gradients, those after do not
    force_u_zero(monkeypatch, (0, "mlp", 0.5413))
    common = ["--arch", "nag", "--num-iterations", "3", "--eval-every", "100", "--nag-gate-log-every", "0"]
    err = script_error(tiny_main, *common, "--run", "f0", "--nag-mod-floor", "0")
    # the NaN spreads backwards to the embedding and every earlier branch, so the parameter list alone misleads
    assert "step 1" in err and "wte.weight" in err and "gates.coef" in err
    assert "origin: branch 0.mlp (update 2): β·u^(β−1) overflows, min u 0, β 0.99998" in err, err
    # the fixed twin: the same shut branch with the floor stays finite
    run_dir = tiny_main(common + ["--run", "f1", "--nag-mod-floor", "1e-6"])
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert len(rows) == 4 and all(r["train_loss"] is None or r["train_loss"] == r["train_loss"] for r in rows)


def test_pow_backward_overflow():
    from nag.model import pow_backward

    assert (
        pow_backward(0.0, 0.99998) == float("inf") and pow_backward(0.0, 1.0) == 1.0 and pow_backward(0.0, 3.0) == 0.0
    )
    # the step-13 NaN of a CPU search run: u never reached 0, but β had fallen to 0.019
    assert pow_backward(1.79e-41, 0.018925) == float("inf") and pow_backward(1e-30, 0.5) < 1e16


def test_origin_skips_u_zero_with_beta_above_one(run_base, script_error, monkeypatch):
    # u = 0 with β ≥ 1 is harmless (the backward of u^β is 0 there): the origin is the later branch with β < 1
    force_u_zero(monkeypatch, (0, "attn", 3.0), (1, "attn", 0.0))
    err = script_error(
        tiny_main,
        "--arch",
        "nag",
        "--run",
        "f",
        "--num-iterations",
        "3",
        "--eval-every",
        "100",
        "--nag-gate-log-every",
        "0",
        "--nag-mod-floor",
        "0",
    )
    assert "origin: branch 1.attn (update 3): β·u^(β−1) overflows, min u 0, β 0.69315" in err, err


# ---------------------------------------------------------------------------
# the gate-collapse verdict on synthetic metrics.jsonl


def write_metrics(path, m_by_step):
    """m_by_step: {step: [mean m per branch]}; a row per step, with gate telemetry only where given."""
    with open(path, "w") as f:
        for step in range(max(m_by_step) + 1):
            row = {"step": step, "train_loss": 1.0}
            if step in m_by_step:
                ms = m_by_step[step]
                row["gate"] = {
                    "num_branches": len(ms),
                    "branches": [{"name": f"{i // 2}.{('attn', 'mlp')[i % 2]}", "m_mean": m} for i, m in enumerate(ms)],
                }
            f.write(json.dumps(row) + "\n")
    return path


def test_collapse_verdict(tmp_path):
    from nag.gate_collapse import collapse_verdict

    n = 10
    init = [0.5] * n
    collapsed = write_metrics(tmp_path / "c.jsonl", {0: init, 50: [0.01] * 3 + [0.4] * 7, 100: [0.02] * 3 + [0.6] * 7})
    v = collapse_verdict(collapsed)
    assert (
        v["verdict"] == "collapsed" and v["share"] == pytest.approx(0.3) and (v["mid_step"], v["end_step"]) == (50, 100)
    )
    # the same three shut at mid-run, but two reopen by the end: 1/10 stays shut
    recovering = write_metrics(
        tmp_path / "r.jsonl", {0: init, 50: [0.01] * 3 + [0.4] * 7, 100: [0.01, 0.3, 0.3] + [0.6] * 7}
    )
    assert collapse_verdict(recovering)["verdict"] == "recovered"
    # shutting only after mid-run is not the collapse of failure 2 (gates that slam shut early and stay shut)
    late = write_metrics(tmp_path / "l.jsonl", {0: init, 50: init, 100: [0.01] * 3 + [0.6] * 7})
    assert collapse_verdict(late)["verdict"] == "healthy"
    healthy = write_metrics(tmp_path / "h.jsonl", {0: init, 40: [0.3] * n, 80: [0.2] * n, 100: [0.15] * n})
    v = collapse_verdict(healthy)
    assert v["verdict"] == "healthy" and v["share"] == 0 and v["mid_step"] == 80
    # exactly the stated share counts; one fewer branch does not
    assert (
        collapse_verdict(write_metrics(tmp_path / "s.jsonl", {0: init, 100: [0.0] * 2 + [0.5] * 8}))["verdict"]
        == "collapsed"
    )
    assert (
        collapse_verdict(write_metrics(tmp_path / "t.jsonl", {0: init, 100: [0.0] * 1 + [0.5] * 9}))["verdict"]
        == "healthy"
    )
    assert collapse_verdict(write_metrics(tmp_path / "g.jsonl", {0: init}))["verdict"] == "no telemetry"


def test_tiny_run_telemetry_feeds_the_verdict(run_base):
    run_dir = tiny_main(
        ["--arch", "nag", "--run", "v", "--num-iterations", "4", "--eval-every", "100", "--nag-gate-log-every", "2"]
    )
    from nag.gate_collapse import collapse_verdict

    v = collapse_verdict(os.path.join(run_dir, "metrics.jsonl"))
    assert v["verdict"] == "healthy" and v["num_branches"] == 4 and v["end_step"] == 4


# ---------------------------------------------------------------------------
# scripts/experiments/failures.py: the four runs and the verdict table


def test_failures_table_and_rerun(run_base, monkeypatch, capsys):
    from scripts.experiments import failures

    # the tiny test model for seconds-long runs; branch 0.mlp shut from the start makes failure 1 certain
    monkeypatch.setattr(
        failures,
        "CPU",
        ["--preset", "tiny", "--nag-gate-log-every", "2", "--eval-every", "100000", "--save-every", "2"],
    )
    monkeypatch.setattr(failures, "CPU_STEPS", {"fail1": 4, "fail2": 4})
    force_u_zero(monkeypatch, (0, "mlp", 0.5413))
    failures.main(["--scale", "cpu"])
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 6 and out[0].startswith("| case | seed | settings | outcome | verdict | number |")
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out[2:]]
    assert [r[0] for r in rows] == ["fail1 broken", "fail1 fixed", "fail2 broken", "fail2 fixed"]
    assert rows[0][3:] == [
        "non-finite at step 1",
        "reproduced",
        "branch 0.mlp (update 2): β·u^(β−1) overflows, min u 0, β 0.99998",
    ]
    assert rows[1][3:] == ["finite", "twin holds", "min u 0"]  # u still reaches 0; the floor keeps the step finite
    # one shut branch of four is 25%, above the 20% share: both failure-2 runs count as collapsed here
    assert rows[2][4] == "reproduced" and rows[2][5] == "collapsed: 25% of branches shut mid-run to end"
    assert rows[3][4] == "twin fails"
    # the error line is in outcome.json and ends the run's log (docs/failures.md)
    outcome = json.load(open(os.path.join(run_base, "runs", "fail-fail1-broken-s1", "outcome.json")))
    last = open(os.path.join(run_base, "runs", "fail-fail1-broken-s1.log")).read().strip().splitlines()[-1]
    assert outcome["error"].startswith("non-finite gradient at step 1") and last == f"error: {outcome['error']}"
    # a rerun trains nothing: every run's outcome.json is reused
    runs = os.path.join(run_base, "runs")
    before = {f: os.stat(os.path.join(runs, f)).st_mtime_ns for f in os.listdir(runs)}
    failures.main(["--scale", "cpu"])
    assert capsys.readouterr().out.strip().splitlines() == out
    assert {f: os.stat(os.path.join(runs, f)).st_mtime_ns for f in os.listdir(runs)} == before
    # other settings under the same run name: one line, nothing reused or overwritten
    monkeypatch.setitem(failures.CPU_STEPS, "fail2", 6)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        failures.main(["--scale", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 3
        and err[-1].startswith("error: ")
        and "fail-fail2-broken-s1 was trained with other settings" in err[-1]
    )
    assert {f: os.stat(os.path.join(runs, f)).st_mtime_ns for f in os.listdir(runs)} == before


def test_failures_bad_scale(run_base, script_error):
    from scripts.experiments import failures

    assert "unknown --scale 'gpu' (expected cpu or published)" in script_error(failures.main, "--scale", "gpu")
    assert "unknown arguments for --scale cpu: --gpus 8" in script_error(failures.main, "--scale", "cpu", "--gpus", "8")


def test_failures_bad_seeds_are_one_line(run_base, script_error):
    from scripts.experiments import failures

    # the one seed-list rule (nanochat.common.parse_seeds), as speedrun's --seeds
    for bad in ("a", "1,1", ",", "", "-1", "1,,2"):
        assert "--seeds takes different non-negative integers separated by commas" in script_error(
            failures.main, "--seeds", bad
        )
    assert "--seeds is for --scale cpu" in script_error(failures.main, "--scale", "published", "--seeds", "1,2")
    assert not os.path.exists(os.path.join(run_base, "runs"))


def test_failures_cpu_dry_run_trains_nothing(tmp_path, monkeypatch, capsys):
    from scripts.experiments import failures

    def must_not_run(*args, **kwargs):
        raise AssertionError("a dry run trained or prepared data")

    monkeypatch.setattr(failures.base_train, "train", must_not_run)
    monkeypatch.setattr(failures, "prepare_cpu_data", must_not_run)
    base = tmp_path / "base"
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    failures.main(["--scale", "cpu", "--dry-run", "--seeds", "1,2"])
    out = capsys.readouterr()
    assert out.out == "" and not base.exists()
    assert f"8 runs in {base}/runs; data to build" in out.err and "tokenizer 4,096 tokens, to train" in out.err, out.err
    assert (
        out.err.count("| to do |") == 8
        and "| fail-fail1-broken-s2 | 200 | " in out.err
        and "| fail-fail2-fixed-s1 | 100 | " in out.err
    )
    assert "--run fail-fail2-fixed-s2 --seed 2 --resume latest --nag-mod-floor 1e-06" in out.err
    # a finished run is shown as reused, one of other settings as refused
    for (case, role, _, flags), outcome in zip(failures.settings("cpu"), ("same", "other")):
        name, argv = failures.cpu_run(case, role, flags, 1)
        os.makedirs(base / "runs" / name)
        (base / "runs" / name / "outcome.json").write_text(
            json.dumps({"argv": argv if outcome == "same" else argv[:-1]})
        )
    failures.main(["--scale", "cpu", "--dry-run"])
    err = capsys.readouterr().err
    assert (
        "| fail-fail1-broken-s1 | 200 | " in err
        and "| done (reused) |" in err
        and "| other settings (refused) |" in err
    )
    assert err.count("| to do |") == 2
