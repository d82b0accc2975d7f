"""scripts/depth_sweep.py: the planner's parameter matching across depths, a tiny end-to-end sweep, bad input."""

import json
import math
import os

import pytest
import torch

from scripts import base_train, depth_sweep
from scripts.archs import ARCHS


def gpt_block_params(scale, depth, dim, vocab):
    args = base_train.parse_args(depth_sweep.train_argv(scale, "gpt", depth, dim, 1, "x"))
    with torch.device("meta"):
        return depth_sweep.block_params(ARCHS["gpt"](base_train.model_config_from_args(args, vocab)))


@pytest.mark.parametrize("scale,vocab", [("published", 32768), ("cpu", 4096)])
def test_planner_holds_block_params_across_depths(scale, vocab):
    s = depth_sweep.SCALES[scale]
    plan = depth_sweep.plan_sweep(scale, s["depths"], s["flops"], vocab, 8 if scale == "published" else 1)
    head, target = s["head_dim"], plan["reference"]["block_params"]
    rows = plan["depths"]
    assert [r["depth"] for r in rows] == s["depths"]
    # the reference shape itself comes back unchanged
    ref = next(r for r in rows if r["depth"] == s["reference"][0])
    assert ref["dim"] == s["reference"][1] and ref["block_params"] == target
    for r in rows:
        assert r["dim"] % head == 0
        assert abs(r["block_params"] / target - 1) <= depth_sweep.MAX_PARAM_MISMATCH, r
        assert r["block_params"] == gpt_block_params(scale, r["depth"], r["dim"], vocab)
        # no other multiple of the head dim is closer (in ratio) at this depth
        for other in (r["dim"] - head, r["dim"] + head):
            if other > 0:
                p = gpt_block_params(scale, r["depth"], other, vocab)
                assert abs(math.log(p / target)) >= abs(math.log(r["block_params"] / target))
        # FLOP-matched: each arch's horizon spends the budget to within half a step
        for arch, run in r["runs"].items():
            step_flops = run["total_flops"] / run["num_iterations"]
            assert abs(run["total_flops"] - s["flops"]) <= step_flops / 2 + 1, (r["depth"], arch)
        assert r["runs"]["nag"]["num_iterations"] <= r["runs"]["gpt"]["num_iterations"]  # NAG's gates cost a little
    # deeper means narrower, and the width-to-depth ratio falls
    assert [r["dim"] for r in rows] == sorted((r["dim"] for r in rows), reverse=True)
    assert [r["aspect_ratio"] for r in rows] == sorted((r["aspect_ratio"] for r in rows), reverse=True)


def test_published_plan_ends_at_the_published_pair():
    plan = depth_sweep.plan_sweep("published", [16, 64], 3e19, 32768, 8)
    d16, d64 = plan["depths"]
    assert (d16["dim"], d16["aspect_ratio"]) == (1280, 80)  # the paper's widest ratio at this block size
    for arch in ("gpt", "nag"):
        args = base_train.parse_args(["--preset", "published", "--arch", arch])
        assert d64["runs"][arch]["num_iterations"] == base_train.make_plan(args, 32768, 8).num_iterations
    text = depth_sweep.plan_table(plan)
    assert "est. hours" in text and "4 runs" in text and "GPUs at 40% MFU" in text


def tiny_scale(monkeypatch):
    monkeypatch.setitem(depth_sweep.SCALES, "cpu", {"preset": "tiny", "reference": (2, 64), "depths": [1, 2], "flops": 2e9, "head_dim": 32})


