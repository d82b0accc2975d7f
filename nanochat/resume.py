"""
Where a run starts again, and what may differ when it does.

A run resumes from a complete checkpoint (nanochat/checkpoint_manager.py) with the arch, model and total batch it
was planned with, the same tokenizer and data, and the same settings, the flags that change what it learns.
RESUME_TABLE says, flag by flag, what a resume may change: the flags that are no setting (where and how often a run
reports and saves, how it is launched: NOT_SETTINGS) change freely; --change-settings accepts the settings, the
horizon included, and config.json's segments record each change from the step it applies to; the flags that fix the
model's parameters and shapes, the batch or the initialisation no resume can change. An arch registry adds its own
archs' free flags to not_settings; an arch flag that adds or removes parameters is refused by comparing the model the
command builds with the checkpoint's (parameter_changes), so this file names no arch.

A resume goes on with the run as it was at its checkpoint (run_at: the checkpoint's own record, so config.json may be
lost): every setting the command line does not state is the run's there, changes accepted earlier included
(continued_args); a stated one that differs is a change. Resuming from an earlier step drops the history after it.
"""

import argparse
import os

from nanochat.common import UserError
from nanochat import checkpoint_manager as ckpt
from nanochat import run_dir as run_files

# what must match for a resume. The process count may change: the train data is cut into world_size × grad_accum
# shards, a number fixed by the total and device batch sizes, and each shard's loader state moves to its new owner
RESUME_KEYS = ("arch", "model_config", "total_batch_size")
HORIZON = frozenset({"num_iterations", "target_flops", "target_param_data_ratio"})  # checked as the planned step count

# What a resume may change: (kind, flags, what then happens), every flag of the baseline's parser once
# (tests/test_resume_settings.py checks that). A new value of an "optimizer" flag is what the optimizer steps with
# from the resumed step on: load_state_dicts (nanochat/optim.py) restores the moments and buffers only, never the
# saved LRs or decays, and the schedules scale the new values as on a fresh run.
FREE, OPTIMIZER, TRAINING, REFUSED_KIND = "free", "optimizer", "training", "refused"
RESUME_TABLE = (
    (
        FREE,
        (
            "run",
            "resume",
            "dry_run",
            "change_settings",
            "preset",
            "device_type",
            "gpu",
            "gpu_memory",
            "attn",
            "eval_every",
            "eval_tokens",
            "save_every",
            "log_every",
            "log_to",
            "step_timeout",
        ),
        "changes no number the run trains: may differ on any resume",
    ),
    (
        OPTIMIZER,
        ("embedding_lr", "unembedding_lr", "matrix_lr", "weight_decay"),
        "with --change-settings: the optimizer groups step with the new value from the resumed step on",
    ),
    (
        TRAINING,
        tuple(sorted(HORIZON)),
        "with --change-settings: the new horizon (planned step count) stretches or cuts the schedules",
    ),
    (
        TRAINING,
        ("warmup_steps", "warmdown_ratio", "final_lr_frac"),
        "with --change-settings: the LR schedule from the resumed step on",
    ),
    (TRAINING, ("data_seed",), "with --change-settings: the order of the train documents from the resumed step on"),
    (TRAINING, ("fp8",), "with --change-settings: fp8 matmuls from the resumed step on (no flag turns them off)"),
    (
        REFUSED_KIND,
        ("arch", "depth", "model_dim", "head_dim", "n_kv_head", "max_seq_len", "window_pattern"),
        "it builds another model than the checkpoint holds",
    ),
    (
        REFUSED_KIND,
        ("total_batch_size", "device_batch_size"),
        "the train data is cut into total batch ÷ device batch shards, each with its own saved reading position",
    ),
    (REFUSED_KIND, ("seed",), "it seeds the initialisation, which the checkpoint's weights and RNG state replace"),
)
# flags that change no number a run trains: where and how often it reports and saves, how it is launched
NOT_SETTINGS = frozenset(f for kind, flags, _ in RESUME_TABLE if kind == FREE for f in flags) | HORIZON
# {flag: why no resume can change it}
REFUSED = {f: why for kind, flags, why in RESUME_TABLE if kind == REFUSED_KIND for f in flags}
# what a checkpoint's meta repeats of config.json (beside its arch, model config, fingerprints and process count), so
# that the run as it was at that step is known without config.json, and exactly where later starts changed it since
RUN_KEYS = ("args", "num_iterations", "total_batch_size", "grad_accum_steps")


