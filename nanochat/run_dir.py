"""
Read and write a run directory's files other than checkpoints: config, metrics and evaluations.

The files of a run directory other than its checkpoints: config.json, metrics.jsonl and the evaluations
(eval/step_NNNNNN.* per evaluated step, and eval.json, core_records.parquet and core_tasks.csv at the top,
copies of the highest step evaluated), read and written here only. docs/runs.md lists them. Also the one rule of
every results folder (an evaluated step here, a report or an analysis elsewhere): a result is replaced only by
one of the same inputs; one of other inputs or settings moves to replaced/ first, never deleted.

metrics.jsonl holds one JSON object with an integer step per line, appended as training goes. A kill in the
middle of a write leaves a torn last line, one that does not parse: every reader here skips it (read_metrics
with a note) or hands it back with step None (metrics_lines, for keep_history to move aside). A bad line
anywhere else is an error naming the file and the line.
"""

import io
import os
import re
import csv
import json
import time
import shutil
import hashlib
import tempfile
import contextlib

from nanochat.common import UserError, print0, get_base_dir, atomic_write_bytes, atomic_write_json, ensure_writable_dir
from nanochat.core_eval import load_records, save_records

METRICS = "metrics.jsonl"
CONFIG = "config.json"
EVAL_JSON = "eval.json"
EVAL_DIR = "eval"  # one set of files per evaluated step
RECORDS = "core_records.parquet"
CSV = "core_tasks.csv"
TOP = {"json": EVAL_JSON, "records": RECORDS, "csv": CSV}  # copies of the highest step evaluated
STEP_FILE = re.compile(r"step_(\d+)\.json")  # a step's results in eval/: step_000123.json
PENDING = os.path.join(EVAL_DIR, "pending")  # a step's new results while an earlier complete one stays in place
REPLACED = "replaced"  # in a results folder: earlier results of other inputs or settings, never deleted
# in a report or analysis folder: the tool, its inputs, the files it wrote there and their sha256
MANIFEST = "inputs.json"


# ---------------------------------------------------------------------------
# metrics.jsonl


def metrics_entries(path):
    """(line number, row, text) of each non-blank line of a metrics.jsonl, row None for a torn last line.
    A generator, so that a reader's own checks of earlier lines come before an error in a later one."""
    with open(path, "rb") as f:
        lines = [(lineno, raw) for lineno, raw in enumerate(f, 1) if raw.strip()]
    for k, (lineno, raw) in enumerate(lines):
        text = raw.decode("utf-8", "replace")
        text = text if text.endswith("\n") else text + "\n"
        try:
            row = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            if k == len(lines) - 1:
                yield lineno, None, text
                return
            raise UserError(f"{path} line {lineno}: malformed JSON") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise UserError(f"{path} line {lineno}: expected a JSON object with an integer step")
        yield lineno, row, text


def torn_note(path, lineno):
    return f"{path} line {lineno} is torn (a write cut short) and was skipped"


def read_metrics(path):
    """(rows, notes) of metrics.jsonl, a torn last line skipped with a note. Steps must increase: a repeated
    or earlier step means two processes wrote the run, or a resume went wrong."""
    if not os.path.exists(path):
        raise UserError(f"{path} is missing; is {os.path.dirname(path)} a run directory written by scripts.base_train?")
    rows, notes = [], []
    for lineno, row, _ in metrics_entries(path):
        if row is None:
            notes.append(torn_note(path, lineno))
            continue
        if rows and row["step"] <= rows[-1]["step"]:
            kind = "repeats" if any(r["step"] == row["step"] for r in rows) else "goes back to"
            raise UserError(
                f"{path} line {lineno} {kind} step {row['step']} (after step {rows[-1]['step']}): "
                "the log mixes two writers or an undone resume; restore it before comparing"
            )
        rows.append(row)
    if not rows:
        raise UserError(f"{path} has no rows; the run logged no step")
    return rows, notes


def metrics_lines(path):
    """[(step, line ending in a newline)] of metrics.jsonl as written, a torn last line with step None; [] without the
    file."""
    if not os.path.exists(path):
        return []
    return [(None if row is None else row["step"], text) for _, row, text in metrics_entries(path)]


def rows_with(path, key):
    """The metrics.jsonl rows that carry key, in step order (a restarted run's repeats: the last wins)."""
    rows = {}
    for _, row, _ in metrics_entries(path):
        if row is not None and key in row:
            rows[row["step"]] = row
    return [rows[s] for s in sorted(rows)]


