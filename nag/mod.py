"""
Mixture-of-Depths (MoD): which tokens run a sub-layer, and a gathered computation for them.

The computation is gathered so that a skipped token really costs nothing (docs/mod.md).
Shared by NAG-MoD (nag/model.py) and the router baseline
(nag/router_mod.py); only the score differs:

    NAG     r_l = atan(α_l·m_l) / atan(α_l) ∈ [0, 1]      the predicted rotation over the largest possible one
    router  g_l = σ(x̂·w_l + b_l)                          paper eq. 40, x̂ the normed input

A token runs sub-layer l when its score is above the threshold, and skips it otherwise. One threshold
is shared by every attention layer, each MLP layer has its own (the paper's global / local rule).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from nanochat import step_timer
from nanochat.flash_attention import masked_attention, window_mask
from nanochat.gpt import norm, apply_rotary, QK_SCALE

BLOCKS = ("attn", "mlp", "both")
KINDS = ("attn", "mlp")
MAX_RATE = 0.95  # above this almost nothing runs and a batch quantile rests on a handful of tokens
# share of each batch's attention shortfall carried into the next threshold: 1 would cancel it at once
# but add the previous batch's sampling noise to every batch; 0.2 settles in about five batches
DEBT_GAIN = 0.2


@dataclass
class ModConfig:
    blocks: str = "both"  # which sub-layers tokens may skip
    rate: float = 0.0  # target share of skipped token-sublayers
    momentum: float = 0.9  # evaluation thresholds: weight of the old estimate once 1/(1-momentum) batches are in

    def covers(self, kind):
        """The sub-layer kind is a MoD one (NAG adds its X_l there, even at rate 0)."""
        return self.blocks in (kind, "both")

    def skips(self, kind):
        """Tokens are actually routed around this kind of sub-layer."""
        return self.rate > 0 and self.covers(kind)


def add_mod_args(parser):
    """The MoD flags, read by both MoD models (registered once, by the nag spec in nag/archs.py)."""
    g = parser.add_argument_group("Mixture-of-Depths (--arch nag: rotation score; --arch gpt-router: router baseline)")
    g.add_argument("--mod-rate", type=float, default=None, help="target share of skipped token-sublayers, in [0, 0.95)")
    g.add_argument(
        "--mod-blocks", type=str, default=None, choices=BLOCKS, help="sub-layers tokens may skip (default: both)"
    )


def check_rate(rate, flag="--mod-rate"):
    from nanochat.common import UserError

    if not (math.isfinite(rate) and 0 <= rate < MAX_RATE):
        raise UserError(f"{flag} must be in [0, {MAX_RATE}) (got {rate:g})")


def mod_config_from_args(args):
    """ModConfig from the flags, or None when MoD is off."""
    from nanochat.common import UserError

    if args.mod_rate is None:
        if args.mod_blocks:
            raise UserError("--mod-blocks needs --mod-rate (the target share of skipped token-sublayers)")
        return None
    check_rate(args.mod_rate)
    return ModConfig(blocks=args.mod_blocks or "both", rate=args.mod_rate)


def rotation_score(alpha, m):
    """r = atan(α·m)/atan(α) of every token, (B, T), no grad: the skip decision is not differentiable.
    As α → 0 (the first steps of the α warm-up) r → m, which is used there."""
    a = alpha.detach().float().reshape(())
    m = m.detach().float().squeeze(-1)
    small = a.abs() < 1e-6  # a tensor test, not a Python one: no host sync
    return torch.where(small, m, torch.atan(a * m) / torch.atan(torch.where(small, torch.ones_like(a), a)))


# ---------------------------------------------------------------------------
# thresholds


class Thresholds(nn.Module):
    """The skip thresholds and the skip rates they realised.

    Training: MLP layer l skips the round(rate·N) lowest-scoring tokens of its batch (a batch quantile).
    The attention threshold is global, but layer l's scores depend on what the layers before it skipped,
    so no same-batch quantile of all attention scores exists when layer l runs: attention uses the
    pooled quantile of the previous training batch (the first batch: its own per-layer quantile). Scores
    that rise during training make that threshold skip too little, so the quantile is taken at the target
    rate plus a share of the shortfall accumulated so far (integral control): the average realised rate is
    the target.
    Evaluation: every threshold is its running estimate (a moving average of the batch quantiles), fixed,
    so a token's path depends only on its own prefix. All of it is buffers: it travels in the checkpoint.
    """

    def __init__(self, n_layer, config, device=None):
        super().__init__()
        self.config = config
        self.momentum = config.momentum
        self.register_buffer("values", torch.zeros(1 + n_layer, device=device))  # [attention, mlp 0, mlp 1, ...]
        self.register_buffer("counts", torch.zeros(1 + n_layer, device=device))  # batches averaged in; 0 = never set
        # the previous batch's pooled attention quantile
        self.register_buffer("last_attn", torch.zeros(1, device=device))
        # Σ DEBT_GAIN·(target − realised), attention skips
        self.register_buffer("attn_debt", torch.zeros(1, device=device))
        self.pending = []  # attention scores and skip masks of the current training forward
        self.sums = {}  # (mode, kind, layer) -> [summed skipped fraction, forwards]

    @torch.no_grad()
    def reset(self):
        self.values.zero_()
        self.counts.zero_()
        self.last_attn.zero_()
        self.attn_debt.zero_()
        self.pending, self.sums = [], {}

    def calibrated(self):
        """Every threshold that evaluation will use has been estimated at least once."""
        slots = ([0] if self.config.skips("attn") else []) + (
            [1 + i for i in range(len(self.values) - 1)] if self.config.skips("mlp") else []
        )
        return all(self.counts[s].item() > 0 for s in slots)

    @torch.no_grad()
    def update(self, slot, value):
        n = self.counts[slot] + 1
        w = torch.clamp(1 / n, min=1 - self.momentum)  # a plain mean first, a moving average later
        self.values[slot] += w * (value - self.values[slot])
        self.counts[slot] = n

    @torch.no_grad()
    def decide(self, kind, layer, score):
        """Which tokens run the sub-layer: a bool (B, T) mask, True = execute."""
        s = score.detach().float()
        slot = 0 if kind == "attn" else 1 + layer
        if self.training:
            batch = batch_threshold(s, self.config.rate)
            if kind == "mlp":
                thr = batch
                self.update(slot, batch)
            else:
                thr = torch.where(self.counts[0] > 0, self.last_attn[0], batch)
        else:
            thr = self.values[slot]
        execute = s > thr
        if self.training and kind == "attn":
            self.pending.append((s.flatten(), execute.flatten()))
        key = ("train" if self.training else "eval", kind, layer)
        acc = self.sums.setdefault(key, [torch.zeros((), device=s.device), 0])
        acc[0] += 1 - execute.float().mean()
        acc[1] += 1
        return execute

    def bound(self, kind, execute):
        """Rows run_executed packs, known without reading `execute` (no host sync); None: their exact number,
        read on the host. Training MLP: its batch quantile runs at most N - round(rate·N) of N tokens. Attention
        has no such bound: the global threshold lets layers differ widely (6 % and 51 % skipped at a 30 % target
        in a test model), so a capacity from the target would override it (6 % became 19 % at target + 10 %), and
        the full length would give back the saved queries. Evaluation: fixed thresholds bound nothing."""
        if execute is None or not self.training or kind == "attn":
            return None
        n = execute.numel()
        return n - skip_count(self.config.rate, n)

    @torch.no_grad()
    def finish(self):
        """End of a training forward: this batch's pooled attention scores give the next batch's threshold (their
        quantile at the target plus the shortfall so far) and the running estimate's next value (at the target)."""
        if self.pending:
            scores = torch.cat([s for s, _ in self.pending])
            realised = 1 - torch.cat([e for _, e in self.pending]).float().mean()
            rate = self.config.rate
            self.attn_debt.add_(DEBT_GAIN * (rate - realised)).clamp_(-rate, MAX_RATE - rate)
            self.last_attn.copy_(batch_threshold(scores, rate + self.attn_debt).reshape(1))
            self.update(0, batch_threshold(scores, rate))
        self.pending = []

    def pop_rates(self, mode):
        """{(kind, layer): mean skipped fraction} over the forwards of this mode since the last call."""
        keys = [key for key in self.sums if key[0] == mode]
        values = (
            step_timer.read_values(torch.stack([self.sums[key][0] / self.sums[key][1] for key in keys])) if keys else []
        )
        out = {(k, l): v for (_, k, l), v in zip(keys, values)}  # one host read for all of them
        self.sums = {key: v for key, v in self.sums.items() if key[0] != mode}
        return out


