"""Bits per byte: a tokenizer-independent loss, so models with different vocabularies compare."""

import math
import torch
import torch.distributed as dist


@torch.no_grad()
def evaluate_bpb(model, batches, steps, token_bytes):
    """
    Sum the per-token loss (nats) over `steps` batches and divide by the bytes those
    targets stand for. Special tokens (0 bytes) and ignored targets (-1) are left out.
    Summed across ranks when distributed.
    """
    device = token_bytes.device
    total_nats = torch.zeros((), dtype=torch.float64, device=device)
    total_bytes = torch.zeros((), dtype=torch.int64, device=device)
    for _ in range(steps):
        x, y, *_ = next(batches)
        loss = model(x, y, loss_reduction="none").view(-1)
        y = y.view(-1)
        valid = y >= 0
        nbytes = torch.where(valid, token_bytes[y.clamp_min(0)], 0)
        counted = nbytes > 0
        total_nats += (loss.double() * counted).sum()
        total_bytes += nbytes.sum()
    if dist.is_initialized():
        dist.all_reduce(total_nats)
        dist.all_reduce(total_bytes)
    if total_bytes.item() == 0:
        return float("nan")
    return total_nats.item() / (math.log(2) * total_bytes.item())
