"""
Sampling with a KV cache (docs/design.md §9), for every arch.

A prefill forward over the whole prompt, then one forward of one token per sampled token.

Attention is the only part of the model that reads other positions, and it reads them through their keys
and values: so the cache holds, per layer, the keys (after rotary and QK-norm) and values of every position
so far, and a new position's forward is exactly the one it has in a forward over the whole sequence. A
subclass that keeps the cache exact keeps everything else per position (docs/design.md §9 says which do), or, as the
recipe's smear (which reads the previous token's embedding), keeps what it reads of the last position in the cache.

Decoding stops when the context is full: the model was trained on sequence_len positions, and a cache of
that length holds them all (no sliding window).
"""

import codecs

import torch
import torch.nn.functional as F

LAST = (slice(None), -1)  # logits_at of every forward here: the last position of each row only


class LayerKV:
    """One layer's view of the cache, handed to its attention."""

    def __init__(self, cache, layer):
        self.cache, self.layer = cache, layer

    def extend(self, k, v):
        """Store k, v (B, KV heads, T, head dim) at the positions after the cached ones; return the keys and
        values of every position so far. The cache's position moves on once the whole forward is done."""
        c = self.cache
        start, end = c.pos, c.pos + k.size(2)
        c.keys[self.layer][:, :, start:end] = k
        c.values[self.layer][:, :, start:end] = v
        return c.keys[self.layer][:, :, :end], c.values[self.layer][:, :, :end]


class KVCache:
    """Keys and values of every layer for positions 0..pos-1 of `batch_size` rows, preallocated to max_len."""

    def __init__(self, n_layer, batch_size, n_kv_head, max_len, head_dim, dtype, device):
        shape = (batch_size, n_kv_head, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.layers = [LayerKV(self, i) for i in range(n_layer)]
        self.max_len = max_len
        self.pos = 0
        # the last cached position's embedding, for a model that smears it into the next (nanochat/recipe.py)
        self.prev_embedding = None

    @classmethod
    def for_model(cls, model, batch_size=1):
        cfg = model.config
        return cls(
            cfg.n_layer,
            batch_size,
            cfg.n_kv_head,
            cfg.sequence_len,
            cfg.n_embd // cfg.n_head,
            model.compute_dtype,
            model.cos.device,
        )

    def advance(self, T):
        self.pos += T


def context_room(model, prompt_len):
    """How many tokens can follow a prompt of prompt_len tokens: every sampled token but the last is fed back at
    the next position, and positions stop at sequence_len."""
    return max(0, model.config.sequence_len - prompt_len + 1)


def sample_next(logits, temperature, top_k, rng):
    """(B, V) logits -> (B, 1) ids: argmax at temperature 0, else a draw from the top_k (None: all) tokens."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float()
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    probs = F.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=rng)


@torch.no_grad()  # not inference_mode: MoD's skip-rate sums made here are updated by later forwards
def generate(model, tokens, max_tokens, temperature=1.0, top_k=None, seed=42, use_cache=True):
    """Yield up to max_tokens ids sampled after the prompt `tokens` (a list of ids), fewer when the context is full
    (context_room). use_cache=False recomputes the whole sequence for every token: the reference the cache is
    tested against. The model runs in eval mode (MoD: the fixed thresholds decide, token by token)."""
    if not tokens:
        raise ValueError("generate needs at least one prompt token")
    if len(tokens) > model.config.sequence_len:
        raise ValueError(f"a prompt of {len(tokens)} tokens exceeds the context ({model.config.sequence_len})")
    device = model.cos.device
    rng = torch.Generator(device=device).manual_seed(seed)
    n = min(max_tokens, context_room(model, len(tokens)))
    ids = torch.tensor([tokens], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        cache = KVCache.for_model(model) if use_cache else None
        logits = model(ids, logits_at=LAST, cache=cache)  # the prefill: the whole prompt in one forward
        for i in range(n):
            nxt = sample_next(logits, temperature, top_k, rng)
            yield nxt.item()
            if i + 1 == n:
                break  # the last token is never fed back: it would need a position past the context
            if use_cache:
                logits = model(nxt, logits_at=LAST, cache=cache)
            else:
                ids = torch.cat([ids, nxt], dim=1)
                logits = model(ids, logits_at=LAST)
    finally:
        model.train(was_training)


class Utf8Stream:
    """Token bytes in, complete characters out: a UTF-8 character may be split across tokens, so the bytes of an
    unfinished one wait for the next token. finish() flushes what is left (an unfinished tail becomes U+FFFD)."""

    def __init__(self, token_bytes):
        self.token_bytes = token_bytes  # id -> bytes
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id):
        return self.decoder.decode(self.token_bytes(token_id))

    def finish(self):
        return self.decoder.decode(b"", final=True)
