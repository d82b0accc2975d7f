"""Issue 39: clear handling of user mistakes and user edits, in one line each.

One rule for the numbers of every command line, a user's edit of a report never lost, the remaining
tracebacks as one line, and no confusing refusal (an ignored arch flag, a float32 run called bf16, an empty
eval/pending/, a run name that starts with a dot or holds a newline)."""

import os
import json
import errno
import shutil

import pytest

from conftest import TINY_TRAIN, linked_base
from test_compare import write_run, eval_record
from scripts import base_train, base_eval, compare, sample, export_hf, speedrun, tok_train, tok_eval, check_cuda
from scripts.experiments import depth_sweep
import analysis.run
import analysis.compare.pair
from nanochat import run_dir as run_files

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRAIN = TINY_TRAIN + ["--num-iterations", "4", "--save-every", "2", "--eval-every", "-1"]
SMALL_BPB = ["--eval", "bpb", "--split-tokens", "256", "--device-batch-size", "4", "--device-type", "cpu"]


@pytest.fixture(scope="module")
def trained(tiny_base_dir, tmp_path_factory):
    """A base dir holding one finished 4-step gpt run, `g` (checkpoints at 2 and 4), shared: tests copy it to change
    it."""
    base = linked_base(tiny_base_dir, tmp_path_factory.mktemp("user_errors") / "base")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(base))
        run_dir = base_train.main(TRAIN + ["--run", "g"])
    return {"base": base, "run": run_dir}


