"""nanochat.run_dir's one rule for metrics.jsonl: torn last lines and bad lines.

A torn last line (a kill mid-write) is skipped with a note or
handed back with step None; a bad line anywhere else is a one-line error naming the file and the line."""

import json

import pytest

from nanochat.common import UserError
from nanochat import demo_check, run_dir

TORN = '{"step": 3, "train_lo'  # what a kill in the middle of a write leaves


def write_metrics(path, steps, tail=""):
    with open(path, "w") as f:
        f.writelines(json.dumps({"step": s, "train_loss": 5.0 - s}) + "\n" for s in steps)
        f.write(tail)
    return str(path)


def test_a_torn_last_line_is_skipped_with_a_note(tmp_path):
    path = write_metrics(tmp_path / run_dir.METRICS, range(3), TORN)
    rows, notes = run_dir.read_metrics(path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert notes == [f"{path} line 4 is torn (a write cut short) and was skipped"]
    # a whole last line is a row like any other: no note
    rows, notes = run_dir.read_metrics(write_metrics(tmp_path / "whole.jsonl", range(3)))
    assert [r["step"] for r in rows] == [0, 1, 2] and notes == []


def test_metrics_lines_return_a_torn_last_line_with_step_none(tmp_path):
    path = write_metrics(tmp_path / run_dir.METRICS, range(2), TORN)
    lines = run_dir.metrics_lines(path)
    assert [s for s, _ in lines] == [0, 1, None]
    assert lines[-1][1] == TORN + "\n"  # as written, ended so that it appends cleanly elsewhere
    assert lines[0][1] == json.dumps({"step": 0, "train_loss": 5.0}) + "\n"
    assert run_dir.metrics_lines(str(tmp_path / "absent.jsonl")) == []
    assert [r["step"] for r in run_dir.rows_with(path, "train_loss")] == [0, 1]  # the other readers skip it too


@pytest.mark.parametrize("bad", [TORN, "[1, 2]", '{"train_loss": 1.0}'])
def test_a_bad_line_before_the_last_is_an_error_naming_it(tmp_path, bad):
    path = tmp_path / run_dir.METRICS
    with open(path, "w") as f:
        f.write(json.dumps({"step": 0}) + "\n\n" + bad + "\n" + json.dumps({"step": 1}) + "\n")
    for read in (
        run_dir.read_metrics,
        run_dir.metrics_lines,
        lambda p: run_dir.rows_with(p, "step"),
        lambda p: run_dir.keep_history(p, 0),
    ):
        with pytest.raises(UserError) as e:
            read(str(path))
        # the file's own line number, blank lines counted
        assert f"{path} line 3" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / f"{run_dir.METRICS}.bak-0").exists()  # refused before moving anything


def test_a_last_line_that_parses_but_is_no_row_is_an_error(tmp_path):
    path = write_metrics(tmp_path / run_dir.METRICS, range(2), "[1, 2]\n")  # whole JSON: no write was cut short
    with pytest.raises(UserError, match="line 3: expected a JSON object with an integer step"):
        run_dir.read_metrics(path)


def test_keep_history_moves_the_rows_past_the_step_aside(tmp_path, capsys):
    path = write_metrics(tmp_path / run_dir.METRICS, range(6), TORN)
    run_dir.keep_history(path, 3)
    assert [s for s, _ in run_dir.metrics_lines(path)] == [0, 1, 2, 3]
    bak = f"{path}.bak-3"
    assert [line for line in open(bak)] == [json.dumps({"step": s, "train_loss": 5.0 - s}) + "\n" for s in (4, 5)] + [
        TORN + "\n"
    ]
    assert "3 earlier row(s) of metrics.jsonl past step 3 kept in metrics.jsonl.bak-3" in capsys.readouterr().out
    run_dir.keep_history(path, 3)  # nothing past the step: nothing moves
    assert len(open(bak).readlines()) == 3
    # a later restart from the same step appends to its backup, never replacing it
    run_dir.append_row(path, {"step": 4, "train_loss": 0.5})
    run_dir.keep_history(path, 3)
    assert [json.loads(line)["step"] for line in open(bak).readlines()[3:]] == [4]
    # a fresh start (step 0) keeps nothing: it writes its own step-0 row
    run_dir.keep_history(path, 0)
    assert run_dir.metrics_lines(path) == [] and [json.loads(line)["step"] for line in open(f"{path}.bak-0")] == [
        0,
        1,
        2,
        3,
    ]


