"""
From a finished capture to plain numbers: every value of analysis.json for one run.

The capture is analysis/capture.py's.

All arithmetic is in analysis/measures.py; this module only feeds it and names the results.
"""

import math

import torch

from analysis import measures as M

WALKTHROUGH_DEAD_GAIN = 0.05  # walkthrough: a branch whose mean α·m is below this is "shut off"
DEAD_MODULATOR = 0.1  # relative count: mean m (the share of the branch's own ceiling α) below this


def _list(t):
    return [float(x) for x in t.tolist()]


def summarise(acc, model, clusters, seed):
    # small CPU linear algebra (d×d eigvalsh, k-means) runs fastest on one thread: with more, on a busy machine,
    # OpenMP's waiting made eigvalsh of a 256×256 matrix 100× slower
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _summarise(acc, model, clusters, seed)
    finally:
        torch.set_num_threads(threads)


def _summarise(acc, model, clusters, seed):
    s = {k: v.cpu() for k, v in acc.sums.items()}
    n, K = acc.tokens, acc.num_updates
    out = {
        "arch": model.arch,
        "tokens": n,
        "tokens_without_bos": acc.tokens_nobos,
        "num_updates": K,
        "n_layer": model.config.n_layer,
        "n_embd": model.config.n_embd,
    }

    # norm vs depth (paper Fig. 3a-b); percentiles from the token sample
    norms, bos = acc.token_res.get("norm"), acc.token_res.get("bos")
    out["norm"] = {
        "mean": _list(s["norm"] / n),
        "mean_without_bos": _list(s["norm_nobos"] / max(1, acc.tokens_nobos)),
        "p10_p50_p90": [M.percentiles(norms[:, k]) for k in range(K + 1)],
        "p10_p50_p90_without_bos": [M.percentiles(norms[~bos, k]) for k in range(K + 1)],
        "sampled_tokens": len(bos),
    }
    out["norm"]["final_over_embedding"] = out["norm"]["mean"][-1] / out["norm"]["mean"][0]

    # rotation (paper Fig. 3c): mean angle of each update, cumulative sum
    rot = (s["rotation"][1:] / n).tolist()
    cum = torch.tensor(rot).cumsum(0).tolist() if rot else []
    out["rotation"] = {
        "mean_deg": M.degrees(rot),
        "cumulative_deg": M.degrees(cum),
        "total_deg": M.degrees(cum[-1:])[0] if cum else 0.0,
    }

    # spectrum of the unit-RMS states (paper Fig. 4, eqs. 25-31)
    spec = [M.covariance_stats(M.covariance_from_sums(s["dir"][k], s["dir_outer"][k], n)) for k in range(K + 1)]
    out["spectrum"] = {
        key: [x[key] for x in spec] for key in ("total_variance", "effective_rank", "participation_ratio")
    }

    # attention sinks (paper Figs. 7, 12)
    attn = s["attn"] / max(1, acc.attn_rows)
    out["attention"] = {
        **M.sink_stats(attn),
        "bos_share_by_layer": _list(attn[:, :, 0].mean(dim=1)),
        "positions": attn.size(1),
        "map_mean": attn.mean(dim=0).tolist(),
        "maps": attn.tolist(),
    }

    # confidence (walkthrough): final norm vs entropy / loss / top-1
    fn, ent, loss, top1 = (acc.token_res.get(k) for k in ("final_norm", "entropy", "loss", "top1"))
    values = {"entropy": ent, "loss": loss, "top1": top1.double()}
    out["confidence"] = {
        "loss": (s["loss"] / n).item(),
        "entropy": (s["entropy"] / n).item(),
        "top1_accuracy": (s["top1"] / n).item(),
        "final_norm": (s["final_norm"] / n).item(),
        "auroc_norm": M.auroc(fn, top1),
        "auroc_neg_entropy": M.auroc(-ent, top1),
        "deciles_by_norm": M.decile_means(fn, values),
        "deciles_by_neg_entropy": M.decile_means(-ent, values),
        "decile_norm_means": M.decile_means(fn, {"final_norm": fn})["final_norm"],
        "sampled_tokens": len(fn),
    }

    # norm spread among angularly similar states (paper Table III)
    states = acc.state_res.get("state")
    if clusters > len(states):
        raise ValueError(f"{clusters} clusters for {len(states)} sampled states")
    spread = [M.cluster_norm_spread(states[:, k], clusters, seed + k) for k in range(K + 1)]
    p10 = [x["p10"] for x in spread]
    p90 = [x["p90"] for x in spread]
    out["cluster_norm_spread"] = {
        "clusters": clusters,
        "sampled_states": len(states),
        "p10_by_state": p10,
        "p90_by_state": p90,
        "p10": _nanmean(p10),
        "p90": _nanmean(p90),
    }

    out["weights"] = weight_summary(model)
    if acc.is_nag:
        out["nag"] = nag_summary(s, n, model)
    return out


def _nanmean(xs):
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def weight_summary(model):
    """Table IV: every 2-D block matrix, and per kind (e.g. mlp.c_fc) the mean over layers."""
    per = {}
    for name, p in model.blocks.named_parameters():
        if p.ndim == 2 and p.shape[0] > 1:
            per[name] = M.weight_stats(p)
    kinds = {}
    for name, st in per.items():
        kind = name.split(".", 1)[1].rsplit(".", 1)[0]  # "0.mlp.c_fc.weight" -> "mlp.c_fc"
        kinds.setdefault(kind, []).append(st)
    by_kind = {k: {key: sum(x[key] for x in v) / len(v) for key in v[0]} for k, v in kinds.items()}
    return {"by_kind": by_kind, "per_matrix": per}


def nag_summary(s, n, model):
    """α, α·warm-up, mean m and realised gain per update (paper Fig. 5), dead counts (DESIGN §3), preferred
    directions (paper eq. 32, Fig. 6), and the self-check rotation = atan(g)."""
    alpha = [br.alpha.item() for _, br in model.branches()]
    warm = model.alpha_warmup.item()
    gain = _list(s["gain"][1:] / n)
    m = _list(s["m"][1:] / n)
    pref = s["pref"][1:] / s["pref_weight"][1:, None].clamp_min(1e-300)
    cos = M.cosine_matrix(pref)
    return {
        "alpha": alpha,
        "alpha_warmup": warm,
        "alpha_effective": [a * warm for a in alpha],
        "gain_mean": gain,
        "m_mean": m,
        "dead_walkthrough": sum(g < WALKTHROUGH_DEAD_GAIN for g in gain),
        "dead_walkthrough_threshold": WALKTHROUGH_DEAD_GAIN,
        "dead_relative": sum(x < DEAD_MODULATOR for x in m),
        "dead_relative_threshold": DEAD_MODULATOR,
        "preferred_cosine": cos.tolist(),
        **M.locality(cos),
        "atan_check_max_abs_dev": s["atan_dev_max"][1:].max().item(),
        "atan_check_by_update": _list(s["atan_dev_max"][1:]),
    }
