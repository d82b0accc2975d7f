"""scripts/experiments/depth_sweep.py: the planner, a tiny end-to-end sweep, bad input and seeds.

The planner's parameter matching across depths, a tiny end-to-end sweep, bad input,
and with --seeds: the plan of every seed, the results of several seeds, a failed run that the others outlive."""

import json
import math
import os
import re

import pytest
import torch

from nag.archs import plan_for
from nag import train_flags
from scripts import compare
from scripts.experiments import depth_sweep
from nanochat.gpt import GPT
from nanochat.plan import model_config_from_args
from tests.test_compare import eval_record, write_run


def gpt_block_params(scale, depth, dim, vocab):
    args = train_flags.parse_args(depth_sweep.train_argv(scale, "gpt", depth, dim, 1, "x"))
    with torch.device("meta"):
        return depth_sweep.block_params(GPT(model_config_from_args(args, vocab)))


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
        args = train_flags.parse_args(["--preset", "published", "--arch", arch])
        assert d64["runs"][arch]["num_iterations"] == plan_for(args, 32768, 8).num_iterations
    text = depth_sweep.plan_table(plan)
    assert "est. hours" in text and "4 runs" in text and "GPUs at 40% MFU" in text


def tiny_scale(monkeypatch):
    monkeypatch.setitem(
        depth_sweep.SCALES,
        "cpu",
        {"preset": "tiny", "reference": (2, 64), "depths": [1, 2], "flops": 2e9, "head_dim": 32},
    )


def test_tiny_sweep_table_report_and_rerun(run_base, monkeypatch, capsys):
    tiny_scale(monkeypatch)
    rows = depth_sweep.main(["--scale", "cpu"])
    out = capsys.readouterr().out.strip().splitlines()
    assert (
        out[0].startswith("| depth | dim | width/depth | seeds | GPT val bpb | NAG val bpb | NAG - GPT |")
        and len(out) == 4
    )
    assert all(line.startswith(f"| {d} | ") and " | default | " in line for d, line in zip((1, 2), out[2:]))
    runs = os.path.join(run_base, "runs")
    for r in rows:
        evs = {a: json.load(open(os.path.join(runs, f"sweep-{a}-d{r['depth']}", "eval.json"))) for a in ("gpt", "nag")}
        # the table's numbers are each run's own base_eval bpb, and the gap is their difference
        assert r["bpb"]["gpt"] == pytest.approx(evs["gpt"]["val_bpb"], abs=1e-9)
        assert r["bpb"]["nag"] == pytest.approx(evs["nag"]["val_bpb"], abs=1e-9)
        gap = r["gaps"]["nag"]
        assert gap["gap"] == pytest.approx(r["bpb"]["nag"] - r["bpb"]["gpt"], abs=1e-9)
        assert gap["ci"][0] <= gap["gap"] <= gap["ci"][1]
        assert evs["nag"]["arch"] == "nag" and evs["gpt"]["arch"] == "gpt"
    configs = {
        r["depth"]: json.load(open(os.path.join(runs, f"sweep-nag-d{r['depth']}", "config.json")))["model_config"]
        for r in rows
    }
    assert configs[1]["n_layer"] == 1 and configs[2]["n_layer"] == 2 and configs[1]["n_embd"] > configs[2]["n_embd"]
    report = os.path.join(run_base, "reports", "depth_sweep-cpu")
    assert os.path.getsize(os.path.join(report, "depth_gap.png")) > 0
    assert "![NAG - GPT gap against depth](depth_gap.png)" in open(os.path.join(report, "depth_sweep.md")).read()
    # a rerun trains and evaluates nothing and prints the same table
    stamp = lambda: {
        (d, f): os.stat(os.path.join(runs, d, f)).st_mtime_ns
        for d in os.listdir(runs)
        if os.path.isdir(os.path.join(runs, d))
        for f in os.listdir(os.path.join(runs, d))
    }
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
    assert {k: v for k, v in after.items() if k[0] != "sweep-gpt-d2"} == {
        k: v for k, v in before.items() if k[0] != "sweep-gpt-d2"
    }
    # another budget under the same run names: one line, nothing trained or overwritten
    with pytest.raises(SystemExit):
        depth_sweep.main(["--scale", "cpu", "--flops", "3e9"])
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[-1].startswith("error: ")
        and "sweep-gpt-d1 holds a run of other settings (8 steps at width 96, this sweep plans" in err[-1]
    )
    assert stamp() == after
    # every arm of nag/archs.py's depth study at depths 2 and 4: depth 2's pair is reused, the rest trains
    figures = legends_of_saved_figures(monkeypatch)
    arms = ["gpt", "nag", "gpt-lns", "gpt-peri", "gpt-layerrope"]
    rows = depth_sweep.main(["--scale", "cpu", "--depths", "2,4", "--archs", ",".join(arms)])
    err = capsys.readouterr().err
    assert "depth 2 gpt:" not in err and "depth 2 nag:" not in err and "depth 4 gpt-layerrope: training" in err
    assert [r["depth"] for r in rows] == [2, 4] and all(set(r["bpb"]) == set(arms) for r in rows)
    md = open(os.path.join(report, "depth_sweep.md")).read()
    labels = [a.upper() for a in arms]
    assert all(f" {l} val bpb |" in md and f"\n| {l} | sweep-{a}-d4 | " in md for a, l in zip(arms, labels))
    assert "![GPT, NAG, GPT-LNS, GPT-PERI, GPT-LAYERROPE: residual norm and rotation by layer](arm_geometry.png)" in md
    assert "own best rate" not in md  # no --lr-sweep: every arm at the preset's rate
    data = json.load(open(os.path.join(report, "depth_sweep.json")))
    assert "lr_sweep" not in data and data["geometry_depth"] == 4 and set(data["geometry"]) == set(arms)
    for a in arms:  # the embedding, then each block's output; one rotation per block
        g = data["geometry"][a]
        assert len(g["norm"]) == 4 + 1 and len(g["rotation"]) == 4 and g["run"] == f"sweep-{a}-d4"
        assert all(n > 0 for n in g["norm"]) and all(0 < r < 180 for r in g["rotation"])
    assert figures["depth_gap.png"] == {f"{l} - GPT" for l in labels[1:]} | set(labels)
    assert figures["arm_geometry.png"] == set(labels)
    assert os.path.getsize(os.path.join(report, "arm_geometry.png")) > 0


