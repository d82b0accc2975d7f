"""
Where a run starts again, and what may differ when it does.

A run resumes from a complete checkpoint (nanochat/checkpoint_manager.py) with the arch, model and total batch it
was planned with, the same tokenizer and data, and the same settings, the flags that change what it learns.
NOT_SETTINGS is the one list of the baseline's flags that do not (where and how often a run reports and saves,
how it is launched); an arch registry adds its own archs' flags. --change-settings accepts other settings, the horizon
included, and config.json's segments record each change from the step it applies to.
"""

import json
import os

from nanochat.common import UserError
from nanochat import checkpoint_manager as ckpt

# what must match for a resume. The process count may change: the train data is cut into world_size × grad_accum
# shards, a number fixed by the total and device batch sizes, and each shard's loader state moves to its new owner
RESUME_KEYS = ("arch", "model_config", "total_batch_size")
HORIZON = frozenset({"num_iterations", "target_flops", "target_param_data_ratio"})  # checked as the planned step count
# flags that change no number a run trains: where and how often it reports and saves, how it is launched
NOT_SETTINGS = frozenset({"run", "resume", "dry_run", "change_settings", "preset", "device_type", "compile", "attn",
                          "eval_every", "eval_tokens", "save_every", "log_every", "log_to", "keep_checkpoints",
                          "step_timeout", "start_timeout"}) | HORIZON


def flag(key):
    return f"--{key.replace('_', '-')}"


def settings_changes(old_cfg, record, defaults, not_settings):
    """{flag: (then, now)} for every setting that differs from the run's current one (model, optimizer, schedule, data).
    defaults: the parser's defaults (a flag newer than the run ran with its default)."""
    then, now = old_cfg.get("args", {}), record["args"]
    then = {k: then.get(k, defaults.get(k)) for k in now}
    return {flag(k): (then[k], now[k]) for k in sorted(set(now) - not_settings) if then[k] != now[k]}


def settings_segments(old_cfg, record, start, defaults, not_settings):
    """config.json's history of settings: one segment per start with other settings, oldest first, never rewritten."""
    segments = list(old_cfg.get("segments", [])) or [{"start_step": 0, "command": old_cfg.get("command", record["command"]),
                                                        "git_commit": old_cfg.get("git_commit", record["git_commit"])}]
    changes = {k: {"then": a, "now": b} for k, (a, b) in (settings_changes(old_cfg, record, defaults, not_settings) if old_cfg else {}).items()}
    for key in ("num_iterations", "world_size"):  # the horizon (--change-settings), the process count (the same numbers: docs/runs.md)
        if old_cfg.get(key, record[key]) != record[key]:
            changes[key] = {"then": old_cfg[key], "now": record[key]}
    if start > 0 and (changes or old_cfg.get("git_commit") != record["git_commit"]):
        segments.append({"start_step": start, "command": record["command"], "git_commit": record["git_commit"], "changes": changes})
    return segments


def read_config(run_dir):
    path = os.path.join(run_dir, "config.json")
    return json.load(open(path)) if os.path.exists(path) else {}


def start_step(run_dir, args, record, tokenizer, defaults, not_settings):
    """The step to start from, after every check that can refuse the command (nothing is written here).
    Returns None for a finished run resumed with --resume latest (nothing to do)."""
    complete = ckpt.complete_steps(run_dir) if os.path.isdir(run_dir) else []
    if not args.resume:
        if complete:
            raise UserError(f"{run_dir} already holds a run with checkpoints up to step {complete[-1]}; "
                            "continue it with --resume latest, or pick another --run")
        return 0
    if args.resume == "latest":
        if not complete:
            return 0
        step = ckpt.latest_step(run_dir, skip_damaged=True)
    else:
        step = int(args.resume)
        if step not in complete:
            raise ckpt.missing_step_error(run_dir, step)
    ckpt.check_vocab(ckpt.load_meta(run_dir, step), tokenizer)
    old_cfg = read_config(run_dir)
    for key in RESUME_KEYS:
        if key in old_cfg and old_cfg[key] != record.get(key):
            raise UserError(f"cannot resume {run_dir}: its {key} was {old_cfg[key]} but this command gives {record.get(key)}")
    for key, old in old_cfg.get("fingerprints", {}).items():
        if record["fingerprints"].get(key) != old:
            what = "tokenizer" if key == "tokenizer" else f"{key[5:]} data"
            raise UserError(f"cannot resume {run_dir}: its {what} changed (fingerprint {old} then, {record['fingerprints'].get(key)} now); "
                            "resume with the base dir it was trained in")
    # first what --change-settings cannot accept either, so that no message suggests it in vain
    shards = lambda cfg: cfg["world_size"] * cfg["grad_accum_steps"]
    if "grad_accum_steps" in old_cfg and shards(old_cfg) != shards(record):
        raise UserError(f"cannot resume {run_dir} on {record['world_size']} process(es) × {record['grad_accum_steps']} micro-step(s): its "
                        f"data was cut into {shards(old_cfg)} shards ({old_cfg['world_size']} × {old_cfg['grad_accum_steps']}), this "
                        f"command's --device-batch-size gives {shards(record)}; keep --device-batch-size {old_cfg.get('args', {}).get('device_batch_size', 'it had')}")
    changed = settings_changes(old_cfg, record, defaults, not_settings)
    if changed and not args.change_settings:
        listed = "; ".join(f"{k} {a} → {b}" for k, (a, b) in changed.items())
        finished = step == old_cfg.get("num_iterations") and args.resume == "latest"
        raise UserError(f"cannot {'reuse the finished run' if finished else 'resume'} {run_dir} with other settings ({listed}): "
                        + ("pick another --run" if finished else "drop them, pick another --run, or add --change-settings to record the change from this step on"))
    planned = old_cfg.get("num_iterations", record["num_iterations"])
    if planned != record["num_iterations"] and not args.change_settings:
        raise UserError(f"cannot resume {run_dir}: it was planned for {planned} steps but this command gives {record['num_iterations']} "
                        "(the LR schedule would change mid-run); add --change-settings if that is what you want")
    if step > record["num_iterations"]:
        raise UserError(f"cannot resume {run_dir} from step {step}: the new horizon ends at step {record['num_iterations']}")
    if step == record["num_iterations"] and args.resume == "latest":
        return None
    return step


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
    states = {r: ckpt.load_train_state(run_dir, step, r) for r in owners}  # on the CPU: RNG states must stay there
    optimizer.load_state_dicts({r: states[r]["optimizer"] for r in optim_ranks})  # moved to the params' device
    return {"elapsed": states[0].get("elapsed", 0.0), "rng": states[mine[0] // saved_accum]["rng"],
            "dataloader": [states[s // saved_accum]["dataloader"][s % saved_accum] for s in mine]}
