"""nanochat/stats.py: paired bootstrap intervals, the CORE delta's, the minimum detectable difference."""

import math
import random

import numpy as np
import pytest

from nanochat import stats
from nanochat.core_eval import evaluate_core
from tests.test_core_eval import TinyCausalLM, ByteTokenizer, mixed_items


def synthetic_pair(n, acc_a, shift, seed):
    """Paired verdicts: b agrees with a except that a fraction `shift` of a's wrong items become right."""
    rng = np.random.default_rng(seed)
    a = rng.random(n) < acc_a
    b = a.copy()
    wrong = np.flatnonzero(~a)
    b[rng.choice(wrong, int(shift * n), replace=False)] = True
    return a.astype(int), b.astype(int)


def test_bootstrap_finds_a_known_difference():
    a, b = synthetic_pair(4000, 0.5, 0.05, seed=1)
    r = stats.paired_bootstrap(a, b)
    assert r["delta"] == pytest.approx(0.05)
    lo, hi = r["ci"]
    assert 0.04 < lo < 0.05 < hi < 0.06 and r["p"] < 0.001
    # swapping the runs flips the sign and the interval
    s = stats.paired_bootstrap(b, a)
    assert s["delta"] == -r["delta"] and s["ci"] == pytest.approx((-hi, -lo), abs=2e-3)


def test_bootstrap_interval_has_the_binomial_width():
    # 200 discordant items of 1000 split evenly: SE of the mean difference is sqrt(0.2 / 1000)
    a = np.array([1] * 100 + [0] * 100 + [1] * 400 + [0] * 400)
    b = np.array([0] * 100 + [1] * 100 + [1] * 400 + [0] * 400)
    r = stats.paired_bootstrap(a, b, n_resamples=20000)
    assert r["delta"] == 0 and r["p"] > 0.9
    half = 1.96 * math.sqrt(0.2 / 1000)
    assert r["ci"][0] == pytest.approx(-half, rel=0.1) and r["ci"][1] == pytest.approx(half, rel=0.1)


def test_identical_runs_give_zero_and_p_one():
    a = np.random.default_rng(0).integers(0, 2, 500)
    r = stats.paired_bootstrap(a, a.copy())
    assert r == {"delta": 0.0, "ci": (0.0, 0.0), "p": 1.0}


def test_bootstrap_is_deterministic_for_a_seed():
    a, b = synthetic_pair(300, 0.4, 0.02, seed=3)
    assert stats.paired_bootstrap(a, b, seed=7) == stats.paired_bootstrap(a, b, seed=7)
    # another seed draws other resamples (the verdicts are discrete, so compare the whole result, p included)
    assert stats.paired_bootstrap(a, b, n_resamples=500, seed=7) != stats.paired_bootstrap(
        a, b, n_resamples=500, seed=8
    )


def test_bootstrap_refuses_unpaired_or_non_binary_input():
    with pytest.raises(ValueError, match="same items"):
        stats.paired_bootstrap([0, 1, 1], [0, 1])
    with pytest.raises(ValueError, match="0/1"):
        stats.paired_bootstrap([0, 2], [0, 1])


def records_of(verdicts):
    """{task: 0/1 list} -> the column dict base_eval writes (idx in a scrambled order, as a file may hold them)."""
    rows = [(t, i, c) for t, vs in verdicts.items() for i, c in enumerate(vs)]
    random.Random(0).shuffle(rows)
    return {"task": [r[0] for r in rows], "idx": [r[1] for r in rows], "correct": [r[2] for r in rows]}