def flag(key):
    return f"--{key.replace('_', '-')}"


def settings_changes(then, record, defaults, not_settings):
    """{flag: (then, now)} for every setting that differs from the run's at the checkpoint (then: run_at's; model,
    optimizer, schedule, data); none where the checkpoint's settings are unknown. defaults: the parser's defaults (a
    flag newer than the run ran with its default)."""
    if "args" not in then:
        return {}
    then, now = then["args"], record["args"]
    then = {k: then.get(k, defaults.get(k)) for k in now}
    return {flag(k): (then[k], now[k]) for k in sorted(set(now) - not_settings) if then[k] != now[k]}


def settings_segments(old_cfg, then, record, start, defaults, not_settings):
    """config.json's history of settings: one segment per start with other settings or another commit, oldest first.
    A start at `start` replaces every segment from that step on: the history describes the run that now exists."""
    segments = [s for s in old_cfg.get("segments", []) if s["start_step"] < start] or [
        {
            "start_step": 0,
            # config.json's own where it predates segments; null where it was lost (who started the run is unknown)
            "command": old_cfg.get("command", None if start else record["command"]),
            "git_commit": old_cfg.get("git_commit", None if start else record["git_commit"]),
        }
    ]
    changes = {k: {"then": a, "now": b} for k, (a, b) in settings_changes(then, record, defaults, not_settings).items()}
    # the horizon (--change-settings), the process count (the same numbers: docs/runs.md)
    for key in ("num_iterations", "world_size"):
        if key in then and then[key] != record[key]:
            changes[key] = {"then": then[key], "now": record[key]}
    if start > 0 and (changes or segments[-1]["git_commit"] != record["git_commit"]):
        segments.append(
            {"start_step": start, "command": record["command"], "git_commit": record["git_commit"], "changes": changes}
        )
    return segments


def describe(key, change):
    if key == "num_iterations":
        return f"the horizon {change['then']} → {change['now']} steps"
    if key == "world_size":
        return f"the process count {change['then']} → {change['now']}"
    return f"{key} {change['then']} → {change['now']}"


def resume_summary(segments, start, then):
    """What a resume at `start` changes (old → new) and which earlier changes it carries on, for its one line."""
    if "args" not in then:
        return (
            "its checkpoint records no settings and config.json is missing: this command's flags were compared with "
            "the checkpoint's model only"
        )
    now = segments[-1].get("changes", {}) if segments[-1]["start_step"] == start else {}
    earlier = {}  # {key: (step, change)}: the latest change of each, before this start
    for segment in segments:
        if segment["start_step"] < start:
            earlier.update({k: (segment["start_step"], c) for k, c in segment.get("changes", {}).items()})
    text = "changes " + ", ".join(describe(k, c) for k, c in now.items()) if now else "changes no setting"
    # the process count is no setting: it is never carried on
    carried = [f"{describe(k, c)} (since step {s})" for k, (s, c) in earlier.items() if k not in {*now, "world_size"}]
    return text + ("; carries on " + ", ".join(carried) if carried else "")


CONFIG_FIX = (
    "restore it from a copy, or move it away: a resume then compares the command with what the checkpoint records, "
    "and writes a new config.json whose history starts at that step"
)


def read_config(run_dir):
    """A run's config.json, {} where it has none; a damaged one is one line naming it and the fix (run_dir.py)."""
    return run_files.read_config(run_dir, CONFIG_FIX, missing_ok=True)


