"""Bits per byte: a tokenizer-independent loss, so models with different vocabularies compare."""

import math
from itertools import islice

import torch
import torch.distributed as dist

from nanochat.common import UserError
from nanochat.dataloader import data_loader


def batch_loss(model, x, y, token_bytes):
    """(summed nats, bytes) of one batch's targets: float64 and int64 scalars. Special tokens (0 bytes)
    and ignored targets (-1) are left out."""
    loss = model(x, y, loss_reduction="none").view(-1)
    y = y.view(-1)
    nbytes = torch.where(y >= 0, token_bytes[y.clamp_min(0)], 0)
    return (loss.double() * (nbytes > 0)).sum(), nbytes.sum()


def held_batches(tokenizer, B, T, split, wanted):
    """`wanted`, or fewer when one pass over the split packs fewer batches of B × T: the count of the stream every
    evaluation reads, data_loader(tokenizer, B, T, split, one_pass=True), so none of its text is scored twice. Counted
    by packing those batches: it reads the text the evaluation then reads again. A split of less than one batch
    is refused."""
    held = sum(1 for _ in islice(data_loader(tokenizer, B, T, split, one_pass=True), wanted))
    if held == 0:
        raise UserError(f"the {split} split holds less than one batch of {B}×{T} tokens; lower --device-batch-size")
    return held


def shared_batches(batches, n, rank=0, world_size=1, device="cpu"):
    """
    This rank's share of the first n batches of a stream every rank reads whole (a one-process data_loader):
    (index, inputs, targets) of batches rank, rank + W, ..., moved to device. The batches, and a bpb over them
    (evaluate_bpb_shared), are then the same whatever the number of processes W.
    """
    for i in range(n):
        x, y, *_ = next(batches)
        if i % world_size == rank:
            yield i, x.to(device), y.to(device)


@torch.no_grad()
def evaluate_bpb_shared(model, batches, token_bytes, per_batch=None, progress=None):
    """
    Bits per byte over the batches of a stream shared by all ranks, `batches` yielding (index, inputs,
    targets) of this rank's share (shared_batches). Each batch's nats and bytes are gathered into stream
    order and summed in that order, so the result does not depend on the number of processes. If per_batch
    is a dict, it receives those lists ("nats", "bytes"), one entry per batch, for paired comparisons
    (nanochat.stats.bpb_delta_interval). progress: a nanochat.common.Progress over the stream's batches, or None.
    """
    device = token_bytes.device
    mine = []
    for i, x, y in batches:
        mine.append((i, *batch_loss(model, x, y, token_bytes)))
        if progress is not None:
            progress.update(i + 1)
    n = torch.tensor(max((i + 1 for i, _, _ in mine), default=0), device=device)
    if dist.is_initialized():
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
    nats = torch.zeros(int(n), dtype=torch.float64, device=device)
    nbytes = torch.zeros(int(n), dtype=torch.int64, device=device)
    for i, batch_nats, batch_bytes in mine:
        nats[i], nbytes[i] = batch_nats, batch_bytes
    if dist.is_initialized():  # every entry is filled by one rank, zero on the others: the sum is exact
        dist.all_reduce(nats)
        dist.all_reduce(nbytes)
    nats, nbytes = nats.tolist(), nbytes.tolist()
    if per_batch is not None:
        per_batch["nats"], per_batch["bytes"] = nats, nbytes
    if sum(nbytes) == 0:
        return float("nan")
    return math.fsum(nats) / (math.log(2) * sum(nbytes))
