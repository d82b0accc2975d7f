"""speedrun.sh: the dry-run plan, bad input, and a tiny CPU pipeline run, rerun and resumed.

The dry-run plan of the published pair (and of several seeds), bad input caught before any work,
a tiny CPU pipeline run three times: everything, then nothing (every stage skipped), then a resume from a
checkpoint; and a failed run that leaves the next one to go on."""

import contextlib
import fcntl
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

import pytest

from nanochat import dataset

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEEDRUN = os.path.join(REPO, "speedrun.sh")
needs_venv = pytest.mark.skipif(
    not os.path.exists(os.path.join(REPO, ".venv", "bin", "python")),
    reason="a real (non-dry) speedrun sources runs/setup_env.sh, which would install .venv",
)


def speedrun(base, *args):
    env = {k: v for k, v in os.environ.items() if k != "NANOCHAT_OFFLINE"}
    env.update(NANOCHAT_BASE_DIR=str(base), OMP_NUM_THREADS="1")  # the tiny models gain nothing from threads
    r = subprocess.run(["bash", SPEEDRUN, *args], capture_output=True, text=True, env=env, timeout=150)
    r.stdout = r.stderr + r.stdout  # the plan is printed on stderr
    return r


def one_line_error(result):
    assert result.returncode == 1, result.stdout + result.stderr
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), result.stderr
    return err[0]


def test_dry_run_published_plan(tmp_path):
    # the README's `bash speedrun.sh --dry-run` as it is shown (tests/test_examples.py leaves it to this test); the
    # base dir from NANOCHAT_BASE_DIR, and without --gpus on a machine with none, the plan is for 8
    base = tmp_path / "never_created"
    r = speedrun(base, "--dry-run")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {
        m[0]: m[1:]
        for m in re.findall(r"^(\w+-published)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s+(\S+)", r.stdout, re.M)
    }
    num = lambda s: int(s.replace(",", ""))
    gpt, nag = rows["gpt-published"], rows["nag-published"]
    assert num(gpt[2]) == 9474 and num(nag[2]) == 9425
    assert num(gpt[3]) == 9474 * 2**20 == 9_934_209_024 and num(nag[3]) == 9425 * 2**20
    for row in (gpt, nag):
        assert num(row[0]) > 350e6 and abs(float(row[4]) / 3e19 - 1) < 1e-3
        assert num(row[1]) * num(row[3]) == pytest.approx(float(row[4]), rel=1e-4)
    assert re.search(r"^data: \d+ ClimbMix train shards", r.stdout, re.M)
    epochs = float(re.search(r"^data: expected epochs ([\d.]+)", r.stdout, re.M).group(1))
    assert 0.8 < epochs <= 1.0  # the download covers the longest run once, packing losses included, and not much more
    for line in ("checkpoints:", "training time:", "disk: need", "dry run: nothing was started"):
        assert line in r.stdout
    assert "40% MFU" in r.stdout and "[to do]" in r.stdout
    assert not base.exists()  # a dry run writes nothing


def test_data_budget_arithmetic():
    from scripts import speedrun as sr

    for tokens in (9474 * 2**20, 9425 * 2**20, 10**8, 3 * 10**11):
        shards = dataset.shards_for(tokens)
        assert dataset.expected_epochs(tokens, shards) <= 1 / dataset.DATA_MARGIN + 1e-9  # the margin is left over
        assert dataset.expected_epochs(tokens, shards - 1) > dataset.expected_epochs(tokens, shards)
        # the text read: tokens trained / kept fraction, which the shards hold
        assert shards * dataset.TOKENS_PER_SHARD >= tokens / dataset.PACKING_KEPT


def plan_in_process(base, *args):
    """scripts.speedrun's plan (what speedrun.sh prints first) in this process: (stderr, stdout). The shell around it
    is tested by the dry runs above and below; here only the planning's own rules are."""
    from scripts import speedrun as speedrun_py

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        mp.setenv("NANOCHAT_BASE_DIR", str(base))
        mp.delenv("NANOCHAT_OFFLINE", raising=False)
        speedrun_py.main(list(args))
    return err.getvalue(), out.getvalue()


def test_too_few_shards_are_flagged(tmp_path):
    plan, _ = plan_in_process(tmp_path / "none", "--dry-run", "--shards", "100", "--base-dir", str(tmp_path / "none"))
    assert re.search(r"expected epochs 3\.\d\d .*MORE THAN ONE", plan), plan


def test_the_plan_builds_no_optimizer(tmp_path, monkeypatch):
    # the plan (a process of its own on every speedrun.sh) reads the optimizer's groups without building one: torch
    # imports torch._dynamo for the first optimizer, ~1.5 s of CPU
    import torch

    def refuse(*args, **kwargs):
        raise AssertionError("the plan built an optimizer")

    monkeypatch.setattr(torch.optim.Optimizer, "__init__", refuse)
    plan, _ = plan_in_process(tmp_path / "none", "--dry-run", "--base-dir", str(tmp_path / "none"))
    assert re.search(r"^data: \d+ ClimbMix train shards", plan, re.M), plan