def legends_of_saved_figures(monkeypatch):
    """{file name: the legend entries of every panel} of each figure saved from here on."""
    import matplotlib.figure

    saved, real = {}, matplotlib.figure.Figure.savefig

    def spy(fig, path, *args, **kwargs):
        legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()]
        saved[os.path.basename(str(path))] = {t.get_text() for lg in legends for t in lg.get_texts()}
        return real(fig, path, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    return saved


@torch.no_grad()
def test_block_geometry_matches_a_forward_by_hand():
    """analysis/arms.py: the norm at block boundaries and each block's rotation, input to output."""
    from analysis.arms import BlockAccumulator, geometry_of
    from analysis.capture import CaptureConfig, capture
    from analysis import measures as M
    from tests.test_analysis import batches_of, gpt_states, tiny_model

    model, data = tiny_model(), batches_of(3)
    acc = capture(model, iter(data), 3, 0, CaptureConfig(token_sample=1, state_sample=1), accumulator=BlockAccumulator)
    by_batch = [gpt_states(model, i) for i, _ in data]
    states = [torch.cat([s.reshape(-1, 32) for s in ss]).double() for ss in zip(*by_batch)]
    g = geometry_of(acc)
    assert g["norm"] == pytest.approx([states[k].norm(dim=1).mean().item() for k in (0, 2, 4, 6)], rel=1e-5)
    by_hand = [M.rotation_angles(states[k], states[k + 2]).mean().item() * 180 / math.pi for k in (0, 2, 4)]
    assert g["rotation"] == pytest.approx(by_hand, rel=1e-4)
    assert (acc.sums["norm"] / acc.tokens).tolist()[0::2] == g["norm"]  # analysis.json's norm.mean, every other


def test_sweep_bad_input(run_base, script_error, monkeypatch):
    assert "unknown --scale 'gpu' (expected cpu or published)" in script_error(depth_sweep.main, "--scale", "gpu")
    assert "unknown arguments for --scale cpu: --gpus2 8" in script_error(
        depth_sweep.main, "--scale", "cpu", "--gpus2", "8"
    )
    assert "--depths needs at least two different positive depths, got '4'" in script_error(
        depth_sweep.main, "--depths", "4"
    )
    assert "--depths takes comma-separated layer counts, got 'a,b'" in script_error(depth_sweep.main, "--depths", "a,b")
    assert script_error(depth_sweep.main, "--flops", "-1") == "error: --flops must be positive; got -1"
    # was a ZeroDivisionError traceback: the counts follow the one number rule of every command
    assert script_error(depth_sweep.main, "--scale", "published", "--gpus", "0", "--dry-run") == (
        "error: --gpus must be positive; got 0"
    )
    monkeypatch.setenv("NANOCHAT_BASE_DIR", "/proc/no-such-base")
    assert "cannot create the base dir /proc/no-such-base" in script_error(
        depth_sweep.main, "--scale", "cpu", "--dry-run"
    )


def test_gpus_at_the_cpu_scale_is_a_note_not_silence(run_base, capsys):
    """--scale cpu --gpus 8 used to drop --gpus without a word; it says so now, as base_train's notes on a flag its
    arch does not read ("applies only with")."""
    depth_sweep.main(["--scale", "cpu", "--gpus", "8", "--dry-run"])
    err = capsys.readouterr().err
    assert "note: --gpus applies only with --scale published; this cpu sweep ignores it" in err
    depth_sweep.main(["--scale", "cpu", "--dry-run"])
    assert "--gpus" not in capsys.readouterr().err


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
    rows = depth_sweep.main(
        ["--scale", "published", "--depths", "16,64", "--gpus", "4", "--flops", "1e19", "--offline"]
    )
    assert calls == [
        [
            "bash",
            "speedrun.sh",
            "--preset",
            "published",
            "--tag",
            f"d{d}",
            "--flops",
            "1e+19",
            "--gpus",
            "4",
            "--offline",
            "--",
            "--depth",
            str(d),
            "--model-dim",
            str(w),
            "--head-dim",
            "128",
        ]
        for d, w in ((16, 1280), (64, 640))
    ]
    assert [r["depth"] for r in rows] == [16, 64]
    for r in rows:  # each pair's gap from the shared val batches its eval.json holds
        assert r["gaps"]["nag"]["gap"] == pytest.approx((1.0 + 1.0) / (400 * math.log(2)), abs=1e-12)
    assert "| 16 | 1280 | 80 |" in capsys.readouterr().out
    # speedrun.sh failing at a depth: the next depth still runs, and both are named at the end
    calls.clear()
    monkeypatch.setattr(
        depth_sweep.subprocess, "run", lambda cmd: calls.append(cmd) or type("Failed", (), {"returncode": 1})()
    )
    with pytest.raises(SystemExit):
        depth_sweep.main(["--scale", "published", "--depths", "16,64"])
    assert [c[c.index("--tag") + 1] for c in calls] == ["d16", "d64"]
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: failed: speedrun.sh at depth 16, speedrun.sh at depth 64 "
        "(rerun to retry them; finished runs are reused)"
    )


