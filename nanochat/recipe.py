"""
Today's nanochat recipe on the clean GPT baseline (docs/design.md §10).

The GPT of nanochat/gpt.py plus the parts that
nanochat's record run (dev/LEADERBOARD.md "Run 6": d24, tokens/params 8, fp8) trains with, as karpathy/nanochat's
nanochat/gpt.py (GPT.__init__, init_weights, forward, setup_optimizer) defines them:

- value embeddings: on every other layer (the last one included) a per-token vector, looked up like wte, is added to
  the attention values with a gate 3·σ(W·x[:12]), one per KV head (CausalSelfAttention, ve=);
- smear: x_t += λ·σ(w·x_t[:24])·x_{t-1} on the normed embedding: the previous token mixed into each token;
- backout: the residual after layer n_layer // 2, times a scalar, subtracted before the final norm;
- resid lambdas and x0 lambdas: before block i, x ← r_i·x + c_i·x0, x0 the (smeared) normed embedding;
- quarter windows: an S layer sees a quarter of the context, rounded up to 128 (the baseline's S sees half).

Each part is on by default and switched off by its own flag (--no-value-embeds, ...); with every part off the model
is the baseline GPT exactly: the same parameters, the same init draws (the parts draw after the baseline's), the
same logits. The mixin RecipeParts holds the parts, so that an arch built on another baseline class takes them too.
"""

import math
from dataclasses import dataclass, asdict, fields

import torch
import torch.nn as nn

from nanochat.gpt import GPT, Embedding, Linear, VE_GATE_CHANNELS, layer_windows, norm
from nanochat.common import positive_float


@dataclass
class RecipeConfig:
    value_embeds: bool = True
    smear: bool = True
    backout: bool = True
    resid_lambdas: bool = True
    x0_lambdas: bool = True
    quarter_windows: bool = True


PARTS = tuple(f.name for f in fields(RecipeConfig))
SMEAR_CHANNELS = 24  # the smear gate reads this many leading channels of the token's normed embedding
# AdamW LR of smear_gate, smear_lambda, backout_lambda: a constant in nanochat (no batch or width scaling)
SMEAR_LR = 0.2
WINDOW_TILE = 128  # nanochat rounds the short window up to FA3's tile


HELP = {
    "value_embeds": "no value embeddings (gated per-token vectors added to the attention values)",
    "smear": "no smear (the previous token's embedding mixed into each token)",
    "backout": "no backout (the mid-depth residual subtracted before the head)",
    "resid_lambdas": "no per-layer residual scales (an arch without an additive stream has none anyway)",
    "x0_lambdas": "no per-layer mix of the embedding into the stream",
    "quarter_windows": "S windows of half the context, as the baseline's, not nanochat's quarter",
}


def add_recipe_args(parser):
    g = parser.add_argument_group("nanochat recipe (--arch gpt-recipe and the archs built on it; docs/design.md §10)")
    for part in PARTS:
        g.add_argument(f"--no-{part.replace('_', '-')}", action="store_true", help=HELP[part])
    g.add_argument(
        "--scalar-lr",
        type=positive_float,
        default=0.5,
        help="AdamW LR of the x0 lambdas (× batch LR scale); resid lambdas take 1%% of it",
    )


def recipe_config_from_args(args):
    return RecipeConfig(**{part: not getattr(args, f"no_{part}") for part in PARTS})


def has_value_embed(layer, n_layer):
    """Every other layer, counted back from the last one (nanochat's has_ve)."""
    return layer % 2 == (n_layer - 1) % 2


