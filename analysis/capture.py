"""
One streaming, no-grad pass over tokens that records what analysis/measures.py needs.

The models run their own forward pass; we only observe it:
- GPT (nanochat/gpt.py): a pre-hook on each Block sees x_{2i}, a hook on its attention module
  sees the attention output a (x_{2i+1} = x_{2i} + a, the same addition the block does), a hook
  on the Block sees x_{2i+2}.
- NAG (nag/model.py): the instance's `update` method is wrapped; it sees R̄, s before and after
  each residual update and the gate's input, from which m and g = α·warmup·m are recomputed.
- Attention maps (both): a pre-hook on each attention module recomputes softmax(qkᵀ/√h) for the
  first 64 positions through the module's own c_q / c_k, rotary and QK-norm.

State k = 0 is the embedding, k = 2i+1 follows block i's attention, k = 2i+2 its MLP.
Memory does not grow with the number of tokens: fp64 running sums (means, Σxxᵀ per k), a
(L, 64, 64) attention sum, and two bounded uniform samples of tokens (bottom-k of random keys):
per-token scalars (norms, angles, gains, entropy, loss, top-1) and full residual vectors.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanochat.gpt import apply_rotary, norm, QK_SCALE
from nag.model import NAGGPT


@dataclass
class CaptureConfig:
    attn_positions: int = 64  # the paper's attention maps cover the first 64 positions (Figs. 7, 12)
    token_sample: int = 65536  # tokens whose per-token scalars are kept (percentiles, deciles, AUROC)
    state_sample: int = 1024  # tokens whose residual vectors at every k are kept (clustering)
    seed: int = 0


class Reservoir:
    """A uniform sample of at most `cap` tokens from a stream: each token gets a random key and the cap smallest
    keys are kept (bottom-k sampling). `begin(n)` decides which of the next n tokens enter and into which slots;
    `write(name, values)` then stores fields of those tokens (values: the whole batch, first dim n)."""

    def __init__(self, cap, gen, device):
        self.cap = cap
        self.gen = gen
        # empty slots hold keys above any random key, largest first: they are taken in order, so the filled
        # slots are always a prefix
        self.keys = 2.0 + torch.arange(cap, 0, -1, dtype=torch.float64, device=device)
        self.fields = {}
        self.seen = 0

    def begin(self, n):
        new_keys = torch.rand(n, generator=self.gen, dtype=torch.float64).to(self.keys.device)
        merged = torch.cat([self.keys, new_keys])
        keep = torch.topk(merged, min(self.cap, merged.numel()), largest=False).indices
        kept = torch.zeros(merged.numel(), dtype=torch.bool, device=merged.device)
        kept[keep] = True
        self.new_idx = torch.nonzero(kept[self.cap :]).flatten()  # batch tokens that enter
        self.slots = torch.nonzero(~kept[: self.cap]).flatten()[: len(self.new_idx)]  # slots they take
        self.keys[self.slots] = new_keys[self.new_idx]
        self.seen += n

    def write(self, name, values, index=None):
        """Store values[new tokens] into field `name` (at position `index` of its second dim, if given)."""
        if name not in self.fields:
            raise KeyError(f"reservoir field {name} was not declared")
        field = self.fields[name]
        v = values[self.new_idx].to(field.dtype)
        if index is None:
            field[self.slots] = v
        else:
            field[self.slots, index] = v

    def declare(self, name, shape, dtype):
        self.fields[name] = torch.zeros((self.cap, *shape), dtype=dtype, device=self.keys.device)

    def filled(self):
        return min(self.cap, self.seen)

    def get(self, name):
        """The sampled values in slot order (a token's fields share a slot), on the CPU."""
        return self.fields[name][: self.filled()].cpu()


def attention_probs(attn, x, cos_sin, mask, positions):
    """Post-softmax attention (B, H, P, P) of the first P positions, through the module's own projections,
    rotary and QK-norm (nanochat/gpt.py CausalSelfAttention); SDPA's default scale 1/√head_dim."""
    B, T, _ = x.shape
    P = min(positions, T)
    x = x[:, :P]
    q = attn.c_q(x).view(B, P, attn.n_head, attn.head_dim)
    k = attn.c_k(x).view(B, P, attn.n_kv_head, attn.head_dim)
    cos, sin = (t[:, :P] for t in cos_sin)
    q = norm(apply_rotary(q, cos, sin)) * QK_SCALE
    k = norm(apply_rotary(k, cos, sin)) * QK_SCALE
    q, k = q.transpose(1, 2).float(), k.transpose(1, 2).float()
    k = k.repeat_interleave(attn.n_head // attn.n_kv_head, dim=1)  # GQA: query head h reads kv head h // group
    scores = q @ k.transpose(-1, -2) / math.sqrt(attn.head_dim)
    allowed = torch.ones(P, P, dtype=torch.bool, device=x.device).tril()
    if mask is not None:
        allowed = allowed & mask[..., :P, :P]
    return scores.masked_fill(~allowed, -math.inf).softmax(dim=-1)


class Accumulator:
    """Running statistics of one model over a stream of batches; see the module docstring."""

    def __init__(self, model, cfg, device):
        c = model.config
        self.is_nag = isinstance(model, NAGGPT)  # nag-recipe too
        self.dim = c.n_embd
        self.num_updates = 2 * c.n_layer  # K; states k = 0..K
        self.cfg = cfg
        K, d, L = self.num_updates, c.n_embd, c.n_layer
        P = min(cfg.attn_positions, c.sequence_len)
        z = lambda *shape: torch.zeros(shape, dtype=torch.float64, device=device)
        self.sums = {
            "norm": z(K + 1),
            "norm_nobos": z(K + 1),
            "rotation": z(K + 1),
            "dir": z(K + 1, d),
            "dir_outer": z(K + 1, d, d),
            "attn": z(L, P, P),
            "loss": z(1),
            "top1": z(1),
            "entropy": z(1),
            "final_norm": z(1),
        }
        if self.is_nag:
            self.sums.update(gain=z(K + 1), m=z(K + 1), pref=z(K + 1, d), pref_weight=z(K + 1), atan_dev_max=z(K + 1))
        self.tokens = 0
        self.tokens_nobos = 0
        self.attn_rows = 0  # sequences contributing to the attention sum
        gen = torch.Generator().manual_seed(cfg.seed)
        self.token_res = Reservoir(cfg.token_sample, gen, device)
        self.state_res = Reservoir(cfg.state_sample, gen, device)
        for name, shape in [
            ("norm", (K + 1,)),
            ("rotation", (K + 1,)),
            ("final_norm", ()),
            ("entropy", ()),
            ("loss", ()),
            ("top1", ()),
            ("bos", ()),
        ] + ([("gain", (K + 1,))] if self.is_nag else []):
            self.token_res.declare(name, shape, torch.bool if name in ("top1", "bos") else torch.float32)
        self.state_res.declare("state", (K + 1, d), torch.float32)
        self.prev_dir = None
        self.pending_gain = None

    def state_bytes(self):
        """Bytes held between batches: constant in the number of tokens seen (tests check it)."""
        tensors = list(self.sums.values()) + [self.token_res.keys, self.state_res.keys]
        tensors += list(self.token_res.fields.values()) + list(self.state_res.fields.values())
        return sum(t.numel() * t.element_size() for t in tensors)

    # ----- called by the hooks, in forward order -----

    def begin_batch(self, idx, bos):
        n = idx.numel()
        self.token_res.begin(n)
        self.state_res.begin(n)
        self.bos = (idx == bos).flatten()
        self.token_res.write("bos", self.bos)
        self.tokens += n
        self.tokens_nobos += int((~self.bos).sum())
        self.prev_dir = None

    def state(self, k, direction, norms):
        """Residual state k: its direction (any scale; B, T, d) and the residual's norm per token (B, T)."""
        d = direction.reshape(-1, self.dim).double()
        norms = norms.reshape(-1).double()
        unit = d * torch.rsqrt(d.square().mean(dim=1, keepdim=True).clamp_min(1e-300))  # unit RMS, as R̄
        s = self.sums
        s["norm"][k] += norms.sum()
        s["norm_nobos"][k] += norms[~self.bos].sum()
        s["dir"][k] += unit.sum(0)
        s["dir_outer"][k] += unit.T @ unit
        self.token_res.write("norm", norms, k)
        self.state_res.write("state", unit * (norms / math.sqrt(self.dim))[:, None], k)  # the residual itself
        if k > 0:
            from analysis.measures import rotation_angles

            theta = rotation_angles(self.prev_dir, d)
            s["rotation"][k] += theta.sum()
            self.token_res.write("rotation", theta, k)
            if self.is_nag:  # DESIGN §3: the rotation of update k is atan(g_k) per token
                dev = (theta - torch.atan(self.pending_gain)).abs().max()
                s["atan_dev_max"][k] = torch.maximum(s["atan_dev_max"][k], dev)
        self.prev_dir = d
        if k == self.num_updates:
            self.last_norms = norms

    def gate(self, k, res_dir, m, gain):
        """NAG update k's modulator m and realised gain g per token, computed on its input R̄ (= state k−1)."""
        m, g = m.reshape(-1).double(), gain.reshape(-1).double()
        r = res_dir.reshape(-1, self.dim).double()
        s = self.sums
        s["gain"][k] += g.sum()
        s["m"][k] += m.sum()
        s["pref"][k] += m @ r  # paper eq. 32: Σ m(R̄) R̄ ...
        s["pref_weight"][k] += m.sum()  # ... / Σ m(R̄)
        self.token_res.write("gain", g, k)
        self.pending_gain = g

    def attention(self, layer, probs):
        self.sums["attn"][layer] += probs.double().mean(dim=1).sum(dim=0)  # head mean, summed over sequences
        if layer == 0:
            self.attn_rows += probs.size(0)

    def output(self, logits, targets):
        logp = F.log_softmax(logits.float(), dim=-1).view(-1, logits.size(-1))
        t = targets.reshape(-1)
        entropy = -(logp.exp() * logp).sum(dim=-1)
        loss = -logp.gather(1, t[:, None]).squeeze(1)
        top1 = logp.argmax(dim=-1) == t
        s = self.sums
        s["loss"] += loss.double().sum()
        s["entropy"] += entropy.double().sum()
        s["top1"] += top1.double().sum()
        s["final_norm"] += self.last_norms.sum()
        for name, v in (("entropy", entropy), ("loss", loss), ("top1", top1), ("final_norm", self.last_norms)):
            self.token_res.write(name, v)


# ---------------------------------------------------------------------------
# attaching to the models


def attach(model, acc):
    """Install the observers on model; returns a function that removes them."""
    handles = []
    P = acc.cfg.attn_positions
    for i, block in enumerate(model.blocks):
        handles.append(
            block.attn.register_forward_pre_hook(
                lambda mod, args, i=i: acc.attention(i, attention_probs(mod, args[0], args[1], args[2], P))
            )
        )
    if isinstance(model, NAGGPT):
        return _attach_nag(model, acc, handles)
    current = {}

    def block_in(i):
        def hook(mod, args):
            x = args[0]
            if i == 0:
                acc.state(0, x, x.double().norm(dim=-1))
            current["x"] = x

        return hook

    def attn_out(i):
        def hook(mod, args, out):
            x = current["x"] + out  # exactly the block's own `x + self.attn(...)`
            acc.state(2 * i + 1, x, x.double().norm(dim=-1))

        return hook

    def block_out(i):
        def hook(mod, args, out):
            acc.state(2 * i + 2, out, out.double().norm(dim=-1))

        return hook

    for i, block in enumerate(model.blocks):
        handles.append(block.register_forward_pre_hook(block_in(i)))
        handles.append(block.attn.register_forward_hook(attn_out(i)))
        handles.append(block.register_forward_hook(block_out(i)))
    return lambda: [h.remove() for h in handles]


def _attach_nag(model, acc, handles):
    from nag.functional import modulator

    # the method the model's forward makes its updates with, and where the branch sits in its arguments:
    # NAGGPT.sublayer(kind, layer, block, br, ...), nag-recipe's recipe_sublayer(kind, block, br, ...)
    name, at = ("recipe_sublayer", 2) if hasattr(model, "recipe_sublayer") else ("sublayer", 3)
    original = getattr(model, name)
    root_d = math.sqrt(model.config.n_embd)

    def sublayer(*args, **kwargs):
        br, res_dir, log_norm = args[at : at + 3]
        l = br.l
        if l == 1:
            acc.state(0, res_dir, root_d * log_norm.double().exp())
        m = modulator(br.m_down(res_dir), br.coef, br.beta_raw, model.nag.mod_floor)
        acc.gate(l, res_dir, m, br.alpha * model.alpha_warmup * m)
        new_dir, new_log_norm = original(*args, **kwargs)
        acc.state(l, new_dir, root_d * new_log_norm.double().exp())  # ‖R‖ = √d·e^s
        return new_dir, new_log_norm

    setattr(model, name, sublayer)  # an instance attribute shadows the method; deleting it restores the original

    def detach():
        delattr(model, name)
        for h in handles:
            h.remove()

    return detach


# ---------------------------------------------------------------------------
# the pass


@torch.no_grad()
def capture(model, batches, num_batches, bos, cfg=None, progress=None, accumulator=None):
    """Run model over num_batches (inputs, targets, ...) batches, observing it; returns the Accumulator (of the
    class `accumulator`, an Accumulator subclass, if given: analysis/arms.py adds per-block rotation)."""
    cfg = cfg or CaptureConfig()
    device = model.lm_head.weight.device
    acc = (accumulator or Accumulator)(model, cfg, device)
    detach = attach(model, acc)
    try:
        for b in range(num_batches):
            inputs, targets = next(batches)[:2]
            acc.begin_batch(inputs, bos)
            logits = model(inputs)
            acc.output(logits, targets)
            if progress:
                progress(b + 1, num_batches)
    finally:
        detach()
    return acc