def test_bad_input_in_the_shell_is_one_line_error(tmp_path):
    assert "unknown preset 'gpt5'" in one_line_error(speedrun(tmp_path, "--dry-run", "--preset", "gpt5"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "gpt5"], "unknown preset 'gpt5'"),
        (["--arch", "gpt,bert"], "unknown arch 'bert'"),
        (
            ["--preset", "run6", "--arch", "gpt,gpt-recipe"],
            "--arch gpt,gpt-recipe names one arch twice with --preset run6",
        ),
        (["--gpus", "3"], "not a multiple"),  # 2^20 tokens per step do not split over 3 × 16 × 2048
        (["--flops", "1e12", "--arch", "gpt"], "0 steps"),  # below one step of 2^20 tokens
    ],
)
def test_bad_input_is_one_line_error(tmp_path, monkeypatch, script_error, args, message):
    from scripts import speedrun as speedrun_py

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    monkeypatch.delenv("NANOCHAT_OFFLINE", raising=False)
    assert message in script_error(speedrun_py.main, "--dry-run", *args)


@needs_venv
def test_disk_is_checked_before_any_download(tmp_path):
    # the published pair needs ~200 GiB for checkpoints: here either the disk check or the GPU check
    # stops it, with one line, before any data is fetched
    r = speedrun(tmp_path, "--gpus", "8", "--arch", "gpt", "--base-dir", str(tmp_path))
    assert r.returncode == 1
    assert re.search(r"^error: (not enough disk|torch sees \d CUDA device)", r.stdout + r.stderr, re.M), (
        r.stdout + r.stderr
    )
    assert not (tmp_path / "base_data").exists() and not (tmp_path / "tokenizer").exists()


FAKE_NVIDIA_SMI = """#!/usr/bin/env bash
# stands in for a node with 8 H100s on driver 570 (CUDA 12.8)
case "$1" in
  -L) for i in 0 1 2 3 4 5 6 7; do echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-0000000$i)"; done ;;
  --query-gpu=driver_version) echo "570.86.15" ;;
  *) echo "| NVIDIA-SMI 570.86.15    Driver Version: 570.86.15    CUDA Version: 12.8 |" ;;
esac
"""


@pytest.fixture
def fake_gpu_node(tmp_path, monkeypatch):
    """PATH with an nvidia-smi that lists 8 H100s, while torch here is the CPU build."""
    if torch_sees_cuda():
        pytest.skip("torch sees a real GPU here")
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def torch_sees_cuda():
    import torch

    return torch.cuda.is_available()


@needs_venv
def test_gpu_node_with_cpu_torch_stops_before_any_stage(tmp_path, fake_gpu_node):
    base = tmp_path / "base"
    r = speedrun(base, "--base-dir", str(base))
    err = one_line_error(r)
    assert "torch sees 0 CUDA device(s), 8 needed" in err and "CPU build" in err and "driver 570.86.15" in err, err
    assert "===" not in r.stdout and not base.exists()  # no stage started, nothing written


def test_speedrun_plan_checks_torch_not_just_nvidia_smi(tmp_path, fake_gpu_node, script_error):
    from scripts import speedrun as speedrun_py

    base = tmp_path / "base"
    err = script_error(speedrun_py.main, "--base-dir", str(base))
    assert "torch sees 0 CUDA device(s), 8 needed" in err and "nvidia-smi lists 8 GPU(s)" in err
    assert not base.exists()


