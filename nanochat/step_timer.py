"""
Where a training step's time goes, and small device values read on the host, without device waits.

Neither the timing nor the reads make the device wait.

    timer = StepTimer(device)
    ...                          # get a micro-batch
    timer.mark("data")           # the time since the previous mark went to "data"
    parts, wall = timer.read()   # {phase: seconds} since the previous read, and the wall-clock seconds

On a CPU a mark is a wall-clock timestamp. On CUDA it is an event recorded on the current stream, so a part is
device time: from the device finishing the work queued before one mark to finishing the work queued before the
next. Work the device runs while the host is ahead costs its device time; a wait for the host (a batch not ready,
a host sync, logging) costs the device's idle time, which is what that wait really costs the step. Either way
every moment lies in exactly one part, so the parts add up to the interval. Marks never synchronise; read() waits
for the last mark once, so call it only where the step syncs anyway (a logged step).

    ms = call_ms(fn, device, setup=zero_grads)   # one call of fn alone: the benchmarks' and the attention probe's timer

call_ms times one call the same way, a mark before it and one after: CUDA events on CUDA (device time, so work
queued by setup before the first mark is not counted), the host clock elsewhere.
"""

import time
import statistics

import torch

# the parts of a step, in the order they are shown; `save` is the checkpoint written after the previous row
PHASES = ("data", "fwd_bwd", "optim", "sync_log", "eval", "save")
LABELS = {
    "data": "data",
    "fwd_bwd": "fwd+bwd",
    "optim": "optim",
    "sync_log": "sync+log",
    "eval": "eval",
    "save": "save",
}


class StepTimer:
    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.start = self._stamp()
        self.marks = []  # (phase, stamp): the time up to stamp went to phase

    def _stamp(self):
        """(host clock, CUDA event or None)."""
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return time.perf_counter(), event

    def _seconds(self, a, b):
        return a[1].elapsed_time(b[1]) / 1000 if self.cuda else b[0] - a[0]

    def mark(self, phase):
        self.marks.append((phase, self._stamp()))

    def read(self):
        """({phase: seconds} since the previous read, in PHASES order, phases without a mark left out; the host-clock
        seconds of the same interval, which on a CPU is their sum). The next interval starts at the last mark."""
        if not self.marks:
            return {}, 0.0
        if self.cuda:
            self.marks[-1][1][1].synchronize()  # every earlier event of the stream has completed too
        totals, prev = {}, self.start
        for phase, stamp in self.marks:
            totals[phase] = totals.get(phase, 0.0) + self._seconds(prev, stamp)
            prev = stamp
        wall = prev[0] - self.start[0]
        self.start, self.marks = prev, []
        return {p: totals[p] for p in PHASES if p in totals}, wall


def call_ms(fn, device, reps=10, warmup=2, setup=None):
    """Milliseconds of one call of fn on `device`: the median of `reps` calls after `warmup` untimed ones, each call
    timed alone. setup(), when given, runs before every call and is not timed (set the leaves' grads to None, run
    the forward whose backward fn is). One host sync, at the end."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    marks = []
    for _ in range(reps):
        if setup:
            setup()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            marks.append((start, end))
        else:
            t0 = time.perf_counter()
            fn()
            marks.append((t0, time.perf_counter()))
    if cuda:
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in marks)
    return statistics.median(1e3 * (b - a) for a, b in marks)


def read_values(tensor):
    """A small device tensor's values as Python numbers. On a GPU this waits for the work queued before it (a host
    sync), so a training step calls it once, where its work is all queued; every read of a step goes through here,
    which lets a test on the meta device (whose tensors have no values) count them."""
    return tensor.tolist()


def biggest(parts):
    """'fwd+bwd 71%': the largest part and its share of the interval, for the training line."""
    total = sum(parts.values())
    if not parts or total <= 0:
        return ""
    phase = max(parts, key=parts.get)
    return f"{LABELS[phase]} {100 * parts[phase] / total:.0f}%"


class Readback:
    """A small device tensor read on the host one step later. The copy to pinned memory is queued behind the step's
    work and its event is waited on at the next step, after that step's own work is queued: the device never runs
    dry, unlike .item(), which empties its queue. On a CPU the copy is plain and the wait is nothing."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.host = None  # pinned buffer, reused: take() has waited for the copy that last wrote it
        self.pending = None

    def put(self, tensor, info=None):
        tensor = tensor.detach()
        if not self.cuda:
            self.pending = (tensor.clone(), None, info)
            return
        if self.host is None or self.host.shape != tensor.shape or self.host.dtype != tensor.dtype:
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.host.copy_(tensor, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self.pending = (self.host, done, info)

    def take(self):
        """(values on the host, info) of the last put, or None when nothing is pending."""
        if self.pending is None:
            return None
        values, done, info = self.pending
        self.pending = None
        if done is not None:
            done.synchronize()
        return read_values(values), info