# ---------------------------------------------------------------------------
# --seeds: every pair once per seed


def test_seeds_plan_names_args_and_total_cost(run_base, capsys, script_error):
    one = depth_sweep.main(["--scale", "published", "--depths", "16,64", "--dry-run"])
    hours = lambda err: float(re.search(r"about (\d+) hours on 8 GPUs", err)[1])
    single = capsys.readouterr().err
    plan = depth_sweep.main(["--scale", "published", "--depths", "16,64", "--dry-run", "--seeds", "1,2,3"])
    err = capsys.readouterr().err
    assert plan["seeds"] == [1, 2, 3] and one["seeds"] is None
    assert plan["depths"] == one["depths"]  # a seed changes the init and data order, not the plan
    assert re.search(
        r"^12 runs \(2 depths × 2 archs × seeds 1,2,3\), 3\.6e\+20 FLOPs in all, about \d+ hours", err, re.M
    ), err
    assert re.search(r"^4 runs, 1\.2e\+20 FLOPs in all", single, re.M) and abs(hours(err) - 3 * hours(single)) <= 1
    # one speedrun.sh per depth, passing the seeds on: its runs are <arch>-published-d<depth>-s<seed>
    lines = [l for l in err.splitlines() if l.startswith("bash speedrun.sh")]
    assert len(lines) == 2 and all(" --seeds 1,2,3 --gpus 8 -- --depth " in l for l in lines)
    assert lines[0].endswith("# runs " + " ".join(f"{a}-published-d16-s{s}" for s in (1, 2, 3) for a in ("gpt", "nag")))
    # on a CPU, base_train per run with its seed flags; without --seeds names and flags are as before
    depth_sweep.main(["--scale", "cpu", "--depths", "2,4", "--dry-run", "--seeds", "1,2"])
    err = capsys.readouterr().err
    cmds = [l for l in err.splitlines() if l.startswith("python -m scripts.base_train")]
    assert len(cmds) == 8 and "8 runs (2 depths × 2 archs × seeds 1,2)" in err
    for cmd, (d, s, a) in zip(cmds, [(d, s, a) for d in (2, 4) for s in (1, 2) for a in ("gpt", "nag")]):
        assert cmd.endswith(f"--seed {s} --data-seed {s} --run sweep-{a}-d{d}-s{s} --resume latest"), cmd
    assert depth_sweep.train_argv("cpu", "gpt", 2, 384, 1e13, "sweep-gpt-d2")[-4:] == [
        "--run",
        "sweep-gpt-d2",
        "--resume",
        "latest",
    ]
    assert "--seed" not in depth_sweep.train_argv("cpu", "gpt", 2, 384, 1e13, "sweep-gpt-d2")
    assert not os.path.exists(os.path.join(run_base, "runs")) and not os.path.exists(os.path.join(run_base, "reports"))
    assert "--seeds takes different non-negative integers" in script_error(
        depth_sweep.main, "--dry-run", "--seeds", "1,1"
    )