def test_preflight_fails_when_no_cuda_test_ran():
    if torch_sees_cuda():
        pytest.skip("torch sees a real GPU here")
    # without the flag the same command passes, every CUDA test skipped: gpu_checks' kernel_tests stage runs it
    # (tests/test_gpu_checks.py::test_every_quick_stage_runs_under_the_slot_python: pytest exit 0, tests skipped)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_nag_kernels.py", "-k", "cuda"]
    preflight = subprocess.run(cmd + ["--require-cuda"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert preflight.returncode == 1 and "0 CUDA test(s) passed" in preflight.stdout, preflight.stdout[-2000:]
    assert "--require-cuda" in open(SPEEDRUN).read()  # and the preflight uses it


def test_tokenizer_of_another_size_is_refused(tiny_base_dir, tmp_path, monkeypatch, script_error):
    from scripts import speedrun as speedrun_py

    base = tmp_path / "base"
    base.mkdir()
    # 512 tokens; the published preset wants 32,768
    os.symlink(os.path.join(tiny_base_dir, "tokenizer"), base / "tokenizer")
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    err = script_error(speedrun_py.main, "--dry-run", "--base-dir", str(base))
    assert "512" in err and "32,768" in err and "fresh --base-dir" in err, err


def write_bundle(root):
    """A one-task CORE bundle, so base_eval never reaches for the network."""
    (root / "eval_data").mkdir(parents=True)
    (root / "core.yaml").write_text(
        "icl_tasks:\n-\n  label: tiny_lm\n  dataset_uri: tiny_lm.jsonl\n"
        "  num_fewshot: [0]\n  icl_task_type: language_modeling\n"
    )
    (root / "eval_meta_data.csv").write_text("Eval Task,Task Category,Random baseline\ntiny_lm,tiny,0.0\n")
    (root / "eval_data" / "tiny_lm.jsonl").write_text(
        "".join(json.dumps({"context": f"Document {i}. The", "continuation": " model"}) + "\n" for i in range(4))
    )
    return str(root)


def mtimes(run_dir):
    return {f: os.stat(os.path.join(run_dir, f)).st_mtime_ns for f in os.listdir(run_dir) if f != ".lock"}


@needs_venv
def test_tiny_pipeline_skips_finished_stages_and_resumes(tiny_base_dir, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    for name in ("base_data", "tokenizer"):  # the session's offline corpus and vocab-512 tokenizer
        os.symlink(os.path.join(tiny_base_dir, name), base / name)
    # 13 steps per run, checkpoints at 5, 10 and 13
    args = [
        "--preset",
        "tiny",
        "--base-dir",
        str(base),
        "--eval-bundle",
        write_bundle(tmp_path / "bundle"),
        "--flops",
        "3e9",
        "--",
        "--save-every",
        "5",
    ]
    runs = {arch: base / "runs" / f"{arch}-tiny" for arch in ("gpt", "nag")}

    first = speedrun(base, *args)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr
    for run_dir in runs.values():
        assert {"model_000005.pt", "model_000010.pt", "model_000013.pt", "eval.json"} <= set(os.listdir(run_dir))
    assert (base / "reports" / "gpt-tiny_vs_nag-tiny" / "report.md").exists()
    assert "=== " in (base / "speedrun.log").read_text()
    before = {arch: mtimes(d) for arch, d in runs.items()}

    second = speedrun(base, *args)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr
    out = second.stdout
    for line in ("data already present, skipping", "tokenizer already trained, skipping", "report already up to date"):
        assert line in out
    for stage in ("train gpt-tiny", "train nag-tiny", "eval gpt-tiny", "eval nag-tiny", "analysis"):
        assert re.search(rf"^  {stage} +\[done, skip\]", out, re.M), stage
    assert "step 00001" not in out and "evaluating" not in out
    assert {arch: mtimes(d) for arch, d in runs.items()} == before  # nothing retrained, nothing re-evaluated

    # an interruption between the checkpoints at 10 and 13: the run resumes from 10 and is evaluated again
    for f in ("model_000013.pt", "meta_000013.json", "optim_000013_rank0.pt"):
        os.remove(runs["gpt"] / f)
    third = speedrun(base, *args)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr
    assert "resumed from step 10" in third.stdout and "step 00011/00013" in third.stdout
    assert "step 00001/" not in third.stdout
    after = mtimes(runs["gpt"])
    assert after["model_000010.pt"] == before["gpt"]["model_000010.pt"] and "model_000013.pt" in after
    assert after["eval.json"] != before["gpt"]["eval.json"]
    assert mtimes(runs["nag"]) == before["nag"]
    assert "report already up to date" not in third.stdout  # gpt's new eval.json: the report is redone
    steps = [json.loads(line)["step"] for line in open(runs["gpt"] / "metrics.jsonl")]
    assert steps == list(range(14))


# ---------------------------------------------------------------------------
# base_train flags after `--` without --tag: runs of their own, named the same on every rerun


def fake_finished_run(run_dir, step, world_size):
    """The files that make checkpoint `step` complete (checkpoint_manager.is_complete), empty."""
    os.makedirs(run_dir)
    fake_checkpoint(run_dir, step, world_size)


def fake_checkpoint(run_dir, step, world_size):
    names = [f"model_{step:06d}.pt"] + [f"optim_{step:06d}_rank{r}.pt" for r in range(world_size)]
    for name in names:
        open(os.path.join(run_dir, name), "w").close()
    # written last, with the files' sizes, as a save does
    with open(os.path.join(run_dir, f"meta_{step:06d}.json"), "w") as f:
        json.dump({"world_size": world_size, "file_sizes": {name: 0 for name in names}}, f)


def plan_of(capsys, *argv):
    """(the plan on stderr, the plan file's assignments: a value or, for an array, a list). The file is data: every
    line one plain assignment of quoted values, nothing that runs; nothing goes to stdout."""
    from scripts import speedrun as sr

    fd, path = tempfile.mkstemp(prefix="speedrun-plan.")
    os.close(fd)
    cut = argv.index("--") if "--" in argv else len(argv)  # speedrun's own flags end at --
    try:
        sr.main([*argv[:cut], "--plan-file", path, *argv[cut:]])
        text = open(path).read()
    finally:
        os.remove(path)
    out = capsys.readouterr()
    assert out.out == ""
    sh = {}
    for line in text.splitlines():
        key, value = line.split("=", 1)
        assert re.fullmatch(r"(export )?[A-Z_]+", key), line
        sh[key] = shlex.split(value[1:-1]) if value.startswith("(") else shlex.split(value)[0]
        assert line == f"{key}=" + (
            f"({' '.join(map(shlex.quote, sh[key]))})" if value.startswith("(") else shlex.quote(sh[key])
        )
    return out.err, sh


def test_extra_flags_without_tag_get_runs_of_their_own(tmp_path, capsys):
    base = tmp_path / "base"
    fake_finished_run(base / "runs" / "nag-published", 9425, 8)  # the default NAG run, finished
    common = ["--dry-run", "--arch", "nag", "--gpus", "8", "--base-dir", str(base)]
    err, sh = plan_of(capsys, *common)
    assert sh["RUNS"] == ["nag-published"] and sh["TRAIN_DONE"] == ["1"] and "tag:" not in err
    assert sh["PAIR"] == "0" and not re.search(r"^  (analysis|report) ", err, re.M)  # one arch: nothing to compare
    for _ in range(2):  # a rerun of the same command finds the same runs
        err, sh = plan_of(capsys, *common, "--", "--nag-mod-floor", "0")
        assert sh["RUNS"] == ["nag-published-nag-mod-floor0"] and sh["TRAIN_DONE"] == ["0"], err
        assert re.search(r"^tag: nag-mod-floor0 \(from the base_train flags after --", err, re.M), err
        assert re.search(r"^  train nag-published-nag-mod-floor0 +\[to do\]", err, re.M)
    fake_finished_run(base / "runs" / "nag-published-nag-mod-floor0", 9425, 8)
    err, sh = plan_of(capsys, *common, "--", "--nag-mod-floor", "0")
    assert sh["TRAIN_DONE"] == ["1"] and re.search(r"^  train nag-published-nag-mod-floor0 +\[done, skip\]", err, re.M)
    # flags that change how a run is saved or logged, not what it learns, keep the name; --tag always wins
    assert plan_of(capsys, *common, "--", "--save-every", "5", "--nag-gate-log-every", "10")[1]["RUNS"] == [
        "nag-published"
    ]
    assert plan_of(capsys, *common, "--tag", "nofloor", "--", "--nag-mod-floor", "0")[1]["RUNS"] == [
        "nag-published-nofloor"
    ]
    assert not (base / "base_data").exists()


def test_derived_tags():
    from scripts.speedrun import MAX_TAG, derived_tag

    assert derived_tag(["--nag-mod-floor", "0"]) == derived_tag(["--nag-mod-floor=0"]) == "nag-mod-floor0"
    assert (
        derived_tag(["--nag-renorm", "predicted", "--depth", "32", "--save-every", "5"])
        == "nag-renorm-predicted_depth32"
    )
    assert derived_tag(["--save-every", "5", "--no-compile"]) == ""
    long = ["--matrix-lr", "0.02", "--embedding-lr", "0.3", "--unembedding-lr", "0.008", "--nag-mod-floor"]
    a, b = derived_tag(long + ["1e-6"]), derived_tag(long + ["1e-7"])
    assert (
        a != b
        and len(a) <= MAX_TAG
        and a.startswith("matrix-lr0.02_embedding-lr0.3")
        and a == derived_tag(long + ["1e-6"])
    )
    assert all(c.isalnum() or c in "._-" for c in derived_tag(["--eval-bundle", "/a b/c"]))


# ---------------------------------------------------------------------------
# --seeds: every arch once per seed, one failed run named at the end while the others go on


def test_seeds_plan_every_run_and_their_total(tmp_path, capsys):
    base = tmp_path / "base"
    common = ["--dry-run", "--gpus", "8", "--base-dir", str(base)]
    one_err, one = plan_of(capsys, *common)
    err, sh = plan_of(capsys, *common, "--seeds", "1,2")
    runs = ["gpt-published-s1", "nag-published-s1", "gpt-published-s2", "nag-published-s2"]
    assert sh["RUNS"] == runs and sh["TRAIN_DONE"] == sh["EVAL_DONE"] == ["0"] * 4
    plans = [json.loads(line[len("PLAN ") :]) for line in err.splitlines() if line.startswith("PLAN ")]
    assert [(p["run"], p["seed"], p["data_seed"]) for p in plans] == [(r, int(r[-1]), int(r[-1])) for r in runs]
    for i, run in enumerate(runs):
        assert re.search(rf"^{run} +[\d,]+ ", err, re.M)  # a row of the plan table
        for stage in ("train", "eval"):
            assert re.search(rf"^  {stage} {run} +\[to do\]$", err, re.M)
        # the seeds after the user's flags, the run's own name last
        seed = run[-1]
        assert sh_commands(sh, i)["train"][-8:] == [
            "--seed",
            seed,
            "--data-seed",
            seed,
            "--run",
            run,
            "--resume",
            "latest",
        ]
        assert sh_commands(sh, i)["eval"][:2] == ["--run", run]
    assert sh["COMPARE_RUNS"] == ["--a", *runs[0::2], "--b", *runs[1::2]]
    assert sh["REPORT"] == str(base / "reports" / "gpt-published-seeds-1-2_vs_nag-published-seeds-1-2")
    # the cost of all four runs: twice the pair's
    hours = lambda text, pattern: (lambda m: int(m[1]) * 60 + int(m[2]))(re.search(pattern, text, re.M))
    pair = hours(one_err, r"^training time: ≈ (\d+)h(\d+)m")
    assert (
        abs(hours(err, r"^seeds 1,2: 4 runs \(2 × gpt,nag\), ≈ (\d+)h(\d+)m of training on 8 × H100") - 2 * pair) <= 1
    )
    assert abs(hours(err, r"^training time: ≈ (\d+)h(\d+)m .*, all 4 runs$") - 2 * pair) <= 1
    # without --seeds nothing changes: the same names, no seed flags, the pair's report
    assert (
        one["RUNS"] == ["gpt-published", "nag-published"]
        and "--seed" not in sh_commands(one, 0)["train"] + sh_commands(one, 1)["train"]
    )
    assert one["COMPARE_RUNS"] == ["gpt-published", "nag-published"]
    assert one["REPORT"] == str(base / "reports" / "gpt-published_vs_nag-published")
    assert not re.search(r"^seeds", one_err, re.M)


def test_group_report_is_found_current(tmp_path, capsys, monkeypatch):
    from scripts import compare
    from tests.test_compare import eval_record, write_run

    base = tmp_path / "base"
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    common = ["--dry-run", "--preset", "tiny", "--base-dir", str(base), "--seeds", "1,2"]
    err, sh = plan_of(capsys, *common)
    assert sh["REPORT"] == str(base / "reports" / "gpt-tiny-seeds-1-2_vs_nag-tiny-seeds-1-2")
    steps = {
        p["run"]: p["num_iterations"]
        for p in (json.loads(line[5:]) for line in err.splitlines() if line.startswith("PLAN "))
    }
    for i, run in enumerate(sh["RUNS"]):  # finished runs of both seeds, evaluated after their last checkpoint
        seed, step = int(run[-1]), steps[run]
        run_dir = write_run(
            base / "runs",
            run,
            [eval_record(step, 1.30 - i % 2 / 100 + seed / 100, seed=seed)],
            arch=run[:3],
            args={"seed": seed, "data_seed": seed},
        )
        fake_checkpoint(run_dir, step, 1)
        os.utime(os.path.join(run_dir, "eval.json"))
    err, sh = plan_of(capsys, *common)
    assert sh["EVAL_DONE"] == ["1"] * 4 and sh["REPORT_DONE"] == "0"
    # what speedrun.sh runs: the groups' report, its inputs.json in compare's order
    compare.main([*sh["COMPARE_RUNS"], "--out", sh["REPORT"]])
    capsys.readouterr()
    err, sh = plan_of(capsys, *common)
    assert sh["REPORT_DONE"] == "1" and re.search(r"^  report +\[done, skip\]", err, re.M)
    # a re-evaluation with other numbers makes the report stale
    json.dump(eval_record(steps["nag-tiny-s2"], 1.25, seed=7), open(base / "runs" / "nag-tiny-s2" / "eval.json", "w"))
    assert plan_of(capsys, *common)[1]["REPORT_DONE"] == "0"
    # a CORE cut short (base_eval interrupted) is not an evaluation done: the rerun evaluates that run again
    interrupted = {**eval_record(steps["nag-tiny-s2"], 1.25, seed=7), "core_finished": False, "interrupted": True}
    json.dump(interrupted, open(base / "runs" / "nag-tiny-s2" / "eval.json", "w"))
    assert plan_of(capsys, *common)[1]["EVAL_DONE"] == ["1", "1", "1", "0"]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--seeds", "1,x"],
            "--seeds takes different non-negative integers separated by commas, like 1,2,3; got '1,x'",
        ),
        (["--seeds", "1,2,1"], "got '1,2,1'"),
        (["--seeds=-1"], "got '-1'"),
        (
            ["--seeds", "1,2", "--", "--seed", "3"],
            "--seeds sets --seed and --data-seed of every run; drop --seed from the base_train flags after --",
        ),
        (["--seeds", "1", "--", "--data-seed=3"], "drop --data-seed from"),
    ],
)
def test_bad_seeds_are_one_line_errors(tmp_path, script_error, args, message):
    from scripts import speedrun as sr

    assert message in script_error(sr.main, "--dry-run", "--base-dir", str(tmp_path), *args)


