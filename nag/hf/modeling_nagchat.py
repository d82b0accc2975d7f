"""
An exported nag-chat model for transformers, inference only.

The archs: the GPT baseline (nanochat/gpt.py), NAG (nag/model.py, nag/functional.py),
NAG-MoD (nag/mod.py), the router-MoD GPT (nag/router_mod.py), GPT and NAG on nanochat's recipe (nanochat/recipe.py,
nag/recipe.py), and the rival depth arms LNS, Peri-LN and LayerRoPE (nag/rivals.py; LayerRoPE's base b is a weight,
layerrope.base, as natively).

Copied into the export folder by scripts/export_hf.py and loaded with `trust_remote_code=True`, so it imports torch
and transformers only: the math below restates the repo's (docs/design.md §2, §4, §9), and the tests check that it
gives the native model's logits. The weights keep the native names (blocks.0.attn.c_q.weight, gates.alpha, ...).

What differs from the native forward, and why the result is the same:
- positions come from attention_mask (left padding, as generate and lm-eval batch prompts), else 0..T-1;
  a padded key is masked, and a padding query attends to itself only, so that no softmax row is empty;
- MoD runs every sub-layer on every token and keeps the output of the executed ones (the native model gathers them
  first to save the FLOPs); the decision is the evaluation one, a token's score against a fixed threshold;
- the KV cache is transformers' DynamicCache: per layer, the keys (after rotary and QK-norm) and values of every
  position so far, which is all a new position reads of the others (docs/design.md §9); the recipe's smear also reads
  the previous token's embedding, which the forward keeps on the cache object (smear_prev);
- smear mixes in the previous column where a token's position is above 0 (so never a padding column).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_nagchat import NagChatConfig

ROTARY_BASE = 100_000
QK_SCALE = 1.2
SOFTCAP = 15.0
ORTHO_EPS = 1e-24
RMS_EPS = 1e-20
VE_GATE_CHANNELS = 12
SMEAR_CHANNELS = 24
RECIPE_ARCHS = ("gpt-recipe", "nag-recipe")
RIVAL_ARCHS = ("gpt-lns", "gpt-peri", "gpt-layerrope")
LAYERROPE_SITES = ("attn_in", "mlp_in", "attn_out", "mlp_out")  # the two reads, then the two writes
NO_GAINS = (None, None, None, None)
# transformers 5 renamed the output's past_key_values to cache; take whichever this version has
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def apply_rotary(x, cos, sin):
    d = x.size(-1) // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


def layer_windows(config):
    """Attention window of each layer: the pattern cycled (L = the whole context, S = half, or with the recipe's quarter
    windows a quarter rounded up to 128, at most the context), the last layer L."""
    pattern = config.window_pattern.upper()
    long_w, short_w = config.sequence_len, config.sequence_len // 2
    if config.recipe and config.recipe["quarter_windows"]:
        short_w = min(long_w, -(-long_w // 4 // 128) * 128)
    windows = [long_w if pattern[i % len(pattern)] == "L" else short_w for i in range(config.n_layer)]
    windows[-1] = long_w
    return windows


def work_dtype(dtype):
    return torch.promote_types(dtype, torch.float32)


def modulator(mod_logits, coef, beta_raw, floor):
    """m = max(u, floor) ** softplus(beta_raw), u = Σ_i softmax(coef)_i σ(mod_logits_i): shape (..., 1)."""
    dtype = mod_logits.dtype
    weights = torch.softmax(coef, dim=-1, dtype=work_dtype(coef.dtype)).to(dtype)
    u = (torch.sigmoid(mod_logits) * weights).sum(dim=-1, keepdim=True)
    beta = F.softplus(beta_raw.to(work_dtype(beta_raw.dtype))).to(dtype)
    return torch.clamp(u, min=floor) ** beta


def residual_update(res_dir, log_norm, branch_out, gain, renorm):
    """Rotate R̄ towards N_out(branch_out) by atan(g); add ½·log1p(g²) to the log-norm (paper eqs. 10-17)."""
    dim = res_dir.size(-1)
    work = work_dtype(res_dir.dtype)
    r, x, g = res_dir.to(work), branch_out.to(work), gain.to(work)
    x = x - x.mean(dim=-1, keepdim=True)
    x = x - (x * r).sum(dim=-1, keepdim=True) / (r * r).sum(dim=-1, keepdim=True) * r
    o = x * (math.sqrt(dim) * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + ORTHO_EPS))
    y = r + g * o
    if renorm == "measured":
        new_dir = y * torch.rsqrt((y * y).mean(dim=-1, keepdim=True) + RMS_EPS)
    else:
        new_dir = y * torch.rsqrt(1 + g * g)
    g_log = gain.to(log_norm.dtype)
    return new_dir.to(res_dir.dtype), log_norm + 0.5 * torch.log1p(g_log * g_log)


def renormalised(y, log_norm):
    """NAG-on-recipe's additive writes: y back to RMS 1, its RMS carried into the log-norm."""
    rms = y.float().square().mean(dim=-1, keepdim=True).sqrt().clamp_min(1e-12)
    return (y.float() / rms).to(y.dtype), log_norm + torch.log(rms)