def run_at(run_dir, step, meta):
    """The run as it was at its checkpoint of `step` (meta: its meta), in config.json's keys: what a resume compares
    a command with and continues. The checkpoint's own record (RUN_KEYS); for a checkpoint of earlier code, config.json
    with the changes of the segments from `step` on undone; without either, what the meta alone tells (its model,
    batch, fingerprints and process count): no "args", the run's settings unknown."""
    cfg = read_config(run_dir)  # damaged: one line, whatever the meta holds (the next start rewrites it)
    own = {k: meta[k] for k in ("arch", "model_config", "world_size", "fingerprints", *RUN_KEYS) if k in meta}
    if "args" in meta:
        return own
    if "args" in cfg:
        return {**undo_changes(cfg, step), **own}
    if meta.get("tokens") and step:
        own["total_batch_size"] = meta["tokens"] // step
    return own


def undo_changes(cfg, step):
    """config.json's run as it was before the segments that start at `step` or later changed it."""
    run = {**cfg, "args": dict(cfg["args"])}
    for segment in reversed(cfg.get("segments", [])):
        if segment["start_step"] < step:
            break
        for key, change in segment.get("changes", {}).items():
            if key.startswith("--"):
                run["args"][key[2:].replace("-", "_")] = change["then"]
            else:  # the planned horizon (stated in steps: the same plan) or the process count
                run[key] = change["then"]
                if key == "num_iterations":
                    run["args"]["num_iterations"] = change["then"]
    return run


def continued_args(args, stated, then, not_settings):
    """A resume's flags: every setting the command line does not state (stated: the flags it gives itself, not its
    preset's; None: all of them) is the run's at the checkpoint (then: run_at's), changes accepted earlier included,
    so that leaving a flag out never changes the run. The horizon is one setting: stating one of its flags restates
    it. The flags that are no setting (not_settings(args): where and how often a run reports, the flags its arch
    ignores) are the command's."""
    if stated is None or "args" not in then:
        return args
    inherited = {k: v for k, v in then["args"].items() if k in vars(args) and k not in stated}
    if HORIZON & stated:
        inherited = {k: v for k, v in inherited.items() if k not in HORIZON}
    free = not_settings(argparse.Namespace(**{**vars(args), **inherited})) - HORIZON
    return argparse.Namespace(**{**vars(args), **{k: v for k, v in inherited.items() if k not in free}})


def refused_changes(then, record, defaults, refused=REFUSED):
    """{flag: (then, now, why)} for every flag no resume can change that differs from the run's at the checkpoint
    (none where its flags are unknown: the run's model config, then, is compared instead)."""
    if "args" not in then:
        return {}
    then, now = then["args"], record["args"]
    then = {k: then.get(k, defaults.get(k)) for k in now}
    return {flag(k): (then[k], now[k], why) for k, why in refused.items() if k in now and then[k] != now[k]}


def parameter_changes(saved, planned):
    """How the model a command builds differs from a checkpoint's ({name: shape} of their parameters and buffers,
    what a strict load needs to match); '' where it does not."""

    def names(keys):
        keys = sorted(keys)
        return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")

    parts = []
    if lacks := saved.keys() - planned.keys():
        parts.append(f"lacks {names(lacks)}")
    if adds := planned.keys() - saved.keys():
        parts.append(f"adds {names(adds)}")
    if reshaped := [k for k in saved.keys() & planned.keys() if saved[k] != planned[k]]:
        parts.append(f"reshapes {names(reshaped)}")
    return ", ".join(parts)


def checkpoint_step(run_dir, resume):
    """The step of the complete checkpoint --resume names (latest: the newest); None where it names none (no
    --resume, or latest in a run without one); a step that is no complete checkpoint is one line."""
    complete = ckpt.complete_steps(run_dir) if resume and os.path.isdir(run_dir) else []
    if not complete and resume in ("", "latest"):
        return None
    if resume == "latest":
        return complete[-1]
    if int(resume) not in complete:
        raise ckpt.missing_step_error(run_dir, int(resume))
    return int(resume)


