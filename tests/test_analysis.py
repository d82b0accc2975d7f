"""analysis/: its measures, its capture, and the command on a tiny GPT / NAG pair.

Each measure on inputs with a known answer, the capture against an independent forward, NAG's
rotation = atan(g), and the command on a tiny GPT / NAG pair."""

import json
import math
import os
import shutil

import numpy as np
import pytest
import torch

from analysis import measures as M
from analysis.capture import Accumulator, CaptureConfig, attention_probs, capture
from nanochat.gpt import GPT, GPTConfig, norm
from conftest import unwritable_reports

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------
# measures


def numpy_spectrum(x):
    """Independent: numpy covariance (1/n) and eigvalsh."""
    lam = np.clip(np.linalg.eigvalsh(np.cov(x, rowvar=False, bias=True)), 0, None)
    p = lam / lam.sum()
    p = p[p > 0]
    return lam.sum(), math.exp(-(p * np.log(p)).sum()), 1 / (p**2).sum()


def test_spectrum_isotropic_vs_rank1():
    rng = np.random.default_rng(0)
    iso = rng.standard_normal((20000, 6))
    st = M.spectrum_stats(torch.tensor(iso))
    assert st["effective_rank"] > 5.95 and st["participation_ratio"] > 5.9  # all 6 directions carry variance
    assert st["total_variance"] == pytest.approx(6, rel=0.03)
    # offset: covariance is around the mean
    rank1 = rng.standard_normal((500, 1)) * np.array([[1.0, 2.0, -1.0, 0.5, 0.0, 3.0]]) + 7.0
    st1 = M.spectrum_stats(torch.tensor(rank1))
    assert st1["effective_rank"] == pytest.approx(1, abs=1e-6) and st1["participation_ratio"] == pytest.approx(
        1, abs=1e-9
    )
    for x, s in ((iso[:300], M.spectrum_stats(torch.tensor(iso[:300]))), (rank1, st1)):
        assert [s["total_variance"], s["effective_rank"], s["participation_ratio"]] == pytest.approx(
            numpy_spectrum(x), rel=1e-6, abs=1e-9
        )


def test_streaming_sums_equal_all_at_once():
    x = torch.randn(300, 5, dtype=torch.float64) @ torch.randn(5, 5, dtype=torch.float64) + 2
    total, outer = torch.zeros(5, dtype=torch.float64), torch.zeros(5, 5, dtype=torch.float64)
    for chunk in x.split(70):
        total += chunk.sum(0)
        outer += chunk.T @ chunk
    streamed = M.covariance_stats(M.covariance_from_sums(total, outer, len(x)))
    assert streamed == pytest.approx(M.spectrum_stats(x), rel=1e-9)


def causal_uniform(T):
    return torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]


def test_sink_stats_bos_uniform_diagonal():
    T = 8
    bos = torch.zeros(T, T)
    bos[:, 0] = 1
    diag = torch.eye(T)
    uni = causal_uniform(T)
    s = M.sink_stats(torch.stack([bos, bos]))
    assert s["bos_share"] == 1 and s["first4_share"] == 1 and s["diagonal_share"] == pytest.approx(1 / T)
    s = M.sink_stats(torch.stack([diag]))
    assert (
        s["bos_share"] == pytest.approx(1 / T)
        and s["diagonal_share"] == 1
        and s["first4_share"] == pytest.approx(4 / T)
    )
    s = M.sink_stats(torch.stack([uni]))
    harmonic = sum(1 / (i + 1) for i in range(T)) / T
    first4 = sum(min(4, i + 1) / (i + 1) for i in range(T)) / T
    assert s["bos_share"] == pytest.approx(harmonic) and s["diagonal_share"] == pytest.approx(harmonic)
    assert s["first4_share"] == pytest.approx(first4)
    # depth: 8 layers, two per quartile: BOS, BOS | uniform, uniform | diagonal, diagonal | BOS, diagonal
    s = M.sink_stats(torch.stack([bos, bos, uni, uni, diag, diag, bos, diag]))
    assert s["layers_over_half_bos"] == 3  # the three BOS layers; uniform puts only the harmonic mean on BOS
    assert s["bos_share_by_quartile"] == pytest.approx([1, harmonic, 1 / T, (1 + 1 / T) / 2])


