"""runs/gpu_checks.sh and scripts/bench/gpu_checks.py, checked on a CPU.

The one-line stop without a GPU, the python a borrowed
slot has (no .venv, no rustbpe), the stage runner with fake stages (ok, failing, timed out, skipped for the budget,
their compiler caches), the plan against the quick budget, the kernel-test verdict when no CUDA test can run, the
headline arithmetic, every quick stage's figures from a GPU-shaped JSON (base_train against the step stage, the faster
NAG implementation), the branch-op sweep, and bench_train's per-block compile against eager on a tiny model."""

import dataclasses
import json
import os
import resource
import subprocess
import sys
import tarfile
import time

import pytest
import torch

from scripts.bench import gpu_checks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="tests the machine without a GPU")
WRITE_JSON = "import json, sys; json.dump({'x': 1}, open(sys.argv[1], 'w')); print('wrote it')"


def fake(name, code, timeout=60, expect=1, cold=False):
    return gpu_checks.Stage(
        name,
        f"fake {name}",
        [sys.executable, "-c", code, "{json}"],
        timeout,
        expect,
        figures=lambda d: f"x = {d['x']}",
        cold=cold,
    )


def rows(out):
    """(stage, result, note) of each table row of summary.md."""
    lines = [
        l for l in open(os.path.join(out, "summary.md")).read().splitlines() if l.startswith("| ") and "---" not in l
    ]
    return [tuple(c.strip() for c in l.strip("|").split("|")[:4]) for l in lines if not l.startswith("| stage ")]


@no_gpu
def test_without_a_gpu_one_line_within_seconds(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, OMP_NUM_THREADS="1")
    t0 = time.time()
    r = subprocess.run(
        ["bash", os.path.join(REPO, "runs", "gpu_checks.sh"), "--quick"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    elapsed = time.time() - t0
    assert r.returncode == 1, r.stdout + r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no GPU: torch " + torch.__version__), r.stderr
    assert f"CUDA build {torch.version.cuda or 'none'}" in err[0] and "PYTHON=" in err[0]
    assert r.stdout == "" and not out.exists()  # no benchmark started, nothing written
    assert elapsed < 30, elapsed  # torch's import is most of it (~2-5 s on the shared 2-core box)


def test_runner_marks_failures_and_keeps_every_line(tmp_path, monkeypatch):
    out = str(tmp_path)
    # the grandchild shows that a timeout ends the stage's whole process group
    spawn = (
        "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        f"open({str(tmp_path / 'grandchild.pid')!r}, 'w').write(str(p.pid)); time.sleep(120)"
    )
    # the last stage checks that the four lines before it were written as their stages ended
    check = (
        "import json, sys; rows = [l for l in open(sys.argv[1].replace('last.json', 'summary.md')) "
        "if l.startswith('| ')]; assert len(rows) == 4, rows; json.dump({'x': 2}, open(sys.argv[1], 'w'))"
    )
    stages = [
        fake("first", WRITE_JSON),
        fake("fails", "import sys; print('boom'); sys.exit(3)"),
        fake("slow", spawn, timeout=3),
        fake("no_json", "print('forgot')"),
        fake("last", check),
    ]
    t0 = time.time()
    failed = gpu_checks.run_stages(stages, out, budget=100)
    assert time.time() - t0 < 30
    assert failed == ["fails", "slow", "no_json"]
    got = rows(out)
    assert [r[:2] for r in got] == [
        ("first", "ok"),
        ("fails", "FAILED"),
        ("slow", "FAILED"),
        ("no_json", "FAILED"),
        ("last", "ok"),
    ]
    assert got[0][3] == "x = 1" and got[4][3] == "x = 2"
    assert got[1][3] == "exit 3: boom" and "timed out after 3 s" in got[2][3] and "no no_json.json" in got[3][3]
    assert all(os.path.exists(os.path.join(out, f"{n}.json")) for n in ("first", "last"))
    assert not any(os.path.exists(os.path.join(out, f"{n}.json")) for n in ("fails", "slow", "no_json"))
    assert "boom" in open(os.path.join(out, "fails.log")).read()
    pid = int((tmp_path / "grandchild.pid").read_text())
    time.sleep(0.5)
    try:
        state = open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z"), f"the timed-out stage's child {pid} is still running ({state})"


def test_budget_ends_a_stage_and_skips_the_next(tmp_path):
    stages = [fake("slow", "import time; time.sleep(60)"), fake("after", WRITE_JSON)]
    (tmp_path / "after.json").write_text('{"x": 0}')  # an earlier run's: it must not count as this run's figures
    t0 = time.time()
    failed = gpu_checks.run_stages(stages, str(tmp_path), budget=3)
    assert time.time() - t0 < 15  # the budget, not the stage's own 60 s limit, ended it
    assert failed == ["slow"]  # the stage cut short failed; the one never started did not
    got = rows(str(tmp_path))
    assert got[0][1] == "FAILED" and "timed out after 3 s (the budget's end)" in got[0][3]
    assert got[1][1] == "SKIPPED" and got[1][3].startswith("not started: 0 s of the 3 s budget left, it expects 1 s")
    assert not (tmp_path / "after.json").exists()


def test_a_stage_whose_expected_time_is_not_left_is_skipped(tmp_path):
    # a stage expecting more than the budget left is not started (it would be cut short), and the run goes on to the
    # stages that still fit; results.json says SKIPPED with the reason, and nothing failed
    stages = [fake("big", WRITE_JSON, expect=50), fake("small", WRITE_JSON, expect=1)]
    failed = gpu_checks.run_stages(stages, str(tmp_path), budget=20)
    assert failed == []
    got = rows(str(tmp_path))
    assert got[0][:3] == ("big", "SKIPPED", "0") and "it expects 50 s" in got[0][3] and got[1][:2] == ("small", "ok")
    results = json.loads((tmp_path / "results.json").read_text())["stages"]
    assert (
        results["big"]["result"] == "SKIPPED"
        and results["big"]["figures"] is None
        and "budget left" in results["big"]["note"]
    )
    assert results["small"]["result"] == "ok" and results["small"]["figures"] == {"x": 1}
    assert not (tmp_path / "big.log").exists()  # never started


CACHES = (
    "import json, os, sys; json.dump({'x': [os.environ.get(k) for k in ('TORCHINDUCTOR_CACHE_DIR', "
    "'TRITON_CACHE_DIR')]}, open(sys.argv[1], 'w'))"
)


def test_stages_share_the_compiler_caches_but_the_cold_one(tmp_path, monkeypatch):
    # every stage process compiles into the run's caches (in its work folder), so a graph or kernel compiles once per
    # run; a cold stage gets none of them, not even one the caller had set (bench_train --fresh-cache makes its own)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere/inductor")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    stages = [fake("warm", CACHES), fake("cold", CACHES, cold=True), fake("warm_again", CACHES)]
    assert gpu_checks.run_stages(stages, str(tmp_path), budget=60) == []
    got = {n: json.loads((tmp_path / f"{n}.json").read_text())["x"] for n in ("warm", "cold", "warm_again")}
    shared = [str(tmp_path / gpu_checks.CACHE / "inductor"), str(tmp_path / gpu_checks.CACHE / "triton")]
    assert got["warm"] == got["warm_again"] == shared and got["cold"] == [None, None]


def test_the_plan_has_one_cold_stage():
    # --fresh-cache in the one stage that measures cold compile, and that stage alone runs without the shared caches
    plan = gpu_checks.stages(quick=False, eval_bundle="/bundle")
    cold = [s.name for s in plan if s.cold]
    fresh = [s.name for s in plan if "--fresh-cache" in s.cmd]
    assert cold == fresh == ["depth"]


def test_main_exit_status_and_summary(tmp_path, monkeypatch):
    # main with a GPU faked: the machine in results.json, the summary's table and headline block, exit status 1 on a
    # failed stage, and in $OUT nothing but the three outputs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        gpu_checks, "environment", lambda: {"gpu": "Fake GPU", "driver": "0", "torch": "t", "triton": "t", "cuda": "c"}
    )
    monkeypatch.setattr(gpu_checks, "QUICK_BUDGET", 60)  # the fakes' time, not a GPU's
    monkeypatch.setattr(
        gpu_checks, "stages", lambda quick, bundle: [fake("ok", WRITE_JSON), fake("bad", "raise SystemExit(2)")]
    )
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    with pytest.raises(SystemExit) as e:
        gpu_checks.main(["--quick", "--out", str(tmp_path / "ignored")])
    assert e.value.code == 1
    out = tmp_path / "out"
    results = json.loads((out / "results.json").read_text())
    assert results["env"]["gpu"] == "Fake GPU" and not (tmp_path / "ignored").exists()
    assert results["stages"]["ok"]["figures"] == {"x": 1} and results["stages"]["bad"] == {
        **results["stages"]["bad"],
        "ok": False,
        "figures": None,
    }
    summary = (out / "summary.md").read_text()
    assert [r[:2] for r in rows(str(out))] == [("ok", "ok"), ("bad", "FAILED")]
    assert "## Headline figures" in summary and summary.rstrip().endswith("FAILED: bad (logs: logs.tar.gz)")
    assert sorted(os.listdir(out)) == sorted(gpu_checks.OUTPUTS)
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert sorted(os.path.basename(n) for n in tar.getnames()) == ["bad.log", "env.json", "ok.log"]


KILLED_RUN = f"""
import sys
from scripts.bench.gpu_checks import Stage, run_stages
work, out = sys.argv[1:]
stage = lambda name, code: Stage(name, name, [sys.executable, "-c", code, "{{json}}"], 60, 1)
run_stages([stage("first", {WRITE_JSON!r}), stage("second", "import time; time.sleep(60)"),
            stage("never", {WRITE_JSON!r})],
           work, 100, out, env={{"gpu": "Fake GPU"}})
"""


def test_a_killed_run_keeps_the_finished_stages_in_at_most_eight_files(tmp_path):
    # the borrowed slot's limit kills the whole run mid-stage: what came back holds every stage that had finished,
    # in the three outputs alone (a slot returns at most 8 files, at most 2 folders deep)
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir(), out.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_RUN, str(work), str(out)],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"),
    )
    t0 = time.time()
    while not (out / "results.json").exists() and time.time() - t0 < 60:
        time.sleep(0.1)
    time.sleep(0.5)  # into the second stage's sleep
    proc.kill()
    proc.wait()
    results = json.loads((out / "results.json").read_text())
    assert results["stages"]["first"]["figures"] == {"x": 1} and "second" not in results["stages"]
    assert results["env"] == {"gpu": "Fake GPU"}
    names = os.listdir(out)
    assert len(names) <= 8 and set(names) <= set(gpu_checks.OUTPUTS) and all((out / n).is_file() for n in names), names
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert "wrote it" in tar.extractfile("gpu_checks_logs/first.log").read().decode()