def skip_count(rate, n):
    """How many of n tokens a batch quantile at `rate` skips (at most: ties run fewer)."""
    return round(rate * n)


def batch_threshold(scores, rate):
    """The score at or below which the round(rate·N) lowest-scoring tokens fall (-inf: none). A tensor rate
    (attention: the target plus the shortfall) stays on the device: k is a tensor, no host sync."""
    flat = scores.flatten()
    if torch.is_tensor(rate):  # rounds half to even, like round(); in float64, like float(rate) * N
        k = torch.round(rate.double().reshape(1) * flat.numel()).long().clamp(0, flat.numel())
        kth = flat.sort().values.index_select(0, (k - 1).clamp_min(0)).reshape(())
        return torch.where(k.reshape(()) > 0, kth, -math.inf)
    k = skip_count(rate, flat.numel())
    if k == 0:
        return torch.full((), -math.inf, device=flat.device)
    return torch.kthvalue(flat, k).values


@torch.no_grad()
def calibrate(model, batches, steps):
    """Fixed thresholds for evaluation from `steps` batches (plain mean of their batch quantiles), then eval mode."""
    th = model.thresholds
    th.reset()
    th.momentum = 1.0  # weight 1/n: every batch counts the same
    model.train()
    try:
        for _ in range(steps):
            x, *_ = next(batches)
            model(x)
    finally:
        th.momentum = th.config.momentum
        model.eval()
    th.pop_rates("train")