def keep_history(metrics_path, step):
    """Rows past the checkpoint we restart from (and a torn last line) move to metrics.jsonl.bak-<step>,
    appended, never deleted; metrics.jsonl then reads like an uninterrupted run up to that step."""
    rows = metrics_lines(metrics_path)
    last_kept = step if step > 0 else -1  # a fresh start writes its own step-0 row
    keep = [line for s, line in rows if s is not None and s <= last_kept]
    drop = [line for s, line in rows if s is None or s > last_kept]
    if not drop:
        return
    bak = f"{metrics_path}.bak-{step}"
    with open(bak, "a") as f:
        f.writelines(drop)
    atomic_write_bytes(metrics_path, "".join(keep).encode())
    print0(
        f"note: {len(drop)} earlier row(s) of metrics.jsonl "
        f"{'past step ' + str(step) if step else ''} kept in {os.path.basename(bak)}"
    )


def append_row(metrics_path, row):
    with open(metrics_path, "a") as f:
        f.write(json.dumps(row) + "\n")


# ---------------------------------------------------------------------------
# reading a run


def run_path(name, base_dir=None):
    """<base>/runs/<name>: where the run of that name lives (base: $NANOCHAT_BASE_DIR unless given)."""
    return os.path.join(base_dir or get_base_dir(), "runs", name)


def resolve_run_dir(run):
    """A run name is one path component, looked up under $NANOCHAT_BASE_DIR/runs; anything with a path
    separator is taken as a directory (relative to the current one). The same rule in every script."""
    if os.sep in run or (os.altsep and os.altsep in run):
        return os.path.normpath(os.path.abspath(run))
    if run in ("", ".", ".."):
        raise UserError(f"{run!r} is not a run name; give a name like gpt-d20, or a directory path like ./runs/gpt-d20")
    return run_path(run)


def existing_run_dir(run):
    path = resolve_run_dir(run)
    if not os.path.isdir(path):
        raise UserError(
            f"no run directory {path}; give a run name under {os.path.join(get_base_dir(), 'runs')} or a path"
        )
    return os.path.normpath(path)


def metrics_path(run_dir):
    return os.path.join(run_dir, METRICS)


def read_json(path, fix=None, missing_ok=False):
    """A JSON file's content, None where it is absent and missing_ok. Every JSON file of a run is read here: a missing,
    unreadable or damaged one is one line naming it (and `fix`: what to do about it), never a traceback."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        if missing_ok:
            return None
        why = "is missing"
    except OSError as e:
        why = f"cannot be read ({e.strerror or e})"
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        why = f"is not valid JSON ({e})"
    raise UserError(f"{path} {why}" + (f"; {fix}" if fix else "")) from None


def read_record(path):
    """A results json as a dict, or None when absent or unreadable (then it is rewritten from scratch)."""
    try:
        record = read_json(path, missing_ok=True)
    except UserError:
        return None
    return record if isinstance(record, dict) else None


def read_config(run_dir, fix="restore it from a copy", missing_ok=False):
    """A run's config.json ({} where it has none and missing_ok); missing or damaged, one line naming it and `fix`."""
    path = os.path.join(run_dir, CONFIG)
    if not missing_ok and not os.path.exists(path):
        raise UserError(f"{path} is missing; is {run_dir} a run directory written by scripts.base_train?")
    config = read_json(path, fix, missing_ok=True)
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise UserError(f"{path} is not a run's config (a JSON object); {fix}")
    return config


def read_eval(run_dir):
    """A run's eval.json (its highest evaluated step), None where it has none; damaged, one line."""
    path = os.path.join(run_dir, EVAL_JSON)
    ev = read_json(path, missing_ok=True)
    if ev is not None and not isinstance(ev, dict):
        raise UserError(f"{path} is not an evaluation record (a JSON object); rerun scripts.base_eval")
    return ev


def earlier_version(path, what, fix):
    """The one line for a file of a format this version never writes: what it is, and that it is not read."""
    return UserError(
        f"{path} is {what}, written by an earlier version of this code, which this one does not read; {fix}"
    )