@pytest.mark.parametrize(
    "args, owner, flag",
    [
        (["--", "--arch", "nag"], "--arch", "--arch"),
        (["--", "--ar=nag"], "--arch", "--arch"),  # base_train reads an abbreviation as the flag
        (["--", "--preset", "d20"], "--preset", "--preset"),
        (["--", "--run", "mine"], "--tag", "--run"),
        (["--flops", "1e12", "--", "--target-flops", "2e12"], "--flops", "--target-flops"),
        (["--seeds", "1", "--", "--data-seed=3"], "--seeds", "--data-seed"),
    ],
)
def test_a_flag_speedrun_sets_per_run_is_refused_after_the_dashes(tmp_path, script_error, args, owner, flag):
    """`speedrun.sh --preset tiny -- --arch nag` used to plan both runs as NAG, the GPT run included, under a header
    saying "arch gpt,nag": a base_train flag after -- wins over the one speedrun writes on every run's command line.
    One rule for every flag speedrun writes there: refused, pointing at speedrun's own flag."""
    from scripts import speedrun as sr

    err = script_error(sr.main, "--dry-run", "--preset", "tiny", "--base-dir", str(tmp_path), *args)
    assert f"speedrun's {owner} sets" in err and f"drop {flag} from the base_train flags after --" in err
    assert "--resume latest" in script_error(sr.main, "--dry-run", "--base-dir", str(tmp_path), "--", "--resume", "3")