def test_results_of_two_seeds(run_base, tmp_path, capsys):
    plan = {
        "scale": "cpu",
        "archs": ["gpt", "nag"],
        "seeds": [1, 2],
        "depths": [{"depth": d, "dim": w, "aspect_ratio": w / d} for d, w in ((2, 384), (4, 256), (8, 192))],
    }
    runs = os.path.join(run_base, "runs")
    gap = {1: 0.10, 2: 0.16}  # the seeds disagree on the gap: seed noise the interval must hold
    for d in (2, 4, 8):
        for s in (1, 2):
            for arch, bpb in (("gpt", 1.70 + s / 100), ("nag", 1.70 + s / 100 + gap[s])):
                if (d, s, arch) in ((4, 2, "nag"), (8, 1, "gpt"), (8, 2, "gpt")):
                    continue  # depth 4: seed 2 unfinished; depth 8: no pair evaluated
                write_run(
                    runs,
                    f"sweep-{arch}-d{d}-s{s}",
                    [eval_record(80, bpb, seed=10 * d + s)],
                    arch=arch,
                    args={"seed": s, "data_seed": s},
                )
    rows = depth_sweep.results(plan, run_base)
    d2, d4, d8 = rows
    # depth 2: the mean over both seeds, and the very interval of `compare --a GPT runs --b NAG runs` (paired by seed)
    compare.main(
        [
            "--a",
            "sweep-gpt-d2-s1",
            "sweep-gpt-d2-s2",
            "--b",
            "sweep-nag-d2-s1",
            "sweep-nag-d2-s2",
            "--out",
            str(tmp_path / "g"),
        ]
    )
    groups = json.load(open(tmp_path / "g" / "comparison.json"))["metrics"]["val_bpb"]
    gap = d2["gaps"]["nag"]
    assert groups["delta"]["value"] == pytest.approx(gap["gap"], abs=1e-12) and groups["delta"]["ci"] == pytest.approx(
        list(gap["ci"]), abs=1e-12
    )
    assert d2["bpb"]["gpt"] == pytest.approx(groups["groups"]["a"]["mean"]) and d2["bpb"]["nag"] == pytest.approx(
        groups["groups"]["b"]["mean"]
    )
    assert d2["seeds"] == [1, 2] and d2["runs"]["gpt"] == pytest.approx(
        [groups["runs"][f"sweep-gpt-d2-s{s}"] for s in (1, 2)]
    )
    # two seeds that disagree: a wide interval (t with 1 degree of freedom)
    assert gap["ci"][0] < 0.10 and gap["ci"][1] > 0.16
    # depth 4: one seed left, today's paired val-batch interval; depth 8: nothing
    assert (
        d4["seeds"] == [1]
        and d4["interval"] == "val batches"
        and d4["gaps"]["nag"]["ci"][1] - d4["gaps"]["nag"]["ci"][0] < 0.02
    )
    assert "gaps" not in d8 and "bpb" not in d8 and d8["seeds"] == []
    table = depth_sweep.results_table(rows, plan["archs"]).splitlines()
    assert table[0] == "| depth | dim | width/depth | seeds | GPT val bpb | NAG val bpb | NAG - GPT | 95% interval |"
    assert table[2].startswith("| 2 | 384 | 192 | 1,2 | ") and table[3].startswith("| 4 | 256 | 64 | 1 | ")
    assert table[4] == "| 8 | 192 | 24 | - | - | - | - | not evaluated |"
    depth_sweep.plot(rows, plan["archs"], str(tmp_path / "gap.png"))
    assert os.path.getsize(tmp_path / "gap.png") > 0
    json.dumps(rows)  # depth_sweep.json takes them as they are