def headline(run):
    """One line of a run's evaluated figures at full precision (val bpb, CORE or partial CORE): what docs/LOG.md
    compares bit for bit between runs of the same seed (runs/runcpu.sh ends with one per run)."""
    run_dir = existing_run_dir(run)
    ev = read_eval(run_dir) or {}
    core = (
        ("CORE", ev["core_metric"]) if ev.get("core_metric") is not None else ("partial CORE", ev.get("partial_core"))
    )
    tasks = f" ({ev['num_tasks_scored']} tasks)" if ev.get("num_tasks_scored") else ""
    return f"{os.path.basename(run_dir)}: val bpb {ev.get('val_bpb')!r}, {core[0]} {core[1]!r}{tasks}"


def load_core_records(run_dir, ev):
    """(columns, settings) of the run's CORE records, or None when eval.json has no CORE results.
    Records missing, damaged, or not of this eval.json are errors."""
    if not ev or not ev.get("tasks"):
        return None
    path = os.path.join(run_dir, RECORDS)
    if not ev.get("core_records"):
        raise earlier_version(
            os.path.join(run_dir, EVAL_JSON),
            "an evaluation with CORE scores but no per-example records",
            f"rerun `python -m scripts.base_eval --run {run_dir} --eval core`",
        )
    if not os.path.exists(path):
        raise UserError(
            f"{run_dir} has CORE scores but no per-example records ({os.path.basename(path)}), so no interval can be "
            f"computed; rerun `python -m scripts.base_eval --run {run_dir} --eval core`"
        )
    cols, settings = load_records(path)
    if settings.get("step") != ev.get("step") or set(settings.get("tasks", {})) != set(ev["tasks"]):
        raise UserError(
            f"{path} does not belong to eval.json next to it (other step or tasks); rerun scripts.base_eval"
        )
    return cols, settings


def history_files(run_dir):
    """The results json of every evaluated step, by name (so by step)."""
    folder = os.path.join(run_dir, EVAL_DIR)
    names = sorted(f for f in os.listdir(folder) if STEP_FILE.fullmatch(f)) if os.path.isdir(folder) else []
    return [os.path.join(folder, f) for f in names]


def evaluated_steps(run_dir):
    return sorted(int(STEP_FILE.fullmatch(os.path.basename(p))[1]) for p in history_files(run_dir))


def check_layout(run_dir, ev):
    """eval.json is a copy of an evaluated step's eval/step_*.json: one without it is of the layout of one eval.json
    per run, before eval/ kept each step's results."""
    step = ev.get("step") if ev else None
    if isinstance(step, int) and not os.path.exists(os.path.join(run_dir, step_files(step)["json"])):
        raise earlier_version(
            os.path.join(run_dir, EVAL_JSON),
            f"an evaluation of step {step} without its {step_files(step)['json']}",
            f"move it aside and rerun `python -m scripts.base_eval --run {run_dir} --step {step}`",
        )


def eval_history(run_dir, ev):
    """[(step, record)] of every evaluated step, by step: eval/step_*.json (eval.json is a copy of the highest)."""
    check_layout(run_dir, ev)
    by_step = {}
    for path in history_files(run_dir):
        rec = read_json(path)
        if not isinstance(rec, dict):
            raise UserError(f"{path} is not an evaluation record (a JSON object); rerun scripts.base_eval at that step")
        step = (
            rec.get("step") if isinstance(rec.get("step"), int) else int(STEP_FILE.fullmatch(os.path.basename(path))[1])
        )
        by_step[step] = rec
    return sorted(by_step.items())


def eval_files(run_dir):
    """The files a run's evaluation numbers come from."""
    named = [os.path.join(run_dir, f) for f in (EVAL_JSON, RECORDS)]
    return [p for p in named if os.path.isfile(p)] + history_files(run_dir)


def load_run(arg):
    """Everything a comparison reads of one run (a name or a path): its directory, name, config, metrics rows,
    eval.json, evaluated steps, CORE records, and notes on what was skipped reading them."""
    run_dir = existing_run_dir(arg)
    config = read_config(run_dir)
    metrics, notes = read_metrics(metrics_path(run_dir))
    ev = read_eval(run_dir)
    vb = (ev or {}).get("val_batches")
    if (ev or {}).get("val_bpb") is not None and not (isinstance(vb, dict) and vb.get("nats")):
        raise earlier_version(
            os.path.join(run_dir, EVAL_JSON),
            "an evaluation of val bpb without its per-batch val losses",
            f"rerun `python -m scripts.base_eval --run {run_dir} --eval bpb`",
        )
    return {
        "dir": run_dir,
        "name": config.get("run") or os.path.basename(run_dir),
        "config": config,
        "metrics": metrics,
        "eval": ev,
        "history": eval_history(run_dir, ev),
        "records": load_core_records(run_dir, ev),
        "read_notes": notes,
    }


