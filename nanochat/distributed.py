"""
What a run of several processes (one node or many) needs beyond DDP itself.

Each is a small piece with one job:

    rank0_decides(fn)       rank 0 computes a value (the start step) and every rank gets it, or the same error
    check_shared_dir(path)  every rank must see the files rank 0 writes: the run directory on a shared filesystem
    Watchdog                a rank that makes no progress for too long says so, names the silent ranks, and exits
    StopRequest             SIGTERM (SLURM, spot instances) asks for a checkpoint at the end of the current step

Exit statuses a launcher can tell apart: EXIT_PREEMPTED after the checkpoint a SIGTERM asked for (rerun with
--resume latest), EXIT_HUNG when the watchdog fired (a restart resumes from the newest complete checkpoint).
"""

import os
import sys
import time
import signal
import socket
import secrets
import threading

import torch.distributed as dist

from nanochat.common import UserError

EXIT_PREEMPTED = 75  # BSD's EX_TEMPFAIL: "try again later", which is what a resume does
EXIT_HUNG = 124  # as timeout(1): the run stopped because something took too long


def rank0_decides(fn, is_ddp):
    """fn() on rank 0, its result on every rank; a UserError on rank 0 is raised on every rank (no rank is left
    waiting in a collective for a rank that has already given up)."""
    if not is_ddp:
        return fn()
    box = [None, None]
    if dist.get_rank() == 0:
        try:
            box[0] = fn()
        except UserError as e:
            box[1] = str(e)
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise UserError(box[1])
    return box[0]


SHARED_CHECK = ".shared-check"


def check_shared_dir(path, is_ddp):
    """Every rank must read, in `path`, the token rank 0 has just written there; otherwise the ranks write their
    checkpoint parts on different disks and no complete checkpoint exists anywhere. Call after rank 0 created path."""
    if not is_ddp:
        return
    rank = dist.get_rank()
    token_file = os.path.join(path, SHARED_CHECK)
    box = [None]
    if rank == 0:
        box[0] = secrets.token_hex(8)
        with open(token_file, "w") as f:
            f.write(box[0])
            f.flush()
            os.fsync(f.fileno())
    dist.broadcast_object_list(box, src=0)
    try:
        with open(token_file) as f:
            seen = f.read() == box[0]
    except OSError:
        seen = False
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, (seen, socket.gethostname()))
    if rank == 0:
        os.remove(token_file)
    blind = [f"{r} ({host})" for r, (ok, host) in enumerate(views) if not ok]
    if blind:
        raise UserError(
            f"rank(s) {', '.join(blind)} do not see {path} as rank 0 ({views[0][1]}) wrote it: the base dir "
            "(NANOCHAT_BASE_DIR) must be one directory on a filesystem "
            "shared by every node (docs/runs.md, several nodes)"
        )


class Watchdog:
    """A thread that ends the process when the main loop stops reporting progress: a rank stopped, hung or died,
    and the others wait for it in a collective. Backend timeouts would say so after 10 (NCCL) or 30 (gloo) minutes
    and name no rank; this fires after `timeout` seconds of the current phase, every waiting rank reports to the
    rendezvous store, and the lowest of them prints the ranks that did not report, with the step and phase."""

    def __init__(self, rank, world_size, poll=0.5):
        self.rank, self.world_size, self.poll = rank, world_size, poll
        self.phase, self.step, self.deadline, self.timeout = "start-up", 0, None, None
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._watch, name="nanochat-watchdog", daemon=True)
        self.thread.start()

    def progress(self, phase, step, timeout):
        """Entering `phase` at `step`: the process exits unless the next call comes within `timeout` seconds."""
        with self.lock:
            self.phase, self.step, self.timeout = phase, step, timeout
            self.deadline = time.monotonic() + timeout

    def stop(self):
        with self.lock:
            self.deadline = None

    def _watch(self):
        while True:
            time.sleep(self.poll)
            with self.lock:
                expired = self.deadline is not None and time.monotonic() > self.deadline
                phase, step, timeout = self.phase, self.step, self.timeout
            if expired:
                self._report(phase, step, timeout)
                os._exit(EXIT_HUNG)

    def _report(self, phase, step, timeout):
        here = f"rank {self.rank} ({socket.gethostname()}, pid {os.getpid()})"
        silent = self._silent_ranks(f"nanochat/hung/{step}/{phase}", grace=min(10.0, max(2.0, timeout / 4)))
        if silent is None:
            print(
                f"error: {here}: no progress for {timeout:.0f} s in {phase} (step {step}); the rendezvous store did "
                "not answer either (it lives in rank 0 or in torchrun's agent: that one is the likely cause)",
                file=sys.stderr,
                flush=True,
            )
        elif silent and min(set(range(self.world_size)) - set(silent)) == self.rank:
            print(
                f"error: rank(s) {', '.join(map(str, silent))} stopped, hung or died in {phase} (step {step}): the "
                f"other ranks waited {timeout:.0f} s for them ({here} reports; a restart resumes from the newest "
                "complete checkpoint)",
                file=sys.stderr,
                flush=True,
            )
        elif not silent and self.rank == 0:
            print(
                f"error: every rank waited {timeout:.0f} s in {phase} (step {step}): no rank is stuck alone (a "
                "collective or the filesystem is); a restart resumes from the newest complete checkpoint",
                file=sys.stderr,
                flush=True,
            )

    def _silent_ranks(self, key, grace):
        """Ranks that did not check in under `key` within `grace` seconds; None if the store cannot be reached."""
        result = []

        def ask():
            store = dist.distributed_c10d._get_default_store()
            store.set(f"{key}/{self.rank}", "1")
            time.sleep(grace)  # the other waiting ranks reach their deadline at about the same time
            result.append([r for r in range(self.world_size) if not store.check([f"{key}/{r}"])])

        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        asking.join(grace + 10)  # a stopped store (in a stopped rank 0) would never answer
        return result[0] if result else None


class StopRequest:
    """SIGTERM sets a flag instead of killing the process; training reads it after each step (every rank agrees on
    it through the loss all-reduce), saves a checkpoint of that step and exits with EXIT_PREEMPTED. SIGKILL, which
    launchers send when that takes too long (torchrun after 30 s), still kills; Ctrl-C (SIGINT) stops at once."""

    def __init__(self):
        self.signal = None
        self.previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        # a repeat changes nothing: under SLURM both the step's processes and torchrun (forwarding) send one
        self.signal = signum

    @property
    def requested(self):
        return self.signal is not None

    def restore(self):
        signal.signal(signal.SIGTERM, self.previous)
