"""
Rival depth arms on the GPT baseline: Layer-Norm Scaling, Peri-LN, LayerRoPE (docs/design.md §11).

Each arm changes only what a block reads from the residual stream (the pre-norm's output) or writes back to it (the
branch output), on the baseline of nanochat/gpt.py, whose norms are parameter-free:

    gpt-lns        x ← x + F(N(x) / √l)                  l = 1..L, the block's 1-based index; no parameters
    gpt-peri       x ← x + g ⊙ N(F(N(x)))                 a learned gain g (init 1) on each output norm
    gpt-layerrope  x ← x + γ_l^write ⊙ F(γ_l^read ⊙ N(x))  one shared gain per site, turned by depth
    (depth_gains)

LayerRoPE (arXiv:2610.09179) has four sites (attn and MLP read, attn and MLP write); each holds one gain γ (d) and
four scalars (α, β, α_rot, β_rot), and block l (0-based) uses γ_l = γ ⊙_c exp(r(l) + iθ(l, j)) on the channel
pairs (γ_2j, γ_2j+1) as complex numbers, r(l) = α + β·log(l+1), θ(l, j) = exp(α_rot +
β_rot·log(l+1))·b^(−2j/d).

The papers' models replace the gains their norms already have; the baseline's norms have none, so Peri-LN adds 2·L·d
parameters and LayerRoPE 4·d + 16. A branch's write happens inside its attention / MLP module (RivalAttention,
RivalMLP), so that a hook on the module (analysis/capture.py) sees exactly what the block adds to the stream.
"""

import math
from dataclasses import dataclass, asdict

import torch
import torch.nn as nn

from nanochat.common import UserError, positive_float
from nanochat.gpt import GPT, Block, CausalSelfAttention, MLP, norm

SITES = ("attn_in", "mlp_in", "attn_out", "mlp_out")  # LayerRoPE's sites: the two reads, then the two writes
GAIN_LR = 0.02  # AdamW LR of the arms' gains and scalars (--rival-gain-lr; docs/design.md §11 says why)
NO_GAINS = (None, None, None, None)  # a block's (attn read, mlp read, attn write, mlp write): the baseline's


@dataclass
class LayerRoPEConfig:
    """LayerRoPE's initial scalars (every site alike) and its base b, a constant."""

    alpha: float = 0.0
    beta: float = -0.5
    alpha_rot: float = 0.0
    beta_rot: float = -0.5
    base: float = 100.0


# the paper's two settings: the model ladder's (the read gain starts at LNS's 1/√(l+1)) and the depth-scaling runs'
LAYERROPE_INITS = {"ladder": LayerRoPEConfig(), "depth": LayerRoPEConfig(beta=0.0, beta_rot=0.0, base=1e4)}


def add_rival_args(parser):
    g = parser.add_argument_group("rival depth arms (--arch gpt-lns, gpt-peri, gpt-layerrope; docs/design.md §11)")
    g.add_argument(
        "--rival-gain-lr",
        type=positive_float,
        default=GAIN_LR,
        help="AdamW LR (no weight decay, × batch LR scale) of Peri-LN's and LayerRoPE's gains and scalars",
    )
    g.add_argument(
        "--layerrope-init",
        choices=list(LAYERROPE_INITS),
        default="ladder",
        help="LayerRoPE's init: ladder (β = β_rot = -0.5, b = 100) or depth (β = β_rot = 0, b = 1e4)",
    )


def times(x, gain):
    """x times a gain: nothing (None), a number (LNS) or a (d,) vector in x's dtype (LayerRoPE)."""
    if gain is None:
        return x
    return x * (gain.to(x.dtype) if torch.is_tensor(gain) else gain)


def written(y, out_gain, gain):
    """A branch's write: Peri-LN's output norm with its gain (out_gain, None elsewhere), then LayerRoPE's gain."""
    if out_gain is not None:
        y = norm(y) * out_gain.to(y.dtype)
    return times(y, gain)