def test_environment_names_the_machine(monkeypatch):
    # results.json's machine: GPU, driver, torch, Triton, CUDA (torch's build and the driver's), faked here
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: type("P", (), {"total_memory": 2**37})())
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr("nanochat.common.nvidia_smi", lambda: (1, "580.65", "13.0"))
    env = gpu_checks.environment()
    assert env["gpu"] == "Fake H200" and env["driver"] == "580.65" and env["driver_cuda"] == "13.0"
    assert env["torch"] == torch.__version__ and env["triton"] and "cuda" in env and env["capability"] == [9, 0]


def test_dry_run_lists_the_plan_and_at_most_eight_output_files():
    r = subprocess.run(
        [sys.executable, "-m", "scripts.bench.gpu_checks", "--quick", "--dry-run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    plan = gpu_checks.stages(quick=True)
    for st, line in zip(plan, lines[1:]):
        assert line.split()[:5] == [st.name, f"{st.timeout:.0f}", "s", f"{st.expect:.0f}", "s"], line
    expected = sum(st.expect for st in plan)
    assert lines[len(plan) + 1].startswith(
        f"expected {expected:.0f} s in all, {100 * expected / gpu_checks.QUICK_BUDGET:.0f}% "
        f"of the {gpu_checks.QUICK_BUDGET} s budget"
    )
    assert (
        lines[-1]
        == f"writes 3 files, all at the top of $OUT (else --out), none in a folder: {', '.join(gpu_checks.OUTPUTS)}"
    )
    assert len(gpu_checks.OUTPUTS) <= 8 and all("/" not in name for name in gpu_checks.OUTPUTS)


# a kernel_tests stage with no CUDA test run fails: test_every_quick_stage_runs_under_the_slot_python


def result(arch, depth, step_ms, mem, compile_s=30.0, mode="on", fresh_cache=False, **extra):
    return {
        "arch": arch,
        "compile": mode,
        "depth": depth,
        "dim": 640,
        "step_ms": step_ms,
        "peak_mem_gib": mem,
        "model_compile_s": compile_s,
        "model_graphs": 1,
        "optim_compile_s": 7.0,
        "optim_graphs": 5,
        "later_graphs": 0,
        "optim_compiled": ["adamw_update", "muon_update"],
        "fresh_cache": fresh_cache,
        "flops_per_token": 1e8 * depth,
        "tokens_per_step": 32768,
        "peak_flops": 1e16,
        **extra,
    }


def test_headline_carries_two_depths_to_64(tmp_path):
    runs = {
        "depth": [
            result("gpt", 4, 10.0, 4.0, 20, fresh_cache=True),
            result("nag:fused", 4, 11.0, 4.2, 25, fresh_cache=True),
        ],
        "step": [result("gpt", 8, 14.0, 6.0, 30), result("nag:fused", 8, 16.0, 6.4, 40)],
        "blocks": [result("gpt", 8, 14.2, 5.9, 9, "blocks"), result("nag:fused", 8, 16.8, 6.3, 12, "blocks")],
    }
    for name, rs in runs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({"results": rs, "ratios": []}))
    text = "\n".join(gpu_checks.headline(str(tmp_path)))
    # per layer: GPT 1 ms and 0.5 GiB, NAG 1.25 ms and 0.55 GiB; at 64: GPT 70 ms, 34 GiB; NAG 86 ms, 37.2 GiB
    assert "step time 1.143×" in text  # depth 8 as measured: 16 / 14
    assert (
        "step time 1.229× (GPT 70 ms, NAG 86 ms)" in text and "peak memory 1.094× (GPT 34.0 GiB, NAG 37.2 GiB)" in text
    )
    assert "GPT MFU 30.0%" in text  # 6.4e9 FLOPs per token × 32768 tokens / 70 ms / 1e16 FLOP/s
    assert "gpt compiled per block / whole, depth 8: step time 1.014× (within 2%)" in text
    assert "nag:fused compiled per block / whole, depth 8: step time 1.050× (outside 2%)" in text
    assert "model compile 12 s (1 graph(s)) vs 40 s, the run's caches shared" in text
    # the cold compile line: the cold stage's variants alone, the model and the optimizer apart, naming what compiled
    cold = next(l for l in text.splitlines() if l.startswith("- cold compile"))
    assert "depth 4 × 640 gpt: model 20 s (1 graph(s)), optimizer 7 s (5 graph(s): adamw_update, muon_update)" in cold
    assert "nag:fused: model 25 s" in cold and "depth 8" not in cold


def test_quick_plan_answers_the_first_questions_within_its_budget():
    quick = gpu_checks.stages(quick=True)
    assert [s.name for s in quick] == ["kernel_tests", "step", "branch_op", "base_train", "mod"]
    assert gpu_checks.QUICK_BUDGET <= 7 * 60  # a borrowed slot gives a command 10 minutes, its start-up included
    # the expected times are the first H200's (a third step variant: half of two more; base_train without its cold
    # compile) but mod's, a guess, within the planned share; attention (48 s) made room (the full run has it)
    expect = {s.name: s.expect for s in quick}
    assert expect == {"kernel_tests": 55, "step": 78 * 1.5, "branch_op": 34, "base_train": 40, "mod": 120}
    assert sum(expect.values()) <= gpu_checks.PLANNED * gpu_checks.QUICK_BUDGET and gpu_checks.PLANNED <= 0.9
    doc = open(os.path.join(REPO, "docs", "gpu_checks.md")).read()  # its budget section quotes both
    assert f"at most {100 * gpu_checks.PLANNED:.0f} % of it" in doc and f"{sum(expect.values()):.0f} s, with" in doc
    # each stage its own limit, with room over its expected time: twice as much for mod's guess, which runs last
    assert all(s.expect < s.timeout <= 180 for s in quick[:-1]) and quick[-1].timeout == 2 * quick[-1].expect
    # the step stage: GPT beside both NAG implementations, compiled whole
    step = next(s for s in quick if s.name == "step")
    assert step.cmd[step.cmd.index("--arch") + 1] == "gpt,nag:fused,nag:compiled"
    assert step.cmd[step.cmd.index("--compile") + 1] == "on"
    full = gpu_checks.stages(quick=False, eval_bundle="/bundle")
    assert [s.name for s in full[len(quick) :]] == [
        "attention",
        "mfu",  # did not fit --quick on the first H200
        "depth",
        "blocks",
        "host_reads",
        "fp8",
        "fp8_d24",
        "published_gpt",
        "published_nag",
        "published_blocks",
        "mod_blocks",
        "fp8_mod",
        "core_batching",
    ]
    assert all(s.expect < s.timeout <= 480 for s in full)  # the 64-layer whole-model compiles: minutes each
    branch_op = next(s for s in quick if s.name == "branch_op")
    assert branch_op.cmd[branch_op.cmd.index("--op-rows-per-program") + 1] == "1,2,4,8,16,32"


def test_the_mod_stage_times_mod_compiled_on_the_gpu_at_the_step_stages_shape():
    # issue 48: scripts.bench.mod on CUDA (the second slot's mod stage timed its CPU), compiled as base_train compiles
    # there, at the step stage's shape: both blocks at 20 and 40 % against full depth, each rate with its target,
    # in bf16 and fp8 (fp8 with MoD in the quick run, no base_train stage of its own); each block alone in the full run
    from scripts.bench import mod as bench_mod

    plan = {s.name: s for s in gpu_checks.stages(quick=False)}
    st, step, blocks = plan["mod"], plan["step"], plan["mod_blocks"]
    assert st.cmd[:3] == [sys.executable, "-m", "scripts.bench.mod"] and st.figures == gpu_checks.mod_figures
    args = bench_mod.parse(st.cmd[3:])
    shape = ("--depth", "--model-dim", "--head-dim", "--max-seq-len", "--device-batch-size", "--vocab-size")
    bench = [int(step.cmd[step.cmd.index(f) + 1]) for f in shape]
    assert [getattr(args, f[2:].replace("-", "_")) for f in shape] == bench
    assert args.device_type == "cuda" and args.compile == "on" and args.json == "{json}" and args.layer_repeats == 0
    assert args.blocks == "both" and args.precision == "bf16,fp8" and args.steps > 0 and args.warmup >= 1
    assert bench_mod.rates_of(args.rates) == sorted(bench_mod.STEP_TARGETS)
    more = bench_mod.parse(blocks.cmd[3:])
    assert more.blocks == "attn,mlp" and more.layer_repeats > 0 and more.device_type == "cuda" and more.compile == "on"
    assert blocks.figures == gpu_checks.mod_figures and "mod_blocks" not in [s.name for s in gpu_checks.stages(True)]


def test_the_mod_figures_and_headline_hold_the_ratios_against_the_targets(tmp_path):
    d = mod_json()
    text = gpu_checks.mod_figures(d)
    assert text.startswith(
        "depth 8 × 640, compiled: full depth 47.6 ms, 10.7 GiB, compile 27 s (1 graph(s)); both 20% 41.0 ms, 9.8 GiB, "
        "compile 33 s (1 graph(s)), skipped attn 20% mlp 20%, overflow attn 0.4% mlp 0.1%; "
    )
    # a recompile after the first steps (a shape from the data) is named
    d["results"][2] = dict(d["results"][2], graphs=3, later_graphs=2)
    assert "both 40% 36.5 ms, 9.1 GiB, compile 31 s (3 graph(s), 2 more later)" in gpu_checks.mod_figures(d)
    d = mod_json()
    assert "both 20% fp8 38.2 ms, 8.9 GiB" in text
    assert text.endswith(
        "both 20% / full depth, step time 0.861× (PASS, target at most 0.90×); both 20% / full depth, peak memory "
        "0.916× (PASS, target at most 1.00×); both 40% / full depth, step time 0.767× (FAIL, target at most 0.75×); "
        "both 40% / full depth, peak memory 0.850× (PASS, target at most 1.00×); both 20% fp8 / bf16, step time "
        "0.932× (PASS, target at most 1.00×); both 40% fp8 / bf16, step time 0.932× (PASS, target at most 1.00×)"
    )
    (tmp_path / "mod.json").write_text(json.dumps(d))
    (line,) = gpu_checks.headline(str(tmp_path))
    assert line.startswith(
        "- MoD against issue 48's targets (NAG, both blocks, depth 8 × 640, 32,768 tokens, compiled whole; full depth "
        "47.6 ms, 10.7 GiB): both 20% / full depth, step time 0.861× (PASS, target at most 0.90×); "
    )
    assert "both 40% / full depth, step time 0.767× (FAIL, target at most 0.75×)" in line


def test_fp8_with_mod_is_a_base_train_stage_at_the_published_width(tmp_path):
    # issue 38: base_train itself, --fp8 --mod-rate 0.2, a few steps at the published width (nag/presets.py), in the
    # full run (the quick run's mod stage times fp8 with MoD in the bench); the same flags base_train parses, its vocab
    # the published one
    from nag.presets import PRESETS
    from scripts.base_train import parse_args

    st = next(s for s in gpu_checks.stages(quick=False) if s.name == "fp8_mod")
    assert "fp8_mod" not in [s.name for s in gpu_checks.stages(quick=True)] and st.expect < st.timeout and not st.cold
    assert st.cmd[:6] == [sys.executable, "-m", "scripts.bench.gpu_checks", "--base-train", "{json}", "--vocab-size"]
    published = PRESETS["published"]
    assert int(st.cmd[6]) == published["vocab"]
    args = parse_args(st.cmd[7:])
    shape = dict(zip(published["train"][::2], published["train"][1::2]))
    assert (args.model_dim, args.head_dim, args.max_seq_len) == tuple(
        int(shape[f]) for f in ("--model-dim", "--head-dim", "--max-seq-len")
    )
    assert args.device_batch_size == 16  # the published run's, which the memory plan picks on an 80 GB H100
    assert (
        args.arch == "nag" and args.fp8 and args.mod_rate == 0.2 and 2 <= args.num_iterations <= 3 and args.depth == 8
    )
    # one micro-batch, no eval
    assert args.total_batch_size == args.device_batch_size * args.max_seq_len and args.eval_every == -1
    assert not hasattr(args, "compile")  # base_train compiles on CUDA by its own rule (no MoD), no flag
    # its figures and its headline line, from the JSON the stage writes
    d = {
        "steps": [
            {"step": 1, "ms": 41000.0, "skip_attn": 0.21, "skip_mlp": 0.2, "mfu": None},
            {"step": 2, "ms": 180.0, "skip_attn": 0.19, "skip_mlp": 0.2, "mfu": None},
            {"step": 3, "ms": 175.0, "skip_attn": 0.2, "skip_mlp": 0.2, "mfu": 0.31},
        ],
        "fp8_layers": 41,
        "attention": "cudnn",
        "peak_mem_gib": 30.5,
    }
    assert st.figures(d) == (
        "3 steps, fp8 on 41 layers, attention cudnn: step 1 41.0 s (compiles), then 180, 175 ms; "
        "skipped % attn 21, 19, 20, mlp 20, 20, 20; MFU 31.0%; peak 30.5 GiB; a step after the first 178 ms (median): "
        "FAIL, target at most 100 ms (1,183 and 1,012 eager on the first H200)"
    )
    (tmp_path / "fp8_mod.json").write_text(json.dumps(d))
    assert gpu_checks.headline(str(tmp_path)) == [
        "- base_train --fp8 --mod-rate 0.2 (NAG-MoD) at width 640, depth 8, compiled: 3 steps ran, the first 41 s, "
        "41 layers in fp8; a step after the first 178 ms (median): FAIL, target at most 100 ms (1,183 and 1,012 eager "
        "on the first H200)"
    ]
    # compiled as it should be: within the target
    d["steps"][1:] = [dict(x, ms=ms) for x, ms in zip(d["steps"][1:], (52.0, 49.0))]
    assert st.figures(d).endswith(
        "a step after the first 50 ms (median): PASS, target at most 100 ms (1,183 and 1,012 eager on the first H200)"
    )


def test_the_base_train_stage_is_the_step_stages_nag_fused_in_base_trains_loop():
    # issue 47: base_train --arch nag at the step stage's shape, compiled (no MoD, no fp8), with the bench's attention
    # kernel and NAG implementation, so that its step after the first can be held against the bench's nag:fused step
    from scripts.base_train import parse_args

    plan = {s.name: s for s in gpu_checks.stages(quick=False)}
    st, step = plan["base_train"], plan["step"]
    assert st.cmd[:6] == [sys.executable, "-m", "scripts.bench.gpu_checks", "--base-train", "{json}", "--vocab-size"]
    assert st.against == "step" and st.figures == gpu_checks.nag_train_figures and not st.cold
    args = parse_args(st.cmd[7:])
    bench = lambda flag: int(step.cmd[step.cmd.index(flag) + 1])
    assert int(st.cmd[6]) == bench("--vocab-size")
    assert (args.depth, args.model_dim, args.head_dim, args.max_seq_len, args.device_batch_size) == tuple(
        bench(f) for f in ("--depth", "--model-dim", "--head-dim", "--max-seq-len", "--device-batch-size")
    )
    assert args.arch == "nag" and args.nag_impl == "fused" and args.attn == "sdpa"  # the bench's
    assert args.mod_rate is None and not args.fp8  # compiled as base_train compiles on CUDA: MoD would run eager
    assert args.total_batch_size == args.device_batch_size * args.max_seq_len and args.eval_every == -1
    assert args.num_iterations == 5  # 4 steps after the one that compiles


def bench_result(arch, step_ms, fwd_bwd_ms, optim_ms, mem):
    """A result of scripts/bench/train.py on the GPU: every key run_variant writes."""
    return result(
        arch,
        8,
        step_ms,
        mem,
        precision="bf16",
        fp8_layers=0,
        host_reads=1,
        tok_per_sec=32768 / step_ms * 1e3,
        fwd_bwd_ms=fwd_bwd_ms,
        optim_ms=optim_ms,
        first_step_s=40.0,
        first_loss=10.4,
        last_loss=9.9,
        params=10**8,
        device="cuda",
        mfu=0.3,
    )


def base_train_steps(*ms):
    """base_train stage steps: step 1 compiles, then steps of `ms` each, a third of them waiting on data."""
    parts = lambda t: {"data": t / 3, "fwd_bwd": t / 2, "optim": t / 12, "sync_log": t / 12}
    return [
        {"step": i + 1, "ms": t, "train_loss": 10.0, "skip_attn": None, "skip_mlp": None, "mfu": None}
        | {"parts_ms": parts(t)}
        for i, t in enumerate((40000.0, *ms))
    ]


def mod_result(blocks, rate, precision, step_ms, mem, compile_s):
    """A result of scripts/bench/mod.py on the GPU: every key Variant.result writes."""
    mod = {"overflow_attn": 0.004, "overflow_mlp": 0.001, "overflow_rows": 0.2, "capacity": 1664} if rate else {}
    return dict(
        blocks=blocks, rate=rate, precision=precision, fp8_layers=41 if precision == "fp8" else 0, step_ms=step_ms,
        compile_s=compile_s, graphs=1, later_graphs=0, peak_mem_gib=mem, flops=int(1e9 * (1 - rate / 2)),
        skip_attn=rate, skip_mlp=rate, **mod
    )


def mod_json():
    """scripts/bench/mod.py's JSON for the quick run's mod stage, as a GPU would write it."""
    from scripts.bench import mod as bench_mod

    results = [
        mod_result("none", 0.0, "bf16", 47.6, 10.7, 27.0),
        mod_result("both", 0.2, "bf16", 41.0, 9.8, 33.0),
        mod_result("both", 0.4, "bf16", 36.5, 9.1, 31.0),
        mod_result("both", 0.2, "fp8", 38.2, 8.9, 35.0),
        mod_result("both", 0.4, "fp8", 34.0, 8.4, 34.0),
    ]
    return {
        "argv": [], "arch": "nag", "device": "cuda", "gpu": "NVIDIA H200", "compiled": True, "depth": 8, "dim": 640,
        "tokens_per_step": 32768, "results": results, "claims": bench_mod.claims(results), "layers": None,
    }


def gpu_like_jsons():
    """Each quick stage's JSON, and those of base_train (held against step) and attention, which the quick run had
    before mod's, shaped as on the first H200 (its figures there: docs/LOG.md, issue 47; mod's are made up)."""
    from scripts.bench import train

    step = [
        bench_result("gpt", 37.5, 34.0, 3.2, 8.7),
        bench_result("nag:fused", 47.6, 39.8, 7.4, 10.0),
        bench_result("nag:compiled", 44.0, 36.2, 7.4, 11.2),
    ]
    # fmt: off
    impl = lambda f, b: dict(
        forward_ms=f, forward_gbps=3912 * 32768 / f / 1e6, forward_of_copy=0.2, backward_ms=b,
        backward_gbps=6532 * 32768 / b / 1e6, backward_of_copy=0.05,
    )
    return {
        "kernel_tests": {
            "pytest_exit": 0, "passed": 30, "failure": 0, "error": 0, "skipped": 0, "cuda_passed": 30,
            "cuda_skipped": 0, "ok": True, "tests": [{"name": "test_fused_cuda", "result": "passed", "reason": ""}],
        },
        "step": {"argv": [], "results": step, "ratios": train.ratios(step)},
        "base_train": {
            "base_train_exit": 0, "seconds": 79.0, "argv": gpu_checks.NAG_TRAIN, "vocab_size": 32768,
            "fp8_layers": 0, "attention": "sdpa", "peak_mem_gib": 10.1, "steps": base_train_steps(84, 84, 84, 47),
        },
        "branch_op": {
            "op": {
                "rows": 32768, "dim": 640, "dtype": "bfloat16", "copy_gbps": 4238.0, "forward_bytes_per_row": 3912,
                "backward_bytes_per_row": 6532, "impls": {"compiled": impl(0.201, 0.889), "fused": impl(0.182, 1.578)},
                "fused_vs_compiled": {"forward": 1.10, "backward": 0.56},
                "rows_per_program": {"default": 16, "best": 4, "gain_over_default": 1.3,
                                     "backward_gbps": {"4": 176.0, "16": 136.0}},
            }
        },
        "attention": {
            "attention": {"requested": "auto", "kernel": "cudnn", "reason": "Hopper GPU, cudnn the fastest"},
            "kernels": {"sdpa": "timed", "cudnn": "timed"},
            "results": [{"kernel": "sdpa", "window": "L", "fwd_bwd_ms": 4.0}],
            "vs_sdpa": [], "fa3_vs_sdpa": [], "window_vs_full": {"sdpa": 0.8},
        },
        "mod": mod_json(),
    }
    # fmt: on


def planned(jsons):
    """The stages of the full plan that have a JSON in jsons, in its order (every quick stage among them)."""
    plan = [s for s in gpu_checks.stages(quick=False) if s.name in jsons]
    assert {s.name for s in gpu_checks.stages(quick=True)} <= {s.name for s in plan} == set(jsons)
    return plan


FIGURED_NAG = (
    "nag:compiled / nag:fused (compiled): 0.924× time, 1.120× memory: nag:compiled is 1.082× as fast as nag:fused "
    "(44.0 vs 47.6 ms a step: fwd+bwd 36.2 vs 39.8, optimizer 7.4 vs 7.4), peak memory 11.2 vs 10.0 GiB "
    "(nag:fused 1.2 GiB less)"
)


def test_every_quick_stage_figures_its_gpu_json_and_base_train_against_step():
    # each quick stage's figures function reads a JSON shaped like the GPU's (a new quick stage needs one here)
    jsons = gpu_like_jsons()
    plan = planned(jsons)
    text = {
        s.name: s.figures(jsons[s.name], jsons[s.against]) if s.against else s.figures(jsons[s.name]) for s in plan
    }
    assert all(isinstance(t, str) and t for t in text.values()), text
    # step: each variant's step split into forward + backward and the optimizer, and which NAG is faster
    assert "nag:fused 47.6 ms (fwd+bwd 39.8, optimizer 7.4), 10.0 GiB" in text["step"]
    assert text["step"].endswith(FIGURED_NAG)
    # base_train: the median of steps 2-5 (84, 84, 84, 47) against the bench's nag:fused step, and where it went
    assert text["base_train"] == (
        "5 steps, attention sdpa: step 1 40.0 s (compiles), then 84, 84, 84, 47 ms; peak 10.1 GiB; a step after the "
        "first 84.0 ms (median; on average data 24.9, fwd+bwd 37.4, optim 6.2, sync+log 6.2 ms) = 1.765× the step "
        "stage's nag:fused 47.6 ms: FAIL, outside 10%"
    )
    near = dict(jsons["base_train"], steps=base_train_steps(52, 50, 51, 49))
    assert gpu_checks.nag_train_figures(near, jsons["step"]).endswith(
        "= 1.061× the step stage's nag:fused 47.6 ms: PASS, within 10%"  # the median, 50.5 ms
    )
    # the step stage failed or was skipped: said, not a traceback
    assert gpu_checks.nag_train_figures(jsons["base_train"], None).endswith(
        "; no nag:fused step from the step stage to compare with (it failed or was skipped)"
    )


def writes(d):
    return f"import sys; open(sys.argv[1], 'w').write({json.dumps(d)!r})"


def test_the_summary_headlines_the_faster_nag_implementation(tmp_path):
    # the quick plan's stages through the runner, each writing its GPU-shaped JSON: the headline's first line names the
    # NAG implementation the step figures favour, with both memories; base_train's line holds it against the bench
    jsons = gpu_like_jsons()
    plan = [dataclasses.replace(s, cmd=[sys.executable, "-c", writes(jsons[s.name]), "{json}"]) for s in planned(jsons)]
    assert gpu_checks.run_stages(plan, str(tmp_path), budget=120) == []
    notes = {r[0]: r[3] for r in rows(str(tmp_path))}
    assert notes["step"].endswith(FIGURED_NAG) and notes["base_train"].endswith("47.6 ms: FAIL, outside 10%")
    lines = gpu_checks.headline(str(tmp_path))
    assert lines[0] == (
        "- NAG implementation the figures favour for training, by step time: compiled (step: depth 8 × 640, "
        "32,768 tokens, compiled whole); nag:compiled is 1.082× as fast as nag:fused (44.0 vs 47.6 ms a step: fwd+bwd "
        "36.2 vs 39.8, optimizer 7.4 vs 7.4), peak memory 11.2 vs 10.0 GiB (nag:fused 1.2 GiB less); nag/model.py's "
        "default on CUDA: fused"
    )
    assert (
        "- base_train --arch nag (fused, SDPA) at the step stage's shape, compiled: a step after the first 84.0 ms "
        "(median; on average data 24.9, fwd+bwd 37.4, optim 6.2, sync+log 6.2 ms) = 1.765× the step stage's "
        "nag:fused 47.6 ms: FAIL, outside 10%" in lines
    )


def test_a_failed_step_stage_leaves_base_train_nothing_to_compare(tmp_path):
    # the step stage fails (or is skipped): base_train's line and the headline say so; no implementation is favoured
    jsons = gpu_like_jsons()
    cmd = lambda s: "raise SystemExit(1)" if s.name == "step" else writes(jsons[s.name])
    plan = [dataclasses.replace(s, cmd=[sys.executable, "-c", cmd(s), "{json}"]) for s in planned(jsons)]
    assert gpu_checks.run_stages(plan, str(tmp_path), budget=120) == ["step"]
    notes = {r[0]: r[1:] for r in rows(str(tmp_path))}
    assert notes["base_train"][0] == "ok" and notes["base_train"][2].endswith(
        "no nag:fused step from the step stage to compare with (it failed or was skipped)"
    )
    lines = gpu_checks.headline(str(tmp_path))
    assert not any("favour" in l for l in lines) and any(l.startswith("- base_train --arch nag") for l in lines)
    # and no JSON at all (every benchmark stage failed): one line that says so
    assert gpu_checks.headline(str(tmp_path / "none")) == ["- no figures: every benchmark stage failed"]


def test_bench_train_says_which_nag_implementation_is_faster():
    # --arch gpt,nag:fused,nag:compiled: each variant's line splits its step; the ratios are to the first variant, and
    # the two NAG implementations' line names the faster one, by how much, and each one's memory
    from scripts.bench import train

    gpt, fused, compiled = (
        bench_result("gpt", 37.5, 34.0, 3.2, 8.7),
        bench_result("nag:fused", 47.6, 39.8, 7.4, 10.0),
        bench_result("nag:compiled", 50.0, 42.2, 7.4, 11.2),
    )
    line = train.variant_line(fused)
    assert "47.6 ms/step (fwd+bwd 39.8, optimizer 7.4)" in line and "peak 10.00 GiB" in line
    got = train.ratios([gpt, fused, compiled])
    assert [q["what"] for q in got] == [
        "nag:fused / gpt (compiled)",
        "nag:compiled / gpt (compiled)",
        "nag:compiled / nag:fused (compiled)",
    ]
    assert [("faster" in q) for q in got] == [False, False, True]
    assert got[2]["faster"] == (
        "nag:fused is 1.050× as fast as nag:compiled (47.6 vs 50.0 ms a step: fwd+bwd 39.8 vs 42.2, optimizer 7.4 vs "
        "7.4), peak memory 10.0 vs 11.2 GiB (nag:fused 1.2 GiB less)"
    )
    # without GPT the first variant is the reference all the same
    alone = train.ratios([fused, compiled])
    assert [q["what"] for q in alone] == ["nag:compiled / nag:fused (compiled)"] and "faster" in alone[0]


def test_nag_compiled_in_a_model_compiled_whole_is_inductor_over_the_reference_math():
    # bench_train's nag:compiled is --nag-impl compiled (nag/model.py branch_function: the reference under
    # torch.compile); in a model compiled whole, dynamo takes that inner compile into the model's one graph, with no
    # break: the same graph as nag:reference's, which Inductor then compiles (nag:fused's graph calls the fused op)
    import torch._dynamo
    from scripts.bench import models

    config = models.train_config(["--depth", "1", "--model-dim", "64", "--head-dim", "32", "--max-seq-len", "16"], 128)
    x, y = torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16))
    ops = {}
    for name in ("nag:reference", "nag:compiled"):
        torch._dynamo.reset()
        model = models.variant(name, config, torch.device("cpu"))
        explained = torch._dynamo.explain(model)(x, y)
        assert explained.graph_count == 1 and explained.graph_break_count == 0, (name, explained.break_reasons)
        ops[name] = [str(n.target) for n in explained.graphs[0].graph.nodes if n.op == "call_function"]
    torch._dynamo.reset()
    assert ops["nag:compiled"] == ops["nag:reference"] and not any("nag." in op for op in ops["nag:compiled"])