def brute_auroc(scores, labels):
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    return sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))


def test_auroc_perfect_reversed_tied_and_brute_force():
    labels = torch.tensor([0, 0, 1, 1, 0, 1])
    s = labels.double()
    assert M.auroc(s, labels) == 1 and M.auroc(-s, labels) == 0 and M.auroc(torch.zeros(6), labels) == 0.5
    rng = np.random.default_rng(1)
    for _ in range(20):
        sc = rng.integers(0, 5, size=30).astype(float)  # many ties
        lb = rng.integers(0, 2, size=30)
        assert M.auroc(torch.tensor(sc), torch.tensor(lb)) == pytest.approx(brute_auroc(sc, lb), abs=1e-12)


def test_cluster_norm_spread_known_clusters():
    # three orthogonal directions with a little angular noise; clusters of different sizes, scales and norm shapes
    gen = torch.Generator().manual_seed(0)
    dirs = torch.eye(6)[:3].double()
    rows, ratios, truth = [], [], []
    for c, (size, scale, power) in enumerate(((10, 1.0, 1), (20, 5.0, 2), (6, 50.0, 0.5))):
        norms = scale * torch.arange(1, size + 1, dtype=torch.float64) ** power
        v = dirs[c] + 0.01 * torch.randn(size, 6, generator=gen, dtype=torch.float64)
        rows.append(v / v.norm(dim=1, keepdim=True) * norms[:, None])
        r = (norms / norms.mean()).numpy()  # within a cluster, norms relative to the cluster's mean
        ratios.append((np.quantile(r, 0.1), np.quantile(r, 0.9)))
        truth += [c] * size
    perm = torch.randperm(36, generator=gen)
    x = torch.cat(rows)[perm]
    out = M.cluster_norm_spread(x, 3, seed=1)
    assert out["p10"] == pytest.approx(np.mean([a for a, _ in ratios])) and out["p90"] == pytest.approx(
        np.mean([b for _, b in ratios])
    )
    assign = M.spherical_kmeans(x, 3, seed=1)
    truth = torch.tensor(truth)[perm]
    assert all(len(set(assign[truth == c].tolist())) == 1 for c in range(3))  # each true cluster in one group


def test_weight_stats_known_stable_rank():
    u, _ = torch.linalg.qr(torch.randn(7, 3, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(5, 3, dtype=torch.float64))
    w = u @ torch.diag(torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)) @ v.T
    st = M.weight_stats(w)
    assert st["stable_rank"] == pytest.approx(14 / 9)
    a = w.numpy()
    assert st["mean_over_std"] == pytest.approx(abs(a.mean()) / a.std(ddof=1))
    assert st["max_over_rms"] == pytest.approx(np.abs(a).max() / np.sqrt((a**2).mean()))


def test_rotation_angles_known_and_tiny():
    theta = torch.tensor([0.0, 1e-7, 0.3, math.pi / 2, 3.0], dtype=torch.float64)
    a = torch.stack([torch.ones_like(theta), torch.zeros_like(theta), torch.zeros_like(theta)], 1) * 2.5
    b = torch.stack([theta.cos(), theta.sin(), torch.zeros_like(theta)], 1) * 0.1  # scale-free
    assert M.rotation_angles(a, b).tolist() == pytest.approx(theta.tolist(), abs=1e-14, rel=1e-9)


def test_locality_band():
    n = 16
    dist = (torch.arange(n)[:, None] - torch.arange(n)[None]).abs().double()
    band = M.locality(torch.exp(-dist))
    flat = M.locality(torch.ones(n, n))
    near = [math.exp(-abs(i - j)) for i in range(n) for j in range(n) if 1 <= abs(i - j) <= 2]  # window round(16/8) = 2
    far = [math.exp(-abs(i - j)) for i in range(n) for j in range(n) if abs(i - j) > 2]
    assert band["window"] == 2 and band["locality"] == pytest.approx(np.mean(near) - np.mean(far))
    assert flat["locality"] == 0
    assert band["cos_by_distance"][0] == pytest.approx(math.exp(-1))


# ---------------------------------------------------------------------------
# the capture