def test_a_flag_speedrun_leaves_alone_still_goes_after_the_dashes(tmp_path, capsys):
    """Without --seeds and --flops, speedrun writes no seed or budget: -- --seed 3 and -- --target-flops set them."""
    err, sh = plan_of(capsys, "--dry-run", "--preset", "tiny", "--base-dir", str(tmp_path), "--", "--seed", "3")
    assert sh["EXTRA"] == ["--seed", "3"] and sh["RUNS"] == ["gpt-tiny-seed3", "nag-tiny-seed3"]


@needs_venv
def test_a_failed_run_leaves_the_others_to_go_on(tiny_base_dir, tmp_path, capsys):
    base = tmp_path / "base"
    base.mkdir()
    for name in ("base_data", "tokenizer"):
        os.symlink(os.path.join(tiny_base_dir, name), base / name)
    # seed 1's run is busy (another process holds its lock): its training fails at once; seed 2's trains 2 steps
    args = [
        "--preset",
        "tiny",
        "--arch",
        "gpt",
        "--seeds",
        "1,2",
        "--flops",
        "5e8",
        "--base-dir",
        str(base),
        "--eval-bundle",
        write_bundle(tmp_path / "bundle"),
    ]
    (base / "runs" / "gpt-tiny-s1").mkdir(parents=True)
    with open(base / "runs" / "gpt-tiny-s1" / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        r = speedrun(base, *args)
    assert r.returncode == 1, r.stdout[-3000:]
    out = r.stdout
    stages = re.findall(r"^=== \[[\d:]+\] (.*) ===$", out, re.M)
    assert stages[2:] == ["train gpt-tiny-s1", "train gpt-tiny-s2", "evaluate gpt-tiny-s1", "evaluate gpt-tiny-s2"], (
        stages
    )
    assert "gpt-tiny-s1 is in use by another process" in out and "skipped: its training failed" in out
    assert (base / "runs" / "gpt-tiny-s2" / "eval.json").exists()
    config = json.load(open(base / "runs" / "gpt-tiny-s2" / "config.json"))
    assert (config["seed"], config["data_seed"]) == (2, 2)
    assert out.strip().splitlines()[-1] == "error: failed: gpt-tiny-s1 (rerun to retry them; finished runs are reused)"
    # the rerun finds seed 2 finished and evaluated, seed 1 to do
    err, sh = plan_of(capsys, "--dry-run", *args)
    assert sh["TRAIN_DONE"] == ["0", "1"] and sh["EVAL_DONE"] == ["0", "1"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
        (["--nnodes", "2", "--rdzv-endpoint", "node0"], "needs --rdzv-endpoint HOST:PORT"),
        (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "node0:29500"], "--node-rank must be in 0..nnodes-1"),
        # speedrun's numbers follow the one rule of every command (nanochat/common.py)
        (["--max-restarts", "-1"], "--max-restarts must be >= 0 (0: no restart); got -1"),
        (["--nnodes", "0"], "--nnodes must be positive; got 0"),
        (["--gpus", "0"], "--gpus must be positive; got 0"),
        (["--shards=-2"], "--shards must be positive; got -2"),
        (["--flops", "inf"], "--flops must be positive; got inf"),
    ],
)
def test_bad_node_flags_are_one_line_errors(tmp_path, script_error, args, message):
    from scripts import speedrun as sr

    assert message in script_error(sr.main, "--dry-run", "--base-dir", str(tmp_path), *args)