def test_a_failed_run_leaves_the_others_to_go_on(run_base, monkeypatch, capsys):
    tiny_scale(monkeypatch)
    steps = {}

    def fake_train(args):  # a finished run's files; sweep-gpt-d1-s1 fails
        if args.run == "sweep-gpt-d1-s1" and not steps.get("fixed"):
            raise RuntimeError("loss is NaN at step 3\nmore detail")
        run_dir = os.path.join(run_base, "runs", args.run)
        n = plan_for(args, 512, 1).num_iterations
        os.makedirs(run_dir, exist_ok=True)
        names = (f"model_{n:06d}.pt", f"optim_{n:06d}_rank0.pt")
        for name in names:
            open(os.path.join(run_dir, name), "w").close()
        json.dump(
            {"world_size": 1, "file_sizes": {name: 0 for name in names}},
            open(os.path.join(run_dir, f"meta_{n:06d}.json"), "w"),
        )
        steps[args.run] = n

    def fake_eval(args):
        json.dump(
            eval_record(steps[args.run], 1.8, seed=len(steps)),
            open(os.path.join(run_base, "runs", args.run, "eval.json"), "w"),
        )

    monkeypatch.setattr(depth_sweep.base_train, "train", fake_train)
    monkeypatch.setattr(depth_sweep.base_eval, "evaluate", fake_eval)
    with pytest.raises(SystemExit) as e:
        depth_sweep.main(["--scale", "cpu", "--seeds", "1,2"])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    log = os.path.join(run_base, "runs", "sweep-gpt-d1-s1.log")
    assert f"depth 1 gpt seed 1: failed: loss is NaN at step 3 (log: {log})" in err
    assert err[-1] == "error: failed: sweep-gpt-d1-s1 (rerun to retry them; finished runs are reused)"
    assert sorted(steps) == sorted(
        f"sweep-{a}-d{d}-s{s}" for a in ("gpt", "nag") for d in (1, 2) for s in (1, 2) if (a, d, s) != ("gpt", 1, 1)
    )  # every other run trained and was evaluated
    assert "RuntimeError: loss is NaN at step 3" in open(log).read()  # the traceback, in the run's log
    report = open(os.path.join(run_base, "reports", "depth_sweep-cpu", "depth_sweep.md")).read()
    # what finished
    assert "| 1 | 96 | 96 | 2 | " in report and re.search(r"^\| 2 \| \d+ \| \d+ \| 1,2 \| ", report, re.M)
    # the rerun trains only the failed run
    steps["fixed"] = True
    done = set(steps)
    rows = depth_sweep.main(["--scale", "cpu", "--seeds", "1,2"])
    assert set(steps) - done == {"sweep-gpt-d1-s1"} and [r["seeds"] for r in rows] == [[1, 2], [1, 2]]


# ---------------------------------------------------------------------------
# --archs: any registered arms, each against GPT


def test_archs_bad_input_is_one_line(run_base, script_error):
    from nag.archs import ARCHS

    err = script_error(depth_sweep.main, "--dry-run", "--archs", "gpt,bert")
    assert "unknown arch 'bert' in --archs gpt,bert (expected some of: " in err and all(a in err for a in ARCHS)
    for bad in ("nag,nag-recipe", "gpt", "gpt,nag,nag"):
        assert (
            f"--archs takes gpt (every gap is against it) and at least one other arch, each once; got {bad!r}"
            in script_error(depth_sweep.main, "--dry-run", "--archs", bad)
        )