def tiny_model(cls=GPT, seed=0, **kw):
    torch.manual_seed(seed)
    config = GPTConfig(sequence_len=16, vocab_size=40, n_layer=3, n_head=2, n_kv_head=1, n_embd=32)
    model = cls(config, **kw)
    model.init_weights()
    with torch.no_grad():  # zero-initialised projections would make every update a no-op
        for block in model.blocks:
            block.attn.c_proj.weight.normal_(0, 0.2)
            block.mlp.c_proj.weight.normal_(0, 0.2)
    return model.eval()


def batches_of(n, B=2, T=16, vocab=40, bos=0, seed=1):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        idx = torch.randint(1, vocab, (B, T + 1), generator=gen)
        idx[:, 0] = bos
        idx[0, 7] = bos  # a second document in the row
        out.append((idx[:, :-1], idx[:, 1:]))
    return out


def gpt_states(model, idx):
    """Independent: the residual states x_0 .. x_K by running the blocks' parts by hand."""
    cos_sin = model.rotary(idx.size(1))
    x = norm(model.wte(idx))
    states = [x]
    for block in model.blocks:
        x = x + block.attn(norm(x), cos_sin, None)
        states.append(x)
        x = x + block.mlp(norm(x))
        states.append(x)
    return states


@torch.no_grad()
def test_gpt_capture_matches_a_forward_by_hand():
    model = tiny_model()
    data = batches_of(3)
    acc = capture(model, iter(data), 3, bos=0, cfg=CaptureConfig(token_sample=1000, state_sample=1000))
    states = [
        torch.cat([s.reshape(-1, 32) for s in ss]).double() for ss in zip(*[gpt_states(model, i) for i, _ in data])
    ]
    n = states[0].size(0)
    assert acc.tokens == n == 96
    bos = torch.cat([i.flatten() for i, _ in data]) == 0
    norms = torch.stack([s.norm(dim=1) for s in states], 1)
    assert (acc.sums["norm"] / n).tolist() == pytest.approx(norms.mean(0).tolist(), rel=1e-5)
    assert (acc.sums["norm_nobos"] / (~bos).sum()).tolist() == pytest.approx(norms[~bos].mean(0).tolist(), rel=1e-5)
    for k in (0, 3, 6):
        unit = states[k] / states[k].square().mean(dim=1, keepdim=True).sqrt()
        got = M.covariance_stats(M.covariance_from_sums(acc.sums["dir"][k], acc.sums["dir_outer"][k], n))
        assert got == pytest.approx(M.spectrum_stats(unit), rel=1e-4)
    rot = torch.stack([M.rotation_angles(states[k - 1], states[k]) for k in range(1, 7)], 1)
    assert (acc.sums["rotation"][1:] / n).tolist() == pytest.approx(rot.mean(0).tolist(), rel=1e-4, abs=1e-6)
    # every token kept (sample cap above n): the sampled norms are the by-hand norms, as a multiset
    assert sorted(acc.token_res.get("norm")[:, 6].tolist()) == pytest.approx(sorted(norms[:, 6].tolist()), rel=1e-5)
    logits = torch.cat([model(i).reshape(-1, 40) for i, _ in data])
    targets = torch.cat([t.flatten() for _, t in data])
    assert acc.sums["loss"].item() / n == pytest.approx(
        torch.nn.functional.cross_entropy(logits, targets).item(), rel=1e-5
    )


@torch.no_grad()
def test_attention_probs_reproduce_the_attention_output():
    model = tiny_model()
    idx = batches_of(1)[0][0]
    x = norm(model.wte(idx))
    attn = model.blocks[0].attn
    cos_sin = model.rotary(16)
    probs = attention_probs(attn, x, cos_sin, None, 64)  # (B, H, T, T), GQA: 2 query heads share 1 kv head
    assert probs.shape == (2, 2, 16, 16)
    assert torch.allclose(probs.sum(-1), torch.ones(2, 2, 16)) and (probs.triu(1) == 0).all()
    v = attn.c_v(x).view(2, 16, 1, 16).transpose(1, 2).repeat_interleave(2, dim=1)
    y = (probs @ v).transpose(1, 2).reshape(2, 16, 32)
    assert torch.allclose(attn.c_proj(y), attn(x, cos_sin, None), atol=1e-5)


