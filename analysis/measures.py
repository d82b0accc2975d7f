"""
The measures of docs/analysis.md, each a small pure function on tensors (no model, no I/O).

The capture pass (analysis/capture.py) only accumulates; every number in
analysis.json comes out of one of these functions. Paper references are to
arXiv:2606.16112 ("the paper") and to the reimplementation walkthrough.
"""

import math

import torch


def _f64(x):
    # fp64 on the tensor's own device: the capture calls some of these on GPU batches
    return torch.as_tensor(x).detach().to(torch.float64)


# ---------------------------------------------------------------------------
# spectrum of the normalised residual stream (paper Fig. 4, eqs. 25-31)


def covariance_stats(cov):
    """TV, erank, PR of a covariance matrix (d, d): eigenvalues λ, p = λ / Σλ,
    TV = Σλ (eq. 27), erank = exp(−Σ p log p) (eqs. 29-30), PR = (Σλ)² / Σλ² (eq. 31)."""
    lam = torch.linalg.eigvalsh(_f64(cov)).clamp_min(0)  # tiny negative eigenvalues are rounding
    tv = lam.sum()
    if tv <= 0:
        return {"total_variance": 0.0, "effective_rank": float("nan"), "participation_ratio": float("nan")}
    p = lam / tv
    entropy = -(p[p > 0] * p[p > 0].log()).sum()
    return {
        "total_variance": tv.item(),
        "effective_rank": entropy.exp().item(),
        "participation_ratio": (1.0 / p.square().sum()).item(),
    }


def covariance_from_sums(total, outer, n):
    """Covariance around the mean, 1/n Σ (x−μ)(x−μ)ᵀ (eq. 25), from the running sums Σx, Σxxᵀ of n rows."""
    mean = _f64(total) / n
    return _f64(outer) / n - torch.outer(mean, mean)


def spectrum_stats(states):
    """states (n, d) → total_variance, effective_rank, participation_ratio of their covariance around the mean.
    The capture feeds unit-RMS rows (R̄, or x/RMS(x) for GPT), so TV = d − ‖μ‖² (eq. 28)."""
    x = _f64(states)
    return covariance_stats(covariance_from_sums(x.sum(0), x.T @ x, x.size(0)))


# ---------------------------------------------------------------------------
# attention sinks (paper Figs. 7 and 12; walkthrough's sink table)