def test_the_base_train_stage_tokenizer_needs_no_rustbpe():
    tok = gpu_checks.pair_tokenizer(32768)
    assert tok.get_vocab_size() == 32768 and tok.get_bos_token_id() == 32768 - 9
    text = "café, 東京: x = 1\n"
    assert tok.decode(tok.encode(text)) == text and len(tok.encode("abcdef")) == 3  # printable pairs are single tokens
    from nanochat.common import UserError

    with pytest.raises(UserError, match="tokenizer of byte pairs"):
        gpu_checks.pair_tokenizer(100)


def test_a_budget_must_be_positive():
    # --budget -5 planned "-6200% of the budget": a non-positive (or not finite) budget is refused in one line
    for budget in ("-5", "0", "nan"):
        r = subprocess.run(
            [sys.executable, "-m", "scripts.bench.gpu_checks", "--dry-run", "--budget", budget],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 1 and r.stdout == "", r.stdout + r.stderr
        assert r.stderr.splitlines() == [f"error: --budget must be positive; got {budget}"]
    r = subprocess.run(
        [sys.executable, "-m", "scripts.bench.gpu_checks", "--quick", "--dry-run", "--budget", "600"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and "of the 600 s budget" in r.stdout


def test_an_eval_bundle_that_is_not_one_is_said_in_one_line(tmp_path):
    # EVAL_BUNDLE=/nonexistent used to drop the core_batching stage without a word
    def dry_run(bundle, *flags):
        env = dict(os.environ, PYTHON=sys.executable, EVAL_BUNDLE=str(bundle))
        r = subprocess.run(
            ["bash", os.path.join(REPO, "runs", "gpu_checks.sh"), "--dry-run", *flags],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        return "core_batching" in [l.split()[0] for l in r.stdout.splitlines() if l.strip()], r.stderr.splitlines()

    nowhere, empty, bundle = tmp_path / "nowhere", tmp_path / "empty", tmp_path / "bundle"
    empty.mkdir(), bundle.mkdir()
    (bundle / "core.yaml").write_text("icl_tasks: []\n")
    assert dry_run(nowhere) == (
        False,
        [f"note: EVAL_BUNDLE={nowhere} is not a folder: the core_batching stage is left out"],
    )
    assert dry_run(empty) == (
        False,
        [f"note: EVAL_BUNDLE={empty} has no core.yaml: the core_batching stage is left out"],
    )
    assert dry_run(bundle) == (True, [])
    assert dry_run(nowhere, "--quick") == (False, [])  # --quick has no such stage to leave out


def test_the_docs_name_what_the_slot_python_has_and_lacks():
    # docs/gpu_checks.md once said the slot's python has no pyarrow or PyYAML; it has both (and base_train imports them)
    text = open(os.path.join(REPO, "docs", "gpu_checks.md")).read()
    section = text[text.index("## The machine's own python3") :]
    section = section[: section.index("\n## ", 1)]
    has = section[section.index("It has ") :].split("\n\n")[0]
    lacks = section[section.index("It lacks ") :].split("\n\n")[0]
    assert all(f"`{name}`" in has for name in gpu_checks.SLOT_HAS) and not any(
        f"`{name}`" in has for name in gpu_checks.SLOT_LACKS
    )
    assert all(f"`{name}`" in lacks for name in gpu_checks.SLOT_LACKS) and "network" in lacks
    assert not any(f"`{name}`" in lacks for name in gpu_checks.SLOT_HAS)
    assert "Python 3.12" in text and "torch 2.11.0+cu130" in text and "Triton 3.6.0" in text


def test_branch_op_json_and_the_rows_per_program_sweep(tmp_path):
    # on a CPU the fused backward runs interpreted: figures of no meaning, but the sweep's code and JSON are the GPU's
    path = tmp_path / "op.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "scripts.bench.nag",
            "--sections",
            "op",
            "--op-rows",
            "8",
            "--op-dim",
            "32",
            "--impls",
            "reference",
            "--op-rows-per-program",
            "8",
            "--json",
            str(path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(path.read_text())
    assert d["op"]["rows"] == 8 and d["op"]["impls"]["reference"]["forward_gbps"] > 0
    # float32 on the CPU: 4-byte rows of 32
    assert d["op"]["forward_bytes_per_row"] == 3 * 128 + 128 + 8
    assert d["op"]["backward_bytes_per_row"] == 5 * 128 + 256 + 4
    sweep = d["op"]["rows_per_program"]
    assert sweep["default"] == 1 and list(sweep["backward_gbps"]) == ["8", "1"]  # the default measured too
    assert sweep["best"] in (1, 8) and sweep["gain_over_default"] >= 1.0
    text = gpu_checks.op_figures(d)
    assert text.startswith("copy ") and f"best {sweep['best']} (" in text and f"× the default 1 (" in text


def test_the_branch_op_byte_model_is_what_the_fused_kernels_read_and_write():
    """The bytes a row of the branch op moves at the least, counted by hand from nag/kernels.py, and again from the
    row tensors the fused ops take and give (on the meta device: no kernel runs). Forward: res, branch, logits
    (C = 32) and log_norm (fp32) in, new_res and new_log_norm out. Backward: res, branch, logits and the two output
    grads in, the grads of res, branch and logits out; log_norm's grad is grad_new_log_norm itself, written by no
    kernel (the bench counted 7,820 B: a D-row and two log-norms too many)."""
    from scripts.bench.nag import branch_op_bytes
    from nag import kernels  # noqa: F401  (registers the ops)

    D, C, bf16 = 640, 32, 2
    assert branch_op_bytes(D, C, bf16) == (3 * D * bf16 + C * bf16 + 2 * 4, 5 * D * bf16 + 2 * C * bf16 + 4)
    assert branch_op_bytes(D, C, bf16) == (3912, 6532) and branch_op_bytes(D, C, bf16, rows=10) == (39120, 65320)
    N = 4
    rows = lambda *shape, dtype=torch.bfloat16: torch.empty(N, *shape, dtype=dtype, device="meta")
    res, branch, logits, grad_new_res = rows(D), rows(D), rows(C), rows(D)
    log_norm, grad_new_log_norm = rows(1, dtype=torch.float32), rows(1, dtype=torch.float32)
    params = [torch.empty(C, device="meta"), torch.empty(1, device="meta"), torch.empty(1, device="meta"), None]
    out = torch.ops.nag.fused_branch(res, log_norm, branch, logits, *params, 0.0, "measured")
    grads = torch.ops.nag.fused_branch_backward(
        grad_new_res, grad_new_log_norm, res, branch, logits, *params, 0.0, "measured"
    )
    per_row = lambda ts: sum(t.numel() * t.element_size() for t in ts if t.dim() == 2 and t.size(0) == N) // N
    assert per_row([res, log_norm, branch, logits, *out]) == 3912
    assert per_row([grad_new_res, grad_new_log_norm, res, branch, logits, *grads]) == 6532


def test_the_branch_op_line_gives_each_direction_and_fused_against_inductor():
    impl = lambda f, b: dict(
        forward_ms=f, forward_gbps=3912 * 32768 / f / 1e6, forward_of_copy=0.5, backward_ms=b,
        backward_gbps=6532 * 32768 / b / 1e6, backward_of_copy=0.25,
    )
    op = dict(copy_gbps=4238.0, forward_bytes_per_row=3912, backward_bytes_per_row=6532)
    op["impls"] = {"compiled": impl(0.2, 0.8), "fused": impl(0.1, 1.0)}
    op["fused_vs_compiled"] = {"forward": 2.0, "backward": 0.8}
    assert gpu_checks.op_figures({"op": op}) == (
        "copy 4238 GB/s (a row: fwd 3,912 B, bwd 6,532 B); compiled fwd 0.200 ms, 641 GB/s (50%), bwd 0.800 ms, "
        "268 GB/s (25%); fused fwd 0.100 ms, 1282 GB/s (50%), bwd 1.000 ms, 214 GB/s (25%); "
        "fused vs compiled (Inductor): fwd 2.00×, bwd 0.80× as fast"
    )


def test_the_branch_op_bench_times_each_direction_alone_with_the_grads_cleared(monkeypatch, capsys):
    """The op section's timing path on the CPU, tiny: each forward starts from cleared grads (none accumulates into
    the next backward, as training's zero_grad does), and the backward's timed calls run the backward alone (its
    forward runs before the timer starts)."""
    import argparse

    from nag import model as nag_model
    from scripts.bench import nag as bench_nag

    events, real = [], nag_model.branch_function

    def spied(impl):
        fn = real(impl)

        def call(*args):
            events.append("F" if all(t.grad is None for t in args[:7]) else "F with grads")
            new_dir, new_log_norm = fn(*args)
            new_dir.register_hook(lambda g: events.append("B"))
            return new_dir, new_log_norm

        return call

    def timer(fn, device, reps=10, warmup=2, setup=None):
        def bracketed():
            events.append("[")
            fn()
            events.append("]")

        return real_ms(bracketed, device, reps, warmup, setup)

    real_ms = bench_nag.call_ms
    monkeypatch.setattr(nag_model, "branch_function", spied)
    monkeypatch.setattr(bench_nag, "call_ms", timer)
    args = argparse.Namespace(op_rows=8, op_dim=32, op_rows_per_program="")
    figures = bench_nag.bench_op(args, ["reference"])
    timed = "".join(events).replace("[]", "")  # the copy bandwidth's calls
    # forward: 2 warm-up and 3 timed calls, each timed; backward: each timed call the backward alone, after its forward
    assert timed == "[F]" * 5 + "F[B]" * 5, timed
    assert figures["impls"]["reference"]["backward_ms"] > 0 and "% of copy" in capsys.readouterr().out


# ---------------------------------------------------------------------------
# the fake slot: the repo venv's python, made to import what a borrowed GPU slot's own python3 has and nothing else
#
# A sitecustomize.py in a folder put on PYTHONPATH (so every process the stages start inherits it) wraps the path
# finder: a top-level module that is not in the standard library, not in the repo, and not of a distribution the
# slot has (gpu_checks.SLOT_HAS and what those require, read from the installed metadata) is not found, exactly as
# if it were not installed: `import rustbpe` raises ModuleNotFoundError, importlib.util.find_spec returns None, and
# importlib.metadata (pytest's plugins, torch's entry points) does not list its distribution either. A venv with
# --system-site-packages cannot do this (the venv has everything), and a stub package that raises on import would
# still be found by find_spec.

SITECUSTOMIZE = """\
# the fake borrowed GPU slot of tests/test_gpu_checks.py (written by the test; see there)
import os, re, sys, sysconfig
import importlib.machinery

MODULES = {modules!r}  # the top-level modules of the slot's distributions
DISTS = {dists!r}  # those distributions, names normalised
REPO = {repo!r}
OPEN = MODULES | set(sys.stdlib_module_names) | set(sys.builtin_module_names)
LOG = os.environ.get("FAKE_SLOT_LOG")  # each module hidden, a line (the test prints them)
# also the modules stdlib_module_names leaves out (_sysconfigdata_*)
STDLIB = {{sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")}}
SITE = {{sysconfig.get_paths()[k] for k in ("purelib", "platlib")}}


def places(spec):
    found = [spec.origin] if spec.origin else list(spec.submodule_search_locations or [])
    return [os.path.abspath(p) for p in found if p]


def under(spec, roots):
    return any(p.startswith(r + os.sep) for p in places(spec) for r in roots)


# inside an allowed package's own folder (setuptools puts its _vendor on sys.path: jaraco, more_itertools)
def vendored(spec):
    return any(
        os.path.relpath(p, r).split(os.sep)[0] in MODULES
        for p in places(spec)
        for r in SITE
        if p.startswith(r + os.sep)
    )


def slots(spec):  # the standard library's or the repo's (not in site-packages), or inside a package the slot has
    return (under(spec, STDLIB | {{REPO}}) and not under(spec, SITE)) or vendored(spec)


class Hide:
    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def find_spec(self, name, path=None, target=None):
        spec = self.inner.find_spec(name, path, target)
        if spec is None or "." in name or name in OPEN or slots(spec):
            return spec
        # not the slot's: past the site-packages folders, a copy the slot has too (setuptools' _vendor) may be found
        outside = [e for e in (path or sys.path) if os.path.abspath(e or ".") not in SITE]
        spec = self.inner.find_spec(name, outside, target)
        if spec is not None and slots(spec):
            return spec
        if LOG:
            with open(LOG, "a") as f:
                f.write(name + "\\n")
        return None

    def find_distributions(self, *args, **kwargs):
        for d in self.inner.find_distributions(*args, **kwargs):
            if re.sub(r"[-_.]+", "-", d.metadata["Name"] or "").lower() in DISTS:
                yield d


sys.meta_path[:] = [Hide(f) if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""


def slot_distributions():
    """(distributions, top-level modules) a slot's python3 has: gpu_checks.SLOT_HAS and everything they require
    (installed here), as the slot's pip installed them."""
    import importlib.metadata as md
    import re
    from packaging.requirements import Requirement

    norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
    todo, dists = list(gpu_checks.SLOT_HAS), set()
    while todo:
        name = todo.pop()
        if norm(name) in dists:
            continue
        dists.add(norm(name))
        try:
            requires = md.distribution(name).requires or []
        except md.PackageNotFoundError:
            continue  # a requirement of the slot's build that this machine's lacks (the CUDA libraries)
        todo += [r.name for r in map(Requirement, requires) if not r.marker or r.marker.evaluate({"extra": ""})]
    modules = {m for m, ds in md.packages_distributions().items() if any(norm(d) in dists for d in ds)}
    return dists, modules


def slot_site(tmp_path):
    """A folder for PYTHONPATH that makes this venv's python a fake slot's (SITECUSTOMIZE above)."""
    site = tmp_path / "slot_site"
    site.mkdir()
    dists, modules = slot_distributions()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(modules=modules, dists=dists, repo=REPO))
    return site


def slot_env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "PYTHONPATH", "VIRTUAL_ENV")}
    return dict(
        env,
        PYTHONPATH=str(slot_site(tmp_path)),
        FAKE_SLOT_LOG=str(tmp_path / "hidden.txt"),
        OMP_NUM_THREADS="1",
        **extra,
    )


def test_the_fake_slot_has_what_the_slot_has(tmp_path):
    # what the slot has imports (and find_spec finds); what it lacks is not found, not even in the metadata
    env = slot_env(tmp_path)
    has = {
        "pyarrow": "pyarrow",
        "PyYAML": "yaml",
        "pytest": "pytest",
        "numpy": "numpy",
        "matplotlib": "matplotlib",
        "tiktoken": "tiktoken",
        "torch": "torch",
        "triton": "triton",
    }
    assert sorted(has) == sorted(gpu_checks.SLOT_HAS)
    code = (
        "import importlib.util, importlib.metadata as md, json, sys\n"
        f"for m in {sorted(has.values())!r}: __import__(m)\n"
        "import nanochat.common, scripts.bench.gpu_checks\n"
        "gone = [m for m in ('rustbpe', 'flash_attn', 'transformers', 'wandb', 'tensorboard', 'lm_eval', "
        "'safetensors', 'trackio', 'xdist') if importlib.util.find_spec(m) is None]\n"
        "dists = sorted(d.metadata['Name'].lower() for d in md.distributions())\n"
        "try:\n    import rustbpe\nexcept ModuleNotFoundError as e:\n    print(json.dumps([gone, dists, str(e)]))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    gone, dists, error = json.loads(r.stdout.splitlines()[-1])
    assert gone == [
        "rustbpe",
        "flash_attn",
        "transformers",
        "wandb",
        "tensorboard",
        "lm_eval",
        "safetensors",
        "trackio",
        "xdist",
    ]
    assert error == "No module named 'rustbpe'"
    assert {"torch", "triton", "pyarrow", "pyyaml", "pytest", "numpy", "matplotlib", "tiktoken"} <= set(dists)
    assert not {"rustbpe", "flash-attn-4", "transformers", "wandb", "pytest-xdist", "nag-chat"} & set(dists)


def fake_slot_python(tmp_path):
    """A repo tree without .venv and a python3 first on PATH that is the fake slot's (slot_env)."""
    tree, bin_dir = tmp_path / "tree", tmp_path / "bin"
    for d in (tree / "runs", bin_dir):
        d.mkdir(parents=True)
    for name in ("scripts", "nanochat", "nag", "tests"):
        (tree / name).symlink_to(os.path.join(REPO, name))
    (tree / "runs" / "gpu_checks.sh").write_text(open(os.path.join(REPO, "runs", "gpu_checks.sh")).read())
    env = slot_env(tmp_path)
    python3 = bin_dir / "python3"
    python3.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python3.chmod(0o755)
    return tree, dict(env, PATH=f"{bin_dir}:{env['PATH']}")


def test_the_slot_python_is_picked_without_venv_or_rustbpe(tmp_path):
    tree, env = fake_slot_python(tmp_path)
    r = subprocess.run(
        ["bash", str(tree / "runs" / "gpu_checks.sh"), "--quick", "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1].startswith("writes 3 files") and not (tree / ".venv").exists()
    # what the stages import, under that python: nothing the slot lacks among it
    code = (
        "import scripts.bench.train, scripts.bench.nag, scripts.bench.attention, scripts.bench.mod, "
        "scripts.bench.models, nag.kernels"
    )
    r = subprocess.run(
        [str(tmp_path / "bin" / "python3"), "-c", code], cwd=tree, capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]


# Each stage's own command line, as gpu_checks builds it, with its sizes made tiny for a CPU: the smallest shape, one
# timed step after one warm-up, the branch op on 8 rows, its sweep over rows per program the default alone.
# bench_train's --compile on becomes off: the CPU's inductor takes 20+ s a variant and builds C++, not the GPU's
# Triton; inductor's imports are the attention stage's, which compiles as it would on the GPU. For the same reason
# nag:compiled becomes nag:reference (the same math, eager): two NAG implementations all the same.
TINY = {
    "--depth": "1",
    "--aspect-ratio": "128",
    "--model-dim": "128",
    "--head-dim": "32",
    "--max-seq-len": "64",  # base_train refuses a MoD rate whose capacity is the whole row: 0.2 of 16 or 32 is
    "--device-batch-size": "1",
    "--total-batch-size": "64",
    "--vocab-size": "512",
    "--steps": "1",
    "--warmup": "1",
    "--compile": "off",
    "--op-rows": "8",
    "--op-dim": "32",
    "--op-rows-per-program": "1",
    "--device-type": "cpu",  # scripts.bench.mod's cuda
}


def tiny(stage):
    cmd = list(stage.cmd)
    for i, arg in enumerate(cmd[:-1]):
        if arg in TINY and not cmd[i + 1].startswith("--"):  # a flag with a value (attention's --compile has none)
            cmd[i + 1] = TINY[arg]
    cmd = [arg.replace("nag:compiled", "nag:reference") for arg in cmd]
    assert all(float(a) <= 512 for a in cmd if a.replace(".", "").isdigit()), cmd  # no size of the GPU's left
    return dataclasses.replace(stage, cmd=cmd, timeout=240)


@pytest.mark.slow
def test_every_quick_stage_runs_under_the_slot_python(tmp_path, monkeypatch):
    # the real commands of --quick (base_train among them) and of fp8_mod (base_train itself) under the fake slot,
    # through the runner as on the GPU: an import the slot cannot make, or a package it lacks, fails its stage here
    for k, v in slot_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("VIRTUAL_ENV", raising=False)
    full = {s.name: s for s in gpu_checks.stages(quick=False)}
    plan = [tiny(s) for s in gpu_checks.stages(quick=True)] + [tiny(full["fp8_mod"])]
    work = tmp_path / "work"
    work.mkdir()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    failed = gpu_checks.run_stages(plan, str(work), budget=3600)  # the runner's loop, one stage after another
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = cpu.ru_utime + cpu.ru_stime - before.ru_utime - before.ru_stime
    got = {
        n: (s["ok"], s["seconds"], s["note"])
        for n, s in json.loads((work / "results.json").read_text())["stages"].items()
    }
    hidden = sorted(set((tmp_path / "hidden.txt").read_text().split())) if (tmp_path / "hidden.txt").exists() else []
    print(f"\nhidden from the stages (tried, not found): {hidden}; the stages' CPU time {cpu:.0f} s")
    for name, (ok, seconds, note) in got.items():
        print(f"{name}: {'ok' if ok else 'FAILED'}, {seconds:.0f} s: {note}")
    assert list(got) == [s.name for s in plan]
    logs = {n: (work / f"{n}.log").read_text()[-3000:] for n in got}
    assert "rustbpe" not in hidden  # not even tried
    # kernel_tests: CUDA by nature; on a CPU every CUDA test skips itself and pytest exits 0, but the stage fails as
    # it must (no CUDA test ran); pytest collected tests/test_nag_kernels.py and its conftest under the slot's python
    # and none errored
    ok, _, note = got.pop("kernel_tests")
    kt = json.loads((work / "kernel_tests.json").read_text())
    assert not ok and note.startswith("exit 1: error: kernel tests: pytest exit 0, 0 CUDA test(s) passed"), logs[
        "kernel_tests"
    ]
    assert kt["pytest_exit"] == 0 and kt["error"] == kt["failure"] == 0 and kt["skipped"] > 0, kt
    assert kt["cuda_passed"] == 0 and kt["cuda_skipped"] > 0 and not kt["ok"], kt
    assert "(0 CUDA)" in gpu_checks.kernel_figures(kt)
    for name, (ok, seconds, note) in got.items():
        assert ok, f"{name}: {note}\n{logs[name]}"
    assert failed == ["kernel_tests"]
    # fp8_mod: base_train's 3 steps with 128-wide layers, the size rule's smallest, so that fp8 and MoD's padding run
    fp8_mod = json.loads((work / "fp8_mod.json").read_text())
    assert fp8_mod["base_train_exit"] == 0 and fp8_mod["fp8_layers"] > 0 and fp8_mod["attention"] == "sdpa"
    assert [s["step"] for s in fp8_mod["steps"]] == [1, 2, 3] and all(0 < s["skip_mlp"] < 1 for s in fp8_mod["steps"])
    assert got["fp8_mod"][2].startswith(f"3 steps, fp8 on {fp8_mod['fp8_layers']} layers, attention sdpa: step 1 ")
    # step: both NAG implementations, the faster named; base_train: 5 steps held against the step stage's nag:fused
    assert "nag:reference / nag:fused (eager): " in got["step"][2] and " as fast as nag:" in got["step"][2]
    assert got["base_train"][2].startswith("5 steps, attention sdpa: step 1 ")
    assert "× the step stage's nag:fused " in got["base_train"][2]
    # mod: the bench's variants, bf16 and fp8, with their targets
    mod = json.loads((work / "mod.json").read_text())
    assert [(r["blocks"], r["rate"], r["precision"]) for r in mod["results"]] == [
        ("none", 0.0, "bf16"), ("both", 0.2, "bf16"), ("both", 0.4, "bf16"), ("both", 0.2, "fp8"), ("both", 0.4, "fp8")
    ]
    assert got["mod"][2].startswith("depth 1 × 128, eager: full depth ") and "fp8 / bf16, step time" in got["mod"][2]


@pytest.mark.slow
def test_per_block_compile_matches_eager(tmp_path):
    # the CPU twin of --compile blocks: the same first loss as eager (same weights, same batch), the model
    # really compiled, and identical blocks sharing one graph (NAG: one per sub-layer kind). Its eager half is the
    # README's bench.train command (tests/test_examples.py runs it here, not again): those flags, then these two
    path = tmp_path / "bench.json"
    readme = "--depth 2 --model-dim 64 --head-dim 32 --max-seq-len 64 --vocab-size 512 --device-batch-size 4 --steps 2"
    readme += " --warmup 1 --arch gpt,nag"
    assert f"python -m scripts.bench.train {readme}" in open(os.path.join(REPO, "README.md")).read()
    cmd = [sys.executable, "-m", "scripts.bench.train", *readme.split(), "--compile", "off,blocks", "--json", str(path)]
    r = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(path.read_text())
    got = {(x["arch"], x["compile"]): x for x in d["results"]}
    for arch, graphs in (("gpt", 1), ("nag", 2)):
        eager, blocks = got[arch, "off"], got[arch, "blocks"]
        assert eager["model_graphs"] == 0 and blocks["model_graphs"] == graphs, (arch, blocks["model_graphs"])
        # the CPU's optimizer is eager
        assert blocks["model_compile_s"] > eager["model_compile_s"] and blocks["optim_graphs"] == 0
        assert blocks["later_graphs"] == 0 and not blocks["fresh_cache"]
        assert blocks["first_loss"] == pytest.approx(eager["first_loss"], rel=1e-5)
        assert blocks["last_loss"] == pytest.approx(eager["last_loss"], rel=1e-4)
    assert "nag / gpt (compiled per block)" in r.stdout and "nag / gpt (eager): step time" in r.stdout
    assert gpu_checks.step_figures(d).startswith("depth 2 × 64: gpt ")
    # the split of a timed step: its two parts are most of it (the rest: zero_grad's return, .item())
    for x in d["results"]:
        assert (
            x["fwd_bwd_ms"] > 0
            and x["optim_ms"] > 0
            and 0.5 * x["step_ms"] <= x["fwd_bwd_ms"] + x["optim_ms"] <= x["step_ms"] * 1.01
        )
    assert "optimizer" in gpu_checks.step_figures(d)