@pytest.fixture
def run_copy(trained, tmp_path, monkeypatch):
    """A private copy of the trained run, in the shared base dir's corpus and tokenizer."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(trained["base"]))
    dest = str(tmp_path / "g")
    shutil.copytree(trained["run"], dest, ignore=shutil.ignore_patterns(".lock"))
    return dest


# ---------------------------------------------------------------------------
# item 2: one rule for the numbers


@pytest.mark.parametrize(
    "main, argv, message",
    [
        # --matrix-lr -1 was refused, --scalar-lr -1 trained without a word (the recipe's LRs are read by gpt-recipe
        # only)
        (
            base_train.main,
            ["--depth", "2", "--dry-run", "1", "--scalar-lr", "-1"],
            "--scalar-lr must be positive; got -1",
        ),
        (
            base_train.main,
            ["--depth", "2", "--dry-run", "1", "--arch", "gpt-recipe", "--scalar-lr", "0"],
            "--scalar-lr must be positive; got 0",
        ),
        (
            base_train.main,
            ["--depth", "2", "--dry-run", "1", "--arch", "nag", "--nag-gate-log-every=-5"],
            "--nag-gate-log-every must be >= 0 (0: never); got -5",
        ),
        # --max-per-task 0 meant "all items" while every other count refused 0: -1 is all, as elsewhere
        (
            base_eval.main,
            ["--run", "nope", "--max-per-task", "0"],
            "--max-per-task must be a positive number, or -1 (all items); got 0",
        ),
        (compare.main, ["a", "b", "--ema", "1.5"], "--ema must be in [0, 1); got 1.5"),
        (analysis.run.main, ["a", "--step=-3"], "--step must be >= 0, or -1 (the latest checkpoint); got -3"),
        (
            sample.main,
            ["--run", "nope", "--prompt", "a", "--step=-2"],
            "--step must be >= 0, or -1 (the latest checkpoint); got -2",
        ),
        (
            export_hf.main,
            ["--run", "nope", "--out", "x", "--step=-2"],
            "--step must be >= 0, or -1 (the latest checkpoint); got -2",
        ),
    ],
)
def test_every_number_flag_follows_one_rule(tmp_path, monkeypatch, script_error, main, argv, message):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    assert script_error(main, *argv) == f"error: {message}"


def parsers():
    """The parsers of the commands; those that build theirs inside main: caught as they parse."""
    import argparse

    built = {
        "base_train": base_train.build_parser(),
        "base_eval": base_eval.build_parser(),
        "sample": sample.build_parser(),
        "export_hf": export_hf.build_parser(),
        "speedrun": speedrun.build_parser(),
        "depth_sweep": depth_sweep.build_parser(),
    }

    def catch(self, args=None, namespace=None):
        raise Caught(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", catch)
        built_in_main = {
            "compare": compare.main,
            "analysis": analysis.run.main,
            "tok_train": tok_train.main,
            "tok_eval": tok_eval.main,
            "check_cuda": check_cuda.main,
        }
        for name, main in built_in_main.items():
            with pytest.raises(Caught) as e:
                main([])
            built[name] = e.value.args[0]
    return built


class Caught(Exception):
    pass


# numbers that are no LR, decay, count, size or step: seeds, an exponent, and the MoD rate (its own [0, 0.95) rule)
NOT_COUNTS = {"seed", "data_seed", "nag_alpha_init_power", "mod_rate"}


def test_no_number_flag_escapes_the_rule():
    """Every int or float flag of the commands is parsed by one of nanochat/common.py's number types (tok_eval
    --max-chars -5 used to report a figure from one document, depth_sweep --gpus 0 ended in a traceback)."""
    from nanochat.common import Number

    loose = [
        f"{tool} {a.option_strings[0]}"
        for tool, p in parsers().items()
        for a in p._actions
        if a.type in (int, float) and a.dest not in NOT_COUNTS
    ]
    assert loose == []
    typed = [a for p in parsers().values() for a in p._actions if isinstance(a.type, Number)]
    assert len(typed) > 40
    assert "-1 (the default): all of them" in " ".join(base_eval.build_parser().format_help().split())


# ---------------------------------------------------------------------------
# item 3: a user's edit is never lost


def test_an_edited_report_moves_to_replaced_instead_of_being_overwritten(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    write_run(tmp_path / "base" / "runs", "a", [eval_record(6, 1.30)])
    write_run(tmp_path / "base" / "runs", "b", [eval_record(6, 1.20, seed=1)])
    out = tmp_path / "out"
    compare.main(["a", "b", "--out", str(out)])
    manifest = json.load(open(out / "inputs.json"))
    assert manifest["sha256"]["report.md"] == run_files.file_sha256(out / "report.md")
    assert set(manifest["sha256"]) == set(manifest["files"]) - {"inputs.json"}
    (out / "report.md").write_text("my notes on the pair\n")
    capsys.readouterr()
    compare.main(["a", "b", "--out", str(out)])  # the same inputs: before, report.md was rewritten without a trace
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    (stamp,) = os.listdir(out / "replaced")
    assert notes == [
        f"note: report.md in {out} changed since `python -m scripts.compare` wrote it (an edit is never "
        f"overwritten); kept in {out / 'replaced' / stamp}/"
    ]
    assert os.listdir(out / "replaced" / stamp) == ["report.md"]
    assert (out / "replaced" / stamp / "report.md").read_text() == "my notes on the pair\n"
    assert "# `a` vs `b`" in (out / "report.md").read_text()
    compare.main(["a", "b", "--out", str(out)])  # nothing edited since: rewritten, nothing more set aside
    assert os.listdir(out / "replaced") == [stamp]


def test_an_analysis_folder_keeps_an_edit_too(tmp_path, capsys):
    """The rule is run_dir's (claim_folder, publish): an analysis' edited file is set aside the same way."""
    folder, inputs = str(tmp_path / "an"), {"runs": [{"dir": "/r", "step": 4}], "tokens": 256}

    def make(text):
        aside = run_files.claim_folder(folder, "analysis", inputs)
        with run_files.staging(folder) as tmp:
            open(os.path.join(tmp, "analysis.md"), "w").write(text)
            open(os.path.join(tmp, "analysis.json"), "w").write("{}\n")
            run_files.publish(tmp, folder, "analysis", inputs, aside)
        return aside

    assert make("one\n") == []
    open(os.path.join(folder, "analysis.md"), "a").write("my remark\n")
    assert make("two\n") == ["analysis.md"]
    (stamp,) = os.listdir(os.path.join(folder, "replaced"))
    assert open(os.path.join(folder, "replaced", stamp, "analysis.md")).read() == "one\nmy remark\n"
    assert open(os.path.join(folder, "analysis.md")).read() == "two\n"
    assert "changed since `python -m analysis` wrote it" in capsys.readouterr().out


# ---------------------------------------------------------------------------
# item 4: every remaining traceback becomes one line


def test_a_damaged_config_on_resume_is_one_line(run_copy, script_error):
    path = os.path.join(run_copy, "config.json")
    open(path, "w").write('{"run": "g", "args": {')  # before: a JSONDecodeError traceback from resume.read_config
    err = script_error(base_train.main, *TRAIN, "--run", run_copy, "--resume", "latest")
    assert err.startswith(f"error: {path} is not valid JSON (") and "restore it from a copy, or move it away" in err
    assert open(path).read() == '{"run": "g", "args": {'


@pytest.mark.parametrize("damage", ["[]", "{not json"])
def test_a_damaged_checkpoint_meta_is_one_line(run_copy, script_error, damage):
    """A meta json that parses but is no object was an AttributeError traceback in every reader."""
    open(os.path.join(run_copy, "meta_000004.json"), "w").write(damage)
    err = script_error(base_eval.main, "--run", run_copy, *SMALL_BPB)
    assert (
        f"the newest checkpoint of {run_copy}, step 4, is damaged (meta_000004.json is not" in err
        and "pass --step 2" in err
    )


def test_a_meta_without_arch_or_model_config_is_one_line(run_copy, script_error):
    """{} was a KeyError traceback on a resume (and in the analysis): the file named, with the previous complete
    step."""
    path = os.path.join(run_copy, "meta_000004.json")
    open(path, "w").write("{}")
    err = script_error(base_train.main, *TRAIN, "--run", run_copy, "--resume", "latest")
    assert (
        err == f"error: {path} lacks the checkpoint's arch or model config: the file is damaged; "
        "the previous complete step is 2"
    )


def test_a_full_disk_while_writing_an_analysis_or_report_is_one_line(
    run_copy, tmp_path, monkeypatch, capsys, script_error
):
    """The figure writer's OSError (errno 28) was a traceback; now one line naming the folder, and nothing half-made."""

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(analysis.run, "make_figures", full)
    out = tmp_path / "reports" / "an"
    with pytest.raises(SystemExit) as e:
        analysis.run.main(
            [
                run_copy,
                "--tokens",
                "256",
                "--clusters",
                "2",
                "--state-sample",
                "16",
                "--device-batch-size",
                "4",
                "--device-type",
                "cpu",
                "--out",
                str(out),
            ]
        )
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the pass's progress line
    assert (
        e.value.code == 1
        and err
        == f"error: cannot write the results to {out} (No space left on device): nothing of them was kept; "
        "free space and run the command again"
    )
    assert os.listdir(tmp_path / "reports") == []  # neither the folder nor its staging folder
    # compare's report goes through the same staging folder
    monkeypatch.setattr(analysis.compare.pair, "write_report", full)
    write_run(tmp_path / "hand", "a", [eval_record(6, 1.30)])
    write_run(tmp_path / "hand", "b", [eval_record(6, 1.20, seed=1)])
    err = script_error(compare.main, str(tmp_path / "hand" / "a"), str(tmp_path / "hand" / "b"), "--out", str(out))
    assert err.startswith(f"error: cannot write the results to {out} (No space left on device)")
    assert os.listdir(tmp_path / "reports") == []