def test_core_delta_point_estimate_is_the_core_score_exactly(tmp_path, write_eval_bundle):
    # two different tiny models scored by evaluate_core on the same items: the interval's point estimates
    # are its CORE numbers to the last bit, and the delta is their difference
    data = {
        "mc": mixed_items("multiple_choice", 30),
        "wino": mixed_items("schema", 25),
        "lam": mixed_items("language_modeling", 20),
    }
    root = write_eval_bundle(
        tmp_path / "b",
        [
            ("mc", "multiple_choice", 1, 25, data["mc"]),
            ("wino", "schema", 0, 50, data["wino"]),
            ("lam", "language_modeling", 0, 0, data["lam"]),
        ],
    )
    outs = [
        evaluate_core(TinyCausalLM(seq_len=96, seed=s), ByteTokenizer(), "cpu", root, log=lambda line: None)
        for s in (0, 1)
    ]
    cols = [{k: [r[k] for r in out["records"]] for k in ("task", "idx", "correct")} for out in outs]
    r = stats.core_delta_interval(cols[0], cols[1], outs[0]["settings"])
    assert r["core_a"] == outs[0]["partial_core"] and r["core_b"] == outs[1]["partial_core"]
    assert r["delta"] == outs[1]["partial_core"] - outs[0]["partial_core"] != 0
    for label in data:
        t = r["tasks"][label]
        assert (
            t["centered_a"] == outs[0]["tasks"][label]["centered"]
            and t["centered_b"] == outs[1]["tasks"][label]["centered"]
        )
        assert t["ci"][0] <= t["delta"] <= t["ci"][1] and t["n"] == len(data[label])
    assert r["ci"][0] <= r["delta"] <= r["ci"][1]


def test_core_delta_interval_resamples_within_tasks():
    meta = {"tasks": {"easy": {"random_baseline": 50.0}, "hard": {"random_baseline": 25.0}}}
    a = {"easy": [1] * 300 + [0] * 300, "hard": [1] * 100 + [0] * 300}
    b = {"easy": [1] * 300 + [0] * 300, "hard": [1] * 100 + [1] * 60 + [0] * 240}  # +0.15 accuracy on hard only
    r = stats.core_delta_interval(records_of(a), records_of(b), meta)
    hard_delta = (0.4 - 0.25) / 0.75 - (0.25 - 0.25) / 0.75
    assert r["delta"] == pytest.approx(hard_delta / 2) and r["p"] < 0.001
    assert r["tasks"]["easy"] == {**r["tasks"]["easy"], "delta": 0.0, "ci": (0.0, 0.0), "p": 1.0}
    # the CORE interval is the hard task's interval halved (the easy task adds no variance)
    assert r["ci"][0] == pytest.approx(r["tasks"]["hard"]["ci"][0] / 2, rel=0.05)
    assert r["tasks"]["hard"]["se_a"] == pytest.approx(math.sqrt(0.25 * 0.75 / 400) / 0.75)
    # identical runs: 0 inside the interval, p = 1; deterministic per seed
    same = stats.core_delta_interval(records_of(a), records_of(a), meta)
    assert same["delta"] == 0 and same["ci"] == (0.0, 0.0) and same["p"] == 1.0
    assert stats.core_delta_interval(records_of(a), records_of(b), meta, seed=3) == stats.core_delta_interval(
        records_of(a), records_of(b), meta, seed=3
    )
    with pytest.raises(ValueError, match="task hard: the two runs did not score the same examples"):
        stats.core_delta_interval(records_of(a), records_of({**b, "hard": b["hard"][:-1]}), meta)


def test_bpb_delta_interval_from_per_batch_losses():
    rng = np.random.default_rng(0)
    nbytes = rng.integers(900, 1100, 40).astype(float)
    nats_a = nbytes * math.log(2) * (1.0 + 0.05 * rng.standard_normal(40))  # ~1.0 bpb, batch-to-batch spread
    nats_b = nats_a - nbytes * math.log(2) * 0.01  # b is better by exactly 0.01 bpb on every batch
    r = stats.bpb_delta_interval(nats_a, nats_b, nbytes)
    assert r["delta"] == pytest.approx(-0.01) and r["bpb_a"] == pytest.approx(nats_a.sum() / math.log(2) / nbytes.sum())
    # paired: no noise left
    assert r["ci"] == pytest.approx((-0.01, -0.01), abs=1e-9) and r["p"] < 0.001 and r["batches"] == 40
    noisy = stats.bpb_delta_interval(nats_a, nats_a * (1 + 0.02 * rng.standard_normal(40)), nbytes)
    assert noisy["ci"][0] < noisy["delta"] < noisy["ci"][1] and noisy["ci"][1] - noisy["ci"][0] > 1e-3