# ---------------------------------------------------------------------------
# writing evaluations: eval/step_NNNNNN.* per evaluated step, and top-level copies of the highest one


def core_csv(tasks):
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["task", "accuracy", "centered", "num_examples"])
    for label, r in tasks.items():
        w.writerow([label, r["accuracy"], r["centered"], r["num_examples"]])
    return buf.getvalue()


def step_files(step):
    """The run-dir-relative names of one step's results: its json, CORE records and per-task CSV."""
    stem = os.path.join(EVAL_DIR, f"step_{step:06d}")
    return {"json": stem + ".json", "records": f"{stem}_{RECORDS}", "csv": f"{stem}_{CSV}"}


def mergeable(old, new):
    """Whether results measured with fingerprints `old` may be merged with ones measured with `new`: the same
    tokenizer, and the same data where both know it. Results without fingerprints (from before they were
    recorded) may not: nothing says what they were measured with."""
    if not isinstance(old, dict) or old.get("tokenizer") != new["tokenizer"]:
        return False
    return all(old.get(k) is None or v is None or old[k] == v for k, v in new.items())


def previous_results(run_dir, step, fingerprints):
    """The earlier results of this step, to keep the sections not re-run, else {}. Results measured with another
    tokenizer or data are not merged with the new ones: their files move to eval/replaced/ (never deleted)."""
    old = read_record(os.path.join(run_dir, step_files(step)["json"]))
    if old is None or old.get("step") != step:
        return {}
    if mergeable(old.get("fingerprints"), fingerprints):
        return old
    dest = set_aside(os.path.join(run_dir, EVAL_DIR), step_names(run_dir, step))
    print0(
        f"note: the results of step {step} were measured with other fingerprints ({old.get('fingerprints')}, now "
        f"{fingerprints}): they are replaced, not merged, and kept in {os.path.relpath(dest, run_dir)}/"
    )
    return {}


def step_names(run_dir, step, folder=EVAL_DIR):
    """The names of one step's files that exist in folder (eval/ or eval/pending/)."""
    names = [os.path.basename(n) for n in step_files(step).values()]
    return [n for n in names if os.path.exists(os.path.join(run_dir, folder, n))]


def read_pending(run_dir, step, fingerprints):
    """The results of a step staged in eval/pending/ by an evaluation that did not finish, when measured with these
    fingerprints (so a rerun may resume them), else {}."""
    old = read_record(os.path.join(run_dir, PENDING, os.path.basename(step_files(step)["json"])))
    ok = old is not None and old.get("step") == step and mergeable(old.get("fingerprints"), fingerprints)
    return old if ok else {}


def write_results(run_dir, record, records=None, settings=None, pending=False):
    """Write one step's results into eval/ (its CORE records first, when given, with the settings), then the
    top-level copies when it is the highest step evaluated; pending: into eval/pending/ instead, no copies (an
    earlier complete result stays in place until commit_pending). Every file is written atomically."""
    step = record["step"]
    folder = os.path.join(run_dir, PENDING if pending else EVAL_DIR)
    path = {k: os.path.join(folder, os.path.basename(v)) for k, v in step_files(step).items()}
    if records is not None:
        meta = {**settings, "step": step, "run": record["run"], "fingerprints": record["fingerprints"]}
        save_records(path["records"], records, meta, atomic_write_bytes)
    elif record["core_records"] is None and os.path.exists(path["records"]):
        os.remove(path["records"])  # records of an earlier CORE run no longer described by the json
    # rewritten every time, so it always matches the json (a header alone when CORE has no results)
    atomic_write_bytes(path["csv"], core_csv(record["tasks"]).encode())
    atomic_write_json(path["json"], record)
    if not pending:
        copy_to_top(run_dir, record)