# ---------------------------------------------------------------------------
# item 5: no confusing refusals


def test_a_flag_the_arch_ignores_never_blocks_its_resume(run_copy, capsys):
    """--no-smear and --scalar-lr are the recipe's: a gpt run ignores them (a note says so), so they are no setting
    of it, given or dropped on a resume. Before: "cannot resume ... with other settings (--no-smear False → True;
    ...)"."""
    capsys.readouterr()
    assert base_train.main(TRAIN + ["--run", run_copy, "--resume", "2", "--no-smear", "--scalar-lr", "0.3"]) == run_copy
    out = capsys.readouterr().out
    assert "note: --no-smear, --scalar-lr apply only with a recipe arch" in out and "resumed from step 2" in out
    config = json.load(open(os.path.join(run_copy, "config.json")))
    assert all(
        "--no-smear" not in s.get("changes", {}) and "--scalar-lr" not in s.get("changes", {})
        for s in config["segments"]
    )
    assert config["fp8_layers"] == 0  # what trained in fp8 (compare's precision): nothing, without --fp8


def test_precision_is_what_the_run_trained(tmp_path, monkeypatch, script_error):
    """--fp8 on a model whose size rule admits no layer trains in the compute dtype: no fp8 run. Precision is
    config.json's compute_dtype and fp8_layers, and float32 is named float32 (it was "bf16" whatever the device)."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    runs = tmp_path / "runs"
    for name, extra in (
        ("c8", {"compute_dtype": "float32", "fp8_layers": 0}),
        ("c32", {"compute_dtype": "float32", "fp8_layers": 0}),
        ("g8", {"compute_dtype": "bfloat16", "fp8_layers": 12}),
    ):
        run_dir = write_run(runs, name, [eval_record(6, 1.30)], args={"fp8": name.endswith("8")})
        config = json.load(open(os.path.join(run_dir, "config.json")))
        json.dump({**config, **extra}, open(os.path.join(run_dir, "config.json"), "w"))
    assert compare.main(["c8", "c32"]).endswith("report.md")  # before: refused as an fp8 run against a bf16 one
    assert script_error(compare.main, "g8", "c32") == (
        "error: `g8` trained with fp8 matmuls (--fp8), `c32` in float32: their gap would mix the precision into the "
        "architecture's; compare runs of one precision, or pass --mixed-precision"
    )


def test_base_eval_leaves_no_empty_pending_folder(run_copy):
    base_eval.main(["--run", run_copy, *SMALL_BPB])
    base_eval.main(["--run", run_copy, *SMALL_BPB])  # the step has results: staged in eval/pending/, then moved in
    assert sorted(os.listdir(os.path.join(run_copy, "eval"))) == ["step_000004.json", "step_000004_core_tasks.csv"]


@pytest.mark.parametrize(
    "run, why",
    [
        (".hidden", "starts with a letter or digit"),
        ("-x", "starts with a letter or digit"),
        ("_x", "starts with a letter or digit"),
        ("scratch/.x", "starts with a letter or digit"),
        ("a\nb", "holds a control character"),
        ("a\x1b[2Jb", "holds a control character"),
    ],
)
def test_a_run_name_starts_with_a_letter_or_digit_and_holds_no_control_character(
    tmp_path, monkeypatch, script_error, run, why
):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    err = script_error(base_train.main, "--depth", "2", "--dry-run", "1", f"--run={run}")
    assert err.startswith(f"error: {run!r} is not a run name: ") and why in err