def test_tiny_sweep_table_report_and_rerun(run_base, monkeypatch, capsys):
    tiny_scale(monkeypatch)
    rows = depth_sweep.main(["--scale", "cpu"])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("| depth | dim | width/depth | GPT val bpb | NAG val bpb | NAG - GPT |") and len(out) == 4
    runs = os.path.join(run_base, "runs")
    for r in rows:
        evs = {a: json.load(open(os.path.join(runs, f"sweep-{a}-d{r['depth']}", "eval.json"))) for a in ("gpt", "nag")}
        # the table's numbers are each run's own base_eval bpb, and the gap is their difference
        assert r["gpt_bpb"] == pytest.approx(evs["gpt"]["val_bpb"], abs=1e-9)
        assert r["nag_bpb"] == pytest.approx(evs["nag"]["val_bpb"], abs=1e-9)
        assert r["gap"] == pytest.approx(r["nag_bpb"] - r["gpt_bpb"], abs=1e-9)
        assert r["ci"][0] <= r["gap"] <= r["ci"][1]
        assert evs["nag"]["arch"] == "nag" and evs["gpt"]["arch"] == "gpt"
    configs = {r["depth"]: json.load(open(os.path.join(runs, f"sweep-nag-d{r['depth']}", "config.json")))["model_config"] for r in rows}
    assert configs[1]["n_layer"] == 1 and configs[2]["n_layer"] == 2 and configs[1]["n_embd"] > configs[2]["n_embd"]
    report = os.path.join(run_base, "reports", "depth_sweep-cpu")
    assert os.path.getsize(os.path.join(report, "depth_gap.png")) > 0
    assert "![NAG - GPT gap against depth](depth_gap.png)" in open(os.path.join(report, "depth_sweep.md")).read()
    # a rerun trains and evaluates nothing and prints the same table
    stamp = lambda: {(d, f): os.stat(os.path.join(runs, d, f)).st_mtime_ns for d in os.listdir(runs) if os.path.isdir(os.path.join(runs, d))
                     for f in os.listdir(os.path.join(runs, d))}
    before = stamp()
    depth_sweep.main(["--scale", "cpu"])
    assert capsys.readouterr().out.strip().splitlines() == out and stamp() == before
    # an interrupted sweep: a run that lost its final checkpoint resumes from its last one, and only it is redone
    cfg = json.load(open(os.path.join(runs, "sweep-gpt-d2", "config.json")))
    final = cfg["num_iterations"]
    for f in os.listdir(os.path.join(runs, "sweep-gpt-d2")):
        if f.endswith(f"{final:06d}.pt") or f == f"meta_{final:06d}.json" or f == "eval.json":
            os.remove(os.path.join(runs, "sweep-gpt-d2", f))
    depth_sweep.main(["--scale", "cpu"])
    progress = [l for l in capsys.readouterr().err.splitlines() if l.startswith("depth ")]
    assert progress == [f"depth 2 gpt: training {final} steps (log: {os.path.join(runs, 'sweep-gpt-d2.log')})"]
    log = open(os.path.join(runs, "sweep-gpt-d2.log")).read()
    assert "resumed from step" in log  # the first training of this run did not resume
    after = stamp()
    assert {k: v for k, v in after.items() if k[0] != "sweep-gpt-d2"} == {k: v for k, v in before.items() if k[0] != "sweep-gpt-d2"}
    # another budget under the same run names: one line, nothing trained or overwritten
    with pytest.raises(SystemExit):
        depth_sweep.main(["--scale", "cpu", "--flops", "3e9"])
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "sweep-gpt-d1 holds a run of other settings (8 steps at width 96, this sweep plans" in err[-1]
    assert stamp() == after


def test_sweep_bad_input(run_base, script_error, monkeypatch):
    assert "unknown --scale 'gpu' (expected cpu or published)" in script_error(depth_sweep.main, "--scale", "gpu")
    assert "unknown arguments for --scale cpu: --gpus2 8" in script_error(depth_sweep.main, "--scale", "cpu", "--gpus2", "8")
    assert "--depths needs at least two different positive depths, got '4'" in script_error(depth_sweep.main, "--depths", "4")
    assert "--depths takes comma-separated layer counts, got 'a,b'" in script_error(depth_sweep.main, "--depths", "a,b")
    assert "--flops must be a positive number (got -1)" in script_error(depth_sweep.main, "--flops", "-1")
    monkeypatch.setenv("NANOCHAT_BASE_DIR", "/proc/no-such-base")
    assert "cannot create the base dir /proc/no-such-base" in script_error(depth_sweep.main, "--scale", "cpu", "--dry-run")


def test_sweep_interrupted_is_one_line(run_base, capsys, monkeypatch):
    tiny_scale(monkeypatch)

    def ctrl_c(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(depth_sweep.base_train, "train", ctrl_c)
    with pytest.raises(SystemExit) as e:
        depth_sweep.main(["--scale", "cpu"])
    assert e.value.code == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("interrupted: finished runs and evaluations are kept; the same command resumes the sweep")
    assert not any("Traceback" in line for line in err)


def test_published_sweep_runs_one_speedrun_pair_per_depth(run_base, monkeypatch, capsys):
    calls = []

    def fake_speedrun(cmd):  # stands in for speedrun.sh: records the command, writes what its evaluation would
        calls.append(cmd)
        tag = cmd[cmd.index("--tag") + 1]
        for i, arch in enumerate(("gpt", "nag")):
            run_dir = os.path.join(run_base, "runs", f"{arch}-published-{tag}")
            os.makedirs(run_dir, exist_ok=True)
            nats = [100.0 + i + int(tag[1:]) / 100, 101.0 + i]
            with open(os.path.join(run_dir, "eval.json"), "w") as f:
                json.dump({"val_batches": {"nats": nats, "bytes": [200, 200]}}, f)
        return type("Done", (), {"returncode": 0})()
    monkeypatch.setattr(depth_sweep.subprocess, "run", fake_speedrun)
    rows = depth_sweep.main(["--scale", "published", "--depths", "16,64", "--gpus", "4", "--flops", "1e19", "--offline"])
    assert calls == [["bash", "speedrun.sh", "--preset", "published", "--tag", f"d{d}", "--flops", "1e+19", "--gpus", "4", "--offline",
                      "--", "--depth", str(d), "--model-dim", str(w), "--head-dim", "128"] for d, w in ((16, 1280), (64, 640))]
    assert [r["depth"] for r in rows] == [16, 64]
    for r in rows:  # each pair's gap from the shared val batches its eval.json holds
        assert r["gap"] == pytest.approx((1.0 + 1.0) / (400 * math.log(2)), abs=1e-12)
    assert "| 16 | 1280 | 80 |" in capsys.readouterr().out
    # speedrun.sh failing at a depth stops the sweep with one line
    monkeypatch.setattr(depth_sweep.subprocess, "run", lambda cmd: type("Failed", (), {"returncode": 1})())
    with pytest.raises(SystemExit):
        depth_sweep.main(["--scale", "published", "--depths", "16,64"])
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: speedrun.sh failed at depth 16 (see above); rerun to resume it"
