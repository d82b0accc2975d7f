"""compare: the report of a tiny GPT / NAG pair trained on the same budget and evaluated by base_eval."""

import os
import json
import shutil

import pytest
import torch

from conftest import linked_base, train_tiny_pair
from scripts import base_eval, compare
from nanochat import stats
from nanochat.common import atomic_write_bytes
from nanochat.core_eval import load_records, save_records, centered_accuracy

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


MC_ITEMS = [{"query": f"Document {i}. The", "choices": ["model is", "of and", "to"], "gold": i % 3} for i in range(5)]
SCHEMA_ITEMS = [{"context_options": [f"The head {i}", f"The layer {i}"], "continuation": "is data.", "gold": i % 2} for i in range(5)]
# two scored tasks (multiple choice, schema) and one listed in core.yaml without its file
TASKS = [("mc_task", "multiple_choice", 0, 25.0, MC_ITEMS), ("schema_task", "schema", 0, 50.0, SCHEMA_ITEMS),
         ("gone_task", "multiple_choice", 0, 25.0, None)]


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
            base_eval.main(["--run", arch, "--eval", "core,bpb", "--eval-bundle", bundle, "--split-tokens", "1024",
                            "--device-batch-size", "4"])
        yield {"base": base, "runs": runs, "bundle": bundle}
    torch.set_num_threads(before)


def copy_run(run_dir, dest, with_eval=False):
    os.makedirs(dest)
    for name in ("config.json", "metrics.jsonl") + (("eval.json",) if with_eval else ()):  # without core_records.parquet
        shutil.copy(os.path.join(run_dir, name), dest)
    return str(dest)


def table_row(report, first_cell):
    rows = [line for line in report.splitlines() if line.startswith(f"| {first_cell} |")]
    assert len(rows) == 1, (first_cell, rows)
    return [c.strip() for c in rows[0].strip("|").split("|")][1:]


def test_report_of_a_pair(pair, capsys):
    path = compare.main(["gpt", "nag"])
    assert path == os.path.join(pair["base"], "reports", "gpt_vs_nag", "report.md")
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].endswith(path)
    assert "| steps |" in out and "| final val bpb (training log) |" in out  # the side-by-side table on stdout
    report = open(path).read()
    metrics = {a: [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))] for a, d in pair["runs"].items()}
    evals = {a: json.load(open(os.path.join(d, "eval.json"))) for a, d in pair["runs"].items()}

    assert table_row(report, "steps") == ["6", "6"]
    assert table_row(report, "tokens") == ["1.54K", "1.54K"]
    assert table_row(report, "training FLOPs") == [f"{metrics[a][-1]['flops']:.3e}" for a in ("gpt", "nag")]
    assert table_row(report, "final val bpb (training log)") == [f"{metrics[a][-1]['val_bpb']:.4f} (step 6)" for a in ("gpt", "nag")]
    assert table_row(report, "val bpb (base_eval)") == [f"{evals[a]['val_bpb']:.4f}" for a in ("gpt", "nag")]
    # a partial score is labelled as such and never shown as CORE
    assert table_row(report, "CORE") == ["— (partial only)"] * 2
    assert table_row(report, "partial CORE (tasks scored)") == [f"{evals[a]['partial_core']:.4f} (2/22)" for a in ("gpt", "nag")]

    # every task: centred accuracy of both runs and the delta vs the first
    for task in ("mc_task", "schema_task"):
        g, n = evals["gpt"]["tasks"][task]["centered"], evals["nag"]["tasks"][task]["centered"]
        assert table_row(report, task) == [f"{g:+.4f}", f"{n:+.4f}", f"{n - g:+.4f}"]
    assert table_row(report, "gone_task") == ["missing", "missing", "—"]

    # config differences: only what differs
    assert table_row(report, "`--arch`") == ["gpt", "nag"]
    assert "`--depth`" not in report and "`model_config.n_layer`" not in report
    assert table_row(report, "`nag_config.mod_floor`")[0] == "—"

    for name in ("train_loss_vs_flops.png", "val_bpb_vs_flops.png", "gate_gain_by_depth.png", "gate_dead_branches.png"):
        data = open(os.path.join(os.path.dirname(path), name), "rb").read()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name
        assert f"]({name})" in report
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
    assert sorted(f for f in os.listdir(tmp_path / "solo") if f.endswith(".png")) == ["train_loss_vs_flops.png", "val_bpb_vs_flops.png"]


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
    json.dump(ev, open(os.path.join(run_dir, "eval.json"), "w"))
    return run_dir