def commit_pending(run_dir, record, with_records, replaced_why=None):
    """Move a finished evaluation's files from eval/pending/ into eval/ (its CORE records only when it scored CORE:
    else the ones in place still belong to the json), then the top-level copies. replaced_why: the earlier files
    were measured with other settings, so they move to eval/replaced/ first, with a line saying why."""
    step = record["step"]
    eval_dir = os.path.join(run_dir, EVAL_DIR)
    if replaced_why:
        # CORE records the new json keeps (CORE not scored again) stay in place; the replaced folder gets a copy
        kept = [] if with_records or not record["core_records"] else [os.path.basename(step_files(step)["records"])]
        dest = set_aside(eval_dir, [n for n in step_names(run_dir, step) if n not in kept])
        for name in kept:
            if os.path.exists(os.path.join(eval_dir, name)):
                shutil.copy2(os.path.join(eval_dir, name), os.path.join(dest, name))
        print0(
            f"note: the earlier results of step {step} were measured with other settings ({replaced_why}); "
            f"they are kept in {os.path.relpath(dest, run_dir)}/"
        )
    names = step_files(step)
    if not with_records and record["core_records"] is None and os.path.exists(os.path.join(run_dir, names["records"])):
        os.remove(os.path.join(run_dir, names["records"]))  # as write_results does: no json describes them now
    for key, name in names.items():
        src = os.path.join(run_dir, PENDING, os.path.basename(name))
        if os.path.exists(src) and (key != "records" or with_records):
            os.replace(src, os.path.join(run_dir, name))
    # CORE records of an earlier unfinished run: no json describes them now
    for name in step_names(run_dir, step, PENDING):
        os.remove(os.path.join(run_dir, PENDING, name))
    with contextlib.suppress(OSError):  # emptied: no folder left behind (one still holding another step's files stays)
        os.rmdir(os.path.join(run_dir, PENDING))
    copy_to_top(run_dir, record)


def copy_to_top(run_dir, record):
    """eval.json, core_tasks.csv and core_records.parquet: copies of the step's files, when it is the highest one."""
    step = record["step"]
    if step < max(evaluated_steps(run_dir)):
        return  # an earlier step: the top-level copies stay those of the highest one
    names = step_files(step)
    top = {k: os.path.join(run_dir, v) for k, v in TOP.items()}
    if record["core_records"]:
        with open(os.path.join(run_dir, names["records"]), "rb") as f:
            atomic_write_bytes(top["records"], f.read())
    elif os.path.exists(top["records"]):
        os.remove(top["records"])  # a copy of another step's records (its own file in eval/ stays)
    atomic_write_bytes(top["csv"], core_csv(record["tasks"]).encode())
    atomic_write_json(top["json"], record)


# ---------------------------------------------------------------------------
# results folders (a report, an analysis): what a tool wrote there, and what it may replace


def folder_name(named_steps):
    """The name of a default results folder, after what it holds: <name>@<step>_vs_<name>@<step>..."""
    return "_vs_".join(f"{name.replace(os.sep, '_')}@{step}" for name, step in named_steps)


