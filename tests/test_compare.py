"""compare: the report of a tiny GPT / NAG pair trained on the same budget and evaluated by base_eval."""

import os
import json
import math
import shutil

import numpy as np
import pytest
import torch

from conftest import linked_base, train_tiny_pair, unwritable_reports
from scripts import base_eval, compare
from analysis.compare.inputs import report_is_current
from analysis.compare.tables import config_section
from nanochat import stats
from nanochat.common import atomic_write_bytes
from nanochat.core_eval import load_records, save_records, centered_accuracy
from nanochat.run_dir import step_files

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# 32 items: each task's interval needs stats.MIN_UNITS; 20: the schema task has too few for its own
MC_ITEMS = [{"query": f"Document {i}. The", "choices": ["model is", "of and", "to"], "gold": i % 3} for i in range(32)]
SCHEMA_ITEMS = [
    {"context_options": [f"The head {i}", f"The layer {i}"], "continuation": "is data.", "gold": i % 2}
    for i in range(20)
]
# two scored tasks (multiple choice, schema) and one listed in core.yaml without its file
TASKS = [
    ("mc_task", "multiple_choice", 0, 25.0, MC_ITEMS),
    ("schema_task", "schema", 0, 50.0, SCHEMA_ITEMS),
    ("gone_task", "multiple_choice", 0, 25.0, None),
]