def depth_gains(gamma, depth, base, n_layer):
    """γ_l of every block l = 0..n_layer-1, (n_layer, d) in fp32: the pairs (γ_2j, γ_2j+1) times exp(r(l) + iθ(l,
    j)) as complex numbers. depth: (α, β, α_rot, β_rot); base: b, a 0-d tensor. θ(0, j) = exp(α_rot)·b^(−2j/d)
    is not 0: the first block's gain is turned too."""
    g = gamma.float()
    d = g.size(0)
    alpha, beta, alpha_rot, beta_rot = depth.float().unbind()
    u = torch.arange(1, n_layer + 1, dtype=torch.float32, device=g.device).log()[:, None]  # log(l + 1), (L, 1)
    j = torch.arange(d // 2, dtype=torch.float32, device=g.device)
    theta = torch.exp(alpha_rot + beta_rot * u) * torch.pow(base.float(), -2.0 * j / d)  # (L, d/2)
    mag = torch.exp(alpha + beta * u)
    re, im = g[0::2], g[1::2]
    cos, sin = torch.cos(theta), torch.sin(theta)
    return torch.stack([mag * (re * cos - im * sin), mag * (re * sin + im * cos)], dim=-1).flatten(-2)


class RivalAttention(CausalSelfAttention):
    """The baseline's attention with the branch's write in its output (out_gain: Peri-LN's, else None)."""

    def __init__(self, config, out_norm=False, device=None):
        super().__init__(config, device=device)
        self.out_gain = nn.Parameter(torch.empty(config.n_embd, device=device)) if out_norm else None

    def forward(self, x, cos_sin, mask, kv=None, ve=None, gain=None):
        return written(super().forward(x, cos_sin, mask, kv, ve), self.out_gain, gain)


class RivalMLP(MLP):
    def __init__(self, config, out_norm=False, device=None):
        super().__init__(config, device=device)
        self.out_gain = nn.Parameter(torch.empty(config.n_embd, device=device)) if out_norm else None

    def forward(self, x, gain=None):
        return written(super().forward(x), self.out_gain, gain)


class RivalBlock(Block):
    def __init__(self, config, out_norm=False, device=None):
        nn.Module.__init__(self)  # the baseline's two modules, in its order, as the rival kinds
        self.attn = RivalAttention(config, out_norm, device=device)
        self.mlp = RivalMLP(config, out_norm, device=device)

    def forward(self, x, cos_sin, mask, kv=None, ve=None, gains=NO_GAINS):
        read_attn, read_mlp, write_attn, write_mlp = gains
        x = x + self.attn(times(norm(x), read_attn), cos_sin, mask, kv, ve, write_attn)
        x = x + self.mlp(times(norm(x), read_mlp), write_mlp)
        return x


class RivalGPT(GPT):
    """The baseline with RivalBlocks: an arm says what each block reads and writes (block_gains, out_norm)."""

    out_norm = False

    def __init__(self, config, device=None):
        super().__init__(config, device=device)
        # the baseline's blocks rebuilt (free on the meta device, where models are built): the same matrices in the same
        # order, so the same init draws as gpt; an arm's 1-D parameters come after them
        self.blocks = nn.ModuleList([RivalBlock(config, self.out_norm, device=device) for _ in range(config.n_layer)])
        for block, w in zip(self.blocks, self.windows):
            block.attn.window = w

    @classmethod
    def kwargs_from_args(cls, args):
        """Constructor arguments from base_train's flags (ArchSpec.init_kwargs): none; no Mixture-of-Depths."""
        if getattr(args, "mod_rate", None) is not None or getattr(args, "mod_blocks", None):
            raise UserError(
                f"--arch {cls.arch} has no Mixture-of-Depths: drop the --mod-* flags, or use --arch nag / gpt-router"
            )
        return {}

    def block_gains(self):
        """Per block, (attn read, mlp read, attn write, mlp write) gains for `times`."""
        return [NO_GAINS] * self.config.n_layer

    def gain_params(self):
        """The arm's own parameters: every one that is not a matrix (the baseline has none)."""
        return [p for p in self.parameters() if p.ndim < 2]

    # the added work is O(d) per site and token: like the baseline's norms, not a matmul, so neither in S nor in the
    # FLOPs (matmul_params keeps the 2-D weights; every parameter an arm adds is 1-D)

    def optimizer_groups(self, embedding_lr, unembedding_lr, matrix_lr, weight_decay, lr_scale, gain_lr=GAIN_LR):
        groups = super().optimizer_groups(embedding_lr, unembedding_lr, matrix_lr, weight_decay, lr_scale)
        gains = self.gain_params()
        if gains:  # norm gains and depth scalars: AdamW without decay, as LayerRoPE's OLMo port trains them
            groups.append(
                dict(
                    kind="adamw",
                    name="rival_gains",
                    params=gains,
                    lr=gain_lr * lr_scale,
                    betas=(0.8, 0.95),
                    weight_decay=0.0,
                )
            )
        return groups

    def forward(
        self, idx, targets=None, loss_reduction="mean", positions=None, allowed=None, logits_at=None, cache=None
    ):
        # every arm is per position: the KV cache holds all a new position reads of the others (docs/design.md §9)
        T = idx.size(1)
        cos_sin, masks, kvs = self.attention_inputs(T, idx.device, positions, allowed, cache)
        x = norm(self.wte(idx).to(self.compute_dtype))
        for block, gains, mask, kv in zip(self.blocks, self.block_gains(), masks, kvs):
            x = block(x, cos_sin, mask, kv, None, gains)
        return self.end_forward(x, T, targets, loss_reduction, logits_at, cache)


class LNSGPT(RivalGPT):
    """Layer-Norm Scaling (arXiv:2502.05795): both pre-norms of block l (1-based) scaled by 1/√l."""

    arch = "gpt-lns"

    def __init__(self, config, device=None):
        super().__init__(config, device=device)
        # a number per block, as the code has it
        self.lns_scales = [1 / math.sqrt(i + 1) for i in range(config.n_layer)]

    def block_gains(self):
        return [(s, s, None, None) for s in self.lns_scales]


class PeriGPT(RivalGPT):
    """Peri-LN (arXiv:2502.02732): each branch's output rms-normed with a learned gain before the residual add."""

    arch = "gpt-peri"
    out_norm = True

    @torch.no_grad()
    def init_weights(self):
        super().init_weights()
        for block in self.blocks:
            block.attn.out_gain.fill_(1.0)
            block.mlp.out_gain.fill_(1.0)


class LayerRoPE(nn.Module):
    """LayerRoPE's parameters: per site a gain γ (d) and depth scalars (α, β, α_rot, β_rot); the base b is a buffer
    so that it travels with the weights (the Hugging Face export carries weights, not the checkpoint's meta)."""

    def __init__(self, n_embd, device=None):
        super().__init__()
        self.gamma = nn.ParameterDict({s: nn.Parameter(torch.empty(n_embd, device=device)) for s in SITES})
        self.depth = nn.ParameterDict({s: nn.Parameter(torch.empty(4, device=device)) for s in SITES})
        self.register_buffer("base", torch.empty((), device=device))

    @torch.no_grad()
    def reset(self, cfg):
        for s in SITES:
            self.gamma[s].fill_(1.0)
            self.depth[s].copy_(torch.tensor([cfg.alpha, cfg.beta, cfg.alpha_rot, cfg.beta_rot]))
        self.base.fill_(cfg.base)

    def gains(self, n_layer):
        """{site: (n_layer, d) fp32}: every block's γ_l, computed once per forward."""
        return {s: depth_gains(self.gamma[s], self.depth[s], self.base, n_layer) for s in SITES}


class LayerRoPEGPT(RivalGPT):
    """LayerRoPE (arXiv:2610.09179) on the pre-norm baseline: shared read and write gains, turned by depth."""

    arch = "gpt-layerrope"

    def __init__(self, config, layerrope=None, device=None):
        super().__init__(config, device=device)
        self.layerrope_config = layerrope or LayerRoPEConfig()
        self.layerrope = LayerRoPE(config.n_embd, device=device)

    @classmethod
    def kwargs_from_args(cls, args):
        return {**super().kwargs_from_args(args), "layerrope": LAYERROPE_INITS[args.layerrope_init]}

    @classmethod
    def extra_init_kwargs(cls, meta):
        return {"layerrope": LayerRoPEConfig(**meta["layerrope_config"])}

    def extra_meta(self):
        return {"layerrope_config": asdict(self.layerrope_config)}

    @torch.no_grad()
    def init_weights(self):
        super().init_weights()
        self.layerrope.reset(self.layerrope_config)

    def block_gains(self):
        g = self.layerrope.gains(self.config.n_layer)
        return [tuple(g[s][i] for s in SITES) for i in range(self.config.n_layer)]