def quarter_window(sequence_len):
    """nanochat's short window, -(-T // 4 // 128) * 128: a quarter of the context rounded up to WINDOW_TILE (2048 →
    512; nanochat's comment says 768, its code gives 512), at most the context."""
    return min(sequence_len, -(-sequence_len // 4 // WINDOW_TILE) * WINDOW_TILE)


def recipe_windows(config, quarter):
    """Per-layer windows: the baseline's pattern, with S layers at nanochat's quarter window when `quarter`."""
    windows = layer_windows(config)
    if not quarter:
        return windows
    return [w if w >= config.sequence_len else quarter_window(config.sequence_len) for w in windows]


def previous_rows(x, positions=None, allowed=None):
    """(prev, has): for every position the row of the token before it in its own sequence, and whether there is one.
    Plain rows: the row before. Packed rows (evaluation): the key it may attend to whose position is one less."""
    B, T, _ = x.shape
    if positions is None:
        prev = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
        has = torch.arange(T, device=x.device)[None, :].expand(B, T) > 0
        return prev, has
    match = allowed & (positions[:, None, :] == positions[:, :, None] - 1)  # (B, T queries, T keys)
    src = match.to(torch.int8).argmax(dim=-1)
    return torch.gather(x, 1, src[..., None].expand_as(x)), match.any(dim=-1)


class RecipeParts:
    """The recipe's parameters, their init, optimizer groups and counts, on a GPT subclass (mixed in before it)."""

    def build_recipe(self, recipe, device=None):
        self.recipe = recipe or RecipeConfig()
        cfg, r = self.config, self.recipe
        self.windows = recipe_windows(cfg, r.quarter_windows)
        for block, w in zip(self.blocks, self.windows):
            block.attn.window = w
        L = cfg.n_layer
        self.backout_layer = L // 2
        if r.resid_lambdas:
            self.resid_lambdas = nn.Parameter(torch.empty(L, device=device))
        if r.x0_lambdas:
            self.x0_lambdas = nn.Parameter(torch.empty(L, device=device))
        if r.smear:
            self.smear_gate = Linear(SMEAR_CHANNELS, 1, device=device)
            self.smear_lambda = nn.Parameter(torch.empty(1, device=device))
        if r.backout:
            self.backout_lambda = nn.Parameter(torch.empty(1, device=device))
        if r.value_embeds:
            kv_dim = cfg.n_kv_head * (cfg.n_embd // cfg.n_head)
            layers = [i for i in range(L) if has_value_embed(i, L)]
            self.value_embeds = nn.ModuleDict(
                {str(i): Embedding(cfg.vocab_size, kv_dim, device=device) for i in layers}
            )
            for i in layers:
                self.blocks[i].attn.ve_gate = Linear(VE_GATE_CHANNELS, cfg.n_kv_head, device=device)

    @torch.no_grad()
    def init_recipe(self):
        """nanochat's inits: r_i 1.15 → 1.05 and c_i 0.20 → 0.05 linearly over the layers, smear λ 0, backout 0.2,
        both gates uniform [0, 0.02] (slightly open), value embeddings uniform ±√3·d^-½ (like c_v)."""
        r, L = self.recipe, self.config.n_layer
        depth = torch.arange(L, dtype=torch.float32) / max(L - 1, 1)
        if r.resid_lambdas:
            self.resid_lambdas.copy_(1.15 - 0.10 * depth)
        if r.x0_lambdas:
            self.x0_lambdas.copy_(0.20 - 0.15 * depth)
        if r.smear:
            self.smear_lambda.zero_()
            nn.init.uniform_(self.smear_gate.weight, 0.0, 0.02)
        if r.backout:
            self.backout_lambda.fill_(0.2)
        if r.value_embeds:
            bound = math.sqrt(3) * self.config.n_embd**-0.5
            for ve in self.value_embeds.values():
                nn.init.uniform_(ve.weight, -bound, bound)
            for block in self.blocks:
                if block.attn.ve_gate is not None:
                    nn.init.uniform_(block.attn.ve_gate.weight, 0.0, 0.02)

    def recipe_groups(self, embedding_lr, scalar_lr, lr_scale):
        """nanochat's AdamW groups of the parts (setup_optimizer). The ve gates live in the blocks: Muon, as there."""
        r = self.recipe
        dim_scale = (self.config.n_embd / 768) ** -0.5
        groups = []
        if r.value_embeds:
            groups.append(
                dict(
                    kind="adamw",
                    name="value_embeds",
                    params=list(self.value_embeds.parameters()),
                    lr=0.5 * embedding_lr * dim_scale * lr_scale,
                    betas=(0.8, 0.995),
                    weight_decay=0.01,
                )
            )
        if r.resid_lambdas:
            groups.append(
                dict(
                    kind="adamw",
                    name="resid_lambdas",
                    params=[self.resid_lambdas],
                    lr=0.01 * scalar_lr * lr_scale,
                    betas=(0.8, 0.95),
                    weight_decay=0.05,
                )
            )
        if r.x0_lambdas:
            groups.append(
                dict(
                    kind="adamw",
                    name="x0_lambdas",
                    params=[self.x0_lambdas],
                    lr=scalar_lr * lr_scale,
                    betas=(0.96, 0.95),
                    weight_decay=0.0,
                )
            )
        scalars = ([self.smear_gate.weight, self.smear_lambda] if r.smear else []) + (
            [self.backout_lambda] if r.backout else []
        )
        if scalars:
            groups.append(
                dict(
                    kind="adamw", name="smear_backout", params=scalars, lr=SMEAR_LR, betas=(0.8, 0.95), weight_decay=0.0
                )
            )
        return groups

    def matmul_params(self):
        """The baseline's, less the value embeddings (lookups). The gates count: nanochat counts every Linear."""
        return [
            p
            for n, p in self.named_parameters()
            if p.ndim == 2 and n != "wte.weight" and not n.startswith("value_embeds.")
        ]

    def recipe_extra_params(self):
        """Parameters outside the size rules' S, as nanochat's num_scaling_params (transformer matrices + lm_head)
        leaves them out: value embeddings, the lambdas, the smear gate. The ve gates are in the blocks, hence in S."""
        return sum(
            p.numel()
            for n, p in self.named_parameters()
            if n.split(".")[0]
            in ("value_embeds", "resid_lambdas", "x0_lambdas", "smear_gate", "smear_lambda", "backout_lambda")
        )

    def value_embed(self, layer, idx, dtype):
        if not self.recipe.value_embeds or str(layer) not in self.value_embeds:
            return None
        return self.value_embeds[str(layer)](idx).to(dtype)

    def smear_gates(self, x):
        """λ·σ(w·x[..., :24]): how much of the previous token each token takes, (..., 1)."""
        return self.smear_lambda.to(x.dtype) * torch.sigmoid(self.smear_gate(x[..., :SMEAR_CHANNELS]))

    def smear(self, x, positions=None, allowed=None, cache=None):
        """x_t + gate(x_t)·x_{t-1} for every token with a previous one in its sequence. Decoding with a KV cache, the
        previous token of the first new one is the cache's prev_embedding (set here to the last new one's)."""
        if positions is not None:
            prev, has = previous_rows(x, positions, allowed)
            return x + self.smear_gates(x) * has[..., None].to(x.dtype) * prev
        first, rest = x[:, :1], x[:, 1:]
        if x.size(1) > 1:  # nanochat's training form: the first position unchanged
            rest = rest + self.smear_gates(rest) * x[:, :-1]
        if cache is not None:
            prev, cache.prev_embedding = cache.prev_embedding, x[:, -1:]
            if prev is not None:
                first = first + self.smear_gates(first) * prev
        return torch.cat([first, rest], dim=1)

    # ----- checkpoint hooks -----

    @classmethod
    def recipe_init_kwargs(cls, meta):
        return {"recipe": RecipeConfig(**meta["recipe_config"])}

    def recipe_meta(self):
        return {"recipe_config": asdict(self.recipe)}


class RecipeGPT(RecipeParts, GPT):
    arch = "gpt-recipe"

    def __init__(self, config, recipe=None, device=None):
        super().__init__(config, device=device)
        self.build_recipe(recipe, device)

    @classmethod
    def extra_init_kwargs(cls, meta):
        return cls.recipe_init_kwargs(meta)

    def extra_meta(self):
        return self.recipe_meta()

    @torch.no_grad()
    def init_weights(self):
        super().init_weights()
        self.init_recipe()

    def num_scaling_params(self):
        """S of the size rules as nanochat counts it: every parameter under the blocks (ve gates included) + lm_head."""
        return sum(p.numel() for p in self.blocks.parameters()) + self.lm_head.weight.numel()

    def optimizer_groups(self, embedding_lr, unembedding_lr, matrix_lr, weight_decay, lr_scale, scalar_lr=0.5):
        groups = super().optimizer_groups(embedding_lr, unembedding_lr, matrix_lr, weight_decay, lr_scale)
        return groups + self.recipe_groups(embedding_lr, scalar_lr, lr_scale)

    def forward(
        self, idx, targets=None, loss_reduction="mean", positions=None, allowed=None, logits_at=None, cache=None
    ):
        r = self.recipe
        T = idx.size(1)
        cos_sin, masks, kvs = self.attention_inputs(T, idx.device, positions, allowed, cache)
        x = norm(self.wte(idx).to(self.compute_dtype))
        if r.smear:
            x = self.smear(x, positions, allowed, cache)
        x0, x_mid = x, None
        for i, (block, mask, kv) in enumerate(zip(self.blocks, masks, kvs)):
            if r.resid_lambdas:
                x = self.resid_lambdas[i] * x
            if r.x0_lambdas:
                x = x + self.x0_lambdas[i] * x0
            x = block(x, cos_sin, mask, kv, self.value_embed(i, idx, x.dtype))
            if i == self.backout_layer:
                x_mid = x
        if r.backout:
            x = x - self.backout_lambda.to(x.dtype) * x_mid
        return self.end_forward(x, T, targets, loss_reduction, logits_at, cache)
