"""nanochat.run_dir's one rule for metrics.jsonl: torn last lines and bad lines.

A torn last line (a kill mid-write) is skipped with a note or
handed back with step None; a bad line anywhere else is a one-line error naming the file and the line."""

import json

import pytest

from nanochat.common import UserError
from nanochat import run_dir

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
