"""
Stop a run on a non-finite loss or gradient before the update is applied.

The stop names the step, the parameters whose gradients are non-finite and, where the model
can tell (its nonfinite_origin hook), where it started.

The flags are computed on the device and veto the step's update there (MuonAdamW.step's gate), so nothing waits
for them: a step that logs a row reads them with its loss, after its update is queued (check_finite); one that
logs none hands them to the next step, which reads them with its own work already queued (check_finite_late).
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
    return (
        f"non-finite {'loss' if not math.isfinite(loss) else 'gradient'} at step {step} (loss {loss:.4g}); "
        f"non-finite gradients in: {shown or 'none'}"
    )


def check_finite(values, names, step, origin=None):
    """Raise NonFiniteError unless every flag is set. values: the host copy of finite_flags' tensor behind the loss,
    [loss, loss flag, gradient flags...]; names: graded_names of the step. The step's update was vetoed on the device
    (MuonAdamW.step's gate), so the weights are still those the step started from, which origin() (the model's guess
    at where it started, over the step's last micro-batch) needs."""
    loss, flags = values[0], values[1:]
    if all(flags):
        return
    bad = [n for n, ok in zip(names, flags[1:]) if not ok]
    where = origin() if origin else None
    # the origin last: the failure experiments read it from there (scripts/experiments/failures.py)
    raise NonFiniteError(
        nonfinite_message(step, loss, bad) + "; its update was not applied" + (f"; origin: {where}" if where else "")
    )


def check_finite_late(values, step, names, log_every):
    """check_finite for a step that logged no row, read during the next step (before that step's update): the
    vetoed step's batch is gone, so no origin is sought; no checkpoint holds the step (saves log)."""
    loss, flags = values[0], values[1:]
    if all(flags):
        return
    bad = [n for n, ok in zip(names, flags[1:]) if not ok]
    raise NonFiniteError(
        nonfinite_message(step, loss, bad) + f"; its update was not applied; seen during step {step + 1} (with "
        f"--log-every {log_every} a step that logs no row is checked during the next); --log-every 1 from the "
        "last checkpoint names its origin"
    )
