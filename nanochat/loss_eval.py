"""Bits per byte: a tokenizer-independent loss, so models with different vocabularies compare."""

import math
import torch
import torch.distributed as dist


@torch.no_grad()
def evaluate_bpb(model, batches, steps, token_bytes, per_batch=None):
    """
    Sum the per-token loss (nats) over `steps` batches and divide by the bytes those
    targets stand for. Special tokens (0 bytes) and ignored targets (-1) are left out.
    Summed across ranks when distributed. If per_batch is a dict, it receives the summed
    nats and bytes of each step ("nats", "bytes": lists), so that two models evaluated on the
    same batches can be compared batch by batch (nanochat.stats.bpb_delta_interval).
    """
    device = token_bytes.device
    total_nats = torch.zeros((), dtype=torch.float64, device=device)
    total_bytes = torch.zeros((), dtype=torch.int64, device=device)
    step_nats, step_bytes = [], []
    for _ in range(steps):
        x, y, *_ = next(batches)
        loss = model(x, y, loss_reduction="none").view(-1)
        y = y.view(-1)
        valid = y >= 0
        nbytes = torch.where(valid, token_bytes[y.clamp_min(0)], 0)
        counted = nbytes > 0
        nats, nb = (loss.double() * counted).sum(), nbytes.sum()
        total_nats += nats
        total_bytes += nb
        if per_batch is not None:
            step_nats.append(nats)
            step_bytes.append(nb)
    if dist.is_initialized():
        dist.all_reduce(total_nats)
        dist.all_reduce(total_bytes)
    if per_batch is not None and steps > 0:
        nats, nb = torch.stack(step_nats), torch.stack(step_bytes)
        if dist.is_initialized():  # step i of every rank together is one batch
            dist.all_reduce(nats)
            dist.all_reduce(nb)
        per_batch["nats"], per_batch["bytes"] = nats.tolist(), nb.tolist()
    if total_bytes.item() == 0:
        return float("nan")
    return total_nats.item() / (math.log(2) * total_bytes.item())