def test_accumulator_memory_does_not_grow_with_tokens():
    model = tiny_model()
    cfg = CaptureConfig(token_sample=40, state_sample=10)  # smaller than one batch of 32 tokens: the samples fill up
    small = capture(model, iter(batches_of(1)), 1, bos=0, cfg=cfg)
    large = capture(model, iter(batches_of(6)), 6, bos=0, cfg=cfg)
    assert large.tokens == 6 * small.tokens
    assert small.state_bytes() == large.state_bytes()
    assert large.token_res.filled() == 40 and large.state_res.filled() == 10
    # the sample is uniform over the stream, not the first tokens only: later batches contribute
    assert large.token_res.keys.max() < 1


@torch.no_grad()
def test_nag_rotation_equals_atan_gain():
    from nag.model import NAGGPT

    model = tiny_model(NAGGPT)
    data = batches_of(2)
    acc = capture(model, iter(data), 2, bos=0, cfg=CaptureConfig(token_sample=1000, state_sample=100))
    rot, gain = acc.token_res.get("rotation")[:, 1:], acc.token_res.get("gain")[:, 1:]
    assert rot.mean() > 0.05  # the updates do rotate
    assert (rot - torch.atan(gain)).abs().max() < 1e-5
    assert acc.sums["atan_dev_max"].max() < 1e-5
    # the final state's norm is √d·e^{s_L}: the logits are the lm_head cosines times it, recovered exactly
    fn = acc.token_res.get("final_norm")
    assert fn.min() > 0 and acc.sums["final_norm"].item() / acc.tokens == pytest.approx(
        fn.double().mean().item(), rel=1e-6
    )


# ---------------------------------------------------------------------------
# the command on a tiny trained pair


@pytest.fixture(scope="module")
def pair(tiny_base_dir, tmp_path_factory):
    from conftest import linked_base, train_tiny_pair

    base = linked_base(tiny_base_dir, tmp_path_factory.mktemp("analysis_base"))
    os.makedirs(base / "runs" / "empty")
    train_tiny_pair(base, "--eval-every", "-1")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(base))
        # a run made with another tokenizer (its vocab differs from this base dir's 512)
        shutil.copytree(base / "runs" / "gpt", base / "runs" / "othertok")
        for meta_path in (base / "runs" / "othertok").glob("meta_*.json"):
            meta = json.loads(meta_path.read_text())
            meta["model_config"]["vocab_size"] = 1024
            meta_path.write_text(json.dumps(meta))
        yield base


