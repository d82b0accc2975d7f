"""
The clean GPT baseline (docs/design.md §2).

Pre-norm transformer with parameter-free RMSNorm, rotary embeddings, QK-norm,
ReLU² MLP, no biases, untied embedding / lm_head, zero-initialised output
projections and a logit soft-cap. Weights are fp32 masters; every matmul runs in
the model's compute dtype by casting the weight inside the Linear forward.
"""

import math
from dataclasses import dataclass, asdict

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat.fp8 import fp8_linear, admits as fp8_admits, opaque_to_compile
from nanochat.flash_attention import (
    KERNELS,
    causal_attention,
    load_kernel,
    mask_free,
    masked_attention,
    prepare_windows,
)


@dataclass
class GPTConfig:
    sequence_len: int = 2048
    vocab_size: int = 32768
    n_layer: int = 12
    n_head: int = 6
    n_kv_head: int = 6
    n_embd: int = 768
    window_pattern: str = "L"  # per layer, cycled: L = full context, S = half context; the last layer is always L

    def to_dict(self):
        return asdict(self)


ROTARY_BASE = 100_000
QK_SCALE = 1.2
SOFTCAP = 15.0
# a value embedding's gate reads this many leading channels of the attention input (nanochat/recipe.py)
VE_GATE_CHANNELS = 12


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


class Embedding(nn.Embedding):
    """nn.Embedding without an init of its own: init_weights sets it. Its normal_ on the meta device, where every
    model is built, would import torch._dynamo: ~1.5 s of CPU in each process that builds a model."""

    def reset_parameters(self):
        pass


class Linear(nn.Linear):
    """Bias-free linear layer whose fp32 master weight is cast to the input's dtype; in training, fp8 matmuls instead
    where GPT.set_fp8 turned them on (nanochat/fp8.py)."""

    def __init__(self, in_features, out_features, bias=False, device=None):
        super().__init__(in_features, out_features, bias=bias, device=device)
        self.fp8 = False

    def forward(self, x):
        if self.fp8 and self.training and self.bias is None:
            return fp8_linear(x, self.weight)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)


def apply_rotary(x, cos, sin):
    # x: (B, T, H, D); rotate the two halves of each head as complex pairs
    d = x.size(-1) // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


def layer_windows(config):
    """Attention window (in tokens) of each layer from the cycled pattern."""
    pattern = config.window_pattern.upper()
    if not pattern or any(c not in "LS" for c in pattern):
        raise ValueError(f"window pattern must be made of L and S, got {config.window_pattern!r}")
    long_w, short_w = config.sequence_len, config.sequence_len // 2
    windows = [long_w if pattern[i % len(pattern)] == "L" else short_w for i in range(config.n_layer)]
    windows[-1] = long_w
    return windows


class CausalSelfAttention(nn.Module):
    def __init__(self, config, device=None):
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        assert config.n_embd % config.n_head == 0 and config.n_head % config.n_kv_head == 0
        d, hd = config.n_embd, self.head_dim
        self.c_q = Linear(d, self.n_head * hd, device=device)
        self.c_k = Linear(d, self.n_kv_head * hd, device=device)
        self.c_v = Linear(d, self.n_kv_head * hd, device=device)
        self.c_proj = Linear(d, d, device=device)
        self.window = config.sequence_len  # this layer's window, set by GPT from the pattern
        self.kernel = "sdpa"  # of plain rows: one of flash_attention.KERNELS (GPT.set_attention)
        self.ve_gate = None  # Linear(VE_GATE_CHANNELS, n_kv_head) on a layer with value embeddings (nanochat/recipe.py)

    def forward(self, x, cos_sin, mask, kv=None, ve=None):
        """mask: None for a plain row (causal, within this layer's window: the kernel's own window support, or on CUDA
        flex_attention, or SDPA's is_causal / a window mask), else a bool mask of the keys each query sees (always
        SDPA).
        kv: this layer's KV cache (nanochat/engine.py) when decoding: x holds the new positions only, their keys and
        values are appended to the cached ones, and mask (queries × every key so far) is always given.
        ve: this layer's value embeddings of the tokens (B, T, n_kv_head · head_dim), or None: added to the values with
        a gate 3·σ(ve_gate(x[..., :12])) in (0, 3), one per KV head."""
        B, T, _ = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        if ve is not None:
            gate = 3 * torch.sigmoid(self.ve_gate(x[..., :VE_GATE_CHANNELS]))  # (B, T, n_kv_head)
            v = v + gate.unsqueeze(-1) * ve.view(B, T, self.n_kv_head, self.head_dim)
        cos, sin = cos_sin
        q = norm(apply_rotary(q, cos, sin)) * QK_SCALE
        k = norm(apply_rotary(k, cos, sin)) * QK_SCALE
        if mask is None and kv is None:
            y = causal_attention(q, k, v, self.window, self.kernel)  # (B, T, H, D) in and out
        else:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
            if kv is not None:
                k, v = kv.extend(k, v)
            y = masked_attention(q, k, v, mask).transpose(1, 2)
        return self.c_proj(y.reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config, device=None):
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd, device=device)
        self.c_proj = Linear(4 * config.n_embd, config.n_embd, device=device)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config, device=None):
        super().__init__()
        self.attn = CausalSelfAttention(config, device=device)
        self.mlp = MLP(config, device=device)

    def forward(self, x, cos_sin, mask, kv=None, ve=None):
        x = x + self.attn(norm(x), cos_sin, mask, kv, ve)
        x = x + self.mlp(norm(x))
        return x