def model_differences(then, now):
    """The fields in which two model configs differ, as 'name then → now'."""
    keys = sorted(then.keys() | now.keys())
    return ", ".join(f"{k} {then.get(k)} → {now.get(k)}" for k in keys if then.get(k) != now.get(k))


def start_step(run_dir, args, record, tokenizer, defaults, not_settings, planned_shapes=None, saved_shapes=None):
    """The step to start from, after every check that can refuse the command (nothing is written here, nothing loaded).
    Returns None for a finished run resumed with --resume latest (nothing to do). The command is compared with the run
    as it was at the checkpoint (run_at). planned_shapes: {name: shape} of the model the command builds; saved_shapes:
    the same of a checkpoint's model, from its meta (the caller's arch registry builds it): where they differ, the run
    cannot resume, whichever flag made the difference."""
    if not args.resume:
        complete = ckpt.complete_steps(run_dir) if os.path.isdir(run_dir) else []
        if complete:
            raise UserError(
                f"{run_dir} already holds a run with checkpoints up to step {complete[-1]}; "
                "continue it with --resume latest, or pick another --run"
            )
        return 0
    step = checkpoint_step(run_dir, args.resume)
    if step is None:
        return 0
    if args.resume == "latest":
        ckpt.latest_step(run_dir, skip_damaged=True)  # a note for each newer checkpoint it skips (incomplete, damaged)
    meta = ckpt.load_meta(run_dir, step)
    ckpt.check_vocab(meta, tokenizer)
    then = run_at(run_dir, step, meta)
    # first what --change-settings cannot accept either, so that no message suggests it in vain; a new device batch
    # alone is left to the shard count below, which says what to keep
    refused = refused_changes(then, record, defaults)
    if refused and not (set(refused) == {"--device-batch-size"} and "grad_accum_steps" in then):
        listed = ", ".join(f"{k} {a} → {b} ({why})" for k, (a, b, why) in refused.items())
        raise UserError(
            f"cannot resume {run_dir} with {listed}: a run keeps {'it' if len(refused) == 1 else 'them'} "
            "from start to end; pick another --run"
        )
    for key in RESUME_KEYS:
        if key in then and then[key] != record.get(key):
            differ = (
                model_differences(then[key], record[key])
                if key == "model_config"
                else f"{then[key]} → {record.get(key)}"
            )
            raise UserError(
                f"cannot resume {run_dir}: its {key} at step {step} differs from this command's ({differ})"
                + ("" if "args" in then else "; the checkpoint records no flags: give those the run was trained with")
            )
    for key, old in then.get("fingerprints", {}).items():
        if record["fingerprints"].get(key) != old:
            what = "tokenizer" if key == "tokenizer" else f"{key[5:]} data"
            raise UserError(
                f"cannot resume {run_dir}: its {what} changed (fingerprint {old} then, "
                f"{record['fingerprints'].get(key)} now); resume with the base dir it was trained in"
            )
    shards = lambda cfg: cfg["world_size"] * cfg["grad_accum_steps"]
    if "grad_accum_steps" in then and shards(then) != shards(record):
        raise UserError(
            f"cannot resume {run_dir} on {record['world_size']} process(es) × {record['grad_accum_steps']} "
            f"micro-step(s): its data was cut into {shards(then)} shards ({then['world_size']} × "
            f"{then['grad_accum_steps']}), this command's --device-batch-size gives {shards(record)}; keep "
            f"--device-batch-size {then.get('args', {}).get('device_batch_size', 'it had')}"
        )
    changed = settings_changes(then, record, defaults, not_settings)
    if (
        planned_shapes is not None
        and saved_shapes is not None
        and (diff := parameter_changes(saved_shapes(meta), planned_shapes))
    ):
        # an arch's flag that adds or removes parameters (a recipe part, say): the table above names the baseline's only
        tabled = {flag(f) for _, flags, _ in RESUME_TABLE for f in flags}
        culprits = {k: v for k, v in changed.items() if k not in tabled} or changed
        listed = ", ".join(f"{k} {a} → {b}" for k, (a, b) in culprits.items())
        why = (
            "pick another --run"
            if listed
            else "no flag changed it: was it saved by other code?"
            if "args" in then
            else "the checkpoint records no flags: give the ones the run was trained with"
        )
        raise UserError(
            f"cannot resume {run_dir}" + (f" with {listed}" if listed else "") + f": the model this command builds "
            f"{diff} against the checkpoint of step {step}, and a run keeps its parameters from start to end; {why}"
        )
    planned = then.get("num_iterations", record["num_iterations"])
    if changed and not args.change_settings:
        listed = "; ".join(f"{k} {a} → {b}" for k, (a, b) in changed.items())
        finished = step == planned and args.resume == "latest"
        raise UserError(
            f"cannot {'reuse the finished run' if finished else 'resume'} {run_dir} with other settings ({listed}): "
            + (
                "pick another --run"
                if finished
                else "drop them, pick another --run, or add --change-settings to record the change from this step on"
            )
        )
    if planned != record["num_iterations"] and not args.change_settings:
        raise UserError(
            f"cannot resume {run_dir}: it was planned for {planned} steps but this command gives "
            f"{record['num_iterations']} (the LR schedule would change "
            "mid-run); add --change-settings if that is what you want"
        )
    if step > record["num_iterations"]:
        raise UserError(
            f"cannot resume {run_dir} from step {step}: the new horizon ends at step {record['num_iterations']}"
        )
    if step == record["num_iterations"] and args.resume == "latest":
        return None
    return step


