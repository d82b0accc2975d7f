"""compare: the report of a tiny GPT / NAG pair trained on the same budget and evaluated by base_eval."""

import os
import json
import shutil

import pytest
import torch

from scripts import base_train, base_eval, compare

TINY = ["--depth", "2", "--model-dim", "64", "--head-dim", "32", "--max-seq-len", "64", "--device-batch-size", "4",
        "--total-batch-size", "256", "--eval-tokens", "512", "--warmup-steps", "2", "--nag-alpha-warmup-tokens", "1024",
        "--matrix-lr", "0.5", "--embedding-lr", "2.0", "--unembedding-lr", "0.1",
        "--num-iterations", "6", "--eval-every", "3", "--nag-gate-log-every", "2"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_bundle(root):
    """Two scored tasks (multiple choice, schema) and one listed in core.yaml without its file."""
    mc = [{"query": f"Document {i}. The", "choices": ["model is", "of and", "to"], "gold": i % 3} for i in range(5)]
    schema = [{"context_options": [f"The head {i}", f"The layer {i}"], "continuation": "is data.", "gold": i % 2} for i in range(5)]
    tasks = {"mc_task": ("multiple_choice", 25.0, mc), "schema_task": ("schema", 50.0, schema), "gone_task": ("multiple_choice", 25.0, None)}
    yaml, meta = ["icl_tasks:"], ["Eval Task,Random baseline"]
    os.makedirs(os.path.join(root, "eval_data", "t"))
    for label, (kind, baseline, items) in tasks.items():
        yaml += ["-", f"  label: {label}", f"  dataset_uri: t/{label}.jsonl", "  num_fewshot: [0]", f"  icl_task_type: {kind}"]
        meta.append(f"{label},{baseline}")
        if items:
            with open(os.path.join(root, "eval_data", "t", f"{label}.jsonl"), "w") as f:
                f.writelines(json.dumps(it) + "\n" for it in items)
    (root / "core.yaml").write_text("\n".join(yaml) + "\n")
    (root / "eval_meta_data.csv").write_text("\n".join(meta) + "\n")
    return str(root)


@pytest.fixture(scope="module")
def pair(tiny_base_dir, tmp_path_factory):
    """gpt and nag runs of the same 6-step budget, both evaluated (CORE on the fake bundle, bpb)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: a second thread only costs when the 2 cores are contended
    base = tmp_path_factory.mktemp("compare_base")
    for name in ("base_data", "tokenizer"):
        os.symlink(os.path.join(tiny_base_dir, name), base / name)
    bundle = write_bundle(tmp_path_factory.mktemp("bundle"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(base))
        runs = {}
        for arch in ("gpt", "nag"):
            runs[arch] = base_train.main(TINY + ["--arch", arch, "--run", arch])
            base_eval.main(["--run", arch, "--eval", "core,bpb", "--eval-bundle", bundle, "--split-tokens", "256",
                            "--device-batch-size", "4"])
        yield {"base": base, "runs": runs}
    torch.set_num_threads(before)


def copy_run(run_dir, dest, with_eval=False):
    os.makedirs(dest)
    for name in ("config.json", "metrics.jsonl") + (("eval.json",) if with_eval else ()):
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


def test_deltas_and_mismatched_subsets(pair, tmp_path):
    # the tiny pair scores the same on every task: edit a copy so that the deltas are not all zero
    edited = copy_run(pair["runs"]["nag"], tmp_path / "nag-edited", with_eval=True)
    ev = json.load(open(os.path.join(edited, "eval.json")))
    ev["tasks"]["mc_task"]["centered"] = 0.55
    ev["max_per_task"] = 10
    json.dump(ev, open(os.path.join(edited, "eval.json"), "w"))
    report = open(compare.main(["gpt", edited, "--out", str(tmp_path / "out")])).read()
    g = json.load(open(os.path.join(pair["runs"]["gpt"], "eval.json")))["tasks"]
    assert table_row(report, "mc_task") == [f"{g['mc_task']['centered']:+.4f}", "+0.5500", f"{0.55 - g['mc_task']['centered']:+.4f}"]
    shared = table_row(report, "**mean over the 2 tasks all runs scored**")
    mean_gpt = (g["mc_task"]["centered"] + g["schema_task"]["centered"]) / 2
    mean_nag = (0.55 + ev["tasks"]["schema_task"]["centered"]) / 2
    assert shared == [f"{mean_gpt:+.4f}", f"{mean_nag:+.4f}", f"{mean_nag - mean_gpt:+.4f}"]
    assert "different --max-per-task limits" in report and "at most 10 examples per task" in report


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
