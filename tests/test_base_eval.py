"""base_eval on tiny trained runs of both archs, with a small fake CORE bundle written here."""

import os
import csv
import json
import re
import math

import pytest
import torch

from conftest import linked_base, train_tiny_pair
from scripts import base_eval
from nanochat import core_eval

EVAL = ["--split-tokens", "512", "--device-batch-size", "4", "--sample-tokens", "4", "--max-per-task", "4"]

# label, task type, shots, random baseline (%), items
MC_ITEMS = [
    {"query": f"Document {i}. The model", "choices": ["is the data.", "of weight gradient", "and"], "gold": i % 3}
    for i in range(6)
]
SCHEMA_ITEMS = [
    {"context_options": [f"The layer {i} was", f"The head {i} is"], "continuation": "the attention.", "gold": i % 2}
    for i in range(6)
]
LM_ITEMS = [{"context": f"Document {i}. The", "continuation": " model"} for i in range(6)]
FAKE_TASKS = [
    ("tiny_mc", "multiple_choice", 1, 33.3, MC_ITEMS),
    ("tiny_schema", "schema", 0, 50.0, SCHEMA_ITEMS),
    ("tiny_lm", "language_modeling", 2, 0.0, LM_ITEMS),
]
ABSENT = ("absent_task", "multiple_choice", 0, 25.0, None)  # listed in core.yaml, its file missing


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def pair(tiny_base_dir, tmp_path_factory, write_eval_bundle):
    """A base dir sharing the session corpus and tokenizer, with a 6-step gpt run and nag run, and a fake bundle."""
    base = linked_base(tiny_base_dir, tmp_path_factory.mktemp("eval_base"))
    bundle = write_eval_bundle(tmp_path_factory.mktemp("bundle"), FAKE_TASKS + [ABSENT])
    runs = train_tiny_pair(base)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(base))
        yield {"base": base, "bundle": bundle, "runs": runs}


@pytest.mark.parametrize("arch", ["gpt", "nag"])
def test_eval_writes_results_of_either_arch(pair, capsys, arch):
    run_dir = pair["runs"][arch]
    record = base_eval.main(["--run", arch, "--eval-bundle", pair["bundle"]] + EVAL)
    out = capsys.readouterr().out
    saved = json.load(open(os.path.join(run_dir, "eval.json")))
    assert saved == json.loads(json.dumps(record))
    assert saved["run"] == arch and saved["arch"] == arch and saved["step"] == 6 and saved["tokens"] == 6 * 256
    for key in ("val_bpb", "train_bpb"):
        assert math.isfinite(saved[key]) and 0 < saved[key] < 10
    assert saved["val_bpb"] != saved["train_bpb"]
    # same tokens and batch shape as the training-time eval: the same number (past NAG's alpha warm-up)
    logged = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))][-1]
    assert saved["val_bpb"] == pytest.approx(logged["val_bpb"], rel=1e-5)
    assert saved["split_tokens"] == 512

    # CORE: three tasks scored on 4 items each, one listed missing, reported as partial only
    assert set(saved["tasks"]) == {"tiny_mc", "tiny_schema", "tiny_lm"}
    for label, _, _, baseline, _ in FAKE_TASKS:
        t = saved["tasks"][label]
        assert t["num_examples"] == 4 and 0 <= t["accuracy"] <= 1
        assert t["centered"] == pytest.approx((t["accuracy"] - baseline / 100) / (1 - baseline / 100))
    assert saved["missing_tasks"] == ["absent_task"] and saved["num_tasks_scored"] == 3
    assert saved["core_metric"] is None and saved["partial_label"] == "partial CORE (3/22)"
    assert saved["partial_core"] == pytest.approx(sum(t["centered"] for t in saved["tasks"].values()) / 3)
    assert saved["max_per_task"] == 4 and saved["eval_bundle"] == pair["bundle"] and saved["core_error"] is None

    # per-task CSV mirrors eval.json
    rows = list(csv.DictReader(open(os.path.join(run_dir, "core_tasks.csv"))))
    assert [r["task"] for r in rows] == ["tiny_mc", "tiny_schema", "tiny_lm"]
    for r in rows:
        t = saved["tasks"][r["task"]]
        assert float(r["accuracy"]) == pytest.approx(t["accuracy"]) and float(r["centered"]) == pytest.approx(
            t["centered"]
        )
        assert int(r["num_examples"]) == 4

    # samples: every prompt, greedy and sampled, the greedy one reproducible
    assert [s["prompt"] for s in saved["samples"]] == base_eval.PROMPTS
    assert all(isinstance(s["greedy"], str) and isinstance(s["sampled"], str) for s in saved["samples"])
    again = base_eval.main(["--run", arch, "--eval", "sample"] + EVAL)
    assert again["samples"] == saved["samples"]
    assert again["tasks"] == saved["tasks"] and again["val_bpb"] == saved["val_bpb"]  # same step: other sections kept

    # progress lines with time, and the final table never calls a partial score CORE
    assert any(
        line.startswith("tiny_lm") and re.search(r"\d+\.\ds  \[\d+/\d+(, eta \d+m\d\ds)?\]$", line)
        for line in out.splitlines()
    )
    lines = out.splitlines()
    table = lines[max(i for i, line in enumerate(lines) if line.startswith("task") and "centred" in line) :]
    assert any(line.startswith("partial CORE (3/22)") for line in table) and not any(
        line.startswith("CORE") for line in table
    )
    assert any(line.startswith("absent_task") and "missing" in line for line in table)


