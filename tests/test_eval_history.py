"""base_eval's results per evaluated step (eval/step_NNNNNN.*), and what they record.

Also the numbers that must not depend on how the evaluation ran: the number of processes,
a --split-tokens larger than the split, an interruption."""

import os
import re
import sys
import json
import signal
import shutil
import subprocess

import pytest
import torch

from conftest import PROCESSES, TINY_TRAIN, linked_base, tiny_documents
from scripts import base_eval
from nanochat import core_eval
from nanochat import run_dir as run_files
from nanochat.common import UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVAL = ["--split-tokens", "512", "--device-batch-size", "4", "--sample-tokens", "4", "--max-per-task", "4"]
ITEMS = {
    "tiny_mc": [
        {"query": f"Document {i}. The model", "choices": ["is the data.", "of weight gradient", "and"], "gold": i % 3}
        for i in range(6)
    ],
    "tiny_schema": [
        {"context_options": [f"The layer {i} was", f"The head {i} is"], "continuation": "the attention.", "gold": i % 2}
        for i in range(6)
    ],
    "tiny_lm": [{"context": f"Document {i}. The", "continuation": " model"} for i in range(6)],
}
TASKS = [
    ("tiny_mc", "multiple_choice", 1, 33.3, ITEMS["tiny_mc"]),
    ("tiny_schema", "schema", 0, 50.0, ITEMS["tiny_schema"]),
    ("absent_task", "multiple_choice", 0, 25.0, None),
    ("tiny_lm", "language_modeling", 2, 0.0, ITEMS["tiny_lm"]),
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def trained(tiny_base_dir, tmp_path_factory, write_eval_bundle):
    """A 6-step gpt run (checkpoints at 3 and 6) in a base dir sharing the session corpus and tokenizer, and a
    bundle."""
    from scripts import base_train

    base = linked_base(tiny_base_dir, tmp_path_factory.mktemp("hist_base"))
    bundle = write_eval_bundle(tmp_path_factory.mktemp("bundle"), TASKS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(base))
        run_dir = base_train.main(
            TINY_TRAIN
            + ["--num-iterations", "6", "--eval-every", "3", "--save-every", "3", "--arch", "gpt", "--run", "gpt"]
        )
    return {"base": str(base), "bundle": bundle, "run_dir": run_dir}


@pytest.fixture
def run(trained, tmp_path, monkeypatch):
    """A fresh copy of the trained run (no evaluation yet): its directory path, which base_eval takes as --run."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", trained["base"])
    run_dir = str(tmp_path / "gpt")
    shutil.copytree(trained["run_dir"], run_dir, ignore=shutil.ignore_patterns(".lock"))
    return run_dir


def evaluate(run_dir, bundle, *argv):
    return base_eval.main(["--run", run_dir, "--eval-bundle", bundle, *EVAL, *argv])


def files(run_dir, names):
    return {n: open(os.path.join(run_dir, n), "rb").read() for n in names}


def load(run_dir, name):
    return json.load(open(os.path.join(run_dir, name)))


TOP = ["eval.json", "core_records.parquet", "core_tasks.csv"]


def step_names(step):
    return [
        f"eval/step_{step:06d}.json",
        f"eval/step_{step:06d}_core_records.parquet",
        f"eval/step_{step:06d}_core_tasks.csv",
    ]


def test_each_step_keeps_its_results_and_eval_json_is_the_highest(run, trained):
    final = evaluate(run, trained["bundle"], "--eval", "core,bpb")
    assert final["step"] == 6 and load(run, "eval.json") == load(run, "eval/step_000006.json") == json.loads(
        json.dumps(final)
    )
    assert final["core_records"] == "eval/step_000006_core_records.parquet"
    top, six = files(run, TOP), files(run, step_names(6))
    assert top == dict(zip(TOP, six.values()))  # the top-level files are copies of step 6's

    # an earlier step afterwards: its own files, and nothing of step 6 changes, at the top or in eval/
    early = evaluate(run, trained["bundle"], "--step", "3", "--eval", "core,bpb")
    assert early["step"] == 3 and early["val_bpb"] != final["val_bpb"] and set(early["tasks"]) == set(final["tasks"])
    assert files(run, TOP) == top and files(run, step_names(6)) == six
    assert load(run, "eval/step_000003.json") == json.loads(json.dumps(early))
    assert core_eval.load_records(os.path.join(run, "eval/step_000003_core_records.parquet"))[1]["step"] == 3

    # a section of one step re-run: merged with that step's other sections only
    again = evaluate(run, trained["bundle"], "--step", "3", "--eval", "sample")
    assert again["tasks"] == early["tasks"] and again["val_bpb"] == early["val_bpb"] and again["samples"]
    assert files(run, TOP) == top
    latest = evaluate(run, trained["bundle"], "--eval", "bpb")  # step 6, the highest: the top copies follow it
    assert (
        latest["tasks"] == final["tasks"]
        and latest["samples"] == []
        and load(run, "eval.json") == json.loads(json.dumps(latest))
    )
    assert files(run, ["core_records.parquet"]) == {"core_records.parquet": six[step_names(6)[1]]}
    # what every record says it was measured with
    for rec in (final, early, latest):
        assert rec["world_size"] == 1 and rec["num_val_batches"] == 2 and rec["split_tokens"] == 512
        assert rec["fingerprints"] == rec["checkpoint_fingerprints"] and set(rec["fingerprints"]) == {
            "tokenizer",
            "data_train",
            "data_val",
        }


def test_results_of_other_fingerprints_are_replaced_not_merged(run, trained, monkeypatch, capsys):
    first = evaluate(run, trained["bundle"], "--eval", "core,bpb")
    real = base_eval.current_fingerprints
    monkeypatch.setattr(base_eval, "current_fingerprints", lambda tok: {**real(tok), "data_val": "0123456789abcdef"})
    other = evaluate(run, trained["bundle"], "--eval", "bpb")
    assert (
        other["tasks"] == {}
        and other["core_records"] is None
        and other["fingerprints"]["data_val"] == "0123456789abcdef"
    )
    # the top copy follows step 6, which has no CORE now
    assert not os.path.exists(os.path.join(run, "core_records.parquet"))
    assert "measured with other fingerprints" in capsys.readouterr().out
    # the replaced results are kept, not deleted
    (stamp,) = os.listdir(os.path.join(run, "eval", "replaced"))  # one folder per replacement, named by its time
    moved = os.path.join(run, "eval", "replaced", stamp)
    assert sorted(os.listdir(moved)) == sorted(os.path.basename(n) for n in step_names(6))
    kept = json.load(open(os.path.join(moved, "step_000006.json")))
    assert kept["tasks"] == first["tasks"] and kept["fingerprints"] == first["fingerprints"]

    # results from before fingerprints were recorded are not merged either
    monkeypatch.setattr(base_eval, "current_fingerprints", real)
    path = os.path.join(run, "eval", "step_000006.json")
    old = json.load(open(path))
    del old["fingerprints"]
    json.dump(old, open(path, "w"))
    assert evaluate(run, trained["bundle"], "--eval", "sample")["val_bpb"] is None


def test_an_eval_json_from_before_eval_dir_is_one_line(run, trained, script_error):
    # the one-file-per-run layout of an earlier version: eval.json at the top, no eval/. Neither evaluated nor compared
    evaluate(run, trained["bundle"], "--eval", "bpb")
    shutil.rmtree(os.path.join(run, "eval"))
    before = load(run, "eval.json")
    err = script_error(base_eval.main, "--run", run, *EVAL, "--step", "3", "--eval", "bpb")
    with pytest.raises(UserError) as e:
        run_files.load_run(run)  # what compare reads
    assert (
        err
        == f"error: {e.value}"
        == (
            f"error: {os.path.join(run, 'eval.json')} is an evaluation of step 6 without its eval/step_000006.json, "
            "written by an earlier version of this code, which this one does not read; move it aside and rerun "
            f"`python -m scripts.base_eval --run {run} --step 6`"
        )
    )
    assert load(run, "eval.json") == before and not os.path.exists(os.path.join(run, "eval"))


def test_a_tokenizer_retrained_to_the_same_size_is_refused(tiny_base_dir, tmp_path, monkeypatch, script_error):
    from scripts import base_train
    from nanochat.tokenizer import Tokenizer

    base = tmp_path / "base"
    base.mkdir()
    os.symlink(os.path.join(tiny_base_dir, "base_data"), base / "base_data")
    shutil.copytree(os.path.join(tiny_base_dir, "tokenizer"), base / "tokenizer")
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    base_train.main(TINY_TRAIN + ["--num-iterations", "2", "--eval-every", "-1", "--arch", "gpt", "--run", "gpt"])
    trained_with = Tokenizer.from_directory(str(base / "tokenizer"))
    # another tokenizer of the same vocab size, trained on other text, in its place
    other = Tokenizer.train_from_iterator(
        iter([d[::-1] for d in tiny_documents(seed=1)]), trained_with.get_vocab_size()
    )
    shutil.rmtree(base / "tokenizer")
    other.save(str(base / "tokenizer"))
    assert other.get_vocab_size() == trained_with.get_vocab_size() and other.fingerprint() != trained_with.fingerprint()
    err = script_error(base_eval.main, "--run", "gpt", "--eval", "bpb", *EVAL)
    assert other.fingerprint() in err and trained_with.fingerprint() in err
    assert not os.path.exists(os.path.join(base, "runs", "gpt", "eval.json"))


def test_split_tokens_beyond_the_split_are_capped(run, trained, capsys):
    """More val tokens asked for than one pass of the packer keeps: base_eval scores those batches, in which no
    document appears twice (a loader cycling over the split mixes the next epoch's copies in)."""
    from types import SimpleNamespace
    from nanochat.loss_eval import held_batches
    from nanochat.tokenizer import get_tokenizer

    tok = get_tokenizer()
    held = held_batches(tok, 4, 64, "val", 10**6)
    assert held > 2
    asked = 3 * held * 4 * 64  # three times that
    record = base_eval.main(["--run", run, "--eval", "bpb", "--split-tokens", str(asked), "--device-batch-size", "4"])
    assert (
        record["num_val_batches"] == held == len(record["val_batches"]["nats"]) and record["split_tokens"] == held * 256
    )
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: the val split holds")]
    assert len(notes) == 1 and f"fewer than --split-tokens {asked:,}" in notes[0]
    # the batches it read, by the documents in them: every tiny document opens "Document <i>."
    _, batches = base_eval.split_batches(tok, 4, 64, "val", SimpleNamespace(split_tokens=asked), "cpu", 0, 1)
    bos = tok.get_bos_token_id()
    texts = [tok.decode(row) for _, x, y in batches for row in torch.cat([x, y[:, -1:]], 1).tolist()]
    pieces = [piece for text in texts for piece in text.split(tok.decode([bos]))]
    named = [m.group(1) for piece in pieces if (m := re.match(r"Document (\d+)\.", piece))]
    assert len(named) > held and len(named) == len(set(named))  # no document scored twice


def launch_eval(base, nproc, *args):
    """base_eval in one process or under torchrun (gloo); its stdout."""
    env = dict(os.environ, NANOCHAT_BASE_DIR=base, OMP_NUM_THREADS="1")
    if nproc == 1:
        cmd = [sys.executable, "-m", "scripts.base_eval"]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "scripts.base_eval",
            "--",
        ]
    out = subprocess.run(cmd + list(args), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@PROCESSES
def test_bpb_is_the_same_under_one_and_two_processes(run, trained):
    # 3 batches: the two ranks get 2 and 1; the per-batch losses come back in the order of one process
    argv = [
        "--run",
        run,
        "--eval",
        "bpb",
        "--split-tokens",
        str(3 * 256),
        "--device-batch-size",
        "4",
        "--device-type",
        "cpu",
    ]
    records = {}
    for nproc in (1, 2):
        launch_eval(trained["base"], nproc, *argv)
        records[nproc] = load(run, "eval/step_000006.json")
    one, two = records[1], records[2]
    print(
        f"val bpb: 1 process {one['val_bpb']:.6f}, 2 processes {two['val_bpb']:.6f} (differ by "
        f"{abs(one['val_bpb'] - two['val_bpb']):.1e}); train bpb: {one['train_bpb']:.6f}, {two['train_bpb']:.6f}"
    )
    assert one["world_size"] == 1 and two["world_size"] == 2 and one["num_val_batches"] == two["num_val_batches"] == 3
    assert abs(one["val_bpb"] - two["val_bpb"]) < 1e-6 and abs(one["train_bpb"] - two["train_bpb"]) < 1e-6
    assert one["val_batches"]["bytes"] == two["val_batches"]["bytes"]
    assert max(abs(a - b) for a, b in zip(one["val_batches"]["nats"], two["val_batches"]["nats"])) < 1e-6


def test_an_interrupted_core_run_is_marked_and_resumed(run, trained, monkeypatch, capsys):
    real = core_eval.task_verdicts
    scored = []

    def stops_at(n, how):
        def verdicts(model, tokenizer, data, *a, **kw):
            if len(scored) == n:
                how()
            scored.append(data)
            return real(model, tokenizer, data, *a, **kw)

        return verdicts

    def ctrl_c():
        raise KeyboardInterrupt

    # Ctrl-C during the second task: exit 130, the first task saved, the record says what the stop left out
    monkeypatch.setattr(core_eval, "task_verdicts", stops_at(1, ctrl_c))
    with pytest.raises(SystemExit) as e:
        evaluate(run, trained["bundle"], "--eval", "core")
    assert e.value.code == 130 and "the same command resumes" in capsys.readouterr().err
    cut = load(run, "eval/step_000006.json")
    assert cut["interrupted"] is True and cut["core_finished"] is False and list(cut["tasks"]) == ["tiny_mc"]
    assert cut["interrupted_tasks"] == ["tiny_schema", "tiny_lm"] and cut["missing_tasks"] == ["absent_task"]
    assert load(run, "eval.json") == cut

    # SIGTERM (torchrun, a scheduler) during the third task: the same, with two tasks saved
    scored.clear()
    monkeypatch.setattr(core_eval, "task_verdicts", stops_at(1, lambda: os.kill(os.getpid(), signal.SIGTERM)))
    with pytest.raises(SystemExit) as e:
        evaluate(run, trained["bundle"], "--eval", "core")
    assert e.value.code == 130
    out = capsys.readouterr().out
    assert "resuming the interrupted CORE evaluation of step 6: 1 task(s) already scored" in out
    cut = load(run, "eval/step_000006.json")
    assert (
        list(cut["tasks"]) == ["tiny_mc", "tiny_schema"]
        and cut["interrupted_tasks"] == ["tiny_lm"]
        and cut["interrupted"] is True
    )

    # the rerun scores only the task left, and ends where an uninterrupted evaluation does
    scored.clear()
    monkeypatch.setattr(core_eval, "task_verdicts", stops_at(-1, None))
    done = evaluate(run, trained["bundle"], "--eval", "core")
    assert len(scored) == 1 and all(item in ITEMS["tiny_lm"] for item in scored[0])
    assert done["interrupted"] is False and done["interrupted_tasks"] == [] and done["core_finished"] is True
    fresh_dir = run + "-fresh"
    shutil.copytree(run, fresh_dir, ignore=shutil.ignore_patterns("eval*", "core_*", ".lock"))
    fresh = evaluate(fresh_dir, trained["bundle"], "--eval", "core")
    assert done["tasks"].keys() == fresh["tasks"].keys()
    assert all(done["tasks"][k]["accuracy"] == fresh["tasks"][k]["accuracy"] for k in fresh["tasks"])
    cols = core_eval.load_records(os.path.join(run, "core_records.parquet"))[0]
    fresh_cols = core_eval.load_records(os.path.join(fresh_dir, "core_records.parquet"))[0]
    assert cols == fresh_cols

    # other settings: an interrupted run is not resumed, it starts over
    scored.clear()
    monkeypatch.setattr(core_eval, "task_verdicts", stops_at(1, ctrl_c))
    with pytest.raises(SystemExit):
        evaluate(run, trained["bundle"], "--eval", "core")
    scored.clear()
    monkeypatch.setattr(core_eval, "task_verdicts", stops_at(-1, None))
    capsys.readouterr()
    other = evaluate(run, trained["bundle"], "--eval", "core", "--max-per-task", "3")
    assert len(scored) == 3 and all(t["num_examples"] == 3 for t in other["tasks"].values())
    assert "starts over" in capsys.readouterr().out


def test_results_of_other_settings_move_to_replaced(run, trained, capsys):
    evaluate(run, trained["bundle"], "--eval", "core,bpb")
    first = evaluate(run, trained["bundle"], "--eval", "core,bpb")  # the same settings: rewritten, nothing to keep
    assert not os.path.exists(os.path.join(run, "eval", "replaced"))
    before = files(run, step_names(6))
    capsys.readouterr()
    other = evaluate(run, trained["bundle"], "--eval", "core", "--max-per-task", "3")
    notes = [line for line in capsys.readouterr().out.splitlines() if "other settings" in line]
    assert len(notes) == 1 and "core: max_per_task 4 → 3" in notes[0] and "eval/replaced/" in notes[0]
    (stamp,) = os.listdir(os.path.join(run, "eval", "replaced"))
    kept = {
        f"eval/{n}": open(os.path.join(run, "eval", "replaced", stamp, n), "rb").read()
        for n in os.listdir(os.path.join(run, "eval", "replaced", stamp))
    }
    assert kept == before  # the earlier results, byte for byte
    assert other["max_per_task"] == 3 and other["val_bpb"] == first["val_bpb"]  # bpb was not re-run: kept
    assert load(run, "eval.json") == load(run, "eval/step_000006.json") == json.loads(json.dumps(other))


def test_an_interrupted_evaluation_never_replaces_a_complete_one(run, trained, monkeypatch, capsys):
    evaluate(run, trained["bundle"], "--eval", "core,bpb")
    before = files(run, TOP + step_names(6))
    real, calls = core_eval.task_verdicts, []

    def ctrl_c_in_the_second_task(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(core_eval, "task_verdicts", ctrl_c_in_the_second_task)
    with pytest.raises(SystemExit) as e:
        evaluate(run, trained["bundle"], "--eval", "core", "--max-per-task", "3")
    assert (
        e.value.code == 130
        and files(run, TOP + step_names(6)) == before
        and not os.path.exists(os.path.join(run, "eval", "replaced"))
    )
    assert "stay as they were" in capsys.readouterr().err
    assert list(load(run, "eval/pending/step_000006.json")["tasks"]) == ["tiny_mc"]  # the cut run, beside them
    # the same command resumes it, and only the finished evaluation replaces the earlier one (kept in replaced/)
    monkeypatch.setattr(core_eval, "task_verdicts", real)
    done = evaluate(run, trained["bundle"], "--eval", "core", "--max-per-task", "3")
    assert "resuming the interrupted CORE evaluation of step 6: 1 task(s) already scored" in capsys.readouterr().out
    assert done["core_finished"] is True and load(run, "eval.json") == json.loads(json.dumps(done))
    (stamp,) = os.listdir(os.path.join(run, "eval", "replaced"))
    assert (
        open(os.path.join(run, "eval", "replaced", stamp, "step_000006.json"), "rb").read()
        == before["eval/step_000006.json"]
    )
    assert not os.path.exists(os.path.join(run, "eval", "pending"))  # emptied, then removed


def test_skip_done_decides_from_what_the_results_hold(run, trained, monkeypatch, capsys, tmp_path):
    """--skip-done (runs/runcpu.sh's rerun) keeps a section only when the step's results hold it whole and measured
    with these settings: a CORE recorded as not evaluated (offline) or interrupted is measured, whatever files
    exist; one short of a task the bundle now holds too."""
    measured = []
    for name in ("eval_bpb", "eval_samples"):
        real = getattr(base_eval, name)
        monkeypatch.setattr(base_eval, name, lambda *a, real=real, name=name: measured.append(name) or real(*a))
    real_verdicts, scored = core_eval.task_verdicts, []

    def verdicts(model, tokenizer, data, *a, **kw):
        if len(scored) == 1 and stop:  # Ctrl-C in the second task
            raise KeyboardInterrupt
        scored.append(data)
        return real_verdicts(model, tokenizer, data, *a, **kw)

    monkeypatch.setattr(core_eval, "task_verdicts", verdicts)
    bundle = str(tmp_path / "bundle")
    shutil.copytree(trained["bundle"], bundle)

    def rerun(*argv, offline=False):
        measured.clear()
        scored.clear()
        capsys.readouterr()
        args = ["--run", run, "--eval", "core,bpb,sample", "--skip-done", *EVAL, *argv]
        record = base_eval.main(args + ([] if offline else ["--eval-bundle", bundle]))
        return record, capsys.readouterr().out

    # offline first: no bundle can be had; bpb and samples are measured, CORE is recorded as not evaluated
    stop = False
    monkeypatch.setattr(core_eval, "EVAL_BUNDLE_URL", (tmp_path / "nowhere" / "eval_bundle.zip").as_uri())
    first, _ = rerun(offline=True)
    assert measured == ["eval_bpb", "eval_samples"] and first["tasks"] == {}
    assert "cannot download" in first["core_error"]
    before = files(run, TOP[::2] + step_names(6)[::2])
    _, out = rerun(offline=True)  # offline again: nothing to measure, nothing written
    assert measured == [] and "nothing measured now" in out and files(run, TOP[::2] + step_names(6)[::2]) == before
    (skipped,) = [line for line in out.splitlines() if line.startswith("CORE skipped: cannot download")]
    assert "from an earlier evaluation" not in skipped  # there is no earlier CORE to keep

    # with a bundle, CORE is measured (its eval.json existed all along); a Ctrl-C cuts it short
    stop = True
    with pytest.raises(SystemExit):
        rerun()
    assert measured == [] and len(scored) == 1
    stop = False
    done, out = rerun()  # the interrupted CORE is not kept either: resumed at its first unfinished task
    assert measured == [] and len(scored) == 2 and "resuming the interrupted CORE evaluation" in out
    assert done["core_finished"] is True and list(done["tasks"]) == ["tiny_mc", "tiny_schema", "tiny_lm"]
    assert done["val_bpb"] == first["val_bpb"] and done["samples"] == first["samples"]
    assert "kept from an earlier evaluation of step 6 with these settings (--skip-done): bpb, sample" in out
    assert load(run, "eval.json") == json.loads(json.dumps(done))

    # whole at these settings: kept, and said to be earlier results, never printed as new ones
    before = files(run, TOP + step_names(6))
    _, out = rerun()
    assert measured == [] and scored == [] and files(run, TOP + step_names(6)) == before
    assert "CORE of an earlier evaluation of step 6, not measured now:" in out and "nothing measured now" in out
    bpb_lines = [line for line in out.splitlines() if line.startswith(("val bpb ", "train bpb "))]
    assert len(bpb_lines) == 2 and all(line.endswith("(kept from an earlier evaluation)") for line in bpb_lines)
    # other settings of a section: that one is measured again
    other, _ = rerun("--split-tokens", "256")
    assert measured == ["eval_bpb"] and scored == [] and other["split_tokens"] == 256
    # the bundle now holds the task it lacked: CORE is measured again, on every task
    with open(os.path.join(bundle, "eval_data", "tiny", "absent_task.jsonl"), "w") as f:
        f.writelines(json.dumps(item) + "\n" for item in ITEMS["tiny_mc"])
    fuller, _ = rerun("--split-tokens", "256")
    assert measured == [] and len(scored) == 4 and fuller["missing_tasks"] == [] and fuller["core_finished"] is True


def test_a_closed_output_stops_nothing(run, trained, monkeypatch):
    """`base_eval ... | head -20`: once the reader is gone the lines are dropped and the evaluation goes on to the
    end, so its CORE is whole (it used to die on the first line it could not write, mid-CORE)."""
    r, w = os.pipe()
    os.close(r)
    closed = os.fdopen(w, "w")
    monkeypatch.setattr(sys, "stdout", closed)
    done = evaluate(run, trained["bundle"], "--eval", "core,bpb")
    monkeypatch.undo()
    closed.close()
    assert done["core_finished"] is True and done["interrupted"] is False and len(done["tasks"]) == 3
    assert done["val_bpb"] is not None and load(run, "eval.json") == json.loads(json.dumps(done))


def test_a_stop_after_the_last_task_leaves_core_finished(run, trained, monkeypatch, capsys):
    """Every task scored and saved, a stop in the lines that follow (Ctrl-C, a kill) leaves a CORE that is whole, not
    one marked interrupted with no task left to run."""

    def stops_at_the_summary(*a, **kw):
        if str(a[0]).startswith("partial CORE"):
            raise KeyboardInterrupt
        print(*a, **kw)

    monkeypatch.setattr(base_eval, "print0", stops_at_the_summary)
    with pytest.raises(SystemExit) as e:
        evaluate(run, trained["bundle"], "--eval", "core")
    saved = load(run, "eval.json")
    assert e.value.code == 130 and len(saved["tasks"]) == 3
    assert saved["core_finished"] is True and saved["interrupted"] is False and saved["interrupted_tasks"] == []


def test_offline_core_kept_from_before_is_never_printed_as_new(run, trained, monkeypatch, capsys, tmp_path):
    """No bundle can be had now (offline): the step's earlier CORE is kept and printed as an earlier result, and no
    "not evaluated" reason is recorded beside it; the bpb measured now is printed as it is."""
    earlier = evaluate(run, trained["bundle"], "--eval", "core")
    monkeypatch.setattr(core_eval, "EVAL_BUNDLE_URL", (tmp_path / "nowhere" / "eval_bundle.zip").as_uri())
    capsys.readouterr()
    now = base_eval.main(["--run", run, "--eval", "core,bpb", *EVAL])
    lines = capsys.readouterr().out.splitlines()
    (skipped,) = [line for line in lines if line.startswith("CORE skipped:")]
    assert skipped.endswith("the CORE results of step 6 shown below are from an earlier evaluation")
    assert "CORE of an earlier evaluation of step 6, not measured now:" in lines
    (partial,) = [line for line in lines if line.startswith("partial CORE (3/22) ")]
    assert partial.endswith("(kept from an earlier evaluation)")
    assert [line for line in lines if line.startswith("val bpb ")][0].endswith(f"{now['val_bpb']:.4f}")
    assert now["tasks"] == earlier["tasks"] and now["core_error"] is None and now["core_finished"] is True


def test_the_cpu_recipes_decide_what_to_evaluate_from_the_results():
    """The CPU recipes leave the decision to base_eval --skip-done (what the results hold), never to whether eval.json
    exists: every base_eval call carries --skip-done, and no script reads eval.json itself to skip one."""
    for name in ("runcpu.sh", "mod_cpu.sh", "recipe_cpu.sh"):
        text = open(os.path.join(REPO, "runs", name)).read()
        calls = re.findall(r"python -m scripts\.base_eval(?:[^\n]*\\\n)*[^\n]*", text)
        assert calls and all("--skip-done" in call for call in calls), (name, calls)
        assert not re.search(r"-f [^\n]*eval\.json[^\n]*then[^\n]*base_eval|already evaluated", text), name