def test_min_detectable_difference():
    # one task of n items, b = 0, independent runs at 50%: SE = sqrt(2 * 0.25 / n), MDE = 2.80 SE
    mde, se = stats.min_detectable_core_diff({"t": 1000}, {"t": 0})
    assert se == pytest.approx(math.sqrt(0.5 / 1000)) and mde == pytest.approx(2.8016 * se, rel=1e-4)
    # T equal tasks: SE shrinks as 1/sqrt(T); centring by b scales it by 1/(1 - b)
    sizes = {f"t{i}": 1000 for i in range(4)}
    assert stats.min_detectable_core_diff(sizes, dict.fromkeys(sizes, 0))[1] == pytest.approx(se / 2)
    assert stats.min_detectable_core_diff({"t": 1000}, {"t": 50})[1] == pytest.approx(2 * se)
    # measured discordance (paired runs agree on most items) replaces the independent-runs variance
    assert stats.min_detectable_core_diff({"t": 1000}, {"t": 0}, discordance=0.1)[1] == pytest.approx(
        math.sqrt(0.1 / 1000)
    )


def test_too_few_units_gives_the_reason_instead_of_an_interval():
    assert stats.MIN_UNITS == 30
    assert stats.too_few_units(2, "batches") == "too few batches for an interval (2 < 30)"
    assert stats.too_few_units(29, "items") == "too few items for an interval (29 < 30)"
    assert stats.too_few_units(30, "batches") is None and stats.too_few_units(10_000, "items") is None
    # why: 2 batches whose deltas share a sign (half the time with no true difference) give a "95% interval"
    # excluding 0 and the smallest p-value there is, however far apart the two deltas are
    r = stats.bpb_delta_interval([1.0, 1.0], [0.99, 0.5], [1, 1])
    assert r["ci"][1] < 0 and r["p"] == pytest.approx(1 / 10001)


# ---------------------------------------------------------------------------
# groups of runs: seeds and evaluation units together


def simulated_groups(rng, k, n, paired, delta, sd_seed=0.01, sd_pair=0.008, sd_batch=0.03, sd_gain=0.01, sd_run=0.02):
    """Per-batch losses (nats, bytes) of two groups of k runs on n shared val batches, b's true bpb delta lower:
    batch difficulty shared by every run, a batch x group gain (b better on some batches: the units are a sample),
    seed noise, part of it shared by the runs of one seed pair when paired, and each run's own batch noise."""
    batch, gain = rng.normal(0, sd_batch, n), rng.normal(0, sd_gain, n)
    common = rng.normal(0, sd_pair, k)

    def group(shift, g):
        s = (common if paired else rng.normal(0, sd_pair, k)) + rng.normal(0, sd_seed, k)
        return (1.0 + shift + s[:, None] + batch + g + rng.normal(0, sd_run, (k, n))) * math.log(2)

    return group(0, 0 * gain), group(delta, gain), np.ones(n)


@pytest.mark.parametrize("paired", [True, False])
def test_group_interval_covers_a_known_difference(paired):
    # 2,000 simulated experiments of 5 seeds per arm on 40 batches; Monte-Carlo SE of a 95% coverage: 0.005
    rng, hits, N = np.random.default_rng(1), 0, 2000
    for e in range(N):
        a, b, nbytes = simulated_groups(rng, 5, 40, paired, delta=0.01)
        values, reps = stats.bpb_replicates(np.vstack([a, b]), nbytes, n_resamples=200, seed=e)
        r = stats.group_delta(values[:5], values[5:], reps[:, :5], reps[:, 5:], paired)
        hits += r["ci"][0] <= 0.01 <= r["ci"][1]
        assert not r["eval_only"] and r["paired"] == paired
    assert 0.93 <= hits / N <= 0.97