def test_earlier_step_and_eval_subset(pair, capsys, monkeypatch):
    record = base_eval.main(["--run", pair["runs"]["gpt"], "--step", "3", "--eval", "bpb"] + EVAL)
    assert record["step"] == 3 and record["tokens"] == 3 * 256 and record["val_bpb"] > 0
    # another step: nothing kept
    assert record["tasks"] == {} and record["samples"] == [] and record["core_metric"] is None
    assert (
        open(os.path.join(pair["runs"]["gpt"], "eval", "step_000003_core_tasks.csv")).read()
        == "task,accuracy,centered,num_examples\n"
    )

    # a NAG checkpoint inside the alpha warm-up (768 of 1024 tokens) is evaluated with its warm-up factor
    seen = []
    real = base_eval.evaluate_bpb_shared
    monkeypatch.setattr(
        base_eval,
        "evaluate_bpb_shared",
        lambda model, *a, **kw: seen.append(model.alpha_warmup.item()) or real(model, *a, **kw),
    )
    base_eval.main(["--run", "nag", "--step", "3", "--eval", "bpb"] + EVAL)
    assert seen == [0.75, 0.75]


def test_offline_without_bundle_still_gives_bpb(pair, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(core_eval, "EVAL_BUNDLE_URL", (tmp_path / "nowhere" / "eval_bundle.zip").as_uri())
    record = base_eval.main(["--run", "nag", "--step", "3", "--eval", "core,bpb"] + EVAL)
    out = capsys.readouterr().out
    skipped = [line for line in out.splitlines() if line.startswith("CORE skipped:")]
    assert len(skipped) == 1 and "--eval-bundle" in skipped[0]
    assert record["val_bpb"] > 0 and record["tasks"] == {} and record["core_metric"] is None
    assert "cannot download" in record["core_error"]


def test_bad_inputs(pair, script_error, tmp_path):
    assert "no complete checkpoint in" in script_error(base_eval.main, "--run", str(tmp_path))
    assert "does not exist" in script_error(base_eval.main, "--run", "never-trained")
    assert "no complete checkpoint for step 5" in script_error(base_eval.main, "--run", "gpt", "--step", "5")
    assert "--eval takes" in script_error(base_eval.main, "--run", "gpt", "--eval", "bpb,mmlu")
    assert "no core.yaml" in script_error(base_eval.main, "--run", "gpt", "--eval-bundle", str(tmp_path))
    from nanochat.tokenizer import Tokenizer

    real_vocab = Tokenizer.get_vocab_size
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Tokenizer, "get_vocab_size", lambda self: real_vocab(self) + 1)
        assert "does not match the tokenizer" in script_error(base_eval.main, "--run", "nag")


def test_records_and_per_batch_losses_are_saved(pair):
    record = base_eval.main(["--run", "gpt", "--eval", "core,bpb", "--eval-bundle", pair["bundle"]] + EVAL)
    run_dir = pair["runs"]["gpt"]
    cols, settings = core_eval.load_records(os.path.join(run_dir, "core_records.parquet"))
    assert record["core_records"] == "eval/step_000006_core_records.parquet" and record["core_finished"] is True
    assert record["interrupted"] is False and record["interrupted_tasks"] == []
    assert (
        open(os.path.join(run_dir, record["core_records"]), "rb").read()
        == open(os.path.join(run_dir, "core_records.parquet"), "rb").read()
    )
    assert settings["step"] == 6 and settings["max_per_task"] == 4 and set(settings["tasks"]) == set(record["tasks"])
    assert settings["tasks"]["tiny_lm"]["num_fewshot"] == 2 and settings["tasks"]["tiny_mc"]["random_baseline"] == 33.3
    for label, t in record["tasks"].items():
        rows = [i for i, task in enumerate(cols["task"]) if task == label]
        assert sorted(cols["idx"][i] for i in rows) == [0, 1, 2, 3]
        assert sum(cols["correct"][i] for i in rows) / 4 == t["accuracy"]
        assert all(math.isfinite(cols["margin"][i]) for i in rows) and len({cols["item"][i] for i in rows}) == 4
    # val bpb is the per-batch losses summed, so compare can resample the very same batches
    vb = record["val_batches"]
    assert len(vb["nats"]) == len(vb["bytes"]) == record["num_val_batches"] == 512 // (4 * 64)
    assert sum(vb["nats"]) / (math.log(2) * sum(vb["bytes"])) == pytest.approx(record["val_bpb"], rel=1e-12)
    assert record["split_tokens"] == record["train_split_tokens"] == 512 and record["bpb_batch_shape"] == [4, 64]
    assert record["world_size"] == 1 and set(record["fingerprints"]) == {"tokenizer", "data_train", "data_val"}
    assert settings["fingerprints"] == record["fingerprints"]
    # a later eval of another step without CORE keeps the records of this one, and the top-level copy
    base_eval.main(["--run", "gpt", "--step", "3", "--eval", "bpb"] + EVAL)
    assert core_eval.load_records(os.path.join(run_dir, "core_records.parquet"))[1]["step"] == 6
    assert os.path.exists(os.path.join(run_dir, record["core_records"]))