def test_several_nodes_plan_launch_and_roles(tmp_path, capsys, monkeypatch):
    base = tmp_path / "base"
    common = ["--dry-run", "--gpus", "8", "--base-dir", str(base)]
    _, one = plan_of(capsys, *common)
    nodes = ["--nnodes", "2", "--rdzv-endpoint", "node0:29500"]
    err, node0 = plan_of(capsys, *common, *nodes, "--node-rank", "0")
    # one node: torchrun on its own; two: the c10d rendezvous at node 0; restarts either way; evaluation on node 0 alone
    assert one["LAUNCH"] == ["torchrun", "--standalone", "--nproc_per_node=8", "--max-restarts=2", "-m"]
    assert node0["LAUNCH"] == [
        "torchrun",
        "--nnodes=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=node0:29500",
        "--rdzv-id=nanochat",
        "--nproc_per_node=8",
        "--max-restarts=2",
        "-m",
    ]
    assert node0["EVAL_LAUNCH"] == ["torchrun", "--standalone", "--nproc_per_node=8", "--max-restarts=0", "-m"]
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in node0  # the setting every torchrun launch gets
    plans = [json.loads(line[len("PLAN ") :]) for line in err.splitlines() if line.startswith("PLAN ")]
    assert [p["world_size"] for p in plans] == [16, 16] and "on 16 × H100" in err
    assert node0["DATA_DONE"] == "0" and node0["PAIR"] == "1"
    # node 1 trains, nothing else: data, tokenizer, evaluations, analysis and report are node 0's
    _, node1 = plan_of(capsys, *common, *nodes, "--node-rank", "1")
    assert (
        node1["LAUNCH"] == node0["LAUNCH"]
        and node1["TRAIN_DONE"] == ["0", "0"]
        and sh_commands(node1, 0) == sh_commands(node0, 0)
    )
    assert node1["DATA_DONE"] == node1["TOK_DONE"] == "1" and node1["EVAL_DONE"] == ["1", "1"] and node1["PAIR"] == "0"