def test_intervals_verdict_and_forest_plot(pair, tmp_path, capsys):
    # the tiny pair as trained: every delta gets its paired interval, as stats computes it from the records
    path = compare.main(["gpt", "nag", "--out", str(tmp_path / "real")])
    report = open(path).read()
    recs = {a: load_records(os.path.join(d, "core_records.parquet")) for a, d in pair["runs"].items()}
    r = stats.core_delta_interval(recs["gpt"][0], recs["nag"][0], recs["gpt"][1])
    for task in ("mc_task", "schema_task"):
        t = r["tasks"][task]
        assert table_row(report, f"`{task}`")[1:3] == [f"{t['ci'][0]:+.4f} … {t['ci'][1]:+.4f}", f"{t['p']:.3g}"]
    assert table_row(report, "**partial CORE (2/22)**")[:2] == [f"{r['delta']:+.4f}" + (" \\*" if r["ci"][0] > 0 or r["ci"][1] < 0 else ""),
                                                                f"{r['ci'][0]:+.4f} … {r['ci'][1]:+.4f}"]
    out = capsys.readouterr().out
    assert f"nag − gpt partial CORE (2/22) = {r['delta']:+.4f} (95% CI {r['ci'][0]:+.4f} … {r['ci'][1]:+.4f}" in out
    assert "at 5 items per task" in out and "(95% CI" in report
    evs = {a: json.load(open(os.path.join(d, "eval.json"))) for a, d in pair["runs"].items()}
    b = stats.bpb_delta_interval(evs["gpt"]["val_batches"]["nats"], evs["nag"]["val_batches"]["nats"], evs["gpt"]["val_batches"]["bytes"])
    assert b["delta"] == pytest.approx(evs["nag"]["val_bpb"] - evs["gpt"]["val_bpb"], rel=1e-9)
    assert f"nag − gpt val bpb = {b['delta']:+.4f} (95% CI {b['ci'][0]:+.4f} … {b['ci'][1]:+.4f}" in report and "on 4 shared val batches" in report
    data = open(tmp_path / "real" / "core_deltas.png", "rb").read()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000 and "](core_deltas.png)" in report

    # an edited copy that gets every mc_task item right where gpt's verdicts stay: the interval excludes 0
    better = edited_copy(pair, "gpt", tmp_path / "gpt-better", correct=lambda row: True if row["task"] == "mc_task" else row["correct"])
    report = open(compare.main(["gpt", better, "--out", str(tmp_path / "better")])).read()
    g = evs["gpt"]["tasks"]["mc_task"]
    delta = (1 - g["accuracy"]) / 0.75
    assert g["accuracy"] < 1 and table_row(report, "`mc_task`")[0] == f"{delta:+.4f} \\*"  # marked: the interval excludes 0
    assert table_row(report, "`schema_task`")[:3] == ["+0.0000", "+0.0000 … +0.0000", "1"]  # identical verdicts: no noise, p = 1
    assert "gpt#2 − gpt partial CORE (2/22) = " in report and ": distinguishable from noise at 5 items per task" in report
    # the usual CORE table shows the same deltas
    assert table_row(report, "mc_task")[2] == f"{delta:+.4f}"


def test_runs_on_other_items_or_without_records_are_refused(pair, tmp_path, script_error):
    other = edited_copy(pair, "nag", tmp_path / "limit", settings_edit=lambda s: s.update(max_per_task=3))
    assert "different CORE items or settings (--max-per-task -1 vs 3)" in script_error(compare.main, "gpt", other, "--out", str(tmp_path / "o"))
    other = edited_copy(pair, "nag", tmp_path / "items", items_edit=lambda r: "x" if r["task"] == "schema_task" and r["idx"] == 2 else r["item"])
    assert "the items of task schema_task differ" in script_error(compare.main, "gpt", other, "--out", str(tmp_path / "o"))
    other = edited_copy(pair, "nag", tmp_path / "shots", settings_edit=lambda s: s["tasks"]["mc_task"].update(num_fewshot=1))
    assert "task mc_task settings" in script_error(compare.main, "gpt", other, "--out", str(tmp_path / "o"))
    assert not os.path.exists(tmp_path / "o")  # refused before writing anything
    # an eval.json from before records were kept
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
    assert f"goes back to step {json.loads(lines[2])['step']}" in script_error(compare.main, run, "--out", str(tmp_path / "o"))
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
        return {"args": {"depth": 2}, "model_config": {"n_embd": 64},
                "optimizer": {"groups": [{"name": "lm_head", "kind": "adamw", "num_params": 10, "lr": 0.1, "betas": lm_head_betas}],
                              "muon_momentum": {"start": 0.85, "end": momentum_end}, "polar_norm_factor": 1.01}}
    runs = [{"name": "a", "config": config([0.8, 0.96], 0.9)}, {"name": "b", "config": config([0.8, 0.95], 0.9)}]
    section = compare.config_section(runs)
    assert "`optimizer.lm_head.betas`" in section and "[0.8, 0.95]" in section
    assert "polar_norm_factor" not in section and "muon_momentum" not in section  # equal: not listed
    runs[1]["config"]["optimizer"]["muon_momentum"]["end"] = 0.95
    assert "`optimizer.muon_momentum.end`" in compare.config_section(runs)
