"""
NAG on today's nanochat recipe (docs/design.md §10).

NAGGPT (nag/model.py) with the recipe's parts (nanochat/recipe.py),
each decided against the paper's equations:

- value embeddings and quarter windows live inside a sub-layer's f (its attention), which NAG leaves as it is: carried
over;
- smear, x0 lambdas and backout are additive writes to the residual sum, which NAG replaces: adapted as eq. 7 writes,
  R ← ρ·(R̄ + w) with w a vector of RMS ~1 (the previous token's R̄, R̄₀, −R̄_mid), then the direction
  renormalised and its gain carried into the log-norm s (eqs. 16–17): R̄ ← N(R̄ + w), s ← s + log RMS(R̄ + w);
- resid lambdas scale R alone, which moves s by log r_i and leaves R̄ as it is: the product of all of them is one
  token-independent offset of s_L, which log G_encode already learns (eq. 18): left out.

With every part off the model is NAGGPT exactly. Mixture-of-Depths is not combined with the recipe.
"""

from dataclasses import replace

import torch

from nanochat.recipe import RecipeConfig, RecipeParts
from nag.model import GATE_LR, NAGGPT, NAGConfig, TEMP_GAIN_LR


def renormalised(y, log_norm):
    """(direction, log-norm) of ρ·y, ρ = exp(log_norm): y back to RMS 1, its RMS carried into the log-norm (eqs.
    16-17)."""
    rms = y.float().square().mean(dim=-1, keepdim=True).sqrt().clamp_min(1e-12)
    return (y.float() / rms).to(y.dtype), log_norm + torch.log(rms)


class NAGRecipeGPT(RecipeParts, NAGGPT):
    arch = "nag-recipe"

    def __init__(self, config, nag=None, impl=None, recipe=None, device=None):
        super().__init__(config, nag=nag, impl=impl, device=device)
        self.build_recipe(replace(recipe or RecipeConfig(), resid_lambdas=False), device)  # left out (module docstring)

    @classmethod
    def extra_init_kwargs(cls, meta):
        return {"nag": NAGConfig(**meta["nag_config"]), **cls.recipe_init_kwargs(meta)}

    def extra_meta(self):
        return {**super().extra_meta(), **self.recipe_meta()}

    @torch.no_grad()
    def init_weights(self):
        super().init_weights()
        self.init_recipe()

    def num_scaling_params(self):
        """NAG's S (nag/model.py) with the ve gates, which live in the blocks; the smear gate stays out, as in
        nanochat."""
        return super().num_scaling_params() - (self.smear_gate.weight.numel() if self.recipe.smear else 0)

    def matmul_params(self):
        """RecipeParts' (no value embeddings), the gate stacks counted as NAGGPT counts them."""
        return self.with_gate_matrices(RecipeParts.matmul_params(self))

    def optimizer_groups(
        self,
        embedding_lr,
        unembedding_lr,
        matrix_lr,
        weight_decay,
        lr_scale,
        gate_lr=GATE_LR,
        temp_gain_lr=TEMP_GAIN_LR,
        scalar_lr=0.5,
    ):
        groups = super().optimizer_groups(
            embedding_lr, unembedding_lr, matrix_lr, weight_decay, lr_scale, gate_lr, temp_gain_lr
        )
        return groups + self.recipe_groups(embedding_lr, scalar_lr, lr_scale)

    def forward(
        self, idx, targets=None, loss_reduction="mean", positions=None, allowed=None, logits_at=None, cache=None
    ):
        r = self.recipe
        T = idx.size(1)
        cos_sin, masks, kvs = self.attention_inputs(T, idx.device, positions, allowed, cache)
        e = self.wte(idx)  # fp32 rows, centred
        rho = e.square().mean(dim=-1, keepdim=True).sqrt().clamp_min(1e-12)
        res_dir = (e / rho).to(self.compute_dtype)
        log_norm = torch.log(rho) + self.log_gain_encode
        if r.smear:
            res_dir, log_norm = renormalised(self.smear(res_dir, positions, allowed, cache), log_norm)
        dir0, mid = res_dir, None
        gates = self.gates.unbound()
        for i, (block, mask, kv) in enumerate(zip(self.blocks, masks, kvs)):
            if r.x0_lambdas:
                res_dir, log_norm = renormalised(res_dir + self.x0_lambdas[i].to(res_dir.dtype) * dir0, log_norm)
            ve = self.value_embed(i, idx, res_dir.dtype)
            for kind, br in (("attn", gates[2 * i]), ("mlp", gates[2 * i + 1])):
                res_dir, log_norm = self.recipe_sublayer(kind, block, br, res_dir, log_norm, cos_sin, mask, kv, ve)
            if i == self.backout_layer:
                mid = res_dir
        if r.backout:
            res_dir, log_norm = renormalised(res_dir - self.backout_lambda.to(res_dir.dtype) * mid, log_norm)
        return self.end_forward((res_dir, log_norm), T, targets, loss_reduction, logits_at, cache)

    def recipe_sublayer(self, kind, block, br, res_dir, log_norm, cos_sin, mask, kv, ve):
        """NAGGPT.sublayer without MoD, the value embeddings passed to the attention."""
        mod_logits = br.m_down(res_dir)
        if self.record_telemetry:
            self.record_branch(mod_logits, br, br.alpha * self.alpha_warmup)
        out = block.attn(res_dir, cos_sin, mask, kv, ve) if kind == "attn" else block.mlp(res_dir)
        return self.branch_update(br, res_dir, log_norm, out, mod_logits)