def test_third_arm_plan_commands_and_cost(run_base, capsys):
    two = depth_sweep.main(["--scale", "published", "--depths", "16,64", "--dry-run"])
    err_two = capsys.readouterr().err
    three = depth_sweep.main(
        ["--scale", "published", "--depths", "16,64", "--dry-run", "--archs", "nag,gpt-recipe,gpt"]
    )
    err = capsys.readouterr().err
    assert three["archs"] == ["gpt", "nag", "gpt-recipe"]  # GPT first: every gap is against it
    for r2, r3 in zip(two["depths"], three["depths"]):  # the same widths, and the pair's plans unchanged
        assert (r2["dim"], r2["runs"]) == (r3["dim"], {a: r3["runs"][a] for a in ("gpt", "nag")})
        assert abs(r3["runs"]["gpt-recipe"]["total_flops"] / 3e19 - 1) < 1e-3  # FLOP-matched too
    assert re.search(r"^6 runs, 1\.8e\+20 FLOPs in all, about \d+ hours on 8 GPUs", err, re.M)
    per_arm = re.search(
        r"^GPU hours per arm \(every depth and seed\): gpt ([\d,]+), nag ([\d,]+), gpt-recipe ([\d,]+); "
        r"all arms ([\d,]+)$",
        err,
        re.M,
    )
    assert per_arm, err
    assert re.search(r"^GPU hours per arm \(every depth and seed\): gpt [\d,]+, nag [\d,]+; all arms", err_two, re.M)
    # one speedrun.sh per depth names every arm; its runs are <arch>-published-d<depth>
    lines = [l for l in err.splitlines() if l.startswith("bash speedrun.sh")]
    assert len(lines) == 2 and all(" --arch gpt,nag,gpt-recipe --tag d" in l for l in lines)
    assert lines[0].endswith("# runs gpt-published-d16 nag-published-d16 gpt-recipe-published-d16")
    assert not any(" --arch " in l for l in err_two.splitlines() if l.startswith("bash speedrun.sh"))


def test_third_arm_results_table_and_figure(run_base, tmp_path):
    archs = ["gpt", "nag", "gpt-recipe"]
    plan = {
        "scale": "cpu",
        "archs": archs,
        "seeds": [1, 2],
        "depths": [{"depth": d, "dim": w, "aspect_ratio": w / d} for d, w in ((2, 384), (4, 256))],
    }
    runs = os.path.join(run_base, "runs")
    offset = {"gpt": 0.0, "nag": 0.10, "gpt-recipe": -0.05}
    for d in (2, 4):
        for s in (1, 2):
            for arch in archs:
                if (d, s, arch) == (4, 2, "gpt-recipe"):
                    continue  # depth 4: seed 2's third arm unfinished, so that seed is left out for every arm
                write_run(
                    runs,
                    f"sweep-{arch}-d{d}-s{s}",
                    [eval_record(80, 1.7 + s / 100 + offset[arch], seed=10 * d + s)],
                    arch=arch,
                    args={"seed": s, "data_seed": s},
                )
    d2, d4 = depth_sweep.results(plan, run_base)
    assert d2["seeds"] == [1, 2] and set(d2["gaps"]) == {"nag", "gpt-recipe"} and set(d2["bpb"]) == set(archs)
    # each arm's gap is the group comparison with GPT alone: the same as the two-arm sweep of that arm
    for arch in ("nag", "gpt-recipe"):
        pair = depth_sweep.results({**plan, "archs": ["gpt", arch]}, run_base)[0]
        got, alone = d2["gaps"][arch], pair["gaps"][arch]
        assert (
            got["gap"] == alone["gap"] and list(got["ci"]) == list(alone["ci"]) and d2["bpb"][arch] == pair["bpb"][arch]
        )
        assert d2["gaps"][arch]["gap"] == pytest.approx(d2["bpb"][arch] - d2["bpb"]["gpt"], abs=1e-12)
    assert d4["seeds"] == [1] and d4["interval"] == "val batches"
    table = depth_sweep.results_table([d2, d4], archs).splitlines()
    assert table[0] == (
        "| depth | dim | width/depth | seeds | GPT val bpb | NAG val bpb | GPT-RECIPE val bpb | NAG - GPT | "
        "95% interval | GPT-RECIPE - GPT | 95% interval |"
    )
    assert table[2].startswith("| 2 | 384 | 192 | 1,2 | ") and table[3].startswith("| 4 | 256 | 64 | 1 | ")
    assert all(line.count("|") == table[0].count("|") for line in table)
    not_run = depth_sweep.results_table(
        [{"depth": 8, "dim": 192, "aspect_ratio": 24, "seeds": []}], archs
    ).splitlines()[2]
    assert not_run == "| 8 | 192 | 24 | - | - | - | - | - | not evaluated | - | not evaluated |"
    depth_sweep.plot([d2, d4], archs, str(tmp_path / "gap.png"))
    assert os.path.getsize(tmp_path / "gap.png") > 0
    json.dumps([d2, d4])


