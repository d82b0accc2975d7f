"""
The router-MoD baseline (paper eq. 40): the GPT baseline with a learned router per sub-layer.

Each skippable sub-layer has a router g_l = σ(x̂·w_l + b_l) on the normed input x̂.
The thresholds follow NAG-MoD's rules (nag/mod.py), and
the executed tokens' sub-layer output is scaled by g_l, which is how the router learns:

    x ← x + g_l(x̂) · f_l(x̂)   for tokens with g_l above the threshold,   x unchanged otherwise

At rate 0 no token is routed and no gate is applied: the model is the GPT baseline exactly.
"""

import math
from dataclasses import asdict

import torch
import torch.nn as nn

from nanochat.common import UserError
from nanochat.gpt import GPT, Linear, norm
from nag import mod as mod_lib
from nag.mod import ModConfig, Thresholds, mod_config_from_args, run_executed, flops_with_skips, KINDS


class RouterMoDGPT(GPT):
    arch = "gpt-router"

    def __init__(self, config, mod=None, device=None):
        super().__init__(config, device=device)
        self.mod = mod or ModConfig()
        self.routers = nn.ModuleDict(
            {
                f"{kind}_{i}": Linear(config.n_embd, 1, bias=True, device=device)
                for i in range(config.n_layer)
                for kind in KINDS
                if self.mod.covers(kind)
            }
        )
        self.thresholds = Thresholds(config.n_layer, self.mod, device)

    # ----- hooks (see GPT; the command-line side, --mod-* and --nag-gate-lr for the routers, is nag/archs.py) -----

    @classmethod
    def extra_init_kwargs(cls, meta):
        return {"mod": ModConfig(**meta["mod_config"])}

    def extra_meta(self):
        return {"mod_config": asdict(self.mod)}

    def step_metrics(self):
        return mod_lib.step_metrics(self)

    def configure_mod(self, mod, device=None):
        """Another rate (base_eval's trade-off curve): only over the sub-layers whose routers were trained."""
        untrained = [k for k in KINDS if mod.covers(k) and not self.mod.covers(k)]
        if untrained:
            raise UserError(
                f"this router-MoD model was trained with --mod-blocks {self.mod.blocks}: it has no trained "
                f"router for {', '.join(untrained)}"
            )
        self.mod = ModConfig(blocks=mod.blocks, rate=mod.rate, momentum=mod.momentum)
        self.thresholds = Thresholds(
            self.config.n_layer, self.mod, device if device is not None else self.wte.weight.device
        )

    # ----- init, optimizer, FLOPs -----

    @torch.no_grad()
    def init_weights(self):
        super().init_weights()
        bound = math.sqrt(3) * self.config.n_embd**-0.5  # like NAG's m_down: scores differ between tokens from step 0
        for r in self.routers.values():
            nn.init.uniform_(r.weight, -bound, bound)
            nn.init.zeros_(r.bias)
        self.thresholds.reset()

    def optimizer_groups(self, embedding_lr, unembedding_lr, matrix_lr, weight_decay, lr_scale, router_lr=1e-3):
        # the routers train like NAG's gates (AdamW at --nag-gate-lr): the two MoDs differ in the score only
        groups = super().optimizer_groups(embedding_lr, unembedding_lr, matrix_lr, weight_decay, lr_scale)
        groups.append(
            dict(
                kind="adamw",
                name="mod_routers",
                params=list(self.routers.parameters()),
                lr=router_lr * lr_scale,
                betas=(0.8, 0.95),
            )
        )
        return groups

    def estimate_flops(self, skip=None):
        return flops_with_skips(self, super().estimate_flops(), self.mod, skip)

    # ----- forward -----

    def forward(
        self, idx, targets=None, loss_reduction="mean", positions=None, allowed=None, logits_at=None, cache=None
    ):
        T = idx.size(1)
        cos_sin, masks, kvs = self.attention_inputs(T, idx.device, positions, allowed, cache)
        x = norm(self.wte(idx).to(self.compute_dtype))
        capacity = mod_lib.forward_capacity(self.mod, T, self.training)
        for i, (block, mask, kv) in enumerate(zip(self.blocks, masks, kvs)):
            for kind in KINDS:
                x = x + self.routed(kind, i, block, norm(x), cos_sin, mask, kv, capacity)
        self.thresholds.finish()
        return self.end_forward(x, T, targets, loss_reduction, logits_at, cache)

    def routed(self, kind, layer, block, h, cos_sin, mask, kv=None, capacity=None):
        if not self.mod.skips(kind):
            return run_executed(kind, block, h, cos_sin, mask, None, kv=kv)
        capacity = capacity or h.size(1)
        gate = torch.sigmoid(self.routers[f"{kind}_{layer}"](h).float())  # (B, T, 1)
        execute, capacity = self.thresholds.decide(kind, layer, gate.squeeze(-1), capacity)
        out = run_executed(kind, block, h, cos_sin, mask, execute, capacity, kv)
        return out * gate.to(h.dtype)
