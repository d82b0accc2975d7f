"""
How sure is a difference between two runs: paired bootstrap intervals and resolvable differences.

Paired bootstrap intervals for the CORE delta, each task's
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
        per_task[label] = {
            **_summary(cb - ca, d),
            "n": int(a.size),
            "centered_a": ca,
            "centered_b": cb,
            "se_a": centered_se(a.mean(), a.size, base),
            "se_b": centered_se(b.mean(), b.size, base),
        }
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
        boot[start : start + len(idx)] = (nb[idx].sum(1) - na[idx].sum(1)) / total
    bpb_a, bpb_b = na.sum() / (math.log(2) * nbytes.sum()), nb.sum() / (math.log(2) * nbytes.sum())
    return {**_summary(bpb_b - bpb_a, boot), "bpb_a": float(bpb_a), "bpb_b": float(bpb_b), "batches": int(na.size)}


def min_detectable_core_diff(task_sizes, baselines, accuracy=0.5, discordance=None, alpha=0.05, power=0.8):
    """The smallest true CORE difference a paired two-sided test at level alpha detects with the given
    power, for tasks of task_sizes items ({label: n}) with random baselines ({label: percent}).

    Per task the variance of the centred-accuracy difference is d / n / (1 - b)^2, d the variance of one
    item's verdict difference: with `discordance` (the fraction of items on which the two runs disagree,
    measured from records; a number or {label: fraction}) d = discordance; without it the runs are taken as independent
    with the given accuracy, d = 2 acc (1 - acc), the upper end for positively correlated models. CORE averages T tasks,
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


# ---------------------------------------------------------------------------
# groups of runs: the difference of two group means over training seeds and evaluation units
#
# Every run of both groups is scored on the same evaluation units (val batches, CORE items), so the units are
# crossed with the runs. The variance of the difference of group means has three parts: seed to seed (training
# noise), the units both groups share (which items happen to be in the tasks), and each run's own item-level
# noise. The seed-to-seed variance of the runs' values already holds the third part; the bootstrap over units
# (shared by all runs, so paired as everywhere here) holds the second and the third. Their sum counts the third
# twice, so it is taken off once: its size is the bootstrap spread of the runs around their group mean
# (see group_delta). docs/comparisons.md says why this and not a two-level resample.


def bpb_replicates(nats, nbytes, n_resamples=10000, seed=0):
    """(values, replicates) of several runs' val bpb on the same batches: nats (runs x batches) summed losses,
    nbytes (batches,) their byte counts. replicates[r, j] is run j's bpb on the r-th resample of the batches,
    one resample shared by every run."""
    nats, nbytes = np.asarray(nats, dtype=np.float64), np.asarray(nbytes, dtype=np.float64)
    if nats.ndim != 2 or nats.shape[1] != nbytes.size or nbytes.size == 0:
        raise ValueError("nats must be runs x batches, nbytes one count per batch")
    rng = np.random.default_rng(seed)
    reps = np.empty((n_resamples, nats.shape[0]))
    for start in range(0, n_resamples, 1000):
        w = _resample_counts(nbytes.size, min(1000, n_resamples - start), rng)
        reps[start : start + len(w)] = (w @ nats.T) / (math.log(2) * (w @ nbytes))[:, None]
    return nats.sum(1) / (math.log(2) * nbytes.sum()), reps


def _resample_counts(n, size, rng):
    """size x n: how often each of n units is drawn in each of size resamples with replacement."""
    idx = rng.integers(0, n, size=(size, n)) + n * np.arange(size)[:, None]
    return np.bincount(idx.ravel(), minlength=size * n).reshape(size, n).astype(np.float64)