def skip_summary(rates):
    """metrics.jsonl form of pop_rates: per sub-layer and the mean per kind."""
    out = {"skip": {f"{l}.{k}": r for (k, l), r in sorted(rates.items(), key=lambda kv: (kv[0][1], kv[0][0]))}}
    for kind in KINDS:
        vals = [r for (k, _), r in rates.items() if k == kind]
        if vals:
            out[f"skip_{kind}"] = sum(vals) / len(vals)
    return out


# ---------------------------------------------------------------------------
# the gathered computation: sub-layer outputs at the executed tokens, zeros elsewhere
#
# The executed tokens are packed into n rows: `bound` where one is known before the data is seen (training
# MLP: no host sync), else their exact number, read on the host (one sync per layer: attention, evaluation).
# The padding rows hold skipped tokens whose result is dropped, and n >= 1: a sub-layer always runs on at least
# one row, so every parameter gets a gradient (zero when no token ran). DDP with find_unused_parameters=False
# then needs no special case for a rank whose micro-batch skips a whole sub-layer, at no cost; telling DDP
# instead (find_unused_parameters=True) would cost a traversal of the autograd graph every step.


def packed(execute, n):
    """(B, n) positions with each row's executed tokens first, in order, and which of them are executed."""
    order = torch.sort((~execute).to(torch.uint8), dim=1, stable=True).indices[:, :n]
    valid = torch.arange(n, device=execute.device)[None] < execute.sum(dim=1, keepdim=True)
    return order, valid


def mlp_executed(mlp, x, execute, bound=None):
    """mlp(x) at the executed tokens and 0 at the others; the MLP only sees the executed tokens (and padding up
    to `bound`, at most that many execute)."""
    if execute is None:
        return mlp(x)
    B, T, D = x.shape
    flat = x.reshape(B * T, D)
    n = bound if bound is not None else int(step_timer.read_values(execute.sum()))  # evaluation: one host read
    idx, valid = packed(execute.reshape(1, B * T), min(max(n, 1), B * T))
    y = torch.where(valid[0, :, None], mlp(flat.index_select(0, idx[0])), 0)
    return flat.new_zeros(B * T, D).index_copy(0, idx[0], y.to(flat.dtype)).view(B, T, D)