def test_paired_interval_is_narrower_on_correlated_seeds():
    # the runs of a seed pair share most of their seed noise (same data order): pairing removes it
    rng, ratio = np.random.default_rng(2), []
    for e in range(50):
        a, b, nbytes = simulated_groups(rng, 5, 40, True, delta=0.01, sd_seed=0.002, sd_pair=0.02)
        values, reps = stats.bpb_replicates(np.vstack([a, b]), nbytes, n_resamples=200, seed=e)
        args = values[:5], values[5:], reps[:, :5], reps[:, 5:]
        p, u = stats.group_delta(*args, paired=True), stats.group_delta(*args, paired=False)
        assert p["delta"] == u["delta"]
        ratio.append((p["ci"][1] - p["ci"][0]) / (u["ci"][1] - u["ci"][0]))
    assert np.median(ratio) < 0.5


def test_group_of_one_is_evaluation_noise_only():
    rng = np.random.default_rng(3)
    a, b, nbytes = simulated_groups(rng, 1, 40, False, delta=0.01)
    values, reps = stats.bpb_replicates(np.vstack([a, b]), nbytes, n_resamples=2000)
    r = stats.group_delta(values[:1], values[1:], reps[:, :1], reps[:, 1:], paired=False)
    assert r["eval_only"] and r["df"] == math.inf and r["seed_sd"] == {"a": None, "b": None, "d": None}
    # then it is the paired bootstrap over batches: the same spread as bpb_delta_interval's
    ref = stats.bpb_delta_interval(a[0], b[0], nbytes, n_resamples=2000)
    assert r["delta"] == pytest.approx(ref["delta"]) and r["se"] * 3.92 == pytest.approx(
        ref["ci"][1] - ref["ci"][0], rel=0.1
    )


def test_replicates_reproduce_each_runs_value():
    rng = np.random.default_rng(4)
    verdicts = [{"t1": rng.integers(0, 2, 40).tolist(), "t2": rng.integers(0, 2, 30).tolist()} for _ in range(3)]
    meta = {"tasks": {"t1": {"random_baseline": 25.0}, "t2": {"random_baseline": 50.0}}}
    values, reps = stats.core_replicates([records_of(v) for v in verdicts], meta, n_resamples=300)
    ref = stats.core_delta_interval(records_of(verdicts[0]), records_of(verdicts[1]), meta)
    assert values[0] == ref["core_a"] and values[1] == ref["core_b"] and reps.shape == (300, 3)
    assert abs(reps.mean(0) - values).max() < 0.03
    nats, nbytes = rng.random((2, 35)) * 1000, rng.integers(500, 1500, 35)
    values, _ = stats.bpb_replicates(nats, nbytes, n_resamples=10)
    assert values == pytest.approx(nats.sum(1) / (math.log(2) * nbytes.sum()))


def test_t_distribution_and_runs_needed():
    for df, q in ((1, 12.706), (2, 4.303), (4, 2.776), (3, 3.182), (10, 2.228), (math.inf, 1.960)):
        assert stats.t_quantile(0.975, df) == pytest.approx(q, abs=2e-3)
    assert stats.t_cdf(0.0, 3) == pytest.approx(0.5) and stats.t_cdf(-2.776, 4) == pytest.approx(0.025, abs=1e-4)
    assert 2 * (1 - stats.t_cdf(100, 1)) == pytest.approx(1 - 2 * math.atan(100) / math.pi, rel=1e-5)  # Cauchy: exact
    # n = 2 (1.96 + 0.84)^2 sigma^2 / delta^2 per arm; paired on the pair differences, half of it
    assert stats.runs_needed(0.01, 0.0148, paired=False) == math.ceil(2 * 2.8016**2 * 0.01**2 / 0.0148**2)
    assert stats.runs_needed(0.02, 0.01, paired=True) == 32 and stats.runs_needed(0.02, 0.01, paired=False) == 63
    assert stats.runs_needed(None, 0.01, paired=False) is None