# base_train's optimizer flags default to these, and so does setup_optimizer: one place for both
OPTIMIZER_DEFAULTS = dict(embedding_lr=0.3, unembedding_lr=0.004, matrix_lr=0.02, weight_decay=0.28)


class GPT(nn.Module):
    arch = "gpt"
    # bytes per logit that the compiled backward of the readout holds beside the logits it saved (nanochat/memory.py):
    # none here, since the loss's gradient is their only reader and Inductor writes it over them in place
    compiled_readout_grad_bytes = 0

    def __init__(self, config, device=None):
        """Build on device="meta" for free, then `to_empty(device=...)` and `init_weights()`."""
        super().__init__()
        self.config = config
        self.windows = layer_windows(config)
        self.wte = Embedding(config.vocab_size, config.n_embd, device=device)
        self.blocks = nn.ModuleList([Block(config, device=device) for _ in range(config.n_layer)])
        for block, w in zip(self.blocks, self.windows):
            block.attn.window = w
        self.attention = "sdpa"  # the kernel of plain rows (set_attention)
        self.lm_head = Linear(config.n_embd, config.vocab_size, device=device)
        # rotary tables are derived state, rebuilt by init_weights (not saved in checkpoints)
        self.rotary_len = config.sequence_len * 4
        head_dim = config.n_embd // config.n_head
        self.register_buffer("cos", torch.empty(1, self.rotary_len, 1, head_dim // 2, device=device), persistent=False)
        self.register_buffer("sin", torch.empty(1, self.rotary_len, 1, head_dim // 2, device=device), persistent=False)
        self.compute_dtype = torch.float32

    @classmethod
    def initialised(cls, config, device="cpu", **kwargs):
        """A fresh model with its init_weights values: built on the meta device (nothing allocated), then placed on
        `device` and initialised there. The one way a model is made, whether to train, load or benchmark."""
        with torch.device("meta"):
            model = cls(config, **kwargs)
        model.to_empty(device=device)
        model.init_weights()
        return model

    # ----- hooks of a model class: what training and checkpoints ask of it (a subclass overrides them) -----

    @classmethod
    def kwargs_on(cls, device_type, init_kwargs):
        """The constructor arguments as a model built on device_type resolves them (a memory plan measures a GPU
        run's model on the CPU)."""
        return init_kwargs

    @classmethod
    def extra_init_kwargs(cls, meta):
        """Constructor arguments beyond the GPTConfig, read back from a checkpoint's meta."""
        return {}

    def extra_meta(self):
        """What a checkpoint must record to rebuild this model, beyond arch and GPTConfig."""
        return {}

    def step_metrics(self):
        """A dict merged into every step's metrics.jsonl row (what the model measured during the step); the baseline has
        none."""
        return {}

    def nonfinite_origin(self, idx):
        """Where a non-finite loss or gradient started, as a short phrase for the guard's line (or None)."""
        return None

    # ----- init -----

    @torch.no_grad()
    def init_weights(self):
        d = self.config.n_embd
        bound = math.sqrt(3) * d**-0.5
        nn.init.normal_(self.wte.weight, std=0.8)
        nn.init.normal_(self.lm_head.weight, std=0.001)
        for block in self.blocks:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v):
                nn.init.uniform_(lin.weight, -bound, bound)
            nn.init.uniform_(block.mlp.c_fc.weight, -0.4 * bound, 0.4 * bound)
            nn.init.zeros_(block.attn.c_proj.weight)
            nn.init.zeros_(block.mlp.c_proj.weight)
        self.init_rotary()

    @torch.no_grad()
    def init_rotary(self):
        head_dim = self.config.n_embd // self.config.n_head
        device = self.cos.device
        inv_freq = ROTARY_BASE ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
        t = torch.arange(self.rotary_len, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)[None, :, None, :]
        self.cos.copy_(freqs.cos())
        self.sin.copy_(freqs.sin())

    def set_compute_dtype(self, dtype):
        self.compute_dtype = dtype

    def set_fp8(self, enabled):
        """fp8 matmuls in training for every Linear the size rule admits (nanochat/fp8.py); returns their names."""
        chosen = [
            name
            for name, m in self.named_modules()
            if isinstance(m, Linear) and fp8_admits(m.in_features, m.out_features)
        ]
        if enabled:
            opaque_to_compile()
        for name, m in self.named_modules():
            if isinstance(m, Linear):
                m.fp8 = enabled and name in chosen
        return chosen if enabled else []

    def set_attention(self, kernel):
        """The attention kernel of plain rows, one of flash_attention.KERNELS (nanochat/flash_attention.py resolves it):
        set once, before torch.compile. Where it takes each layer's window itself (mask_free), no mask is built. On
        CUDA the S windows' flex_attention block masks are built here, so that the compiled graph only reads them."""
        assert kernel in KERNELS, kernel
        if kernel != "sdpa":
            load_kernel(kernel)  # loaded here, not on the first forward (nor inside a compiled graph)
        self.attention = kernel
        for block in self.blocks:
            block.attn.kernel = kernel
        prepare_windows(self.config.sequence_len, self.windows, self.cos.device)

    # ----- accounting -----

    def matmul_params(self):
        """Every 2-D weight used in a matmul (the embedding is a lookup, not a matmul)."""
        return [p for n, p in self.named_parameters() if p.ndim == 2 and n != "wte.weight"]

    def num_scaling_params(self):
        return sum(p.numel() for p in self.matmul_params())

    def estimate_flops(self):
        """Training FLOPs per token: 6 × matmul params + 12·h·q·T_eff attention per layer."""
        h, q = self.config.n_head, self.config.n_embd // self.config.n_head
        t = self.config.sequence_len
        attn = sum(12 * h * q * min(w, t) for w in self.windows)
        return 6 * sum(p.numel() for p in self.matmul_params()) + attn

    # ----- optimizer -----

    def optimizer_groups(self, embedding_lr, unembedding_lr, matrix_lr, weight_decay, lr_scale):
        """AdamW groups for embedding / lm_head, Muon for the block matrices. AdamW LRs scale with (d/768)^-½.
        Betas and the AdamW decays are those of the code behind the published pair (docs/design.md §optimizer)."""
        dim_scale = (self.config.n_embd / 768) ** -0.5
        block_matrices = [p for p in self.blocks.parameters() if p.ndim == 2]
        return [
            dict(
                kind="adamw",
                name="wte",
                params=[self.wte.weight],
                lr=embedding_lr * dim_scale * lr_scale,
                betas=(0.8, 0.995),
                weight_decay=0.001,
            ),
            dict(
                kind="adamw",
                name="lm_head",
                params=[self.lm_head.weight],
                lr=unembedding_lr * dim_scale * lr_scale,
                betas=(0.8, 0.96),
                weight_decay=0.01,
            ),
            dict(
                kind="muon", name="matrices", params=block_matrices, lr=matrix_lr * lr_scale, weight_decay=weight_decay
            ),
        ]

    def setup_optimizer(self, lr_scale=1.0, **settings):
        """MuonAdamW over every parameter: OPTIMIZER_DEFAULTS, overridden by `settings` (and an arch's own LRs)."""
        from nanochat.optim import MuonAdamW

        groups = self.optimizer_groups(lr_scale=lr_scale, **{**OPTIMIZER_DEFAULTS, **settings})
        # every parameter in exactly one group
        seen = [id(p) for g in groups for p in g["params"]]
        assert len(seen) == len(set(seen)), "a parameter is in two optimizer groups"
        missing = [n for n, p in self.named_parameters() if id(p) not in set(seen)]
        assert not missing, f"parameters in no optimizer group: {missing}"
        return MuonAdamW(groups)

    # ----- training hooks (no-ops for the baseline) -----

    def set_tokens_seen(self, tokens):
        """Called before every training step with the number of tokens trained on so far."""

    def after_optimizer_step(self):
        """Work after every optimizer step. A row constraint on a weight belongs instead in its AdamW group
        ("constrain", nanochat/optim.py): imposed inside the update, it fuses where the update compiles."""

    # ----- forward -----

    def rotary(self, T, positions=None):
        """cos, sin for positions 0..T-1, or for the given (B, T) positions of packed rows."""
        assert T <= self.rotary_len, f"sequence of {T} tokens exceeds the rotary table ({self.rotary_len})"
        dt = self.compute_dtype
        if positions is None:
            return self.cos[:, :T].to(dt), self.sin[:, :T].to(dt)
        return self.cos[0, positions].to(dt), self.sin[0, positions].to(dt)

    def attention_masks(self, T, device, positions=None, allowed=None):
        """Per layer, the keys each query sees: None for a plain row the layer attends without a mask (causal, within
        its window), else a bool mask.
        Packed rows (evaluation) give their positions (B, T) and allowed (B, T, T): which tokens each token may
        attend to. Sliding windows count in positions, not in offsets along the row.
        Plain rows need no mask where the kernel takes each layer's window (FA3, FA4: window_size) or flex_attention
        does (the other kernels on CUDA); the CPU keeps the dense masks. Packed rows keep their masks under every
        kernel: a causal window cannot say where a document ends."""
        assert (positions is None) == (allowed is None), "packed rows need both positions and allowed"
        plain = allowed is None
        if plain and (mask_free(self.attention, device) or all(w >= T for w in self.windows)):
            return [None] * len(self.windows)
        if plain:
            positions = torch.arange(T, device=device)[None]
        delta = positions[:, :, None] - positions[:, None, :]
        if plain:
            allowed = delta >= 0
        # (B, 1, T, T): the same for every head; built once per distinct window
        masks = {w: None if plain and w >= T else (allowed & (delta < w))[:, None] for w in set(self.windows)}
        return [masks[w] for w in self.windows]

    def cached_masks(self, start, T, device):
        """Per layer, the keys that queries at positions start..start+T-1 see among the positions 0..start+T-1
        (decoding with a KV cache): causal, and within the layer's window. Always a bool mask (1, 1, T, start+T):
        SDPA's is_causal aligns a short query block with the first keys, not the last."""
        delta = torch.arange(start, start + T, device=device)[:, None] - torch.arange(start + T, device=device)[None]
        masks = {w: ((delta >= 0) & (delta < w))[None, None] for w in set(self.windows)}
        return [masks[w] for w in self.windows]

    def attention_inputs(self, T, device, positions=None, allowed=None, cache=None):
        """(cos_sin, per-layer masks, per-layer KV caches) of a forward over T positions: the first T of a row, the
        packed rows of evaluation, or, with a cache, the T positions after those it holds."""
        if cache is None:
            return (
                self.rotary(T, positions),
                self.attention_masks(T, device, positions, allowed),
                [None] * len(self.blocks),
            )
        assert positions is None and allowed is None, "a KV cache decodes plain rows"
        start = cache.pos
        assert start + T <= cache.max_len, f"{start + T} positions do not fit the KV cache ({cache.max_len})"
        at = torch.arange(start, start + T, device=device)[None]
        return self.rotary(T, at), self.cached_masks(start, T, device), cache.layers

    def logits_from_hidden(self, x, at=None):
        """Logits of the last hidden state (at the positions `at` only, when given)."""
        logits = self.lm_head(norm(x if at is None else x[at])).float()
        return SOFTCAP * torch.tanh(logits / SOFTCAP)

    def end_forward(self, hidden, T, targets, loss_reduction, logits_at, cache):
        """Every forward's end, whatever the arch: the KV cache moves past the T new positions, then the logits of
        `hidden` (logits_from_hidden) and, given targets, the loss."""
        if cache is not None:
            cache.advance(T)
        logits = self.logits_from_hidden(hidden, logits_at)
        if targets is None:
            return logits
        return F.cross_entropy(
            logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1, reduction=loss_reduction
        )

    def forward(
        self, idx, targets=None, loss_reduction="mean", positions=None, allowed=None, logits_at=None, cache=None
    ):
        """Logits (B, T, V), or the loss against targets. Evaluation may pack rows (positions, allowed: see
        attention_masks) and ask for the logits at some (rows, cols) only: (N, V). Decoding passes a KV cache
        (nanochat/engine.py): idx then holds the positions after the cached ones, and the cache takes theirs."""
        T = idx.size(1)
        cos_sin, masks, kvs = self.attention_inputs(T, idx.device, positions, allowed, cache)
        x = norm(self.wte(idx).to(self.compute_dtype))
        for block, mask, kv in zip(self.blocks, masks, kvs):
            x = block(x, cos_sin, mask, kv)
        return self.end_forward(x, T, targets, loss_reduction, logits_at, cache)

    def generate(self, tokens, max_tokens, temperature=1.0, top_k=None, seed=42, use_cache=True):
        """Yield up to max_tokens sampled ids after the prompt `tokens` (list of ids), with a KV cache; temperature
        0 = greedy. Stops early when the context (sequence_len positions) is full (nanochat/engine.py)."""
        from nanochat.engine import generate

        return generate(self, tokens, max_tokens, temperature=temperature, top_k=top_k, seed=seed, use_cache=use_cache)