def set_aside(folder, names):
    """Move folder's files `names` into folder/replaced/<time stamp>/, never deleted; that folder's path."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest, k = os.path.join(folder, REPLACED, stamp), 1
    while os.path.exists(dest):  # two replacements within a second
        k += 1
        dest = os.path.join(folder, REPLACED, f"{stamp}-{k}")
    os.makedirs(dest)
    for name in names:
        os.replace(os.path.join(folder, name), os.path.join(dest, name))
    return dest


def read_manifest(folder):
    """The manifest of a results folder ({"tool", "inputs", "files", "sha256"}), or None (none, unreadable, or not
    a manifest: then no tool's files are there)."""
    m = read_record(os.path.join(folder, MANIFEST))
    return m if m is not None and "tool" in m else None


def folder_entries(folder):
    """What a results folder holds, without replaced/ and hidden names (temp files of a write cut short)."""
    if not os.path.isdir(folder):
        return []
    return sorted(n for n in os.listdir(folder) if n != REPLACED and not n.startswith("."))


def own_files(folder, tool):
    """The files of folder that `tool` wrote there (its manifest lists them), or [] when it is not the tool's."""
    m = read_manifest(folder)
    if m is None or m["tool"] != tool:
        return []
    listed = set(m.get("files") or []) | {MANIFEST}
    return [n for n in folder_entries(folder) if n in listed]


def file_sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def changed_files(folder, names, hashes):
    """Those of names (files in folder) that no longer hold what the tool wrote: their sha256 differs from the one
    recorded (hashes), or none was (a manifest from before the hashes, another writer's file): a user's edit, say."""
    hashes = hashes if isinstance(hashes, dict) else {}
    return [n for n in names if n != MANIFEST and hashes.get(n) != file_sha256(os.path.join(folder, n))]


def input_changes(old, new):
    """What differs between two tools' inputs, in words."""
    old = old if isinstance(old, dict) else {}
    keys = sorted(set(old) | set(new), key=lambda k: (k != "runs", k))
    return "; ".join(
        "other runs or evaluations" if k == "runs" else f"{k} {json.dumps(old.get(k))} → {json.dumps(new.get(k))}"
        for k in keys
        if old.get(k) != new.get(k)
    )


def check_folder_path(folder):
    """A results folder is a folder: a file at its path (or at a path above it) is one line saying so, whatever
    --force says, before any work."""
    there = os.path.abspath(folder)
    while not os.path.lexists(there) and os.path.dirname(there) != there:
        there = os.path.dirname(there)
    if os.path.isdir(there):
        return
    what = "a file, not a folder" if os.path.isfile(there) else "not a folder"
    where = "it" if there == os.path.abspath(folder) else there
    raise UserError(f"cannot write to {folder}: {where} is {what} (the results go into a folder); choose another --out")


def claim_folder(folder, tool, inputs, force=False):
    """May `tool` write its results of `inputs` into folder? Yes when it is new or empty, or holds only the tool's own
    files (its manifest); else one line pointing at --out and --force (with --force: write there, replacing files of
    the names it writes, like scripts.export_hf). Returns the tool's files there that publish() moves to replaced/: all
    of them for other inputs; for the same inputs, those changed since the tool wrote them (their sha256 no longer the
    manifest's: a user's edit of report.md is kept, never overwritten); the others are simply rewritten. Checked before
    any work."""
    check_folder_path(folder)
    entries = folder_entries(folder)
    ours = own_files(folder, tool)
    foreign = [n for n in entries if n not in ours]
    if foreign and not force:
        listed = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UserError(
            f"{folder} holds files that `python -m {tool}` did not write ({listed}); choose another --out, or add "
            "--force to write there (its files of the names written are replaced)"
        )
    m = read_manifest(folder)
    if not ours or m["inputs"] != inputs:
        return ours
    return changed_files(folder, ours, m.get("sha256"))


def publish(tmp, folder, tool, inputs, aside):
    """Move results made in tmp into folder: the tool's files there that claim_folder set aside (of other inputs, or
    changed since it wrote them) to replaced/ first, with a line saying so; then the manifest, listing the new files and
    the tool's others still there with the sha256 of each; then the files. The manifest goes first: a move cut short is
    still known as of these inputs (and a file it did not move yet, by its hash, as not the tool's latest)."""
    os.makedirs(folder, exist_ok=True)
    old = read_manifest(folder) or {}
    if aside:
        other_inputs = old.get("inputs") != inputs
        dest = set_aside(folder, aside)
        if other_inputs:
            print(
                f"note: {folder} held results of other inputs "
                f"({input_changes(old.get('inputs'), inputs)}); they are kept in {dest}/"
            )
        else:
            print(
                f"note: {', '.join(aside)} in {folder} changed since `python -m {tool}` wrote "
                f"{'it' if len(aside) == 1 else 'them'} (an edit is never overwritten); kept in {dest}/"
            )
    new = sorted(os.listdir(tmp))
    kept = [n for n in own_files(folder, tool) if n != MANIFEST]
    recorded = old.get("sha256") if isinstance(old.get("sha256"), dict) else {}
    hashes = {
        **{n: recorded.get(n) or file_sha256(os.path.join(folder, n)) for n in kept},
        **{n: file_sha256(os.path.join(tmp, n)) for n in new},
    }
    atomic_write_json(
        os.path.join(folder, MANIFEST),
        {"tool": tool, "inputs": inputs, "files": sorted(set(new) | set(kept)), "sha256": hashes},
    )
    for name in new:
        os.replace(os.path.join(tmp, name), os.path.join(folder, name))


@contextlib.contextmanager
def staging(folder):
    """A temp folder next to folder, for results made whole before publish() moves them in; removed afterwards, so
    an interrupted or failed run leaves folder as it was. A write that fails there (a full disk: the figure writer's
    OSError, say) is one line naming the folder, with nothing of the results left behind."""
    parent = os.path.dirname(os.path.abspath(folder))
    ensure_writable_dir(parent)
    tmp = None
    try:
        tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(os.path.abspath(folder))}-tmp-")
        yield tmp
    except OSError as e:
        raise UserError(
            f"cannot write the results to {folder} ({e.strerror or e}): nothing of them was kept; free space "
            "and run the command again"
        ) from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
