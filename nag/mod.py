"""
Mixture-of-Depths (MoD): which tokens run a sub-layer, and a gathered computation for them.

The computation is gathered so that a skipped token really costs nothing (docs/mod.md).
Shared by NAG-MoD (nag/model.py) and the router baseline
(nag/router_mod.py); only the score differs:

    NAG     r_l = atan(α_l·m_l) / atan(α_l) ∈ [0, 1]      the predicted rotation over the largest possible one
    router  g_l = σ(x̂·w_l + b_l)                          paper eq. 40, x̂ the normed input

A token runs sub-layer l when its score is above the threshold, and skips it otherwise. One threshold
is shared by every attention layer, each MLP layer has its own (the paper's global / local rule).
Each row computes a fixed number of tokens per sub-layer (capacity): static shapes, no host reads.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from nanochat import step_timer
from nanochat.common import UserError
from nanochat.flash_attention import masked_attention, routed_attention
from nanochat.gpt import norm, apply_rotary, QK_SCALE

BLOCKS = ("attn", "mlp", "both")
KINDS = ("attn", "mlp")
# what Thresholds.tally sums per sub-layer and forward
TALLY = ("skipped", "overflow_tokens", "overflow_rows", "forwards")
MAX_RATE = 0.95  # above this almost nothing runs and a batch quantile rests on a handful of tokens
# a row's capacity is rounded up to a multiple of this many tokens: a GPU kernel's tile (128) at T >= 2048, 8 or more
CAPACITY_TILE = 128
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
    if not (math.isfinite(rate) and 0 <= rate < MAX_RATE):
        raise UserError(f"{flag} must be in [0, {MAX_RATE}) (got {rate:g})")


def mod_config_from_args(args):
    """ModConfig from the flags, or None when MoD is off."""
    if args.mod_rate is None:
        if args.mod_blocks:
            raise UserError("--mod-blocks needs --mod-rate (the target share of skipped token-sublayers)")
        return None
    check_rate(args.mod_rate)
    check_capacity(args.mod_rate, args.max_seq_len)
    return ModConfig(blocks=args.mod_blocks or "both", rate=args.mod_rate)


def capacity_multiple(T):
    return min(CAPACITY_TILE, max(8, T // 16))


def capacity(T, rate):
    """Tokens of a row of T that a skippable sub-layer computes at a target skip rate: T·(1 − rate) rounded up to a
    multiple of min(128, max(8, T // 16)), at most T. A fixed number, so every forward has the same shapes."""
    multiple = capacity_multiple(T)
    need = math.ceil(T * (1 - rate) - 1e-9)  # 1e-9: 80 · (1 − 0.7) is 24.000000000000004 in floats, not 25
    return min(T, -(-need // multiple) * multiple)


def forward_capacity(mod, T, training):
    """Each row's capacity in a forward over T positions: capacity(T, rate) in training, the whole row in evaluation.
    Evaluation then follows the threshold alone, the paper's rule: a token's path depends on its own prefix only,
    whatever the row's length, as it must for a KV cache (decoding one token at a time) to give a full forward's
    result; its shapes are static all the same."""
    return capacity(T, mod.rate) if training and mod is not None else T


def check_capacity(rate, T):
    """A training rate must leave a capacity between 0 and the whole row: at T it would save nothing."""
    cap = capacity(T, rate)
    if rate > 0 and not 0 < cap < T:
        raise UserError(
            f"--mod-rate {rate:g} at --max-seq-len {T}: each row would compute {cap} of its {T} tokens per "
            f"sub-layer (T·(1 − rate) rounded up to a multiple of {capacity_multiple(T)}), so "
            "nothing would be saved: raise the rate or the sequence length"
        )


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
    Within each row at most `capacity` tokens over the threshold run, the highest-scoring; the rest overflow.
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
        # [train, eval] × [attn, mlp] × layer × TALLY: sums over forwards, read by pop_stats (not in the checkpoint);
        # a tensor, not Python counters, so that a compiled forward adds to it in its graph
        self.register_buffer("tally", torch.zeros(2, len(KINDS), n_layer, len(TALLY), device=device), persistent=False)
        self.pending = []  # attention scores and executed counts of the current training forward

    @torch.no_grad()
    def reset(self):
        self.values.zero_()
        self.counts.zero_()
        self.last_attn.zero_()
        self.attn_debt.zero_()
        self.tally.zero_()
        self.pending = []

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
    def decide(self, kind, layer, score, capacity):
        """(execute, its capacity): the tokens that run the sub-layer, a bool (B, T) mask with at most `capacity` in a
        row: of the tokens whose score is over the threshold, the highest-scoring `capacity` of each row; the rest
        overflow. Training's MLP packs its batch as one group, (1, B·T) with B·capacity: its batch quantile bounds the
        batch, not each row, so it never overflows (B·capacity >= B·T − round(rate·B·T)); the same rows run."""
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
        over = s > thr
        if self.training and kind == "mlp":
            over, capacity = over.reshape(1, -1), capacity * over.size(0)
            execute = over  # within its capacity: no top-k to take
        else:
            execute = highest(over, s, capacity)
        n_over = over.sum(dim=1)
        ran = n_over.clamp(max=capacity)  # (B,) tokens each row runs
        if self.training and kind == "attn":
            self.pending.append((s.flatten(), ran.sum()))
        overflow = n_over - ran
        n = over.numel()
        one = torch.ones((), device=s.device)
        row = torch.stack([1 - ran.sum() / n, overflow.sum() / n, (overflow > 0).float().mean(), one])
        self.tally[int(not self.training), KINDS.index(kind), layer] += row  # TALLY's order
        return execute, capacity

    @torch.no_grad()
    def finish(self):
        """End of a training forward: this batch's pooled attention scores give the next batch's threshold (their
        quantile at the target plus the shortfall so far) and the running estimate's next value (at the target)."""
        if self.pending:
            scores = torch.cat([s for s, _ in self.pending])
            realised = 1 - torch.stack([r for _, r in self.pending]).sum() / scores.numel()
            rate = self.config.rate
            self.attn_debt.add_(DEBT_GAIN * (rate - realised)).clamp_(-rate, MAX_RATE - rate)
            self.last_attn.copy_(batch_threshold(scores, rate + self.attn_debt).reshape(1))
            self.update(0, batch_threshold(scores, rate))
        self.pending = []

    def pop_stats(self, mode):
        """(rates, overflow) over the forwards of this mode since the last call, one host read for all:
        rates {(kind, layer): mean skipped fraction}, overflow {(kind, layer): (the mean share of tokens over the
        threshold that did not fit the capacity, the mean share of rows that had such tokens)}."""
        if not (self.config.skips("attn") or self.config.skips("mlp")):
            return {}, {}  # nothing was routed: nothing to read
        m = ("train", "eval").index(mode)
        values = step_timer.read_values(self.tally[m])  # [kind][layer][TALLY]
        self.tally[m].zero_()
        rates, overflow = {}, {}
        for kind, layers in zip(KINDS, values):
            for layer, (skipped, tokens, rows, forwards) in enumerate(layers):
                if forwards:
                    rates[(kind, layer)] = skipped / forwards
                    overflow[(kind, layer)] = (tokens / forwards, rows / forwards)
        return rates, overflow

    def pop_rates(self, mode):
        """{(kind, layer): mean skipped fraction} over the forwards of this mode since the last call."""
        return self.pop_stats(mode)[0]


def highest(over, score, capacity):
    """over (B, T) less, in each row, all but its `capacity` highest-scoring tokens (ties: topk's order)."""
    if capacity >= over.size(1):
        return over
    top = torch.where(over, score, -math.inf).topk(capacity, dim=1, sorted=False).indices
    return over & torch.zeros_like(over).scatter(1, top, True)


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


def skip_summary(rates, overflow=None):
    """metrics.jsonl form of pop_stats: the skip rate per sub-layer and its mean per kind; with overflow, the mean
    share of tokens per kind that overflowed the capacity (overflow_attn, overflow_mlp) and the largest share of
    rows that overflowed in any sub-layer (overflow_rows)."""
    out = {"skip": {f"{l}.{k}": r for (k, l), r in sorted(rates.items(), key=lambda kv: (kv[0][1], kv[0][0]))}}
    for kind in KINDS:
        vals = [r for (k, _), r in rates.items() if k == kind]
        if vals:
            out[f"skip_{kind}"] = sum(vals) / len(vals)
        if overflow:
            tokens = [t for (k, _), (t, _) in overflow.items() if k == kind]
            if tokens:
                out[f"overflow_{kind}"] = sum(tokens) / len(tokens)
    if overflow:
        out["overflow_rows"] = max(r for _, r in overflow.values())
    return out


def step_metrics(model):
    """A training MoD model's `mod` entry of metrics.jsonl since the last one: skip_summary, the capacity of a row of
    the training length and the FLOPs per token at the realised rates."""
    rates, overflow = model.thresholds.pop_stats("train")
    if not rates:
        return {}
    cap = capacity(model.config.sequence_len, model.mod.rate)
    return {
        "mod": {
            **skip_summary(rates, overflow),
            "rate": model.mod.rate,
            "capacity": cap,
            "flops_per_token": model.estimate_flops(rates),
        }
    }


def overflow_warning(mod):
    """The warning line of a metrics `mod` entry where more than half of some sub-layer's rows overflowed, or None."""
    share = mod.get("overflow_rows", 0)
    if share <= 0.5:
        return None
    return (
        f"warning: MoD overflow: in {100 * share:.0f}% of the rows of a sub-layer more tokens passed the threshold "
        f"than the capacity of {mod['capacity']} per row lets run (--mod-rate {mod['rate']:g}); the extra ones skip, "
        "so more is skipped than the threshold asks (overflow_* in metrics.jsonl, docs/mod.md)"
    )


# ---------------------------------------------------------------------------
# the gathered computation: sub-layer outputs at the executed tokens, zeros elsewhere
#
# Each row runs a fixed number of tokens, its capacity (forward_capacity: capacity(T, rate) in training, T in
# evaluation): the tokens Thresholds.decide lets run, in position order, padded with skipped tokens whose result is
# dropped. A fixed number keeps every shape static: no host read, one graph for torch.compile whatever the scores.
# The capacity is at least one token per row: a sub-layer always runs, so every parameter gets a gradient (zero when
# no token ran). DDP with find_unused_parameters=False then needs no special case for a rank whose micro-batch
# skips a whole sub-layer, at no cost; telling DDP instead (find_unused_parameters=True) would cost a traversal of
# the autograd graph every step.


def packed(execute, n):
    """(B, n) positions with each row's executed tokens first, in order, and which of them are executed (the first n
    executed tokens of each row, padded with skipped ones)."""
    order = torch.sort((~execute).to(torch.uint8), dim=1, stable=True).indices[:, :n]
    valid = torch.arange(n, device=execute.device)[None] < execute.sum(dim=1, keepdim=True)
    return order, valid


def gather_rows(x, pos):
    """x (B, T, D) at the positions pos (B, n): (B, n, D)."""
    return torch.gather(x, 1, pos[..., None].expand(*pos.shape, x.size(-1)))


def scatter_rows(y, pos, valid, T):
    """(B, T, D) zeros with y (B, n, D) at the valid positions pos."""
    y = torch.where(valid[..., None], y, 0)
    B, n, D = y.shape
    return y.new_zeros(B, T, D).scatter(1, pos[..., None].expand(B, n, D), y)


def mlp_executed(mlp, x, execute, capacity=None):
    """mlp(x) at the executed tokens and 0 at the others; the MLP sees `capacity` tokens of each row of execute
    (default: all): execute is (B, T), or (1, B·T) to pack the batch as one row (Thresholds.decide)."""
    if execute is None:
        return mlp(x)
    groups = x.reshape(*execute.shape, x.size(-1))
    pos, valid = packed(execute, capacity or execute.size(1))
    return scatter_rows(mlp(gather_rows(groups, pos)).to(x.dtype), pos, valid, execute.size(1)).view(x.shape)


def attention_executed(attn, x, cos_sin, mask, execute, capacity=None, kv=None):
    """attn(x, cos_sin, mask) at the executed tokens and 0 at the others.

    Every token still makes its key and value (later tokens attend to them); only the `capacity` routed tokens of
    each row (default: T) make a query, attend and go through the output projection. With a KV cache (decoding)
    the keys and values of every new token, skipped or not, are appended to it, which is what a full forward would
    have made of them."""
    if execute is None:
        return attn(x, cos_sin, mask, kv)
    B, T, D = x.shape
    qpos, valid = packed(execute, capacity or T)  # (B, Tq)
    Tq = qpos.size(1)
    H, KV, hd = attn.n_head, attn.n_kv_head, attn.head_dim
    q = attn.c_q(gather_rows(x, qpos)).view(B, Tq, H, hd)
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
    if mask is None:  # a plain row, causal within the layer's window: the kernel takes the query positions
        y = routed_attention(q, k, v, qpos, attn.window)
    else:  # packed documents, a KV cache, or the CPU's S windows: the mask's rows at the query positions
        Tk = k.size(2)
        rows = torch.gather(mask.expand(B, 1, T, Tk), 2, qpos[:, None, :, None].expand(B, 1, Tq, Tk))
        y = masked_attention(q, k, v, rows)
    return scatter_rows(attn.c_proj(y.transpose(1, 2).reshape(B, Tq, D)).to(x.dtype), qpos, valid, T)


def run_executed(kind, block, x, cos_sin, mask, execute, capacity=None, kv=None):
    if kind == "attn":
        return attention_executed(block.attn, x, cos_sin, mask, execute, capacity, kv)
    return mlp_executed(block.mlp, x, execute, capacity)


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