def times(x, gain):
    """x times a gain: nothing (None), a number (LNS) or a (d,) vector in x's dtype (LayerRoPE)."""
    if gain is None:
        return x
    return x * (gain.to(x.dtype) if torch.is_tensor(gain) else gain)


def depth_gains(gamma, depth, base, n_layer):
    """LayerRoPE's γ_l of every block l (n_layer, d) in fp32: the pairs (γ_2j, γ_2j+1) times exp(r(l) + iθ(l, j)) as
    complex numbers, r(l) = α + β·log(l+1), θ(l, j) = exp(α_rot + β_rot·log(l+1))·b^(−2j/d);
    depth = (α, β, α_rot, β_rot)."""
    g = gamma.float()
    d = g.size(0)
    alpha, beta, alpha_rot, beta_rot = depth.float().unbind()
    u = torch.arange(1, n_layer + 1, dtype=torch.float32, device=g.device).log()[:, None]
    j = torch.arange(d // 2, dtype=torch.float32, device=g.device)
    theta = torch.exp(alpha_rot + beta_rot * u) * torch.pow(base.float(), -2.0 * j / d)
    mag = torch.exp(alpha + beta * u)
    re, im = g[0::2], g[1::2]
    cos, sin = torch.cos(theta), torch.sin(theta)
    return torch.stack([mag * (re * cos - im * sin), mag * (re * sin + im * cos)], dim=-1).flatten(-2)


def rotation_score(alpha, m):
    """NAG-MoD's score r = atan(α·m)/atan(α), (B, T); r = m where α is ~0."""
    a = alpha.float().reshape(())
    m = m.float().squeeze(-1)
    small = a.abs() < 1e-6
    return torch.where(small, m, torch.atan(a * m) / torch.atan(torch.where(small, torch.ones_like(a), a)))


class CausalSelfAttention(nn.Module):
    def __init__(self, config, has_ve=False, out_norm=False):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        d, hd = config.n_embd, self.head_dim
        self.c_q = nn.Linear(d, self.n_head * hd, bias=False)
        self.c_k = nn.Linear(d, self.n_kv_head * hd, bias=False)
        self.c_v = nn.Linear(d, self.n_kv_head * hd, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        self.ve_gate = nn.Linear(VE_GATE_CHANNELS, self.n_kv_head, bias=False) if has_ve else None
        self.out_gain = nn.Parameter(torch.ones(d)) if out_norm else None  # Peri-LN's output norm gain

    def forward(self, x, cos_sin, mask, cache, layer, ve=None):
        B, T, _ = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        if ve is not None:  # value embeddings, gated per KV head by 3·σ(W·x[:12])
            gate = 3 * torch.sigmoid(self.ve_gate(x[..., :VE_GATE_CHANNELS]))
            v = v + gate.unsqueeze(-1) * ve.view(B, T, self.n_kv_head, self.head_dim)
        cos, sin = cos_sin
        q = norm(apply_rotary(q, cos, sin)) * QK_SCALE
        k = norm(apply_rotary(k, cos, sin)) * QK_SCALE
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            k, v = cache.update(k, v, layer)  # every key and value so far, this forward's appended
        gqa = self.n_kv_head != self.n_head
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config, out_norm=False):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)
        self.out_gain = nn.Parameter(torch.ones(config.n_embd)) if out_norm else None

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config, has_ve=False, out_norm=False):
        super().__init__()
        self.attn = CausalSelfAttention(config, has_ve, out_norm)
        self.mlp = MLP(config, out_norm)


class LayerRoPE(nn.Module):
    """LayerRoPE's shared gains: per site a gain γ (d) and (α, β, α_rot, β_rot); the base b, a buffer."""

    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.ParameterDict({s: nn.Parameter(torch.ones(dim)) for s in LAYERROPE_SITES})
        self.depth = nn.ParameterDict({s: nn.Parameter(torch.zeros(4)) for s in LAYERROPE_SITES})
        self.register_buffer("base", torch.ones(()))


