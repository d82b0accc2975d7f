"""
How sure is a difference between two runs? Paired bootstrap intervals for the CORE delta, each task's
delta and the val bpb delta, and the smallest CORE difference an evaluation of a given size can resolve.

Both runs are scored on the same items (CORE) or the same batches (bpb), so every interval is paired:
an item both runs get right or both get wrong adds no noise to the difference.

The bootstrap resamples items with replacement. For 0/1 verdicts of two runs an item is one of four
kinds (both right, only a, only b, both wrong), so a resample is fully described by how many of each
kind it drew: a multinomial draw of n over the observed frequencies. That is the same distribution as
drawing n indices, at a cost independent of n.

A bootstrap interval needs enough units (val batches, CORE items) to mean what it says: below
MIN_UNITS every caller shows the delta alone, with too_few_units' reason (docs/comparisons.md).
"""

import math
from statistics import NormalDist

import numpy as np

from nanochat.core_eval import centered_accuracy  # the one centring CORE uses; it takes arrays too


# The fewest resampled units (val batches, CORE items) that a 95% bootstrap interval is given for. With n units
# of one sign every resample keeps that sign, so the interval excludes 0 and p = 1 / (resamples + 1) whatever the
# spread; with no true difference that happens with probability 2^(1 - n): half the time on 2 batches.
# Measured coverage of the percentile interval of a mean: 48% at n = 2, 83% at 5, 90% at 10, 93% at 30.
MIN_UNITS = 30


def too_few_units(n, unit):
    """None when a bootstrap over n units (say "batches", "items") gives an interval, else the reason to
    print in its place: the delta is still shown, without interval, p-value or verdict."""
    return None if n >= MIN_UNITS else f"too few {unit} for an interval ({n} < {MIN_UNITS})"


def _verdicts(x, name):
    x = np.asarray(x)
    if x.ndim != 1 or x.size == 0 or not np.isin(x, (0, 1)).all():
        raise ValueError(f"{name} must be a non-empty 1-D array of 0/1 verdicts")
    return x.astype(bool)


def _kind_counts(a, b):
    """(both right, only a, only b, both wrong) counts of paired verdicts."""
    return np.array([(a & b).sum(), (a & ~b).sum(), (~a & b).sum(), (~a & ~b).sum()])


def _resample_accuracies(a, b, n_resamples, rng):
    """n_resamples bootstrap accuracies of a and of b on the same resampled items."""
    n = a.size
    draws = rng.multinomial(n, _kind_counts(a, b) / n, size=n_resamples)
    return (draws[:, 0] + draws[:, 1]) / n, (draws[:, 0] + draws[:, 2]) / n


def _summary(delta, boot):
    """delta, its 95% percentile interval and a two-sided p-value from bootstrap replicates. The p-value
    shifts the replicates to a true difference of 0 and counts those at least as far out as delta
    (+1 on both sides: never exactly 0 from a finite number of resamples)."""
    lo, hi = np.percentile(boot, [2.5, 97.5])
    extreme = np.abs(boot - delta) >= abs(delta) - 1e-12
    p = (1 + extreme.sum()) / (1 + boot.size)
    return {"delta": float(delta), "ci": (float(lo), float(hi)), "p": float(p)}


def paired_bootstrap(correct_a, correct_b, n_resamples=10000, seed=0):
    """Mean difference b - a of paired 0/1 verdicts on the same items, its 95% percentile interval and a
    two-sided p-value: {"delta", "ci": (lo, hi), "p"}."""
    a, b = _verdicts(correct_a, "correct_a"), _verdicts(correct_b, "correct_b")
    if a.size != b.size:
        raise ValueError(f"paired verdicts need the same items: {a.size} vs {b.size}")
    acc_a, acc_b = _resample_accuracies(a, b, n_resamples, np.random.default_rng(seed))
    return _summary(b.mean() - a.mean(), acc_b - acc_a)


def centered_se(accuracy, n, random_baseline_percent):
    """Standard error of one run's centred accuracy on n items (binomial)."""
    return math.sqrt(accuracy * (1 - accuracy) / n) / (1 - random_baseline_percent / 100)


def _by_task(records, label):
    """Verdicts of one task ordered by example index."""
    task = np.asarray(records["task"])
    sel = task == label
    order = np.argsort(np.asarray(records["idx"])[sel], kind="stable")
    return np.asarray(records["correct"])[sel][order].astype(bool), np.asarray(records["idx"])[sel][order]