def core_replicates(records, meta, n_resamples=10000, seed=0):
    """(values, replicates) of several runs' CORE (or partial CORE) on the same items: records, one column dict
    per run as core_delta_interval takes them; items are resampled within each task, one resample shared by
    every run. values are centred and averaged over the tasks exactly as core_delta_interval does."""
    tasks = meta["tasks"]
    if not tasks:
        raise ValueError("no tasks to compare")
    rng = np.random.default_rng(seed)
    values, reps = np.zeros(len(records)), np.zeros((n_resamples, len(records)))
    for label, info in tasks.items():
        by_run = [_by_task(rec, label) for rec in records]
        if by_run[0][0].size == 0 or any(not np.array_equal(idx, by_run[0][1]) for _, idx in by_run):
            raise ValueError(f"task {label}: the runs did not score the same examples")
        correct = np.stack([c for c, _ in by_run]).astype(np.float64)  # runs x items
        base, n = info["random_baseline"], correct.shape[1]
        values += np.array([centered_accuracy(int(c.sum()) / n, base) for c in correct])
        chunk = max(1, min(1000, 2_000_000 // n))  # a resample matrix of at most ~16 MB
        for start in range(0, n_resamples, chunk):
            w = _resample_counts(n, min(chunk, n_resamples - start), rng)
            reps[start : start + len(w)] += centered_accuracy((w @ correct.T) / n, base)
    return values / len(tasks), reps / len(tasks)


def _t_table(df):
    """(t, P(0 < T < t)) of Student's t with df degrees of freedom (any df > 0) on a grid to t = 81,000:
    the trapezoid rule on t = sinh(u), uniform in u, where the density is smooth and its tails short."""
    u = np.linspace(0.0, 12.0, 24001)
    t = np.sinh(u)
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    f = c * (1 + t * t / df) ** (-(df + 1) / 2) * np.cosh(u)
    return t, np.concatenate([[0.0], np.cumsum((f[1:] + f[:-1]) / 2 * (u[1] - u[0]))])


def t_cdf(x, df):
    """Student's t distribution function (no scipy here); df = inf is the normal."""
    if math.isinf(df):
        return NormalDist().cdf(x)
    t, area = _t_table(df)
    return 0.5 + math.copysign(float(np.interp(abs(x), t, area)), x)


def t_quantile(p, df):
    """Inverse of t_cdf."""
    if math.isinf(df):
        return NormalDist().inv_cdf(p)
    t, area = _t_table(df)
    return math.copysign(float(np.interp(abs(p - 0.5), area, t)), p - 0.5)


def own_variance(reps):
    """The item-level variance of the runs' own noise, summed over the runs of one group (or the pair
    differences), from their bootstrap replicates (resamples x runs): k/(k-1) times the summed variance of
    each run around the group mean, which the units every run shares do not move."""
    k = reps.shape[1]
    return k / (k - 1) * (reps - reps.mean(1, keepdims=True)).var(0, ddof=1).sum()


def group_delta(values_a, values_b, reps_a, reps_b, paired, alpha=0.05):
    """The difference of group means b - a with a 1 - alpha interval and a two-sided p-value that account for
    training noise (seeds) and evaluation sampling (the shared units).

    values_*: each run's value (k_a, k_b); reps_*: their bootstrap replicates over the shared units
    (resamples x runs, one resample shared by every run: bpb_replicates, core_replicates). paired: run j of a
    and run j of b share their seeds (k_a = k_b), so the seed noise is that of the differences.

    var = seed variance of the mean difference (sample variances: paired s_d^2 / k, else s_a^2 / k_a + s_b^2 / k_b)
        + bootstrap variance of the difference of group means over the units
        - the runs' own unit-level noise, which both terms hold (taken off once; never below the bootstrap term).
    The interval is delta +/- t quantile * sqrt(var), its degrees of freedom those of the seed variance (k - 1
    paired, Welch-Satterthwaite unpaired) carried to var by Satterthwaite's rule where they are at least 2 (the
    bootstrap terms rest on many units: as good as known); with a group of one there is no seed variance: evaluation
    noise only, normal. Returns {"delta", "ci", "p", "se", "df", "se_eval", "seed_sd": {"a", "b", "d"}, "paired",
    "eval_only"}."""
    va, vb = np.asarray(values_a, dtype=np.float64), np.asarray(values_b, dtype=np.float64)
    ra, rb = np.asarray(reps_a, dtype=np.float64), np.asarray(reps_b, dtype=np.float64)
    ka, kb = va.size, vb.size
    if paired and ka != kb:
        raise ValueError(f"paired groups need as many runs in each: {ka} vs {kb}")
    delta = vb.mean() - va.mean()
    var_eval = float((rb.mean(1) - ra.mean(1)).var(ddof=1))
    sd = {
        "a": float(va.std(ddof=1)) if ka > 1 else None,
        "b": float(vb.std(ddof=1)) if kb > 1 else None,
        "d": float((vb - va).std(ddof=1)) if paired and ka > 1 else None,
    }
    if paired and ka > 1:
        var_seed, df = sd["d"] ** 2 / ka, ka - 1
        own = own_variance(rb - ra) / ka**2
    elif not paired and ka > 1 and kb > 1:
        sa2, sb2 = sd["a"] ** 2 / ka, sd["b"] ** 2 / kb
        var_seed = sa2 + sb2
        df = var_seed**2 / (sa2**2 / (ka - 1) + sb2**2 / (kb - 1)) if var_seed > 0 else float(ka + kb - 2)
        own = own_variance(ra) / ka**2 + own_variance(rb) / kb**2
    else:  # a group of one: no seed-to-seed variance to measure
        var_seed, df, own = None, math.inf, 0.0
    var = var_eval if var_seed is None else max(var_seed + var_eval - own, var_eval)
    if var_seed is not None and df >= 2:  # Satterthwaite: only the seed term rests on few runs, the rest on many units
        df = max(df, var**2 / (var_seed**2 / df)) if var_seed > 0 else math.inf  # never fewer than the seeds give
    # (with 1 degree of freedom a variance is too unstable for that rule: 2 seeds keep t(1), conservative)
    se = math.sqrt(var)
    if se == 0:
        ci, p = (float(delta), float(delta)), 1.0 if delta == 0 else 0.0
    else:
        q = t_quantile(1 - alpha / 2, df)
        ci = (float(delta - q * se), float(delta + q * se))
        p = 2 * (1 - t_cdf(abs(delta) / se, df))
    return {
        "delta": float(delta),
        "ci": ci,
        "p": float(min(1.0, max(p, 0.0))),
        "se": se,
        "df": float(df),
        "se_eval": math.sqrt(var_eval),
        "seed_sd": sd,
        "paired": bool(paired),
        "eval_only": var_seed is None,
    }


def runs_needed(sd, delta, paired, alpha=0.05, power=0.8):
    """Runs per arm for a two-sided test at level alpha to find a true difference delta with the given power,
    normal approximation: unpaired n = 2 (z_{1-alpha/2} + z_power)^2 sd^2 / delta^2, sd the seed-to-seed
    standard deviation of one arm; paired n = (z + z)^2 sd_d^2 / delta^2, sd_d that of the pair differences.
    None without an sd (fewer than 2 seeds) or with delta 0."""
    if sd is None or not delta:
        return None
    z = NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(power)
    return max(2, math.ceil((1 if paired else 2) * z**2 * sd**2 / delta**2))
