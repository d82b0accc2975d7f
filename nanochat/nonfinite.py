"""
Stop a run on a non-finite loss or gradient before the update is applied, naming the step, the parameters whose
gradients are non-finite and, where the model can tell (its nonfinite_origin hook), where it started.

The flags are computed on the device (no host sync): a step that logs a row reads them at once (check_finite),
one that logs none hands them to the next step, which reads them with its own work already queued (check_finite_late).
"""

import math

import torch


class NonFiniteError(Exception):
    pass


def finite_flags(model, loss):
    """1 where finite, 0 where not: the loss, then the gradient of each parameter that has one (in model.parameters()
    order, as graded_names), computed on the device: no host sync."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norms = torch.stack(torch._foreach_norm(grads)).to(loss.dtype) if grads else loss.new_zeros(0)
    return torch.cat([loss.reshape(1), norms]).isfinite().to(loss.dtype)


def graded_names(model):
    return [n for n, p in model.named_parameters() if p.grad is not None]


def nonfinite_message(step, loss, bad):
    shown = ", ".join(bad[:12]) + (f" (+{len(bad) - 12} more)" if len(bad) > 12 else "")
    return (f"non-finite {'loss' if not math.isfinite(loss) else 'gradient'} at step {step} (loss {loss:.4g}); "
            f"non-finite gradients in: {shown or 'none'}")


def check_finite(model, loss, step, idx):
    """Raise NonFiniteError on a non-finite loss or gradient, with the model's guess of the origin over idx
    (the last micro-batch)."""
    if finite_flags(model, loss).all().item():  # one host sync
        return
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    origin = model.nonfinite_origin(idx)
    raise NonFiniteError(nonfinite_message(step, loss.item(), bad) + (f"; origin: {origin}" if origin else ""))


def check_finite_late(values, step, names, log_every):
    """check_finite for a step that logged no row, from its finite_flags read during the next step: the weights have
    taken that step's update by now, so no origin is sought; no checkpoint holds them (saves log)."""
    loss, flags = values[0], values[1:]
    if all(flags):
        return
    bad = [n for n, ok in zip(names, flags[1:]) if not ok]
    raise NonFiniteError(nonfinite_message(step, loss, bad) + f"; seen during step {step + 1} (with --log-every {log_every} a "
                         "step that logs no row is checked during the next); --log-every 1 from the last checkpoint names its origin")