def attention_executed(attn, x, cos_sin, mask, execute, bound=None, kv=None):
    """attn(x, cos_sin, mask) at the executed tokens and 0 at the others.

    Every token still makes its key and value (later tokens attend to it); only executed tokens make a
    query, attend and go through the output projection. Each row's executed positions are packed to the
    left, padded with skipped positions whose result is dropped, to `bound` (at most that many per row
    execute) or, without one, to the longest row. With a KV cache (decoding) the keys and values of every
    new token, skipped or not, are appended to it, which is what a full forward would have made of them."""
    if execute is None:
        return attn(x, cos_sin, mask, kv)
    B, T, D = x.shape
    # no bound (attention in training, every evaluation): the longest row's count, a host read per layer (docs/mod.md)
    n = bound if bound is not None else int(step_timer.read_values(execute.sum(dim=1).max()))
    Tq = min(max(n, 1), T)
    qpos, valid = packed(execute, Tq)  # (B, Tq)
    H, KV, hd = attn.n_head, attn.n_kv_head, attn.head_dim
    xq = torch.gather(x, 1, qpos[..., None].expand(B, Tq, D))
    q = attn.c_q(xq).view(B, Tq, H, hd)
    k = attn.c_k(x).view(B, T, KV, hd)
    v = attn.c_v(x).view(B, T, KV, hd)
    cos, sin = cos_sin
    half = cos.size(-1)
    take = qpos[:, :, None, None].expand(B, Tq, 1, half)
    cq, sq = (torch.gather(c.expand(B, T, 1, half), 1, take) for c in (cos, sin))
    q = norm(apply_rotary(q, cq, sq)) * QK_SCALE
    k = norm(apply_rotary(k, cos, sin)) * QK_SCALE
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if kv is not None:
        k, v = kv.extend(k, v)  # every key so far; a cache always comes with its mask
    Tk = k.size(2)
    # the gathered queries sit at scattered positions, which FA3's causal window cannot express: always a mask
    # (a plain row's None is causal within the layer's window, as in CausalSelfAttention)
    allowed = mask if mask is not None else window_mask(T, attn.window, x.device)[None, None]
    rows = torch.gather(allowed.expand(B, 1, T, Tk), 2, qpos[:, None, :, None].expand(B, 1, Tq, Tk))
    y = masked_attention(q, k, v, rows)
    y = torch.where(valid[..., None], attn.c_proj(y.transpose(1, 2).reshape(B, Tq, D)), 0)
    return x.new_zeros(B, T, D).scatter(1, qpos[..., None].expand(B, Tq, D), y.to(x.dtype))


def run_executed(kind, block, x, cos_sin, mask, execute, bound=None, kv=None):
    if kind == "attn":
        return attention_executed(block.attn, x, cos_sin, mask, execute, bound, kv)
    return mlp_executed(block.mlp, x, execute, bound)


# ---------------------------------------------------------------------------
# FLOPs


def savable_flops(model):
    """{(kind, layer): training FLOPs per token that one skip of that sub-layer saves}, in the baseline's
    convention (6 per matmul weight, 12·h·q·T_eff per layer of attention): attention saves its query and
    output projections and the attention itself (keys and values are still made); MLP saves both matrices."""
    cfg = model.config
    h, q = cfg.n_head, cfg.n_embd // cfg.n_head
    out = {}
    for i, (block, w) in enumerate(zip(model.blocks, model.windows)):
        a = block.attn
        out[("attn", i)] = 6 * (a.c_q.weight.numel() + a.c_proj.weight.numel()) + 12 * h * q * min(w, cfg.sequence_len)
        out[("mlp", i)] = 6 * (block.mlp.c_fc.weight.numel() + block.mlp.c_proj.weight.numel())
    return out


def flops_with_skips(model, full, mod, skip=None):
    """Training FLOPs per token of a MoD model whose full-depth cost is `full`: skip maps (kind, layer) to the
    skipped share (default: the target rate on every skippable sub-layer, what a plan assumes)."""
    if mod is None:
        return full
    if skip is None:
        skip = {(k, i): mod.rate for k in KINDS if mod.skips(k) for i in range(model.config.n_layer)}
    saved = savable_flops(model)
    return full - round(sum(rate * saved[key] for key, rate in skip.items()))