def quartile_groups(n):
    """Indices of n layers split into 4 depth groups; never empty (with n < 4 a layer serves several groups)."""
    return [list(range(q * n // 4, max((q + 1) * n // 4, q * n // 4 + 1))) for q in range(4)]


def sink_stats(attn):
    """attn (layers, T, T): causal post-softmax rows (query i over keys ≤ i), key 0 = BOS.
    Shares are means over layers and query rows of the mass on key 0, on keys 0-3 and on the diagonal."""
    a = _f64(attn)
    L, T, _ = a.shape
    bos_by_layer = a[:, :, 0].mean(dim=1)
    return {
        "bos_share": bos_by_layer.mean().item(),
        "first4_share": a[:, :, : min(4, T)].sum(dim=2).mean().item(),
        "diagonal_share": torch.diagonal(a, dim1=1, dim2=2).mean().item(),
        "layers_over_half_bos": int((bos_by_layer > 0.5).sum().item()),
        "bos_share_by_quartile": [bos_by_layer[g].mean().item() for g in quartile_groups(L)],
    }


# ---------------------------------------------------------------------------
# confidence (walkthrough, "My Experiments")


def auroc(scores, labels):
    """Area under the ROC curve of scores ranking positives (labels true) above negatives; ties count half.
    Mann-Whitney form: mean over (positive, negative) pairs of [s+ > s−] + ½[s+ = s−], via average ranks."""
    s = _f64(scores).cpu().flatten()
    y = torch.as_tensor(labels).detach().cpu().flatten().bool()
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    order = torch.argsort(s)
    sorted_s = s[order]
    # average rank (1-based) of each run of equal scores
    _, inverse, counts = torch.unique_consecutive(sorted_s, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    avg_rank = ends - (counts.double() - 1) / 2
    ranks = torch.empty_like(s)
    ranks[order] = avg_rank[inverse]
    return ((ranks[y].sum() - pos * (pos + 1) / 2) / (pos * neg)).item()


def decile_means(key, values, bins=10):
    """Sort tokens by key, split into `bins` equal-count groups, mean of each value per group (low key first)."""
    order = torch.argsort(_f64(key))
    groups = torch.tensor_split(order, bins)
    return {name: [_f64(v)[g].mean().item() if len(g) else float("nan") for g in groups] for name, v in values.items()}


# ---------------------------------------------------------------------------
# norm spread among angularly similar states (paper Table III)


def spherical_kmeans(states, k, seed, iters=50):
    """Hard-assignment limit of vMF clustering: cluster ids (n,) of the unit-normalised rows."""
    u = _f64(states)
    u = u / u.norm(dim=1, keepdim=True).clamp_min(1e-300)
    n = u.size(0)
    if not 1 <= k <= n:
        raise ValueError(f"k must be in 1..{n}, got {k}")
    # farthest-first seeding: a random first centre, then each next one the point least like any chosen so far
    gen = torch.Generator().manual_seed(seed)
    chosen = [int(torch.randint(n, (1,), generator=gen))]
    best = u @ u[chosen[0]]
    for _ in range(k - 1):
        nxt = int(best.argmin())
        chosen.append(nxt)
        best = torch.maximum(best, u @ u[nxt])
    centres = u[chosen].clone()
    assign = None
    for _ in range(iters):
        sim = u @ centres.T
        new = sim.argmax(dim=1)
        if assign is not None and torch.equal(new, assign):
            break
        assign = new
        for c in range(k):
            members = u[assign == c]
            if len(members) == 0:  # an empty cluster restarts at the worst-fitting point
                members = u[sim.max(dim=1).values.argmin()][None]
            m = members.sum(0)
            centres[c] = m / m.norm().clamp_min(1e-300)
    return assign


def cluster_norm_spread(states, k, seed):
    """Spherical k-means on the unit rows; each norm divided by its cluster's mean norm; the p10 and p90 of
    those ratios per cluster (clusters of at least 2 states), averaged over clusters."""
    x = _f64(states)
    assign = spherical_kmeans(x, k, seed)
    norms = x.norm(dim=1)
    p10, p90 = [], []
    for c in range(k):
        r = norms[assign == c]
        if len(r) < 2:
            continue
        r = r / r.mean()
        p10.append(torch.quantile(r, 0.1).item())
        p90.append(torch.quantile(r, 0.9).item())
    if not p10:
        return {"p10": float("nan"), "p90": float("nan")}
    return {"p10": sum(p10) / len(p10), "p90": sum(p90) / len(p90)}


# ---------------------------------------------------------------------------
# weights (paper Table IV)


def weight_stats(weight):
    """|mean| / std of all entries, max |w| / RMS(w), and stable rank ‖W‖_F² / σ_max²."""
    w = _f64(weight)
    sigma_max = torch.linalg.matrix_norm(w, ord=2)
    return {
        "mean_over_std": (w.mean().abs() / w.std()).item(),
        "max_over_rms": (w.abs().max() / w.square().mean().sqrt()).item(),
        "stable_rank": (w.square().sum() / sigma_max.square()).item(),
    }


# ---------------------------------------------------------------------------
# rotation (paper Fig. 3c; DESIGN: for NAG θ = atan(g))


def rotation_angles(prev, cur):
    """Angle (radians) between consecutive residual vectors, per row of (..., d).
    2·atan2(‖a−b‖, ‖a+b‖) on the unit vectors: accurate for tiny angles, where arccos(cos) is not."""
    a, b = _f64(prev), _f64(cur)
    a = a / a.norm(dim=-1, keepdim=True).clamp_min(1e-300)
    b = b / b.norm(dim=-1, keepdim=True).clamp_min(1e-300)
    return 2 * torch.atan2((a - b).norm(dim=-1), (a + b).norm(dim=-1))


# ---------------------------------------------------------------------------
# NAG preferred directions (paper eq. 32, Fig. 6)


def cosine_matrix(vectors):
    """Pairwise cosine similarity of the rows of (n, d)."""
    v = _f64(vectors)
    v = v / v.norm(dim=1, keepdim=True).clamp_min(1e-300)
    return v @ v.T


def locality(cos):
    """How much more alike nearby sub-layers' preferred directions are than distant ones: mean cosine over pairs
    at distance 1..w minus mean over pairs further apart, w = max(1, round(n/8)). Also the mean per distance."""
    c = _f64(cos)
    n = c.size(0)
    dist = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs()
    by_distance = [c[dist == k].mean().item() for k in range(1, n)]
    w = max(1, round(n / 8))
    near, far = c[(dist >= 1) & (dist <= w)], c[dist > w]
    score = (near.mean() - far.mean()).item() if len(near) and len(far) else float("nan")
    return {"locality": score, "window": w, "cos_by_distance": by_distance}


def percentiles(x, qs=(0.1, 0.5, 0.9)):
    x = _f64(x).flatten()
    if x.numel() == 0:
        return [float("nan")] * len(qs)
    return torch.quantile(x, torch.tensor(qs, dtype=torch.float64)).tolist()


def degrees(radians):
    return [r * 180 / math.pi for r in radians]