# ---------------------------------------------------------------------------
# --lr-sweep: each arm at its own best matrix LR


def test_best_rates_pick_each_arms_lowest_bpb():
    grid = {
        "gpt": {0.5: 1.31, 1: 1.30, 2: 1.32},
        "nag": {0.5: None, 1: 1.50, 2: 1.40},  # an unfinished grid run is not a candidate
        "gpt-lns": {0.5: 1.2, 1: 1.2, 2: 1.3},  # a tie: the first (smallest) multiple
        "gpt-peri": {0.5: None, 1: None, 2: None},  # nothing evaluated: the preset's rate
    }
    assert depth_sweep.best_rates(grid) == {"gpt": 1, "nag": 2, "gpt-lns": 0.5, "gpt-peri": None}
    assert depth_sweep.parse_lr_grid("2,0.5,1") == [0.5, 1, 2]


def test_lr_sweep_trains_a_grid_then_each_arm_at_its_best_rate(run_base, monkeypatch, capsys):
    tiny_scale(monkeypatch)  # depths 1 and 2; the grid at 2, the reference depth
    best = {"gpt": 2, "nag": 0.5}
    trained = {}

    def multiple(run):
        m = re.search(r"-lr([\d.]+)", run)
        return float(m[1]) if m else 1

    def fake_train(args):  # a finished run's files, and the matrix LR it was given
        run_dir = os.path.join(run_base, "runs", args.run)
        n = plan_for(args, 512, 1).num_iterations
        os.makedirs(run_dir, exist_ok=True)
        names = (f"model_{n:06d}.pt", f"optim_{n:06d}_rank0.pt")
        for name in names:
            open(os.path.join(run_dir, name), "w").close()
        json.dump(
            {"world_size": 1, "file_sizes": {name: 0 for name in names}},
            open(os.path.join(run_dir, f"meta_{n:06d}.json"), "w"),
        )
        trained[args.run] = (n, args.matrix_lr)

    def fake_eval(args):  # each arm best at its own multiple: the further from it, the worse
        arch = args.run.split("-d")[0][len("sweep-") :]
        bpb = 1.5 + abs(math.log2(multiple(args.run) / best[arch])) / 10
        with open(os.path.join(run_base, "runs", args.run, "eval.json"), "w") as f:
            json.dump(eval_record(trained[args.run][0], bpb), f)

    monkeypatch.setattr(depth_sweep.base_train, "train", fake_train)
    monkeypatch.setattr(depth_sweep.base_eval, "evaluate", fake_eval)
    rows = depth_sweep.main(["--scale", "cpu", "--lr-sweep", "--lr-grid", "0.5,1,2"])
    # the grid at depth 2 (×1 is the shared-rate run itself), then depth 1 at each arm's own best only
    grid = {f"sweep-{a}-d2" + ("" if m == 1 else f"-lr{m:g}"): m for a in ("gpt", "nag") for m in (0.5, 1, 2)}
    assert set(trained) == set(grid) | {"sweep-gpt-d1-lr2", "sweep-nag-d1-lr0.5"}
    assert all(trained[run][1] == pytest.approx(m * 0.5) for run, m in grid.items())  # the tiny preset's 0.5
    err = capsys.readouterr().err
    assert "own best matrix LR (depth 2): gpt ×2, nag ×0.5" in err
    for r in rows:
        assert r["bpb"] == pytest.approx({"gpt": 1.5, "nag": 1.5}, abs=0.02)  # each at its best: eval_record's noise
    report = os.path.join(run_base, "reports", "depth_sweep-cpu")
    md = open(os.path.join(report, "depth_sweep.md")).read()
    assert "Compared at each arm's own best rate (--lr-sweep)" in md and "each arm at its own best rate):" in md
    assert "| arch | ×0.5 (0.25) | ×1 (0.5) | ×2 (1) | own best rate |" in md
    assert re.search(r"^\| GPT \| 1\.6\d+ \| 1\.5\d+ \| 1\.4\d+ \| ×2 \(1\) \|$", md, re.M), md
    assert re.search(r"^\| NAG \| 1\.4\d+ \| 1\.5\d+ \| 1\.6\d+ \| ×0\.5 \(0\.25\) \|$", md, re.M), md
    data = json.load(open(os.path.join(report, "depth_sweep.json")))
    lr = data["lr_sweep"]
    assert data["compared_at"] == "own best rate" and lr["best"] == best and lr["depth"] == 2
    assert lr["matrix_lr"] == {"gpt": 1.0, "nag": 0.25} and set(lr["val_bpb"]["gpt"]) == {"0.5", "1", "2"}
    assert "residual geometry of sweep-gpt-d2-lr2 failed" in err  # fake checkpoints: a note, not a failed sweep
    # a rerun trains nothing; the sweep without --lr-sweep trains the shared-rate runs depth 1 lacks, reports as before
    done = dict(trained)
    depth_sweep.main(["--scale", "cpu", "--lr-sweep"])
    assert trained == done
    depth_sweep.main(["--scale", "cpu"])
    assert set(trained) - set(done) == {"sweep-gpt-d1", "sweep-nag-d1"}
    data = json.load(open(os.path.join(report, "depth_sweep.json")))
    assert "lr_sweep" not in data and "compared_at" not in data["plan"] and "lr_sweep" not in data["plan"]
    assert "own best rate" not in open(os.path.join(report, "depth_sweep.md")).read()


