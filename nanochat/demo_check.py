"""The CPU demo's four figures against runs/runcpu_expected.json (tolerances: docs/runs.md)."""

import platform

from nanochat.run_dir import existing_run_dir, headline, load_core_records, read_config, read_eval, read_json


def core_step(run_dir, ev):
    """The most one example moves the run's (partial) CORE: one example of a task of n items moves its accuracy by
    1/n and its centred accuracy by 1/(n·(1−b)), b the task's random baseline; CORE is the mean over the T tasks
    scored. So max over the tasks of 1/(T·n·(1−b)); None without CORE results."""
    loaded = load_core_records(run_dir, ev)
    if loaded is None:
        return None
    baselines = {label: task["random_baseline"] / 100 for label, task in loaded[1]["tasks"].items()}
    T = len(ev["tasks"])
    return max(1 / (T * task["num_examples"] * (1 - baselines[label])) for label, task in ev["tasks"].items())


def demo_figures(run):
    """What compare_expected reads of one run: its figures, the core_step of its partial CORE, and what the figures
    depend on (settings, tokenizer, torch) from config.json and eval.json."""
    run_dir = existing_run_dir(run)
    ev, config = read_eval(run_dir) or {}, read_config(run_dir)
    return {
        "val_bpb": ev.get("val_bpb"),
        "partial_core": ev.get("partial_core"),
        "core_tasks": sorted(ev.get("tasks") or {}),
        "max_per_task": ev.get("max_per_task"),
        "core_step": core_step(run_dir, ev),
        "settings": {
            "target_flops": config.get("args", {}).get("target_flops"),
            "seed": config.get("seed"),
            "data_seed": config.get("data_seed"),
        },
        "tokenizer": config.get("fingerprints", {}).get("tokenizer"),
        "torch": config.get("versions", {}).get("torch"),
    }


def compare_expected(figures, expected, python_version):
    """(verdict, lines) of runs' figures ({run: demo_figures(run)}) against an expected-figures file's content
    (runs/runcpu_expected.json; docs/runs.md, "What reproducible means", says why its tolerances are what they are).
    verdict: "as expected" (each figure compared within its tolerance), "differs" (the lines say by how much and what
    to check) or "not applicable" (other runs, training settings or corpus than the expected figures are of: nothing
    compares). A partial CORE of other tasks or another max_per_task is not compared; the val bpb still is."""
    want = expected["runs"]
    if sorted(figures) != sorted(want):
        return "not applicable", [
            f"the expected figures are of {' and '.join(want)} at runcpu.sh's defaults; {', '.join(figures)} are "
            "other runs (SEEDS names them by seed)"
        ]

    def shown(k, v):  # a float as 1e+13, not as its repr 10000000000000.0
        return f"{k} {v:g}" if isinstance(v, float) else f"{k} {v!r}"

    for run, fig in figures.items():
        other = [shown(k, fig["settings"][k]) for k, v in expected["settings"].items() if fig["settings"][k] != v]
        if other:
            wanted = ", ".join(shown(k, v) for k, v in expected["settings"].items())
            return "not applicable", [f"{run} has {', '.join(other)}; the expected figures are for {wanted}"]
        if fig["tokenizer"] != expected["tokenizer"]:
            return "not applicable", [
                f"{run}'s tokenizer is {fig['tokenizer']}, not {expected['tokenizer']}: it was trained on another "
                f"corpus. The offline corpus is this Python's standard-library docs ({python_version} here, the "
                f"expected figures' {expected['python']}), and a downloaded ClimbMix is another corpus altogether"
            ]
        if fig["val_bpb"] is None:
            return "not applicable", [f"{run} has no val bpb: it is not evaluated"]
    lines, beyond = [], False
    bpb_tol = expected["val_bpb_tolerance"]
    for run, fig in figures.items():
        d = fig["val_bpb"] - want[run]["val_bpb"]
        beyond |= abs(d) > bpb_tol
        lines.append(f"{run} val bpb {d:+.1e} from the expected {want[run]['val_bpb']!r} (tolerance ±{bpb_tol:g})")
        if fig["max_per_task"] != expected["max_per_task"]:
            lines.append(
                f"{run} partial CORE not compared: max_per_task {fig['max_per_task']}, the expected figure's "
                f"{expected['max_per_task']}"
            )
            continue
        if fig["core_tasks"] != want[run]["core_tasks"]:
            lines.append(
                f"{run} partial CORE not compared: {len(fig['core_tasks'])} tasks scored, the expected figure's "
                f"{len(want[run]['core_tasks'])} (the CORE bundle differs, or was not there)"
            )
            continue
        d = fig["partial_core"] - want[run]["partial_core"]
        tol = expected["core_examples"] * fig["core_step"]
        beyond |= abs(d) > tol * (1 + 1e-9)  # a flip of exactly that many examples is within
        examples = "one example" if expected["core_examples"] == 1 else f"{expected['core_examples']} examples"
        lines.append(
            f"{run} partial CORE {d:+.5f} from the expected {want[run]['partial_core']!r} (tolerance ±{tol:.5f}: "
            f"{examples} of the coarsest of its {len(fig['core_tasks'])} tasks)"
        )
    if not beyond:
        return "as expected", lines
    torch_note = {fig["torch"] for fig in figures.values()} - {expected["torch"]}
    lines.append(
        "what to check: that the venv holds requirements.lock's versions (bash runs/setup_env.sh installs them"
        + (f"; these runs used torch {', '.join(sorted(torch_note))}" if torch_note else "")
        + f"), and the torch build: the expected figures are of torch {expected['torch']} (PyTorch's CPU build) on "
        f"{expected['machine']}"
    )
    return "differs", lines


def check_expected(runs, expected_path):
    """The lines runs/runcpu.sh ends with: each run's headline, then the verdict of compare_expected against
    expected_path and its lines."""
    expected = read_json(expected_path, "it ships with the repository; restore it from git")
    verdict, lines = compare_expected({run: demo_figures(run) for run in runs}, expected, platform.python_version())
    return [headline(run) for run in runs] + [f"against {expected_path}: {verdict}"] + [f"  {x}" for x in lines]
