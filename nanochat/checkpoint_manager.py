"""
Checkpoints in a run directory, written atomically (temp file + rename):

    model_{step:06d}.pt              {"model": state_dict, "meta": meta}   (written once, by rank 0)
    optim_{step:06d}_rank{r}.pt      one per rank: its dataloader and RNG state and its share of the optimizer
                                     state (its rows of each Muon stack; AdamW's on rank 0: nanochat/optim.py)
    meta_{step:06d}.json             the meta dict, human readable; written last, so its presence
                                     (with the files above) marks the checkpoint complete

meta records the arch, the model config, the number of ranks and whatever else the model class asks
for (its extra_meta), so the right model can be rebuilt from the checkpoint alone.
"""

import os
import re
import glob
import json
import fcntl
import contextlib

import torch
import torch.distributed as dist

from nanochat.common import UserError, atomic_torch_save, atomic_write_json
from nanochat.gpt import GPTConfig

# the old place, for scripts/base_train.py until it imports run_dir
from nanochat.run_dir import resolve_run_dir  # noqa: F401


@contextlib.contextmanager
def run_lock(run_dir, purpose="training"):
    """An exclusive lock on a run directory (flock on runs/<run>/.lock), held for the whole of a training
    run or an evaluation write. The kernel releases it when the process exits, however it exits."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, ".lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            raise UserError(f"{run_dir} is in use by {holder}; wait for it to finish (or stop it) and try again")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} ({purpose})".encode(), 0)
        yield
    finally:
        os.close(fd)


def model_path(run_dir, step):
    return os.path.join(run_dir, f"model_{step:06d}.pt")


def optim_path(run_dir, step, rank):
    return os.path.join(run_dir, f"optim_{step:06d}_rank{rank}.pt")


def meta_path(run_dir, step):
    return os.path.join(run_dir, f"meta_{step:06d}.json")


def saved_steps(run_dir):
    """Steps with a model file, complete or not."""
    steps = []
    for p in glob.glob(os.path.join(run_dir, "model_*.pt")):
        m = re.fullmatch(r"model_(\d+)\.pt", os.path.basename(p))
        if m:
            steps.append(int(m.group(1)))
    return sorted(steps)


def damage(run_dir, step):
    """Why the checkpoint of `step` is not complete, or None when it is: its meta json (written last) and every file it
    lists exist, the model file and one train-state file per rank of the run that saved it, each of the size the meta
    records."""
    name = os.path.basename(meta_path(run_dir, step))
    try:
        with open(meta_path(run_dir, step), encoding="utf-8") as f:
            meta = json.load(f)
    except OSError:
        return "a save was cut short"
    except ValueError:  # written atomically, so never half of one: damaged since (a copy, a disk, an edit)
        return f"{name} is not valid JSON: the file is damaged"
    if not (
        isinstance(meta, dict)
        and isinstance(meta.get("world_size", 1), int)
        and isinstance(meta.get("file_sizes", {}), dict)
    ):
        return (
            f"{name} is not a checkpoint's meta (an object with its number of ranks and file sizes): "
            "the file is damaged"
        )
    if "file_sizes" not in meta and "arch" in meta:  # without its arch too it is damaged, which load_meta says
        return (
            f"{name} records no file sizes: a checkpoint of an earlier version of this code, which this one "
            "does not read"
        )
    sizes = meta.get("file_sizes", {})
    for path in [model_path(run_dir, step)] + [optim_path(run_dir, step, r) for r in range(meta.get("world_size", 1))]:
        name = os.path.basename(path)
        if not os.path.exists(path):
            return f"{name} is missing"
        if name in sizes and os.path.getsize(path) != sizes[name]:
            return f"{name} holds {os.path.getsize(path):,} bytes, its save wrote {sizes[name]:,}: the file is damaged"
    return None


def is_complete(run_dir, step):
    return damage(run_dir, step) is None


def complete_steps(run_dir):
    return [s for s in saved_steps(run_dir) if is_complete(run_dir, s)]


def latest_step(run_dir, skip_damaged=False):
    """The newest complete checkpoint's step; an incomplete newer one (a crash mid-save) is skipped with a note. One
    whose save completed (its meta exists) but whose files no longer match it is damaged: training skips it too
    (skip_damaged: it trains that step again), a reader refuses, since the newest step is what it was asked for."""
    steps = complete_steps(run_dir)
    if not steps:
        raise UserError(
            f"no complete checkpoint in {run_dir}; "
            f"train one with `python -m scripts.base_train --run {os.path.basename(run_dir)}`"
        )
    for s in (s for s in saved_steps(run_dir) if s > steps[-1]):
        if os.path.exists(meta_path(run_dir, s)) and not skip_damaged:
            raise UserError(
                f"the newest checkpoint of {run_dir}, step {s}, is damaged ({damage(run_dir, s)}); the previous "
                f"complete step is {steps[-1]}: pass --step {steps[-1]}, "
                f"or train step {s} again with base_train --resume latest"
            )
        print(
            f"note: skipping the incomplete checkpoint of step {s} in "
            f"{run_dir} ({damage(run_dir, s)}); using step {steps[-1]}",
            flush=True,
        )
    return steps[-1]


def remove_temp_files(run_dir):
    """Half-written temp files of an atomic write cut short by a kill; call only while holding run_lock."""
    for p in glob.glob(os.path.join(run_dir, ".tmp-*")):
        os.remove(p)


def save_checkpoint(run_dir, step, model, meta, train_state, rank=0):
    """Per-rank train state first; once every rank has written its own, rank 0 writes the model file and
    then the meta json, which marks the checkpoint complete. A crash mid-save leaves the previous
    checkpoint as the latest complete one."""
    try:
        atomic_torch_save(train_state, optim_path(run_dir, step, rank))
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        if dist.is_initialized():
            dist.barrier()
        if rank == 0:
            missing = [r for r in range(world_size) if not os.path.exists(optim_path(run_dir, step, r))]
            if missing:  # written on another disk: no complete checkpoint would exist anywhere
                raise UserError(
                    f"rank(s) {', '.join(map(str, missing))} saved their part of step {step} where rank 0 cannot see "
                    f"it ({run_dir}): the base dir must be one directory on a filesystem shared by every node"
                )
            atomic_torch_save({"model": model.state_dict(), "meta": meta}, model_path(run_dir, step))
            # the sizes of every file as written: a later truncation or a copy cut short marks the checkpoint incomplete
            files = [model_path(run_dir, step)] + [optim_path(run_dir, step, r) for r in range(world_size)]
            atomic_write_json(
                meta_path(run_dir, step),
                {**meta, "file_sizes": {os.path.basename(p): os.path.getsize(p) for p in files}},
            )
    except OSError as e:  # a full disk, typically: leave no part of this checkpoint behind to fill it further
        for path in glob.glob(os.path.join(run_dir, f"optim_{step:06d}_rank*.pt")) + [model_path(run_dir, step)]:
            with contextlib.suppress(OSError):
                os.remove(path)
        earlier = [s for s in complete_steps(run_dir) if s < step]
        raise UserError(
            f"cannot save the checkpoint of step {step} in {run_dir} ({e.strerror or e}); the newest complete one is "
            f"{f'step {earlier[-1]}' if earlier else 'none'}: free space, then continue with --resume latest"
        ) from None


def missing_step_error(run_dir, step):
    have = complete_steps(run_dir) if os.path.isdir(run_dir) else []
    if os.path.exists(meta_path(run_dir, step)):  # its save completed: the files were damaged since
        earlier = [s for s in have if s < step]
        hint = f"the previous complete step is {earlier[-1]}" if earlier else "no earlier complete step exists"
        return UserError(f"the checkpoint of step {step} in {run_dir} is damaged ({damage(run_dir, step)}); {hint}")
    return UserError(f"no complete checkpoint for step {step} in {run_dir} (complete steps: {have or 'none'})")


def torch_load(path, device, run_dir, step):
    """torch.load, with a damaged file reported as one line naming it and the previous complete step."""
    try:
        return torch.load(path, map_location=device, weights_only=False)
    except Exception as e:
        earlier = [s for s in complete_steps(run_dir) if s < step]
        hint = f"the previous complete step is {earlier[-1]}" if earlier else "no earlier complete step exists"
        raise UserError(f"cannot read {path} ({type(e).__name__}): the file is damaged; {hint}") from None


def load_model_file(run_dir, step, device="cpu"):
    if not is_complete(run_dir, step):
        raise missing_step_error(run_dir, step)
    return torch_load(model_path(run_dir, step), device, run_dir, step)


def load_meta(run_dir, step):
    """The meta of a complete checkpoint; one that lacks what a reader needs (its arch, model config) is one line."""
    if not is_complete(run_dir, step):
        raise missing_step_error(run_dir, step)
    with open(meta_path(run_dir, step), encoding="utf-8") as f:
        meta = json.load(f)
    if not (isinstance(meta.get("arch"), str) and isinstance(meta.get("model_config"), dict)):
        earlier = [s for s in complete_steps(run_dir) if s < step]
        hint = f"the previous complete step is {earlier[-1]}" if earlier else "no earlier complete step exists"
        raise UserError(
            f"{meta_path(run_dir, step)} lacks the checkpoint's arch or model config: the file is damaged; {hint}"
        )
    return meta


def load_train_state(run_dir, step, rank=0, device="cpu"):
    path = optim_path(run_dir, step, rank)
    if not os.path.exists(path):
        raise UserError(
            f"checkpoint step {step} in {run_dir} has no optimizer state for rank {rank} ({os.path.basename(path)}); "
            "resume with the same number of processes it was saved with"
        )
    return torch_load(path, device, run_dir, step)


def build_model(meta, device, model_class):
    """A fresh, initialised model of the arch and config recorded in meta; model_class maps an arch name to
    its class (the caller's registry of archs: this package knows only the baseline)."""
    cls = model_class(meta["arch"])
    return cls.initialised(GPTConfig(**meta["model_config"]), device, **cls.extra_init_kwargs(meta))


def load_weights(model, ckpt):
    """Load a checkpoint's weights, refusing a checkpoint of the other arch."""
    arch = ckpt["meta"]["arch"]
    if arch != model.arch:
        raise UserError(
            f"checkpoint holds a {arch!r} model but a {model.arch!r} "
            f"model ({type(model).__name__}) was asked to load it"
        )
    model.load_state_dict(ckpt["model"], strict=True)


def load_model(run_dir, step, device, model_class):
    """(model, meta) from a run's latest (step None) or given checkpoint, in eval mode."""
    if not os.path.isdir(run_dir):
        raise UserError(f"run directory {run_dir} does not exist")
    step = latest_step(run_dir) if step is None else step
    ckpt = load_model_file(run_dir, step, device)
    model = build_model(ckpt["meta"], device, model_class)
    load_weights(model, ckpt)
    model.eval()
    return model, ckpt["meta"]


def fingerprints(tokenizer, splits=("train", "val")):
    """What a number depends on besides the weights: the tokenizer and the data (nanochat/tokenizer.py and
    nanochat/dataset.py say what is hashed). Recorded in config.json, every checkpoint's meta and eval.json."""
    from nanochat.dataset import data_fingerprint

    return {"tokenizer": tokenizer.fingerprint(), **{f"data_{s}": data_fingerprint(s) for s in splits}}


def check_vocab(meta, tokenizer):
    """The tokenizer must be the one the checkpoint was trained with: same size, and same merges (its fingerprint)."""
    v_model, v_tok = meta["model_config"]["vocab_size"], tokenizer.get_vocab_size()
    if v_model != v_tok:
        raise UserError(
            f"checkpoint vocab {v_model} does not match the tokenizer's {v_tok}; "
            "use the tokenizer the model was trained with (NANOCHAT_BASE_DIR)"
        )
    trained = (meta.get("fingerprints") or {}).get("tokenizer")
    if not trained:
        raise UserError(
            f"the checkpoint of step {meta.get('step')} records no tokenizer fingerprint: a checkpoint of "
            "an earlier version of this code, which this one does not read"
        )
    if trained != tokenizer.fingerprint():
        raise UserError(
            f"the tokenizer in the base dir (fingerprint {tokenizer.fingerprint()}) is not the one this checkpoint was "
            f"trained with ({trained}), though both have {v_tok:,} tokens; use the base dir the model was trained in"
        )