def test_other_nodes_wait_for_node0s_data(tiny_base_dir, tmp_path, capsys, monkeypatch):
    from scripts import speedrun as sr

    monkeypatch.setattr(sr.time, "sleep", lambda s: None)
    monkeypatch.setattr(sr, "NODE_WAIT_S", 60)
    args = ["--preset", "tiny", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:29500"]
    two_ranks = ["--", "--total-batch-size", "512"]  # the tiny preset's 256 tokens do not split over two processes
    with pytest.raises(SystemExit) as e:
        sr.main([*args, "--base-dir", str(tmp_path / "empty"), *two_ranks])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and err[-1].startswith("error: node 1: node 0 has not prepared the data and tokenizer"), (
        err[-3:]
    )
    assert "node 1: waiting for node 0's data and tokenizer" in err[-2]
    base = tmp_path / "ready"
    base.mkdir()
    for name in ("base_data", "tokenizer"):
        os.symlink(os.path.join(tiny_base_dir, name), base / name)
    sr.main([*args, "--base-dir", str(base), *two_ranks])  # ready: the plan goes on to the training


def sh_commands(sh, i):
    """The base_train and base_eval flags of run i as speedrun.sh's own lines expand them (the lines that start
    each launch, run by bash with the plan's variables and a launcher that prints its arguments)."""
    lines = open(SPEEDRUN).read().splitlines()

    def command(marker):
        start = next(k for k, line in enumerate(lines) if marker in line)
        text = lines[start].split(marker, 1)[1]
        while text.endswith("\\"):
            start += 1
            text = text[:-1] + lines[start].strip()
        return text.split("; then")[0].strip()  # the command's own arguments, up to the end of its line(s)

    assign = "\n".join(
        f"{k}=({' '.join(shlex.quote(v) for v in vs)})" if isinstance(vs, list) else f"{k}={shlex.quote(vs)}"
        for k, vs in sh.items()
    )
    # the run's seed flags, as speedrun.sh reads them
    seed_line = next(line.strip() for line in lines if "read -r -a SEED" in line)
    out = {}
    for name, marker in (("train", 'scripts.base_train -- '), ("eval", 'scripts.base_eval -- ')):
        script = f"{assign}\ni={i}\n{seed_line}\nprintf '%s\\n' {command(marker)}"
        out[name] = subprocess.run(
            ["bash", "-c", script], capture_output=True, text=True, check=True
        ).stdout.splitlines()
    return out


def test_speedrun_sh_runs_the_commands_the_plan_made(tmp_path, capsys):
    """The base_train and base_eval lines written out in speedrun.sh give exactly the flags speedrun planned each run
    with (train_args / eval_args), extra flags after -- and seeds included."""
    from scripts import speedrun as sr

    argv = [
        "--dry-run",
        "--gpus",
        "8",
        "--base-dir",
        str(tmp_path / "b"),
        "--seeds",
        "3,4",
        "--flops",
        "1e18",
        "--eval-bundle",
        str(tmp_path),
        "--",
        "--nag-mod-floor",
        "1e-7",
    ]
    _, sh = plan_of(capsys, *argv)
    args = sr.parse(argv)
    for i, (arch, seed) in enumerate(sr.runs(args)):
        got = sh_commands(sh, i)
        assert got["train"] == sr.train_args(args, arch, seed)
        assert got["eval"] == sr.eval_args(args, arch, seed)


def test_a_pair_shares_one_device_batch_and_the_gpu_it_was_planned_for(tmp_path, capsys):
    """On an RTX 5090 the memory plan alone gives the published GPT 8 rows a micro-batch and NAG 4 (its readout
    holds 2 bytes more per logit): the pair trains with 4, and speedrun.sh's commands carry the GPU and the batch."""
    from scripts import speedrun as sr

    argv = ["--dry-run", "--gpus", "8", "--gpu", "rtx5090", "--base-dir", str(tmp_path / "b")]
    err, sh = plan_of(capsys, *argv)
    assert "device batch: 4 for every run (the memory plan alone gives gpt-published 8, nag-published 4" in err
    assert sh["MEMORY"] == ["--gpu", "rtx5090", "--device-batch-size", "4"]
    records = [json.loads(line[5:]) for line in err.splitlines() if line.startswith("PLAN ")]
    assert [(r["device_batch_size"], r["grad_accum_steps"]) for r in records] == [(4, 16), (4, 16)]
    args = sr.parse(argv)
    args.pair_batch = 4  # what the plan decided
    for i, (arch, seed) in enumerate(sr.runs(args)):
        assert sh_commands(sh, i)["train"] == sr.train_args(args, arch, seed)


def test_seed_lists_follow_one_rule():
    """speedrun.sh's --seeds, runcpu.sh's SEEDS and the experiments' --seeds all go through parse_seeds: "1, 2" (which
    speedrun once took as 1,2 while runcpu refused it) and a repeated seed are refused alike."""
    from nanochat.common import UserError, parse_seeds

    assert parse_seeds("3,1,2") == [3, 1, 2]
    for bad in ("1, 2", " 1,2", "1,1", "1,2,1", "1,,2", "", "-1", "1.0", "１"):
        with pytest.raises(
            UserError, match=r"takes different non-negative integers separated by commas, like 1,2,3; got "
        ):
            parse_seeds(bad)


def test_other_archs_train_beside_the_pair(tmp_path, capsys):
    """--arch may name any arch of nag/archs.py besides the pair's roles (a depth sweep's extra arms): each trains on
    the same budget, seeds and data order under its own name; the analysis and the report stay the pair's."""
    from nag.archs import ARCHS

    common = ["--dry-run", "--gpus", "8", "--base-dir", str(tmp_path / "b"), "--seeds", "1,2"]
    _, pair = plan_of(capsys, *common)
    err, sh = plan_of(capsys, *common, "--arch", "gpt-recipe,nag,gpt")
    assert "gpt-recipe" in ARCHS and sh["RUN_ARCH"] == ["gpt", "nag", "gpt-recipe"] * 2
    assert sh["RUNS"] == [f"{a}-published-s{s}" for s in (1, 2) for a in ("gpt", "nag", "gpt-recipe")]
    assert sh["RUN_SEED_ARGS"] == ["--seed 1 --data-seed 1"] * 3 + ["--seed 2 --data-seed 2"] * 3
    assert (sh["PAIR"], sh["COMPARE_RUNS"], sh["REPORT"]) == (pair["PAIR"], pair["COMPARE_RUNS"], pair["REPORT"])
    assert sh_commands(sh, 2)["train"][:4] == ["--preset", "published", "--arch", "gpt-recipe"]
    _, alone = plan_of(capsys, *common, "--arch", "gpt-recipe")
    assert alone["RUNS"] == ["gpt-recipe-published-s1", "gpt-recipe-published-s2"] and alone["PAIR"] == "0"
    assert alone["COMPARE_RUNS"] == [] and alone["PREFLIGHT"] == "0" and sh["PREFLIGHT"] == "1"


def test_pilot_plans_both_pairs_with_memory_steps_and_hours_for_two_rtx_5090s(tmp_path, capsys):
    """The walkthrough's depth-26 pairs at 1e18 and 3e18 FLOPs (its fork's own arithmetic gives these steps), each
    run's device batch and memory on a 32 GB card, and the hours there and on one H100."""
    err, sh = plan_of(capsys, "--preset", "pilot", "--dry-run", "--gpus", "2", "--gpu", "rtx5090",
                      "--base-dir", str(tmp_path / "base"))  # fmt: skip
    rows = {line.split()[0]: line for line in err.splitlines() if line.startswith(("gpt-pilot", "nag-pilot"))}
    assert list(rows) == ["gpt-pilot-1e18", "nag-pilot-1e18", "gpt-pilot-3e18", "nag-pilot-3e18"]
    steps = {run: int(row.split()[3].replace(",", "")) for run, row in rows.items()}
    assert steps == {"gpt-pilot-1e18": 1465, "nag-pilot-1e18": 1458, "gpt-pilot-3e18": 4396, "nag-pilot-3e18": 4375}
    for row in rows.values():
        assert re.search(r"batch (\d+): [\d.]+/32 GiB fits", row) and re.search(r"\d+h\d\dm at 40% MFU", row)
    assert re.search(r"^training time: ≈ \d+h\d\dm on 2 × RTX 5090 at 40% MFU of 210 TFLOP/s .*; on 1 × H100: ≈ "
                     r"\d+h\d\dm$", err, re.M)  # fmt: skip
    assert "speedrun --preset pilot --flops 3e18 trains it" in err
    assert sh["RUNS"] == ["gpt-pilot-1e18", "nag-pilot-1e18"]  # one pair trains per command
    records = [json.loads(line[5:]) for line in err.splitlines() if line.startswith("PLAN ")]
    assert {r["gpu"]["gpu"] for r in records} == {"rtx5090"} and all(r["memory"]["fits"] for r in records)


def test_a_run_that_does_not_fit_stops_the_plan_in_one_line(tmp_path, capsys, script_error):
    """The plan comes before any download or tokenizer: a run that fits no device batch ends speedrun there."""
    from scripts import speedrun as sr

    base = tmp_path / "base"
    err = script_error(sr.main, "--preset", "published", "--gpu-memory", "3", "--base-dir", str(base), "--dry-run")
    assert "does not fit 3 GiB even at device batch 1" in err
    assert not base.exists()