@pytest.fixture(scope="module")
def pair(tiny_base_dir, tmp_path_factory, write_eval_bundle):
    """gpt and nag runs of the same 6-step budget, both evaluated (CORE on the fake bundle, bpb)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: a second thread only costs when the cores are contended
    base = linked_base(tiny_base_dir, tmp_path_factory.mktemp("compare_base"))
    bundle = write_eval_bundle(tmp_path_factory.mktemp("bundle"), TASKS)
    runs = train_tiny_pair(base)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(base))
        for arch in ("gpt", "nag"):
            base_eval.main(
                [
                    "--run",
                    arch,
                    "--eval",
                    "core,bpb",
                    "--eval-bundle",
                    bundle,
                    "--split-tokens",
                    "1024",
                    "--device-batch-size",
                    "4",
                ]
            )
        yield {"base": base, "runs": runs, "bundle": bundle}
    torch.set_num_threads(before)


def copy_run(run_dir, dest, with_eval=False):
    """A copy of config.json and metrics.jsonl, with_eval: and of eval.json and its step's eval/ json (without the
    CORE records)."""
    os.makedirs(os.path.join(dest, "eval"))
    names = ("config.json", "metrics.jsonl")
    if with_eval:
        names += ("eval.json", step_files(json.load(open(os.path.join(run_dir, "eval.json")))["step"])["json"])
    for name in names:
        shutil.copy(os.path.join(run_dir, name), os.path.join(dest, name))
    return str(dest)


def table_row(report, first_cell):
    rows = [line for line in report.splitlines() if line.startswith(f"| {first_cell} |")]
    assert len(rows) == 1, (first_cell, rows)
    return [c.strip() for c in rows[0].strip("|").split("|")][1:]


def test_report_of_a_pair(pair, capsys):
    path = compare.main(["gpt", "nag"])
    assert path == os.path.join(pair["base"], "reports", "gpt@6_vs_nag@6", "report.md")
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].endswith(path)
    assert "| steps |" in out and "| final val bpb (training log) |" in out  # the side-by-side table on stdout
    report = open(path).read()
    metrics = {
        a: [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))] for a, d in pair["runs"].items()
    }
    evals = {a: json.load(open(os.path.join(d, "eval.json"))) for a, d in pair["runs"].items()}

    assert table_row(report, "steps") == ["6", "6"]
    assert table_row(report, "tokens") == ["1.54K", "1.54K"]
    assert table_row(report, "training FLOPs") == [f"{metrics[a][-1]['flops']:.3e}" for a in ("gpt", "nag")]
    assert table_row(report, "final val bpb (training log)") == [
        f"{metrics[a][-1]['val_bpb']:.4f} (step 6)" for a in ("gpt", "nag")
    ]
    assert table_row(report, "val bpb (base_eval)") == [f"{evals[a]['val_bpb']:.4f}" for a in ("gpt", "nag")]
    # a partial score is labelled as such and never shown as CORE
    assert table_row(report, "CORE") == ["— (partial only)"] * 2
    assert table_row(report, "partial CORE (tasks scored)") == [
        f"{evals[a]['partial_core']:.4f} (2/22)" for a in ("gpt", "nag")
    ]

    # every task: centred accuracy of both runs and the delta vs the first
    for task in ("mc_task", "schema_task"):
        g, n = evals["gpt"]["tasks"][task]["centered"], evals["nag"]["tasks"][task]["centered"]
        assert table_row(report, task) == [f"{g:+.4f}", f"{n:+.4f}", f"{n - g:+.4f}"]
    assert table_row(report, "gone_task") == ["missing", "missing", "—"]

    # config differences: only what differs
    assert table_row(report, "`--arch`") == ["gpt", "nag"]
    assert "`--depth`" not in report and "`model_config.n_layer`" not in report
    assert table_row(report, "`nag_config.mod_floor`")[0] == "—"

    for name in (
        "train_loss_vs_flops.png",
        "val_bpb_vs_flops.png",
        "gate_gain_by_depth.png",
        "gate_dead_branches.png",
        "step_time.png",
    ):
        data = open(os.path.join(os.path.dirname(path), name), "rb").read()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name
        assert f"]({name})" in report
    # the step-time breakdown: each part's mean share over the logged steps, a column per run adding up to 100%
    for k, a in enumerate(("gpt", "nag")):
        rows = [r["time"] for r in metrics[a] if "time" in r]
        assert len(rows) == 6
        fwd_bwd = sum(t["fwd_bwd"] / sum(t.values()) for t in rows) / len(rows)
        assert table_row(report, "fwd+bwd")[k] == f"{100 * fwd_bwd:.1f}%"
        assert (
            abs(
                sum(
                    float(table_row(report, part)[k][:-1])
                    for part in ("data", "fwd+bwd", "optim", "sync+log", "eval", "save")
                )
                - 100
            )
            < 0.5
        )
    assert "partial CORE" in report and "missing: gone_task" in report


def test_run_without_eval_gets_training_parts(pair, tmp_path, capsys):
    bare = copy_run(pair["runs"]["nag"], tmp_path / "nag-bare")
    path = compare.main(["gpt", bare, "--out", str(tmp_path / "out")])
    report = open(path).read()
    assert path == str(tmp_path / "out" / "report.md")
    assert table_row(report, "eval step (base_eval)") == ["6", "no eval.json"]
    assert table_row(report, "mc_task")[1:] == ["—", "—"]
    assert "`nag` has no eval.json" in report and f"scripts.base_eval --run {bare}`" in report
    assert os.path.getsize(tmp_path / "out" / "gate_dead_branches.png") > 0

    # a single gpt run: no gate figures, nothing to diff
    path = compare.main([pair["runs"]["gpt"], "--out", str(tmp_path / "solo")])
    assert "nothing to compare" in open(path).read()
    assert sorted(f for f in os.listdir(tmp_path / "solo") if f.endswith(".png")) == [
        "step_time.png",
        "train_loss_vs_flops.png",
        "val_bpb_vs_flops.png",
    ]


def edited_copy(pair, arch, dest, correct=None, settings_edit=None, items_edit=None):
    """A copy of a run with its CORE records (and the eval.json scores they give) edited."""
    run_dir = copy_run(pair["runs"][arch], dest, with_eval=True)
    cols, settings = load_records(os.path.join(pair["runs"][arch], "core_records.parquet"))
    rows = [dict(zip(cols, vals)) for vals in zip(*cols.values())]
    for r in rows:
        r["correct"] = correct(r) if correct else r["correct"]
        r["item"] = items_edit(r) if items_edit else r["item"]
    settings_edit and settings_edit(settings)
    save_records(os.path.join(run_dir, "core_records.parquet"), rows, settings, atomic_write_bytes)
    ev = json.load(open(os.path.join(run_dir, "eval.json")))
    for label, t in ev["tasks"].items():
        verdicts = [r["correct"] for r in rows if r["task"] == label]
        t["accuracy"] = sum(verdicts) / len(verdicts)
        t["centered"] = centered_accuracy(t["accuracy"], settings["tasks"][label]["random_baseline"])
    ev["partial_core"] = sum(t["centered"] for t in ev["tasks"].values()) / len(ev["tasks"])
    for name in ("eval.json", step_files(ev["step"])["json"]):
        json.dump(ev, open(os.path.join(run_dir, name), "w"))
    return run_dir


def test_intervals_verdict_and_forest_plot(pair, tmp_path, capsys):
    # the tiny pair as trained: every delta gets its paired interval, as stats computes it from the records
    path = compare.main(["gpt", "nag", "--out", str(tmp_path / "real")])
    report = open(path).read()
    recs = {a: load_records(os.path.join(d, "core_records.parquet")) for a, d in pair["runs"].items()}
    r = stats.core_delta_interval(recs["gpt"][0], recs["nag"][0], recs["gpt"][1])
    t = r["tasks"]["mc_task"]
    assert table_row(report, "`mc_task`")[1:3] == [f"{t['ci'][0]:+.4f} … {t['ci'][1]:+.4f}", f"{t['p']:.3g}"]
    assert table_row(report, "`schema_task`")[1:3] == ["too few items for an interval (20 < 30)", "—"]
    assert table_row(report, "**partial CORE (2/22)**")[:2] == [
        f"{r['delta']:+.4f}" + (" \\*" if r["ci"][0] > 0 or r["ci"][1] < 0 else ""),
        f"{r['ci'][0]:+.4f} … {r['ci'][1]:+.4f}",
    ]
    out = capsys.readouterr().out
    assert f"nag − gpt partial CORE (2/22) = {r['delta']:+.4f} (95% CI {r['ci'][0]:+.4f} … {r['ci'][1]:+.4f}" in out
    assert "at 52 items over 2 tasks" in out and "(95% CI" in report
    evs = {a: json.load(open(os.path.join(d, "eval.json"))) for a, d in pair["runs"].items()}
    b = stats.bpb_delta_interval(
        evs["gpt"]["val_batches"]["nats"], evs["nag"]["val_batches"]["nats"], evs["gpt"]["val_batches"]["bytes"]
    )
    assert b["delta"] == pytest.approx(evs["nag"]["val_bpb"] - evs["gpt"]["val_bpb"], rel=1e-9)
    # 4 val batches: the delta, no interval
    assert f"nag − gpt val bpb = {b['delta']:+.4f}: too few batches for an interval (4 < 30)" in report
    data = open(tmp_path / "real" / "core_deltas.png", "rb").read()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000 and "](core_deltas.png)" in report

    # an edited copy that gets every mc_task item right where gpt's verdicts stay: the interval excludes 0
    better = edited_copy(
        pair, "gpt", tmp_path / "gpt-better", correct=lambda row: True if row["task"] == "mc_task" else row["correct"]
    )
    report = open(compare.main(["gpt", better, "--out", str(tmp_path / "better")])).read()
    g = evs["gpt"]["tasks"]["mc_task"]
    delta = (1 - g["accuracy"]) / 0.75
    # marked: the interval excludes 0
    assert g["accuracy"] < 1 and table_row(report, "`mc_task`")[0] == f"{delta:+.4f} \\*"
    assert table_row(report, "`schema_task`")[:3] == ["+0.0000", "too few items for an interval (20 < 30)", "—"]
    assert (
        "gpt#2 − gpt partial CORE (2/22) = " in report
        and ": distinguishable from noise at 52 items over 2 tasks" in report
    )
    # the usual CORE table shows the same deltas
    assert table_row(report, "mc_task")[2] == f"{delta:+.4f}"


def test_runs_on_other_items_or_without_records_are_refused(pair, tmp_path, script_error):
    other = edited_copy(pair, "nag", tmp_path / "limit", settings_edit=lambda s: s.update(max_per_task=3))
    assert "different CORE items or settings (--max-per-task -1 vs 3)" in script_error(
        compare.main, "gpt", other, "--out", str(tmp_path / "o")
    )
    other = edited_copy(
        pair,
        "nag",
        tmp_path / "items",
        items_edit=lambda r: "x" if r["task"] == "schema_task" and r["idx"] == 2 else r["item"],
    )
    assert "the items of task schema_task differ" in script_error(
        compare.main, "gpt", other, "--out", str(tmp_path / "o")
    )
    other = edited_copy(
        pair, "nag", tmp_path / "shots", settings_edit=lambda s: s["tasks"]["mc_task"].update(num_fewshot=1)
    )
    assert "task mc_task settings" in script_error(compare.main, "gpt", other, "--out", str(tmp_path / "o"))
    assert not os.path.exists(tmp_path / "o")  # refused before writing anything
    # an eval.json whose records file is gone
    old = copy_run(pair["runs"]["nag"], tmp_path / "old", with_eval=True)
    err = script_error(compare.main, "gpt", old, "--out", str(tmp_path / "o"))
    assert "has CORE scores but no per-example records" in err and old in err
    # a damaged records file
    damaged = edited_copy(pair, "nag", tmp_path / "damaged")
    records = os.path.join(damaged, "core_records.parquet")
    open(records, "r+b").truncate(os.path.getsize(records) // 2)
    err = script_error(compare.main, "gpt", damaged, "--out", str(tmp_path / "o"))
    assert records in err and "not a readable CORE records file" in err


def test_metrics_with_repeated_steps_or_a_torn_last_line(pair, tmp_path, script_error, capsys):
    run = copy_run(pair["runs"]["gpt"], tmp_path / "dup")
    metrics = os.path.join(run, "metrics.jsonl")
    lines = open(metrics).read().splitlines(keepends=True)
    open(metrics, "w").writelines(lines + [lines[3]])  # a second writer appended step 4 again
    err = script_error(compare.main, run, "--out", str(tmp_path / "o"))
    assert metrics in err and f"repeats step {json.loads(lines[3])['step']}" in err
    open(metrics, "w").writelines(lines[:2] + lines[3:4] + lines[2:3])
    assert f"goes back to step {json.loads(lines[2])['step']}" in script_error(
        compare.main, run, "--out", str(tmp_path / "o")
    )
    # a kill mid-write leaves a torn last line: tolerated, with a note
    open(metrics, "w").writelines(lines + [lines[-1][:10]])
    path = compare.main([run, "--out", str(tmp_path / "torn")])
    note = f"{metrics} line {len(lines) + 1} is torn (a write cut short) and was skipped"
    assert note in open(path).read() and note in capsys.readouterr().out
    assert table_row(open(path).read(), "steps") == ["6"]


def test_bad_inputs_name_file_and_line(pair, tmp_path, script_error):
    broken = copy_run(pair["runs"]["gpt"], tmp_path / "broken")
    metrics = os.path.join(broken, "metrics.jsonl")
    lines = open(metrics).read().splitlines(keepends=True)
    lines[2] = lines[2][: len(lines[2]) // 2] + "\n"  # a row cut in half
    open(metrics, "w").writelines(lines)
    err = script_error(compare.main, "nag", broken, "--out", str(tmp_path / "o"))
    assert metrics in err and "line 3" in err
    open(metrics, "w").writelines(lines[:2] + ["[1, 2]\n"])
    assert "line 3" in script_error(compare.main, broken)
    os.remove(metrics)
    assert "metrics.jsonl is missing" in script_error(compare.main, broken)
    assert "no run directory" in script_error(compare.main, "gpt", "never-trained")
    assert "--ema" in script_error(compare.main, "gpt", "--ema", "1.5")


def test_config_table_shows_optimizer_differences():
    def config(lm_head_betas, momentum_end):
        return {
            "args": {"depth": 2},
            "model_config": {"n_embd": 64},
            "optimizer": {
                "groups": [{"name": "lm_head", "kind": "adamw", "num_params": 10, "lr": 0.1, "betas": lm_head_betas}],
                "muon_momentum": {"start": 0.85, "end": momentum_end},
                "polar_norm_factor": 1.01,
            },
        }

    runs = [{"name": "a", "config": config([0.8, 0.96], 0.9)}, {"name": "b", "config": config([0.8, 0.95], 0.9)}]
    section = config_section(runs)
    assert "`optimizer.lm_head.betas`" in section and "[0.8, 0.95]" in section
    assert "polar_norm_factor" not in section and "muon_momentum" not in section  # equal: not listed
    runs[1]["config"]["optimizer"]["muon_momentum"]["end"] = 0.95
    assert "`optimizer.muon_momentum.end`" in config_section(runs)


# ---------------------------------------------------------------------------
# hand-written run directories: config.json, metrics.jsonl, eval.json and eval/step_*.json as base_train and
# base_eval write them, so that what the numbers were measured with can be set at will

FP = {"tokenizer": "70ce" * 4, "data_train": "da7a" * 4, "data_val": "0a1a" * 4}


def eval_record(step, bpb, batches=40, seed=0, fingerprints=FP, world_size=1, core=None, interrupted=False):
    """An eval record of `batches` val batches around `bpb`, with CORE from {task: 0/1 verdicts} if given."""
    rng = np.random.default_rng(seed)
    nbytes = [1000] * batches
    nats = [n * math.log(2) * (bpb + 0.02 * rng.standard_normal()) for n in nbytes]
    rec = {
        "step": step,
        "val_bpb": sum(nats) / (math.log(2) * sum(nbytes)),
        "train_bpb": None,
        "split_tokens": batches * 256,
        "val_batches": {"nats": nats, "bytes": nbytes},
        "world_size": world_size,
        "fingerprints": fingerprints,
        "tasks": {},
        "core_metric": None,
        "partial_core": None,
        "num_tasks_scored": 0,
        "missing_tasks": None,
        "core_records": None,
    }
    if fingerprints is None:  # an evaluation from before they were recorded
        for key in ("world_size", "fingerprints"):
            rec.pop(key)
    if core:
        rec["tasks"] = {
            t: {
                "accuracy": sum(v) / len(v),
                "centered": centered_accuracy(sum(v) / len(v), 25.0),
                "num_examples": len(v),
            }
            for t, v in core.items()
        }
        rec.update(
            partial_core=sum(t["centered"] for t in rec["tasks"].values()) / len(core),
            num_tasks_scored=len(core),
            missing_tasks=[],
            core_records="core_records.parquet",
            max_per_task=-1,
        )
        if interrupted:
            rec["interrupted"] = True
    return rec


def write_run(root, name, evals, arch="gpt", train_fingerprints=FP, core=None, args=None):
    """A run directory evaluated at each record of evals (the last is eval.json); core: its CORE verdicts;
    args: base_train arguments besides --arch (config.json "args")."""
    run_dir = os.path.join(root, name)
    os.makedirs(os.path.join(run_dir, "eval"))
    last = evals[-1]["step"]
    args = {"arch": arch, **(args or {})}
    config = {
        "run": name,
        "arch": arch,
        "world_size": 1,
        "num_iterations": last,
        "args": args,
        "compute_dtype": "bfloat16",
        "fp8_layers": 12 if args.get("fp8") else 0,
    }
    if train_fingerprints:
        config["fingerprints"] = train_fingerprints
    json.dump(config, open(os.path.join(run_dir, "config.json"), "w"))
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for step in range(last + 1):
            f.write(
                json.dumps({"step": step, "train_loss": 5.0 - step / 10, "flops": 1e9 * step, "tokens": 256 * step})
                + "\n"
            )
    for rec in evals:
        json.dump(rec, open(os.path.join(run_dir, "eval", f"step_{rec['step']:06d}.json"), "w"))
    json.dump(evals[-1], open(os.path.join(run_dir, "eval.json"), "w"))
    if evals[-1]["tasks"]:
        rows = [
            {"task": t, "idx": i, "correct": bool(c), "margin": 0.0, "item": f"{t}-{i}"}
            for t, verdicts in core.items()
            for i, c in enumerate(verdicts)
        ]
        settings = {
            "max_per_task": -1,
            "step": last,
            "tasks": {t: {"random_baseline": 25.0, "num_fewshot": 0} for t in core},
        }
        save_records(os.path.join(run_dir, "core_records.parquet"), rows, settings, atomic_write_bytes)
    return run_dir


@pytest.fixture
def hand_base(tmp_path, monkeypatch):
    base = tmp_path / "base"
    os.makedirs(base / "runs")
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    return base


def test_runs_on_two_corpora_name_the_data_difference(hand_base, capsys):
    other = {**FP, "data_train": "beef" * 4, "data_val": "f00d" * 4}
    write_run(hand_base / "runs", "a", [eval_record(6, 1.30)])
    write_run(
        hand_base / "runs",
        "b",
        [eval_record(6, 1.20, seed=1, fingerprints=other)],
        arch="nag",
        train_fingerprints=other,
    )
    report = open(compare.main(["a", "b"])).read()
    out = capsys.readouterr().out
    for text in (report, out):
        assert f"training data (data_train fingerprint {FP['data_train']} vs {'beef' * 4})" in text
        assert f"val data (data_val fingerprint {FP['data_val']} vs {'f00d' * 4})" in text
        assert "b − a val bpb = " in text and ": no interval, the runs differ in training data" in text
    assert "--split-tokens" not in report and "val bpb = " in out and "95% CI" not in out  # both numbers, no interval
    assert table_row(report, "val data") == [f"`{FP['data_val']}`", f"`{'f00d' * 4}`"]


def test_evaluation_process_count_is_flagged(hand_base, capsys):
    write_run(hand_base / "runs", "a", [eval_record(6, 1.30)])
    write_run(hand_base / "runs", "b", [eval_record(6, 1.20, seed=1, world_size=8)])
    report = open(compare.main(["a", "b"])).read()
    out = capsys.readouterr().out
    assert "warning: `b` vs `a` differ in evaluation processes (world_size 1 vs 8)" in out
    assert (
        "no interval, the runs differ in evaluation processes (world_size 1 vs 8)" in report and "95% CI" not in report
    )


def test_process_count_does_not_matter_once_val_batches_are_shared(hand_base, capsys):
    # base_eval records num_val_batches since every process reads a one-process run's batches: val bpb is the same
    # under any process count, so the pair keeps its interval
    new = lambda *a, **k: dict(eval_record(*a, **k), num_val_batches=40)
    write_run(hand_base / "runs", "a", [new(6, 1.30)])
    write_run(hand_base / "runs", "b", [new(6, 1.20, seed=1, world_size=8)])
    report = open(compare.main(["a", "b"])).read()
    assert "evaluation processes" not in capsys.readouterr().out and "95% CI" in report


def test_unrecorded_fingerprints_are_said_not_guessed(hand_base, capsys):
    write_run(hand_base / "runs", "a", [eval_record(6, 1.30)])
    write_run(hand_base / "runs", "old", [eval_record(6, 1.20, seed=1, fingerprints=None)], train_fingerprints=None)
    report = open(compare.main(["a", "old"])).read()
    assert table_row(report, "training data") == [f"`{FP['data_train']}`", "not recorded"]
    assert "not recorded for `old`" in report and "training data, tokenizer, val data, evaluation processes" in report
    assert "(95% CI" in report  # what was recorded agrees, and the batches pair: the interval stands


def test_run_directories_of_an_earlier_version_are_one_line(hand_base, script_error):
    """What this version never writes is not read: an eval.json without its eval/ step file, val bpb without per-batch
    losses, CORE scores without records named, a config without its precision. One line each, naming the file."""
    write_run(hand_base / "runs", "a", [eval_record(6, 1.30)])
    runs = hand_base / "runs"

    def edit(name, path, change):
        run_dir = write_run(runs, name, [eval_record(6, 1.20, seed=1)])
        for p in [path] if path != "eval" else ["eval.json", "eval/step_000006.json"]:
            with open(os.path.join(run_dir, p)) as f:
                rec = json.load(f)
            change(rec)
            json.dump(rec, open(os.path.join(run_dir, p), "w"))
        return run_dir

    task = {"t": {"accuracy": 1.0, "centered": 1.0, "num_examples": 1}}
    cases = {
        "eval.json": (
            write_run(runs, "no-eval-dir", [eval_record(6, 1.20, seed=1)]),
            "an evaluation of step 6 without its eval/step_000006.json",
        ),
        "nats": (
            edit("no-nats", "eval", lambda r: r.pop("val_batches")),
            "an evaluation of val bpb without its per-batch",
        ),
        "records": (
            edit("no-records", "eval", lambda r: r.update(tasks=task)),
            "an evaluation with CORE scores but no per-example records",
        ),
        "config": (
            edit("no-dtype", "config.json", lambda c: c.pop("compute_dtype")),
            "a run's config without its fp8 layers",
        ),
    }
    shutil.rmtree(os.path.join(cases["eval.json"][0], "eval"))
    for key, (run_dir, what) in cases.items():
        err = script_error(compare.main, "a", os.path.basename(run_dir))
        file = os.path.join(run_dir, "config.json" if key == "config" else "eval.json")
        assert err.startswith(f"error: {file} is {what}") and "written by an earlier version of this code" in err, err


def test_intervals_need_enough_batches(hand_base, capsys):
    write_run(hand_base / "runs", "a", [eval_record(6, 1.30, batches=2)])
    write_run(hand_base / "runs", "b", [eval_record(6, 1.20, batches=2, seed=1)])
    report = open(compare.main(["a", "b"])).read()
    out = capsys.readouterr().out
    delta = eval_record(6, 1.20, batches=2, seed=1)["val_bpb"] - eval_record(6, 1.30, batches=2)["val_bpb"]
    assert f"b − a val bpb = {delta:+.4f}: too few batches for an interval (2 < 30)" in out
    assert "95% CI" not in report and "distinguishable" not in report and "p = " not in report
    write_run(hand_base / "runs", "c", [eval_record(6, 1.30, batches=30)])
    write_run(hand_base / "runs", "d", [eval_record(6, 1.20, batches=30, seed=1)])
    compare.main(["c", "d"])
    assert (
        "(95% CI" in capsys.readouterr().out
        and ": distinguishable from noise on 30 shared val batches"
        in open(os.path.join(hand_base, "reports", "c@6_vs_d@6", "report.md")).read()
    )


def test_core_intervals_need_enough_items(hand_base, capsys):
    rng = np.random.default_rng(0)
    few = {t: list(rng.integers(0, 2, 10)) for t in ("t1", "t2")}
    more = {t: list(rng.integers(0, 2, 20)) for t in ("t1", "t2")}
    for name, core in (("a", few), ("b", {t: [1] * 10 for t in few}), ("c", more), ("d", {t: [1] * 20 for t in more})):
        write_run(hand_base / "runs", name, [eval_record(6, 1.3, core=core)], core=core)
    report = open(compare.main(["a", "b"])).read()
    assert "partial CORE (2/22) = " in report and "too few items for an interval (20 < 30)" in report
    assert table_row(report, "`t1`")[1:3] == ["too few items for an interval (10 < 30)", "—"]
    report = open(compare.main(["c", "d"])).read()  # 40 items in all: the aggregate has its interval, each task not
    assert (
        "distinguishable from noise at 20 items per task" in report
        and table_row(report, "`t1`")[1] == "too few items for an interval (20 < 30)"
    )
    assert "…" in table_row(report, "**partial CORE (2/22)**")[1]


def test_default_folder_never_replaces_a_report_of_other_inputs(hand_base, tmp_path, script_error):
    a = write_run(hand_base / "runs", "a", [eval_record(6, 1.30)])
    write_run(hand_base / "runs", "b", [eval_record(6, 1.20, seed=1)])
    path = compare.main(["a", "b"])
    folder = os.path.join(hand_base, "reports", "a@6_vs_b@6")
    assert path == os.path.join(folder, "report.md") and report_is_current(
        folder, [a, os.path.join(hand_base, "runs", "b")]
    )
    os.utime(path, (0, 0))
    assert compare.main(["a", "b"]) == path and os.path.getmtime(path) > 0  # the same inputs: rewritten
    # runs of the same names in another base dir
    elsewhere = tmp_path / "other"
    write_run(elsewhere, "a", [eval_record(6, 1.25, seed=2)])
    write_run(elsewhere, "b", [eval_record(6, 1.21, seed=3)])
    err = script_error(compare.main, str(elsewhere / "a"), str(elsewhere / "b"))
    assert f"{folder} holds a report of other inputs" in err and "pass --out" in err and str(elsewhere / "a") in err
    # a re-evaluation of the first run at the same step
    json.dump(eval_record(6, 1.29, seed=4), open(os.path.join(a, "eval.json"), "w"))
    err = script_error(compare.main, "a", "b")
    assert f"an earlier evaluation of {os.path.realpath(a)}" in err
    assert not report_is_current(folder, [a, os.path.join(hand_base, "runs", "b")])
    assert compare.main(["a", "b", "--out", folder]) == path  # asked for: replaced
    assert report_is_current(folder, [a, os.path.join(hand_base, "runs", "b")])


def test_several_evaluated_steps_are_plotted(hand_base, capsys):
    core = {f"t{i}": [1, 0] * 20 for i in range(3)}
    write_run(
        hand_base / "runs",
        "a",
        [
            eval_record(2, 1.5, core=core),
            eval_record(4, 1.4, core=core, interrupted=True),
            eval_record(6, 1.3, core=core),
        ],
        core=core,
    )
    write_run(
        hand_base / "runs", "b", [eval_record(3, 1.45, seed=1), eval_record(6, 1.25, seed=2, core=core)], core=core
    )
    report = open(compare.main(["a", "b"])).read()
    data = open(os.path.join(hand_base, "reports", "a@6_vs_b@6", "eval_vs_step.png"), "rb").read()
    assert data.startswith(PNG_MAGIC) and "](eval_vs_step.png)" in report
    assert table_row(report, "`a` | 4")[1] == f"{eval_record(4, 1.4)['val_bpb']:.4f}"
    assert "(partial, 3/22, interrupted)" in table_row(report, "`a` | 4")[2] and table_row(report, "`b` | 3")[2] == "—"
    assert "## Evaluated steps" in report
    # runs logged before base_train measured where a step's time goes: no breakdown, no empty figure
    assert "## Step time" not in report and not os.path.exists(
        os.path.join(hand_base, "reports", "a@6_vs_b@6", "step_time.png")
    )


@pytest.mark.parametrize("how", ["file in the way", "read-only"])
def test_unwritable_base_dir_is_one_line(hand_base, script_error, how):
    write_run(hand_base / "runs", "a", [eval_record(6, 1.30)])
    unwritable_reports(hand_base, how)
    try:
        err = script_error(compare.main, "a")
    finally:
        os.chmod(hand_base / "reports", 0o755)
    assert "cannot write to" in err and "reports" in err


def test_out_on_a_file_says_so(hand_base, script_error, tmp_path):
    """--out names a folder: a file there (or above it) is said to be one, before any work, never taken for a full
    disk; the file is left alone, --force or not."""
    core = {"t1": [1, 0] * 20}
    for name in ("a", "b"):
        write_run(hand_base / "runs", name, [eval_record(6, 1.3, core=core)], core=core)
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    for argv in (["a", "b"], ["a", "b", "--force"], ["--a", "a", "--b", "b"]):
        err = script_error(compare.main, *argv, "--out", str(mine))
        assert f"cannot write to {mine}: it is a file, not a folder" in err and "free space" not in err
    err = script_error(compare.main, "a", "b", "--out", str(mine / "report"))
    assert f"cannot write to {mine / 'report'}: {mine} is a file, not a folder" in err
    assert mine.read_text() == "mine"


def test_an_incomplete_core_is_named_not_blamed_on_the_settings(hand_base, script_error):
    """A CORE evaluation stopped before its last task (Ctrl-C, a kill) scored fewer tasks: compare names it as
    incomplete, with the command that finishes it, rather than "different CORE items or settings"."""
    full = {f"t{i}": [1, 0] * 20 for i in range(3)}
    cut = {t: v for t, v in full.items() if t != "t2"}
    write_run(hand_base / "runs", "a", [eval_record(6, 1.3, core=full)], core=full)
    rec = eval_record(6, 1.3, seed=1, core=cut, interrupted=True)
    rec.update(interrupted_tasks=["t2"], core_finished=False, eval_bundle="/data/eval_bundle")
    b = write_run(hand_base / "runs", "b", [rec], core=cut)
    for argv in (["a", "b"], ["b", "a"]):
        err = script_error(compare.main, *argv)
        assert "incomplete CORE in run `b` (2 of 3 tasks" in err and "different CORE items" not in err
        assert f"`python -m scripts.base_eval --run {b} --eval core --eval-bundle /data/eval_bundle`" in err


# ---------------------------------------------------------------------------
# groups of seeds: --a RUN... --b RUN...


def seed_group(root, arch, bpbs, core_acc, seeds=None, batches=40, args=None, prefix=None):
    """Runs {prefix or arch}-s{seed} of one model, one per seed, evaluated on `batches` val batches and 2 x 40 CORE
    items."""
    rng = np.random.default_rng(len(arch))
    names = []
    for k, bpb in enumerate(bpbs):
        seed = k if seeds is None else seeds[k]
        core = {t: (rng.random(40) < core_acc).astype(int).tolist() for t in ("t1", "t2")}
        name = f"{prefix or arch}-s{seed}"
        write_run(
            root,
            name,
            [eval_record(6, bpb, batches=batches, seed=seed, core=core)],
            arch=arch,
            core=core,
            args={"seed": seed, "data_seed": seed, "depth": 4, **(args or {})},
        )
        names.append(name)
    return names


def test_groups_report_and_comparison_json(hand_base, capsys):
    a = seed_group(hand_base / "runs", "gpt", [1.30, 1.31, 1.295], 0.5)
    b = seed_group(hand_base / "runs", "nag", [1.29, 1.28, 1.285], 0.6)
    path = compare.main(["--a", *a, "--b", *b[::-1]])  # b in another order: paired by seed all the same
    folder = os.path.dirname(path)
    # b in a's seed order
    assert folder == os.path.join(hand_base, "reports", "gpt-s0@6+gpt-s1@6+gpt-s2@6_vs_nag-s0@6+nag-s1@6+nag-s2@6")
    out = capsys.readouterr().out
    assert "paired by seed" in out and "nag-s0 +2 − gpt-s0 +2 val bpb = " in out
    data = json.load(open(os.path.join(folder, "comparison.json")))
    assert data["design"] == "paired" and data["groups"] == {"a": a, "b": b}
    evals = {n: json.load(open(hand_base / "runs" / n / "eval.json")) for n in a + b}
    bpb, core = data["metrics"]["val_bpb"], data["metrics"]["core"]
    assert bpb["runs"] == pytest.approx({n: ev["val_bpb"] for n, ev in evals.items()}, abs=1e-12)
    assert core["runs"] == pytest.approx({n: ev["partial_core"] for n, ev in evals.items()}, abs=1e-12)
    for m, key in ((bpb, "val_bpb"), (core, "partial_core")):
        va, vb = [evals[n][key] for n in a], [evals[n][key] for n in b]
        assert m["groups"]["a"]["mean"] == pytest.approx(np.mean(va)) and m["groups"]["b"]["sd"] == pytest.approx(
            np.std(vb, ddof=1)
        )
        assert m["delta"]["value"] == pytest.approx(np.mean(vb) - np.mean(va))
        lo, hi = m["delta"]["ci"]
        # df is k - 1 at least
        assert lo < m["delta"]["value"] < hi and 0 < m["delta"]["p"] <= 1 and (m["delta"]["df"] or math.inf) >= 2
        # paired: the seed-to-seed sd is that of the pair differences, and the runs needed follow from it
        assert m["seed_sd"] == pytest.approx(np.std(np.subtract(vb, va), ddof=1))
        assert m["runs_needed"]["published"] == stats.runs_needed(m["seed_sd"], m["published_delta"], paired=True)
    report = open(path).read()
    assert (
        f"| a | `gpt-s0` | gpt | 0 | 0 | {evals['gpt-s0']['val_bpb']:.4f} | {evals['gpt-s0']['partial_core']:.4f} |"
        in report
    )
    assert "](groups.png)" in report and "(comparison.json)" in report and "σ_d" in report
    assert open(os.path.join(folder, "groups.png"), "rb").read().startswith(PNG_MAGIC)
    # the positional form is untouched
    assert compare.main([a[0], b[0]]).endswith(os.path.join("gpt-s0@6_vs_nag-s0@6", "report.md"))


def test_groups_of_other_seeds_are_unpaired_and_a_group_of_one_is_evaluation_noise(hand_base, capsys):
    a = seed_group(hand_base / "runs", "gpt", [1.30, 1.31], 0.5)
    b = seed_group(hand_base / "runs", "nag", [1.29, 1.28], 0.6, seeds=[7, 8])
    compare.main(["--a", *a, "--b", *b, "--out", str(hand_base / "unpaired")])
    assert "unpaired" in capsys.readouterr().out
    data = json.load(open(hand_base / "unpaired" / "comparison.json"))
    assert data["design"] == "unpaired" and not data["metrics"]["val_bpb"]["delta"]["eval_only"]
    path = compare.main(["--a", a[0], "--b", b[0], "--out", str(hand_base / "one")])
    out, report = capsys.readouterr().out, open(path).read()
    assert "evaluation noise only" in out and "interval covers evaluation noise only" in report
    data = json.load(open(hand_base / "one" / "comparison.json"))
    assert data["metrics"]["core"]["delta"]["eval_only"] and data["metrics"]["core"]["seed_sd"] is None
    assert "no seed-to-seed standard deviation" in report


def test_nag_flags_differ_between_a_gpt_and_a_nag_group(hand_base, capsys):
    # every run records every flag, and a preset sets NAG's for NAG runs only (runcpu.sh's demo preset does)
    a = seed_group(hand_base / "runs", "gpt", [1.30, 1.31], 0.5, args={"nag_gate_lr": 0.001})
    b = seed_group(hand_base / "runs", "nag", [1.29, 1.28], 0.6, args={"nag_gate_lr": 0.01})
    compare.main(["--a", *a, "--b", *b, "--out", str(hand_base / "archs")])
    assert json.load(open(hand_base / "archs" / "comparison.json"))["design"] == "paired"


def test_groups_are_refused_with_one_line(hand_base, script_error):
    runs = hand_base / "runs"
    a = seed_group(runs, "gpt", [1.30, 1.31], 0.5)
    b = seed_group(runs, "nag", [1.29, 1.28], 0.6)
    deep = seed_group(runs, "gpt", [1.30], 0.5, seeds=[5], args={"depth": 6})
    err = script_error(compare.main, "--a", *a, *deep, "--b", *b)
    assert "`gpt-s5` differs from `gpt-s0` in --depth (4 vs 6)" in err and "only in their seeds" in err
    err = script_error(compare.main, "--a", *a, "--b", *b[:1], *deep)
    assert "group b mixes architectures" in err
    short = seed_group(runs, "nag", [1.29], 0.6, seeds=[9], batches=30, prefix="short")
    err = script_error(compare.main, "--a", *a, "--b", b[0], *short)
    assert "`short-s9` and `gpt-s0` differ in val tokens (split_tokens 10240 vs 7680)" in err
    os.remove(runs / b[1] / "eval.json")
    err = script_error(compare.main, "--a", *a, "--b", *b)
    assert f"`{b[1]}` has no eval.json" in err
    with pytest.raises(SystemExit):  # groups and positional runs do not mix
        compare.main(["--a", *a, "--b", b[0], a[0]])


# ---------------------------------------------------------------------------
# what compare may write, and what it refuses


def test_a_folder_compare_did_not_write_is_never_touched(hand_base, tmp_path, script_error, capsys):
    write_run(hand_base / "runs", "a", [eval_record(6, 1.30)])
    write_run(hand_base / "runs", "b", [eval_record(6, 1.20, seed=1)])
    mine = tmp_path / "mine"
    os.makedirs(mine)
    (mine / "report.md").write_text("my own report\n")
    (mine / "mydata.csv").write_text("1,2\n")
    err = script_error(compare.main, "a", "b", "--out", str(mine))
    assert (
        f"{mine} holds files that `python -m scripts.compare` did not write (mydata.csv, report.md)" in err
        and "--force" in err
    )
    assert (mine / "report.md").read_text() == "my own report\n" and sorted(os.listdir(mine)) == [
        "mydata.csv",
        "report.md",
    ]
    compare.main(["a", "b", "--out", str(mine), "--force"])  # asked for: its own names replaced, the rest untouched
    assert (mine / "mydata.csv").read_text() == "1,2\n" and "# `a` vs `b`" in (mine / "report.md").read_text()

    # a folder of its own: the same inputs are rewritten; other settings move the earlier report to replaced/
    out = tmp_path / "out"
    compare.main(["a", "b", "--out", str(out)])
    compare.main(["a", "b", "--out", str(out)])
    assert not os.path.exists(out / "replaced")
    first = (out / "report.md").read_bytes()
    capsys.readouterr()
    compare.main(["a", "b", "--out", str(out), "--ema", "0.5"])
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "ema 0.95 → 0.5" in notes[0] and str(out / "replaced") in notes[0]
    (stamp,) = os.listdir(out / "replaced")
    assert (out / "replaced" / stamp / "report.md").read_bytes() == first and os.path.exists(
        out / "replaced" / stamp / "inputs.json"
    )
    assert json.load(open(out / "inputs.json"))["inputs"]["ema"] == 0.5


def test_a_run_given_twice_is_refused(hand_base, script_error):
    write_run(hand_base / "runs", "a", [eval_record(6, 1.30)])
    err = script_error(compare.main, "a", os.path.join(hand_base, "runs", "a"))  # one run, by name and by path
    assert "`a` is compared with itself" in err and "give two different runs" in err
    a = seed_group(hand_base / "runs", "gpt", [1.30, 1.31], 0.5)
    b = seed_group(hand_base / "runs", "nag", [1.29, 1.28], 0.6)
    err = script_error(compare.main, "--a", a[0], a[0], "--b", *b)
    assert f"group a lists `{a[0]}` twice" in err and "no second seed" in err and "#2" not in err
    assert "in both groups" in script_error(compare.main, "--a", *a, "--b", b[0], a[1])
    assert not os.path.exists(hand_base / "reports")


def test_a_p_value_below_the_resampling_floor_is_not_zero(hand_base, capsys):
    a = seed_group(hand_base / "runs", "gpt", [1.30, 1.301, 1.302], 0.5)
    b = seed_group(hand_base / "runs", "nag", [1.10, 1.101, 1.102], 0.5)
    path = compare.main(["--a", *a, "--b", *b])  # a gap of 0.2 bpb, seeds 0.001 apart
    out = capsys.readouterr().out
    assert "p = 0)" not in out and "p < 1/10000" in out and "p < 1/10000" in open(path).read()
    from analysis.compare.tables import p_text

    assert p_text(0.0) == "< 1/10000" and p_text(1 / 10001) == "< 1/10000" and p_text(0.0312) == "= 0.0312"


def test_an_fp8_arm_against_a_bf16_one_is_refused_unless_asked(hand_base, script_error, capsys):
    """base_train --fp8 changes every matmul's rounding: a gap between an fp8 and a bf16 run mixes that into the
    architecture's, so compare refuses the mix (pairs and groups) unless --mixed-precision says so."""
    write_run(hand_base / "runs", "g8", [eval_record(6, 1.30)], args={"fp8": True})
    write_run(hand_base / "runs", "n16", [eval_record(6, 1.29)], arch="nag")
    err = script_error(compare.main, "g8", "n16")
    assert err == (
        "error: `g8` trained with fp8 matmuls (--fp8), `n16` in bf16: their gap would mix the precision into the "
        "architecture's; compare runs of one precision, or pass --mixed-precision"
    )
    assert compare.main(["g8", "n16", "--mixed-precision"]).endswith("report.md")
    a = seed_group(hand_base / "runs", "gpt", [1.30, 1.31], 0.5, args={"fp8": True})
    b = seed_group(hand_base / "runs", "nag", [1.29, 1.28], 0.6)
    assert "pass --mixed-precision" in script_error(compare.main, "--a", *a, "--b", *b)
    assert compare.main(["--a", *a, "--b", *b, "--mixed-precision"]).endswith("report.md")
    b8 = seed_group(hand_base / "runs", "nag", [1.29, 1.28], 0.6, args={"fp8": True}, prefix="nag8")
    assert compare.main(["--a", *a, "--b", *b8]).endswith("report.md")  # both in fp8: a comparison like any other