def test_command_on_a_gpt_nag_pair(pair, tmp_path, monkeypatch, capsys):
    from analysis.run import main

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(pair))
    out = tmp_path / "out"
    main(
        [
            "gpt",
            os.path.join(pair, "runs", "nag"),
            "--tokens",
            "512",
            "--clusters",
            "4",
            "--state-sample",
            "64",
            "--device-batch-size",
            "2",
            "--device-type",
            "cpu",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr()
    assert "| attention on BOS |" in printed.out and "batch 4/4" in printed.err
    data = json.loads((out / "analysis.json").read_text())
    gpt, nag = data["runs"]["gpt"], data["runs"]["nag"]
    assert gpt["arch"] == "gpt" and nag["arch"] == "nag" and gpt["tokens"] == nag["tokens"] == 512
    assert len(gpt["norm"]["mean"]) == 5 and len(gpt["rotation"]["cumulative_deg"]) == 4
    assert len(gpt["attention"]["maps"]) == 2 and len(gpt["attention"]["maps"][0]) == 64
    assert "nag" not in gpt and len(nag["nag"]["gain_mean"]) == 4
    assert nag["nag"]["atan_check_max_abs_dev"] < 1e-5
    assert 0 <= nag["confidence"]["auroc_norm"] <= 1 and 0 < gpt["attention"]["bos_share"] < 1
    md = (out / "analysis.md").read_text()
    assert "62.5%" in md and "gpt (gpt)" in md and "nag (nag)" in md
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert {
        "norm_depth.png",
        "rotation.png",
        "spectrum.png",
        "nag_gains.png",
        "preferred_nag.png",
        "attention_mean.png",
        "attention_layers_gpt.png",
        "bos_share.png",
        "confidence.png",
    } <= set(pngs)
    assert all((out / p).read_bytes()[:8] == PNG_MAGIC for p in pngs)
    assert all(f"]({p})" in md for p in pngs)


@pytest.mark.parametrize(
    "args, message",
    [
        (["missing"], "no run directory"),
        (["empty"], "no complete checkpoint"),
        (["gpt", "othertok"], "does not match the tokenizer"),
        (["gpt", "--tokens", "0"], "--tokens must be positive"),
        (["gpt", "--tokens", "100"], "smaller than one batch"),
        (["gpt", "--tokens", "512", "--clusters", "65", "--state-sample", "64"], "larger than the 64 sampled states"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(pair, tmp_path, monkeypatch, script_error, args, message):
    from analysis.run import main

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(pair))
    out = tmp_path / "out"
    err = script_error(main, *args, "--device-batch-size", "2", "--device-type", "cpu", "--out", str(out))
    assert message in err
    assert not out.exists() and not list(tmp_path.glob(".analysis-tmp-*"))


@pytest.mark.parametrize("how", ["file in the way", "read-only"])
def test_unwritable_output_is_one_line_before_the_pass(pair, tmp_path, monkeypatch, script_error, how):
    from analysis.run import main

    base = tmp_path / "base"  # the pair's runs, corpus and tokenizer, with a reports/ that takes no folder
    os.makedirs(base)
    for name in ("base_data", "tokenizer", "runs"):
        os.symlink(os.path.join(pair, name), base / name)
    unwritable_reports(base, how)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    try:  # one line and nothing else on stderr: the pass, whose progress goes there, never started
        err = script_error(
            main,
            "gpt",
            "nag",
            "--tokens",
            "256",
            "--clusters",
            "2",
            "--state-sample",
            "16",
            "--device-batch-size",
            "2",
            "--device-type",
            "cpu",
        )
    finally:
        os.chmod(base / "reports", 0o755)
    assert "cannot write to" in err and str(base / "reports") in err


SMALL = [
    "--tokens",
    "256",
    "--clusters",
    "2",
    "--state-sample",
    "16",
    "--device-batch-size",
    "2",
    "--device-type",
    "cpu",
]


def test_an_analysis_per_step_and_the_report_links_its_own(pair, tmp_path, monkeypatch, capsys):
    from analysis.run import main
    from scripts import compare

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(pair))
    # an analysis of step 3 has its own folder, and a report of the runs at step 6 does not link it
    early = main(["gpt", "nag", "--step", "3", *SMALL])
    assert early == os.path.join(pair, "reports", "analysis_gpt@3_vs_nag@3")
    report = compare.main(["gpt", "nag", "--out", str(tmp_path / "before")])
    assert "analysis.md" not in open(report).read()
    kept = {n: open(os.path.join(early, n), "rb").read() for n in os.listdir(early)}
    out = main(["gpt", "nag", *SMALL])  # the latest step, 6: another folder, step 3's untouched
    assert out == os.path.join(pair, "reports", "analysis_gpt@6_vs_nag@6")
    assert {n: open(os.path.join(early, n), "rb").read() for n in os.listdir(early)} == kept
    report = compare.main(["gpt", "nag", "--out", str(tmp_path / "after")])
    link = os.path.relpath(os.path.join(out, "analysis.md"), tmp_path / "after")
    assert f"[{link}]({link})" in open(report).read() and "@3" not in open(report).read()


def test_an_analysis_never_replaces_what_it_did_not_write(pair, tmp_path, monkeypatch, capsys, script_error):
    from analysis.run import main

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(pair))
    mine = tmp_path / "mine"
    os.makedirs(mine)
    (mine / "analysis.md").write_text("my notes\n")
    err = script_error(main, "gpt", "nag", *SMALL, "--out", str(mine))
    assert (
        "did not write (analysis.md)" in err and "--force" in err and (mine / "analysis.md").read_text() == "my notes\n"
    )
    # its own folder, other settings: the earlier analysis moves to replaced/, with a line
    out = tmp_path / "out"
    main(["gpt", "nag", *SMALL, "--out", str(out)])
    first = (out / "analysis.json").read_bytes()
    capsys.readouterr()
    main(["gpt", "nag", *SMALL, "--seed", "1", "--out", str(out)])
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "seed 0 → 1" in notes[0] and "replaced" in notes[0]
    (stamp,) = os.listdir(out / "replaced")
    assert (out / "replaced" / stamp / "analysis.json").read_bytes() == first
