"""
Checkpoints in a run directory, written atomically (temp file + rename):

    model_{step:06d}.pt              {"model": state_dict, "meta": meta}   (written once, by rank 0)
    optim_{step:06d}_rank{r}.pt      dataloader and RNG state, one per rank; rank 0's also holds the
                                     optimizer state (replicated across ranks, so saved once)
    meta_{step:06d}.json             the meta dict, human readable

meta records the arch, the model config and (for NAG) every NAG setting, so the
right model class can be rebuilt from the checkpoint alone.
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
from nanochat.gpt import GPT, GPTConfig


def get_run_dir(run, base_dir=None):
    from nanochat.common import get_base_dir
    return os.path.join(base_dir or get_base_dir(), "runs", run)


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


def saved_steps(run_dir):
    steps = []
    for p in glob.glob(os.path.join(run_dir, "model_*.pt")):
        m = re.fullmatch(r"model_(\d+)\.pt", os.path.basename(p))
        if m:
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest_step(run_dir):
    steps = saved_steps(run_dir)
    if not steps:
        raise UserError(f"no checkpoint in {run_dir}; train one with `python -m scripts.base_train --run {os.path.basename(run_dir)}`")
    return steps[-1]


def save_checkpoint(run_dir, step, model, meta, train_state, rank=0):
    """Per-rank train state first; once every rank has written its own, rank 0 writes the model file and
    then the meta json. A crash mid-save leaves the previous checkpoint as the latest complete one."""
    atomic_torch_save(train_state, optim_path(run_dir, step, rank))
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        atomic_torch_save({"model": model.state_dict(), "meta": meta}, model_path(run_dir, step))
        atomic_write_json(os.path.join(run_dir, f"meta_{step:06d}.json"), meta)


def load_model_file(run_dir, step, device="cpu"):
    path = model_path(run_dir, step)
    if not os.path.exists(path):
        have = saved_steps(run_dir)
        raise UserError(f"no checkpoint for step {step} in {run_dir} (saved steps: {have or 'none'})")
    return torch.load(path, map_location=device, weights_only=False)


def load_meta(run_dir, step):
    path = os.path.join(run_dir, f"meta_{step:06d}.json")
    if not os.path.exists(path):
        have = saved_steps(run_dir) if os.path.isdir(run_dir) else []
        raise UserError(f"no checkpoint for step {step} in {run_dir} (saved steps: {have or 'none'})")
    with open(path) as f:
        return json.load(f)


def resolve_run_dir(run):
    """A run name is looked up under $NANOCHAT_BASE_DIR/runs; anything with a path separator is a directory."""
    return os.path.normpath(os.path.abspath(run)) if os.sep in run else get_run_dir(run)


def load_train_state(run_dir, step, rank=0, device="cpu"):
    path = optim_path(run_dir, step, rank)
    if not os.path.exists(path):
        raise UserError(f"checkpoint step {step} in {run_dir} has no optimizer state for rank {rank} ({os.path.basename(path)}); "
                        "resume with the same number of processes it was saved with")
    return torch.load(path, map_location=device, weights_only=False)


def model_class(arch):
    if arch == "gpt":
        return GPT
    if arch == "nag":
        from nag.model import NAGGPT  # the baseline never imports nag/ unless asked to
        return NAGGPT
    raise UserError(f"unknown arch {arch!r} (expected gpt or nag)")


def build_model(meta, device):
    """A fresh, initialised model of the arch and config recorded in meta."""
    cls = model_class(meta["arch"])
    config = GPTConfig(**meta["model_config"])
    with torch.device("meta"):
        model = cls(config, **cls.extra_init_kwargs(meta))
    model.to_empty(device=device)
    model.init_weights()
    return model


def load_weights(model, ckpt):
    """Load a checkpoint's weights, refusing a checkpoint of the other arch."""
    arch = ckpt["meta"]["arch"]
    if arch != model.arch:
        raise UserError(f"checkpoint holds a {arch!r} model but a {model.arch!r} model ({type(model).__name__}) was asked to load it")
    model.load_state_dict(ckpt["model"], strict=True)


def load_model(run_dir, step=None, device="cpu"):
    """(model, meta) from a run's latest (or given) checkpoint, in eval mode."""
    if not os.path.isdir(run_dir):
        raise UserError(f"run directory {run_dir} does not exist")
    step = latest_step(run_dir) if step is None else step
    ckpt = load_model_file(run_dir, step, device)
    model = build_model(ckpt["meta"], device)
    load_weights(model, ckpt)
    model.eval()
    return model, ckpt["meta"]


def check_vocab(meta, tokenizer):
    v_model, v_tok = meta["model_config"]["vocab_size"], tokenizer.get_vocab_size()
    if v_model != v_tok:
        raise UserError(f"checkpoint vocab {v_model} does not match the tokenizer's {v_tok}; "
                        "use the tokenizer the model was trained with (NANOCHAT_BASE_DIR)")