def test_lr_sweep_published_cost_and_commands(run_base, monkeypatch, capsys, script_error):
    plan = depth_sweep.main(["--scale", "published", "--depths", "16,64", "--dry-run", "--lr-sweep"])
    err = capsys.readouterr().err
    assert plan["lr_sweep"]["depth"] == 64 and plan["lr_sweep"]["depth_is"] == "the scale's reference depth"
    assert re.search(
        r"^--lr-sweep: matrix LR × 0\.5, 1, 2 of the preset's 0\.012 at depth 64 \(the scale's reference depth\), "
        r"every arm: 4 runs more than the sweep without --lr-sweep, 1\.2e\+20 FLOPs, about \d+ hours on 8 GPUs "
        r"\(\d+ GPU hours\)\nthen every depth with each arm at its own best rate: an arm whose best is ×1 reuses its "
        r"shared-rate runs; after a shared-rate sweep, up to 2 runs more, 6e\+19 FLOPs",
        err,
        re.M,
    ), err
    grid_cmd = " --tag d64-lr0.5 --flops 3e+19 --gpus 8 -- --depth 64 --model-dim 640 --head-dim 128 --matrix-lr 0.006"
    assert grid_cmd in err
    assert "# runs gpt-published-d64-lr2 nag-published-d64-lr2" in err
    # the sweep: the grid, then one speedrun.sh per depth and rate
    calls = []

    def fake_speedrun(cmd):
        calls.append(cmd)
        tag = cmd[cmd.index("--tag") + 1]
        archs = cmd[cmd.index("--arch") + 1].split(",") if "--arch" in cmd else ["gpt", "nag"]
        for arch in archs:
            bpb = {("gpt", "d64-lr2"): 1.4, ("nag", "d64-lr0.5"): 1.4}.get((arch, tag), 1.5)
            run_dir = os.path.join(run_base, "runs", f"{arch}-published-{tag}")
            os.makedirs(run_dir, exist_ok=True)
            json.dump(eval_record(100, bpb), open(os.path.join(run_dir, "eval.json"), "w"))
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(depth_sweep.subprocess, "run", fake_speedrun)
    rows = depth_sweep.main(["--scale", "published", "--depths", "16,64", "--lr-sweep"])
    said = [(c[c.index("--arch") + 1] if "--arch" in c else "gpt,nag", c[c.index("--tag") + 1]) for c in calls]
    assert said == [
        ("gpt,nag", "d64-lr0.5"),
        ("gpt,nag", "d64"),
        ("gpt,nag", "d64-lr2"),
        ("gpt", "d16-lr2"),
        ("nag", "d16-lr0.5"),
        ("gpt", "d64-lr2"),
        ("nag", "d64-lr0.5"),
    ]
    assert calls[3][-2:] == ["--matrix-lr", "0.024"] and [r["depth"] for r in rows] == [16, 64]
    assert rows[0]["bpb"] == pytest.approx({"gpt": 1.5, "nag": 1.5}, abs=0.02)  # the tuned runs' evaluations
    capsys.readouterr()
    assert "--lr-grid goes with --lr-sweep" in script_error(depth_sweep.main, "--dry-run", "--lr-grid", "1,2")
    assert "--lr-grid needs at least two different positive multiples, got '1,-2'" in script_error(
        depth_sweep.main, "--dry-run", "--lr-sweep", "--lr-grid", "1,-2"
    )