def test_runs_on_other_package_versions_get_a_one_line_note(hand_base, capsys):
    """config.json's `versions`: compare notes (never refuses) runs trained on other versions, in the report and on
    stdout; runs on the same versions, or without the record, get no such line."""
    same = {"torch": "2.13.0+cpu", "numpy": "2.4.6"}
    for name, numpy_version in (("v1", "2.4.6"), ("v2", "2.5.5"), ("v3", "2.4.6")):
        run_dir = write_run(hand_base / "runs", name, [eval_record(6, 1.30)])
        config = json.load(open(os.path.join(run_dir, "config.json")))
        json.dump(
            {**config, "versions": {**same, "numpy": numpy_version}}, open(os.path.join(run_dir, "config.json"), "w")
        )
    write_run(hand_base / "runs", "old", [eval_record(6, 1.31)])  # a run that recorded none
    note = "the runs trained with other package versions: numpy 2.4.6 (`v1`) vs 2.5.5 (`v2`)"
    report = open(compare.main(["v1", "v2"])).read()
    assert f"note: {note}" in capsys.readouterr().out.splitlines() and f"- {note}." in report
    for runs in (["v1", "v3"], ["v1", "old"]):
        report = open(compare.main(runs)).read()
        assert "package versions" not in capsys.readouterr().out + report
    a, b = (
        seed_group(hand_base / "runs", "gpt", [1.30, 1.31], 0.5),
        seed_group(hand_base / "runs", "nag", [1.29, 1.28], 0.6),
    )
    for i, name in enumerate(b):
        run_dir = hand_base / "runs" / name
        config = json.load(open(run_dir / "config.json"))
        json.dump({**config, "versions": {**same, "numpy": ("2.4.6", "2.5.5")[i]}}, open(run_dir / "config.json", "w"))
    compare.main(["--a", *a, "--b", *b])
    assert "numpy 2.4.6 (`nag-s0`) vs 2.5.5 (`nag-s1`)" in capsys.readouterr().out