def test_a_crash_keeps_the_finished_tasks(pair, monkeypatch, tmp_path):
    import shutil

    # a run not evaluated yet: the cut results go in place (test_eval_history: beside earlier ones)
    run_dir = str(tmp_path / "nag")
    shutil.copytree(pair["runs"]["nag"], run_dir, ignore=shutil.ignore_patterns("eval*", "core_*", ".lock"))
    real = core_eval.task_verdicts
    calls = []

    def dies_on_the_second_task(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated crash")
        return real(*a, **kw)

    monkeypatch.setattr(core_eval, "task_verdicts", dies_on_the_second_task)
    with pytest.raises(RuntimeError, match="simulated crash"):
        base_eval.main(["--run", run_dir, "--eval", "core", "--eval-bundle", pair["bundle"]] + EVAL)
    saved = json.load(open(os.path.join(run_dir, "eval.json")))
    assert list(saved["tasks"]) == ["tiny_mc"] and saved["core_finished"] is False and saved["core_metric"] is None
    assert (
        saved["interrupted"] is True
        and saved["interrupted_tasks"] == ["tiny_schema", "tiny_lm"]
        and saved["missing_tasks"] == ["absent_task"]
    )
    assert saved == json.load(open(os.path.join(run_dir, "eval", "step_000006.json")))
    cols, settings = core_eval.load_records(os.path.join(run_dir, "core_records.parquet"))
    assert set(cols["task"]) == {"tiny_mc"} and list(settings["tasks"]) == ["tiny_mc"]
    assert [r["task"] for r in csv.DictReader(open(os.path.join(run_dir, "core_tasks.csv")))] == ["tiny_mc"]


def test_small_max_per_task_draws_fewer_shots(pair, capsys):
    record = base_eval.main(["--run", "gpt", "--eval", "core", "--eval-bundle", pair["bundle"], "--max-per-task", "2"])
    assert record["tasks"]["tiny_lm"]["num_examples"] == 2 and record["tasks"]["tiny_lm"]["num_fewshot"] == 1
    assert record["tasks"]["tiny_mc"]["num_fewshot"] == 1
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:") and "few-shot" in line]
    assert len(notes) == 1 and "tiny_lm 2->1" in notes[0]


def test_outputs_checked_before_any_work(pair, script_error, monkeypatch, tmp_path):
    run_dir = pair["runs"]["gpt"]
    blocker = os.path.join(run_dir, "core_records.parquet")
    if os.path.exists(blocker):
        os.remove(blocker)
    os.makedirs(blocker)
    monkeypatch.setattr(
        base_eval.ckpt, "load_model", lambda *a, **k: pytest.fail("work started before the output check")
    )
    try:
        err = script_error(base_eval.main, "--run", "gpt", "--eval-bundle", pair["bundle"], *EVAL)
    finally:
        os.rmdir(blocker)
    assert blocker in err and "directory" in err
    # another process holding the run (training, or another evaluation) stops base_eval at once
    from nanochat.checkpoint_manager import run_lock

    with run_lock(run_dir, "training"):
        err = script_error(base_eval.main, "--run", "gpt", "--eval-bundle", pair["bundle"], *EVAL)
    assert "in use by pid" in err and "(training)" in err


def test_truncated_checkpoint_names_the_file_and_the_previous_step(pair, script_error, tmp_path):
    import shutil

    run_dir = str(tmp_path / "cut")
    shutil.copytree(pair["runs"]["gpt"], run_dir)
    model_file = os.path.join(run_dir, "model_000006.pt")
    with open(model_file, "r+b") as f:
        f.truncate(os.path.getsize(model_file) // 2)
    # its size no longer matches the save's record: the newest step is damaged, named with the previous one
    err = script_error(base_eval.main, "--run", run_dir, "--eval", "bpb", *EVAL)
    assert "step 6, is damaged (model_000006.pt holds" in err and "pass --step 3" in err
    # a meta without file sizes is an earlier version's checkpoint: one line saying so, never read
    meta = json.load(open(os.path.join(run_dir, "meta_000006.json")))
    del meta["file_sizes"]
    json.dump(meta, open(os.path.join(run_dir, "meta_000006.json"), "w"))
    err = script_error(base_eval.main, "--run", run_dir, "--eval", "bpb", *EVAL)
    assert "step 6, is damaged (meta_000006.json records no file sizes: a checkpoint of an earlier version" in err
    assert "pass --step 3" in err
    os.remove(os.path.join(run_dir, "model_000003.pt"))
    assert "no earlier complete step" in script_error(
        base_eval.main, "--run", run_dir, "--step", "6", "--eval", "bpb", *EVAL
    )