def load_resumed_weights(model, run_dir, step, device):
    """The weights saved at `step` into model, refusing a checkpoint that stores them under other names than the
    model's: one of an older layout, which the model converts as it loads (so it still evaluates and exports), but
    whose optimizer state is keyed to the old parameters."""
    saved = ckpt.load_model_file(run_dir, step, device)
    ckpt.load_weights(model, saved)
    old = sorted(saved["model"].keys() - model.state_dict().keys())
    if old:
        raise UserError(
            f"cannot resume {run_dir} from step {step}: its weights are in an older layout ({old[0]}, ...), whose "
            "optimizer state this code cannot read; evaluate or export it, or train a new run"
        )


def load_resume_state(run_dir, step, rank, world_size, grad_accum, optimizer):
    """Load this rank's share of the train state saved at `step` into `optimizer` (each saved rank holds its rows of
    the sharded Muon state, rank 0 the AdamW state: ranks_to_load names the files this rank needs), and return the
    loader states of its data shards, the RNG state and the elapsed time. The data is cut into world_size × grad_accum
    shards whatever the split over processes (start_step checks the count), so a checkpoint of another process count
    resumes too: shard s was micro-step s % a of saved rank s // a, and is now that of rank s // grad_accum."""
    saved_world = ckpt.load_meta(run_dir, step).get("world_size", 1)
    saved_accum = world_size * grad_accum // saved_world
    mine = range(rank * grad_accum, (rank + 1) * grad_accum)
    optim_ranks = optimizer.ranks_to_load(saved_world)
    owners = sorted({s // saved_accum for s in mine} | {0} | set(optim_ranks))
    states = {0: ckpt.load_train_state(run_dir, step, 0)}  # on the CPU: RNG states must stay there
    # the shard count again, from the saved loader states: a checkpoint of earlier code without config.json records
    # no micro-step count for start_step to check
    if (saved := saved_world * len(states[0]["dataloader"])) != world_size * grad_accum:
        raise UserError(
            f"cannot resume {run_dir}: its data was cut into {saved} shards, this command's --device-batch-size gives "
            f"{world_size * grad_accum}; keep the --device-batch-size it was trained with"
        )
    states.update({r: ckpt.load_train_state(run_dir, step, r) for r in owners if r})
    optimizer.load_state_dicts({r: states[r]["optimizer"] for r in optim_ranks})  # moved to the params' device
    return {
        "elapsed": states[0].get("elapsed", 0.0),
        "rng": states[mine[0] // saved_accum]["rng"],
        "dataloader": [states[s // saved_accum]["dataloader"][s % saved_accum] for s in mine],
    }