def core_delta_interval(records_a, records_b, meta, n_resamples=10000, seed=0):
    """The CORE difference b - a with its 95% interval, resampling items within each task.

    records_*: columns "task", "idx", "correct" (one row per scored example, as base_eval writes them).
    meta: {"tasks": {label: {"random_baseline": percent, ...}}}: the task set and centring of the score.
    The point estimates are computed exactly as core_eval.evaluate_core does (accuracy = right / n,
    centred, summed in task order, divided by the number of tasks), so they reproduce its numbers.
    Returns {"delta", "ci", "p", "core_a", "core_b", "tasks": {label: {"delta", "ci", "p", "n",
    "centered_a", "centered_b", "se_a", "se_b"}}}."""
    tasks = meta["tasks"]
    if not tasks:
        raise ValueError("no tasks to compare")
    rng = np.random.default_rng(seed)
    boot = np.zeros(n_resamples)
    core_a, core_b, per_task = [], [], {}
    for label, info in tasks.items():
        a, idx_a = _by_task(records_a, label)
        b, idx_b = _by_task(records_b, label)
        if a.size == 0 or not np.array_equal(idx_a, idx_b):
            raise ValueError(f"task {label}: the two runs did not score the same examples")
        base = info["random_baseline"]
        ca = centered_accuracy(int(a.sum()) / a.size, base)
        cb = centered_accuracy(int(b.sum()) / b.size, base)
        core_a.append(ca)
        core_b.append(cb)
        acc_a, acc_b = _resample_accuracies(a, b, n_resamples, rng)
        d = centered_accuracy(acc_b, base) - centered_accuracy(acc_a, base)
        boot += d
        per_task[label] = {**_summary(cb - ca, d), "n": int(a.size), "centered_a": ca, "centered_b": cb,
                           "se_a": centered_se(a.mean(), a.size, base), "se_b": centered_se(b.mean(), b.size, base)}
    T = len(tasks)
    core_a, core_b = sum(core_a) / T, sum(core_b) / T
    return {**_summary(core_b - core_a, boot / T), "core_a": core_a, "core_b": core_b, "tasks": per_task}


def bpb_delta_interval(nats_a, nats_b, nbytes, n_resamples=10000, seed=0):
    """The val bpb difference b - a from per-batch summed losses (nats) of two runs on the same batches
    (same byte counts), resampling batches: {"delta", "ci", "p", "bpb_a", "bpb_b", "batches"}."""
    na, nb, nbytes = (np.asarray(x, dtype=np.float64) for x in (nats_a, nats_b, nbytes))
    if not (na.shape == nb.shape == nbytes.shape) or na.ndim != 1 or na.size == 0:
        raise ValueError("per-batch losses of both runs and the byte counts must be 1-D arrays of one length")
    rng = np.random.default_rng(seed)
    boot = np.empty(n_resamples)
    for start in range(0, n_resamples, 1000):  # chunks: a (resamples x batches) index matrix stays small
        idx = rng.integers(0, na.size, size=(min(1000, n_resamples - start), na.size))
        total = nbytes[idx].sum(1) * math.log(2)
        boot[start:start + len(idx)] = (nb[idx].sum(1) - na[idx].sum(1)) / total
    bpb_a, bpb_b = na.sum() / (math.log(2) * nbytes.sum()), nb.sum() / (math.log(2) * nbytes.sum())
    return {**_summary(bpb_b - bpb_a, boot), "bpb_a": float(bpb_a), "bpb_b": float(bpb_b), "batches": int(na.size)}


def min_detectable_core_diff(task_sizes, baselines, accuracy=0.5, discordance=None, alpha=0.05, power=0.8):
    """The smallest true CORE difference a paired two-sided test at level alpha detects with the given
    power, for tasks of task_sizes items ({label: n}) with random baselines ({label: percent}).

    Per task the variance of the centred-accuracy difference is d / n / (1 - b)^2, d the variance of one
    item's verdict difference: with `discordance` (the fraction of items on which the two runs disagree,
    measured from records; a number or {label: fraction}) d = discordance; without it the runs are taken as independent with the given
    accuracy, d = 2 acc (1 - acc), the upper end for positively correlated models. CORE averages T tasks,
    so SE = sqrt(sum of variances) / T and MDE = (z_{1-alpha/2} + z_power) SE. Returns (mde, se)."""
    var = 0.0
    for label, n in task_sizes.items():
        acc = accuracy[label] if isinstance(accuracy, dict) else accuracy
        disc = discordance[label] if isinstance(discordance, dict) else discordance
        d = disc if disc is not None else 2 * acc * (1 - acc)
        var += d / n / (1 - baselines[label] / 100) ** 2
    se = math.sqrt(var) / len(task_sizes)
    z = NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(power)
    return z * se, se