def test_headline_gives_the_evaluated_figures_to_every_digit(tmp_path, monkeypatch):
    """runcpu.sh's last lines: val bpb and (partial) CORE as repr gives them, so that LOG can compare bit for bit."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    partial = {
        "val_bpb": 1.7308320840377482,
        "core_metric": None,
        "partial_core": -0.010354302974157079,
        "num_tasks_scored": 18,
    }
    full = {"val_bpb": 0.9, "core_metric": 0.25, "partial_core": 0.25, "num_tasks_scored": 22}
    for name, ev in (("cpu-gpt", partial), ("full", full), ("bare", None)):
        (tmp_path / "runs" / name).mkdir(parents=True)
        if ev:
            (tmp_path / "runs" / name / run_dir.EVAL_JSON).write_text(json.dumps(ev))
    assert (
        run_dir.headline("cpu-gpt")
        == "cpu-gpt: val bpb 1.7308320840377482, partial CORE -0.010354302974157079 (18 tasks)"
    )
    assert run_dir.headline("full") == "full: val bpb 0.9, CORE 0.25 (22 tasks)"
    assert run_dir.headline("bare") == "bare: val bpb None, partial CORE None"
    with pytest.raises(UserError, match="no run directory"):
        run_dir.headline("missing")


EXPECTED = {
    "settings": {"target_flops": 1e13, "seed": 42, "data_seed": None},
    "max_per_task": 50,
    "tokenizer": "04c8e575e562ee5f",
    "python": "3.11.7",
    "torch": "2.13.0+cpu",
    "machine": "an Intel Xeon",
    "val_bpb_tolerance": 1e-5,
    "core_examples": 1,
    "runs": {
        "cpu-gpt": {"val_bpb": 1.73, "partial_core": -0.0103, "core_tasks": ["a", "b"]},
        "cpu-nag": {"val_bpb": 1.89, "partial_core": 0.0035, "core_tasks": ["a", "b"]},
    },
}


def figures(run, **changes):
    """demo_figures of a run that gives exactly the expected figures, but for `changes`."""
    fig = {
        **EXPECTED["runs"][run],
        "core_step": 0.01,
        "max_per_task": EXPECTED["max_per_task"],
        "settings": dict(EXPECTED["settings"]),
        "tokenizer": EXPECTED["tokenizer"],
        "torch": EXPECTED["torch"],
    }
    fig["settings"].update({k: changes.pop(k) for k in list(changes) if k in fig["settings"]})
    return {**fig, **changes}


def test_the_demo_figures_against_the_expected_ones():
    """runcpu.sh's check: within the tolerances as expected, beyond them the differences and what to check, and for
    other runs (SEEDS), settings (MAX_PER_TASK, TARGET_FLOPS) or corpus not applicable rather than a false mismatch."""

    def check(**runs):
        both = {run: figures(run) for run in ("cpu-gpt", "cpu-nag")}
        return demo_check.compare_expected({**both, **runs}, EXPECTED, "3.11.7")

    verdict, lines = check(**{"cpu-gpt": figures("cpu-gpt", val_bpb=1.73 + 2e-6, partial_core=-0.0103 + 0.01)})
    assert verdict == "as expected" and len(lines) == 4  # bpb within 1e-5, CORE by exactly one example
    assert lines[0] == "cpu-gpt val bpb +2.0e-06 from the expected 1.73 (tolerance ±1e-05)"
    verdict, lines = check(**{"cpu-nag": figures("cpu-nag", val_bpb=1.8903)})
    assert verdict == "differs" and "cpu-nag val bpb +3.0e-04 from the expected 1.89" in lines[2]
    assert lines[-1].startswith("what to check: that the venv holds requirements.lock's versions")
    verdict, lines = check(**{"cpu-nag": figures("cpu-nag", partial_core=0.0035 - 0.02, torch="2.12.0+cpu")})
    assert verdict == "differs" and "cpu-nag partial CORE -0.02000" in lines[3] and "torch 2.12.0+cpu" in lines[-1]
    verdict, lines = check(**{"cpu-nag": figures("cpu-nag", core_tasks=["a"], partial_core=0.5)})
    assert verdict == "as expected" and "cpu-nag partial CORE not compared: 1 tasks scored" in lines[3]
    verdict, lines = check(**{"cpu-gpt": figures("cpu-gpt", max_per_task=10, partial_core=0.5)})  # MAX_PER_TASK=10
    assert verdict == "as expected" and "cpu-gpt partial CORE not compared: max_per_task 10" in lines[1]
    # not applicable: nothing is compared
    seeds = {f"cpu-{a}-s1": figures(f"cpu-{a}") for a in ("gpt", "nag")}
    verdict, lines = demo_check.compare_expected(seeds, EXPECTED, "3.11.7")
    assert verdict == "not applicable" and "cpu-gpt-s1, cpu-nag-s1 are other runs" in lines[0]
    verdict, lines = check(**{"cpu-gpt": figures("cpu-gpt", target_flops=2e13, val_bpb=2.0)})  # TARGET_FLOPS=2e13
    assert verdict == "not applicable" and lines == [
        "cpu-gpt has target_flops 2e+13; the expected figures are for target_flops 1e+13, seed 42, data_seed None"
    ]
    verdict, lines = check(**{"cpu-nag": figures("cpu-nag", tokenizer="0ther")})
    assert verdict == "not applicable" and "standard-library docs (3.11.7 here" in lines[0]


def test_core_step_is_one_example_of_the_coarsest_task(tmp_path):
    """Task a: 50 items, baseline 0 (one example: 1/50); task b: 20 items, baseline 50% (1/(20 × 0.5) = 1/10);
    CORE is their mean, so one example moves it by at most 1/10 / 2."""
    from nanochat.core_eval import save_records

    tasks = {"a": {"num_examples": 50, "random_baseline": 0.0}, "b": {"num_examples": 20, "random_baseline": 50.0}}
    records = [{"task": t, "idx": 0, "correct": True, "margin": 1.0, "item": "x"} for t in tasks]
    save_records(str(tmp_path / run_dir.RECORDS), records, {"tasks": tasks}, lambda p, b: open(p, "wb").write(b))
    ev = {"tasks": {t: {"num_examples": v["num_examples"]} for t, v in tasks.items()}, "core_records": run_dir.RECORDS}
    assert demo_check.core_step(str(tmp_path), ev) == pytest.approx(0.05)
    assert demo_check.core_step(str(tmp_path), {}) is None


def test_the_shipped_expected_figures_are_of_runcpu_defaults():
    """runs/runcpu_expected.json: the settings runcpu.sh runs by default and the preset's, and both runs' figures."""
    import os
    import re

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    expected = run_dir.read_json(os.path.join(repo, "runs", "runcpu_expected.json"))
    script = open(os.path.join(repo, "runs", "runcpu.sh")).read()
    defaults = dict(re.findall(r'^(TARGET_FLOPS|MAX_PER_TASK)="\$\{\1:-([^}]+)\}"', script, re.M))
    settings = expected["settings"]
    assert settings["target_flops"] == float(defaults["TARGET_FLOPS"])
    assert expected["max_per_task"] == int(defaults["MAX_PER_TASK"])
    assert sorted(expected["runs"]) == ["cpu-gpt", "cpu-nag"]
    for figs in expected["runs"].values():
        assert isinstance(figs["val_bpb"], float) and isinstance(figs["partial_core"], float) and figs["core_tasks"]


def test_every_run_json_is_read_by_one_reader_with_one_error_line(tmp_path):
    """run_dir.read_json: a missing, unreadable or damaged file is one line naming it and the fix; read_record (results
    rewritten from scratch) and read_config(missing_ok: a resume) keep None and {} for an absent file."""
    path = str(tmp_path / "config.json")
    assert run_dir.read_json(path, missing_ok=True) is None and run_dir.read_record(path) is None
    assert run_dir.read_config(str(tmp_path), missing_ok=True) == {}
    with pytest.raises(UserError, match=f"^{path} is missing; restore it$"):
        run_dir.read_json(path, "restore it")
    with pytest.raises(UserError, match="config.json is missing; is .* a run directory written by scripts.base_train"):
        run_dir.read_config(str(tmp_path))
    open(path, "w").write('{"run": ')
    with pytest.raises(UserError, match=rf"^{path} is not valid JSON \(.*\); restore it$"):
        run_dir.read_json(path, "restore it", missing_ok=True)
    assert run_dir.read_record(path) is None
    with pytest.raises(UserError, match="is not valid JSON .*; move it away"):
        run_dir.read_config(str(tmp_path), "move it away", missing_ok=True)
    (tmp_path / "eval.json").mkdir()  # unreadable: one line too
    with pytest.raises(UserError, match="eval.json cannot be read"):
        run_dir.read_eval(str(tmp_path))