class NAGGates(nn.Module):
    """Every sub-layer's gate, one tensor per kind, row k for update k + 1 (attn of block 0, its MLP, ...)."""

    def __init__(self, branches, dim, directions):
        super().__init__()
        self.m_down_weight = nn.Parameter(torch.zeros(branches, directions, dim))
        self.m_down_bias = nn.Parameter(torch.zeros(branches, directions))
        self.coef = nn.Parameter(torch.zeros(branches, directions))
        self.beta_raw = nn.Parameter(torch.zeros(branches, 1))
        self.alpha = nn.Parameter(torch.zeros(branches, 1))


class NagChatForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = NagChatConfig
    base_model_prefix = "nagchat"
    _no_split_modules = ["Block"]
    _supports_sdpa = True

    def __init__(self, config):
        super().__init__(config)
        if config.arch not in ("gpt", "nag", "gpt-router") + RECIPE_ARCHS + RIVAL_ARCHS:
            raise ValueError(
                f"unknown arch {config.arch!r} (gpt, nag, gpt-router, gpt-recipe, nag-recipe, {', '.join(RIVAL_ARCHS)})"
            )
        d, L = config.n_embd, config.n_layer
        self.is_nag = config.arch in ("nag", "nag-recipe")
        self.parts = dict(config.recipe or {}) if config.arch in RECIPE_ARCHS else {}
        ve_layers = [i for i in range(L) if self.parts.get("value_embeds") and i % 2 == (L - 1) % 2]
        self.windows = layer_windows(config)
        self.wte = nn.Embedding(config.vocab_size, d)
        peri = config.arch == "gpt-peri"
        self.blocks = nn.ModuleList([Block(config, i in ve_layers, peri) for i in range(L)])
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        mod = config.mod or {"blocks": "both", "rate": 0.0}
        self.covers = {k: config.mod is not None and mod["blocks"] in (k, "both") for k in ("attn", "mlp")}
        self.skips = {k: self.covers[k] and mod["rate"] > 0 for k in ("attn", "mlp")}
        if self.is_nag:
            self.gates = NAGGates(2 * L, d, config.nag["directions"])
            self.log_gain_encode = nn.Parameter(torch.zeros(1))
            if config.mod is not None:  # X_l, the learned output of a skipped sub-layer
                self.mod_base = nn.ParameterDict(
                    {
                        f"{k}_{i}": nn.Parameter(torch.zeros(d))
                        for i in range(L)
                        for k in ("attn", "mlp")
                        if self.covers[k]
                    }
                )
        if config.arch == "gpt-router":
            self.routers = nn.ModuleDict(
                {f"{k}_{i}": nn.Linear(d, 1, bias=True) for i in range(L) for k in ("attn", "mlp") if self.covers[k]}
            )
        if config.arch == "gpt-layerrope":
            self.layerrope = LayerRoPE(d)
        if config.mod is not None:  # [attention, mlp 0, mlp 1, ...]: the evaluation thresholds, fixed
            self.register_buffer("mod_thresholds", torch.zeros(1 + L))
        if ve_layers:
            kv_dim = config.n_kv_head * (d // config.n_head)
            self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(config.vocab_size, kv_dim) for i in ve_layers})
        if self.parts.get("resid_lambdas"):
            self.resid_lambdas = nn.Parameter(torch.zeros(L))
        if self.parts.get("x0_lambdas"):
            self.x0_lambdas = nn.Parameter(torch.zeros(L))
        if self.parts.get("backout"):
            self.backout_lambda = nn.Parameter(torch.zeros(1))
        if self.parts.get("smear"):
            self.smear_gate = nn.Linear(SMEAR_CHANNELS, 1, bias=False)
            self.smear_lambda = nn.Parameter(torch.zeros(1))
        self.post_init()

    def _init_weights(self, module):
        """Nothing: an exported model is always loaded from its weights (training from scratch is the repo's job)."""

    def get_input_embeddings(self):
        return self.wte

    def set_input_embeddings(self, value):
        self.wte = value

    def get_output_embeddings(self):
        return self.lm_head

    # ----- positions and masks -----

    def rotary(self, positions, dtype):
        """cos, sin (B, T, 1, head_dim/2) of the given positions, as the native table computes them (fp32)."""
        hd = self.config.n_embd // self.config.n_head
        inv_freq = ROTARY_BASE ** (-torch.arange(0, hd, 2, dtype=torch.float32, device=positions.device) / hd)
        freqs = positions.float()[..., None] * inv_freq
        return freqs.cos()[:, :, None].to(dtype), freqs.sin()[:, :, None].to(dtype)

    def attention_inputs(self, T, past, attention_mask, device):
        """(positions of the T new tokens (B or 1, T), per-layer masks: None = plain causal). A key is seen when it
        is not padding, not after the query, and within the layer's window counted in positions."""
        L = past + T
        valid = None if attention_mask is None else attention_mask[:, -L:].bool()
        if valid is not None and bool(valid.all()):
            valid = None
        pos_k = torch.arange(L, device=device)[None] if valid is None else (valid.long().cumsum(-1) - 1).clamp_min(0)
        pos_q = pos_k[:, past:]
        if valid is None and past == 0 and all(w >= T for w in self.windows):
            return pos_q, [None] * len(self.windows)
        idx_q = torch.arange(past, L, device=device)[:, None]
        idx_k = torch.arange(L, device=device)[None]
        seen = (idx_k <= idx_q)[None]
        if valid is not None:
            seen = (seen & valid[:, None, :]) | (idx_k == idx_q)[None]
        delta = pos_q[:, :, None] - pos_k[:, None, :]
        masks = {w: (seen & (delta < w))[:, None] for w in set(self.windows)}
        return pos_q, [masks[w] for w in self.windows]

    # ----- the sub-layers -----

    def executed(self, out, execute):
        return out if execute is None else torch.where(execute[..., None], out, 0)

    def run(self, kind, layer, x, cos_sin, mask, cache, ve=None):
        block = self.blocks[layer]
        if kind == "attn":
            return block.attn(x, cos_sin, mask, cache, layer, ve)
        return block.mlp(x)

    def written(self, kind, layer, out, gain):
        """A rival's write: Peri-LN's output norm with its gain, then LayerRoPE's write gain (nag/rivals.py)."""
        out_gain = getattr(self.blocks[layer], kind).out_gain
        if out_gain is not None:
            out = norm(out) * out_gain.to(out.dtype)
        return times(out, gain)

    def rival_gains(self, n_layer):
        """Per layer, (attn read, mlp read, attn write, mlp write): LNS's 1/√(l+1) reads, LayerRoPE's γ_l, else
        none."""
        if self.config.arch == "gpt-lns":
            return [(1 / math.sqrt(i + 1),) * 2 + (None, None) for i in range(n_layer)]
        if self.config.arch == "gpt-layerrope":
            lr = self.layerrope
            g = {s: depth_gains(lr.gamma[s], lr.depth[s], lr.base, n_layer) for s in LAYERROPE_SITES}
            return [tuple(g[s][i] for s in LAYERROPE_SITES) for i in range(n_layer)]
        return [NO_GAINS] * n_layer

    def threshold(self, kind, layer):
        return self.mod_thresholds[0 if kind == "attn" else 1 + layer]

    def gpt_layer(self, layer, x, cos_sin, mask, cache, ve=None, gains=NO_GAINS):
        for kind, read, write in (("attn", gains[0], gains[2]), ("mlp", gains[1], gains[3])):
            h = norm(x)
            out = self.run(kind, layer, times(h, read), cos_sin, mask, cache, ve)
            if self.skips[kind]:  # router-MoD: the executed tokens' output, scaled by their gate
                gate = torch.sigmoid(self.routers[f"{kind}_{layer}"](h).float())
                out = self.executed(out, gate.squeeze(-1) > self.threshold(kind, layer)) * gate.to(h.dtype)
            x = x + self.written(kind, layer, out, write)
        return x

    def nag_layer(self, layer, res_dir, log_norm, cos_sin, mask, cache, ve=None):
        nag = self.config.nag
        g = self.gates
        for k, kind in ((2 * layer, "attn"), (2 * layer + 1, "mlp")):
            mod_logits = F.linear(res_dir, g.m_down_weight[k], g.m_down_bias[k])
            alpha = g.alpha[k] * self.config.alpha_warmup
            m = modulator(mod_logits, g.coef[k], g.beta_raw[k], nag["mod_floor"])
            out = self.run(kind, layer, res_dir, cos_sin, mask, cache, ve)
            if self.skips[kind]:  # NAG-MoD: tokens whose rotation score is at or below the threshold skip f
                out = self.executed(out, rotation_score(alpha, m) > self.threshold(kind, layer))
            if self.covers[kind]:
                out = out + self.mod_base[f"{kind}_{layer}"].to(out.dtype)
            res_dir, log_norm = residual_update(res_dir, log_norm, out, alpha * m, nag["renorm"])
        return res_dir, log_norm

    # ----- the recipe's parts (nanochat/recipe.py; NAG's adaptation: nag/recipe.py) -----

    def value_embed(self, layer, input_ids, dtype):
        if not hasattr(self, "value_embeds") or str(layer) not in self.value_embeds:
            return None
        return self.value_embeds[str(layer)](input_ids).to(dtype)

    def smear(self, x, positions, cache):
        """x + λ·σ(w·x[:24])·x_prev at every token whose position is above 0; the previous token of a forward's
        first column is the cache's smear_prev (the last column of the forward before)."""
        stored = getattr(cache, "smear_prev", None) if cache is not None else None
        first = stored if stored is not None and stored.size(0) == x.size(0) else torch.zeros_like(x[:, :1])
        prev = torch.cat([first, x[:, :-1]], dim=1)
        if cache is not None:
            cache.smear_prev = x[:, -1:]
        gate = self.smear_lambda.to(x.dtype) * torch.sigmoid(self.smear_gate(x[..., :SMEAR_CHANNELS]))
        return x + gate * (positions > 0)[..., None].to(x.dtype) * prev

    def gpt_trunk(self, x, input_ids, positions, cos_sin, masks, cache):
        p = self.parts
        if p.get("smear"):
            x = self.smear(x, positions, cache)
        x0, mid = x, None
        gains = self.rival_gains(len(masks))
        for layer, mask in enumerate(masks):
            if p.get("resid_lambdas"):
                x = self.resid_lambdas[layer] * x
            if p.get("x0_lambdas"):
                x = x + self.x0_lambdas[layer] * x0
            ve = self.value_embed(layer, input_ids, x.dtype)
            x = self.gpt_layer(layer, x, cos_sin, mask, cache, ve, gains[layer])
            if layer == len(masks) // 2:
                mid = x
        if p.get("backout"):
            x = x - self.backout_lambda.to(x.dtype) * mid
        return x

    def nag_trunk(self, res_dir, log_norm, input_ids, positions, cos_sin, masks, cache):
        p = self.parts
        if p.get("smear"):
            res_dir, log_norm = renormalised(self.smear(res_dir, positions, cache), log_norm)
        dir0, mid = res_dir, None
        for layer, mask in enumerate(masks):
            if p.get("x0_lambdas"):
                res_dir, log_norm = renormalised(res_dir + self.x0_lambdas[layer].to(res_dir.dtype) * dir0, log_norm)
            ve = self.value_embed(layer, input_ids, res_dir.dtype)
            res_dir, log_norm = self.nag_layer(layer, res_dir, log_norm, cos_sin, mask, cache, ve)
            if layer == len(masks) // 2:
                mid = res_dir
        if p.get("backout"):
            res_dir, log_norm = renormalised(res_dir - self.backout_lambda.to(res_dir.dtype) * mid, log_norm)
        return res_dir, log_norm

    # ----- forward -----

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        cache=None,
        past_key_values=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        """Logits (B, T, V) and, with labels, the mean next-token loss (labels are input_ids; -100 is ignored).
        Other inputs of transformers' models (position_ids, inputs_embeds, ...) are not taken: positions follow
        attention_mask. cache (past_key_values before transformers 5.2x): a DynamicCache, which this forward extends."""
        cache = cache if cache is not None else past_key_values
        T = input_ids.size(1)
        past = cache.get_seq_length() if cache is not None else 0
        positions, masks = self.attention_inputs(T, past, attention_mask, input_ids.device)
        # no sliding window: the long layers would see more than in training
        if int(positions.max()) >= self.config.sequence_len:
            raise ValueError(
                f"position {int(positions.max())} is past the context: the model was trained on "
                f"{self.config.sequence_len} positions, which a prompt and its new tokens must fit"
            )
        dtype = self.wte.weight.dtype
        cos_sin = self.rotary(positions, dtype)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) and logits_to_keep > 0 else slice(None)
        if self.is_nag:
            e = self.wte(input_ids).float()
            rho = e.square().mean(dim=-1, keepdim=True).sqrt().clamp_min(1e-12)  # ρ₀ = ‖e‖/√d
            res_dir = (e / rho).to(dtype)
            log_norm = torch.log(rho) + self.log_gain_encode.float()
            res_dir, log_norm = self.nag_trunk(res_dir, log_norm, input_ids, positions, cos_sin, masks, cache)
            res_dir, log_norm = res_dir[:, keep], log_norm[:, keep]
            logits = self.lm_head(res_dir).float() / self.config.n_embd * log_norm.exp()  # cosine × carried norm
        else:
            x = self.gpt_trunk(norm(self.wte(input_ids)), input_ids, positions, cos_sin, masks, cache)
            logits = self.lm_head(norm(x[:, keep])).float()
            logits = SOFTCAP * torch.tanh(logits / SOFTCAP)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.size(-1)),
                labels[:, 1:].reshape(-1).to(logits.device),
                ignore_index=-100,
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})
