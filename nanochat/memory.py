"""
GPU memory of a training run, worked out before it starts: each term, the peak, and whether it fits.

The peak of a step comes at the start of the backward, when every activation saved for it is still held
(docs/memory.md). Its terms:
- weights: the fp32 master copies; optimizer: AdamW's two moments, Muon's momentum and variance for this rank's
  share of each stack (nanochat/optim.py shards Muon over the ranks); gradients: those alive at the peak (the
  readout's alone in one micro-batch a step; all of them between accumulated micro-batches, and DDP's buckets);
- activations: the bytes autograd saves per token per layer, and per token outside the layers (embedding,
  readout, loss), measured on this machine's CPU at a few tokens and scaled to the micro-batch (`measure`), plus
  the weights' low-precision copies saved for the backward;
- what the compiled readout's backward holds beside the saved logits (a property of the arch, per logit).
Nothing is allocated on a GPU: a plan for a GPU that is not here (--gpu, --gpu-memory) is made the same way.
"""

import os
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

GIB = 2**30
# a GPU needs more than the peak the allocator reports: the CUDA context and the cuBLAS / cuDNN / NCCL workspaces
# live outside it (~0.5-1 GiB on an H100), and the allocator's blocks are never filled exactly. Our allowance:
CONTEXT_GIB = 1.0
ALLOCATOR_SLACK = 0.05  # of the peak (expandable segments, base_train's allocator setting, fragment little)
MAX_AUTO_BATCH = 1024  # the largest device batch --device-batch-size auto tries
DEFAULT_BATCH = 32  # --device-batch-size auto where no GPU memory is planned (a CPU run)
PROBE_TOKENS = 13  # a probe row: prime, so that a token dimension is told apart from every model dimension
PROBE_TOKENS_ROUTED = 257  # with MoD, long enough that a sub-layer's capacity rounds as it does at full length


@dataclass(frozen=True)
class Footprint:
    """What one arch saves for the backward, measured at a probe (bytes)."""

    per_token_layer: float  # activations per token per layer
    per_token_head: float  # activations per token outside the layers (embedding, readout, loss) at the peak
    weights_layer: float  # low-precision weight copies saved for the backward, per layer
    weights_head: float  # the same outside the layers


def probe_tokens(config, routed):
    """A prime row length that equals none of the model's dimensions."""
    t = PROBE_TOKENS_ROUTED if routed else PROBE_TOKENS
    dims = {config.n_embd, config.n_head, config.n_kv_head, config.n_embd // config.n_head, config.vocab_size}
    while t in dims or any(t % k == 0 for k in range(2, int(t**0.5) + 1)):
        t += 1
    return t


class LiveTokenBytes(TorchDispatchMode):
    """The bytes of every storage with a token dimension alive at once, and their most: an eager step's own
    allocations (what it saves and what it holds while it computes) as the ops run."""

    def __init__(self, tokens):
        super().__init__()
        self.tokens, self.live, self.now, self.peak = tokens, set(), 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and self.tokens in t.shape and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live:
                    self.live.add(key)
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self.release, key, storage.nbytes())
        return out

    def release(self, key, nbytes):
        self.live.discard(key)
        self.now -= nbytes


def saved_bytes(model, idx, compiled):
    """(bytes with a token dimension, bytes without) that a training forward of `model` on idx saves for the
    backward, in distinct storages. Compiled: as Inductor would partition it (its decompositions, the min-cut
    partitioner), though the graphs then run uncompiled."""
    T = idx.size(1)
    token, other = {}, {}

    def pack(t):
        s = t.untyped_storage()
        (token if T in t.shape else other)[s.data_ptr()] = s.nbytes()
        return t

    forward = model
    if compiled:
        # imported here: on a machine without a GPU Triton's interpreter must be set up (by the model's import of its
        # kernels) before Inductor imports Triton
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        from torch._inductor.decomposition import select_decomp_table

        def keep(gm, _):
            return gm

        backend = aot_autograd(
            fw_compiler=keep,
            bw_compiler=keep,
            partition_fn=min_cut_rematerialization_partition,
            decompositions=select_decomp_table(),
        )
        torch._dynamo.reset()
        forward = torch.compile(model, backend=backend, dynamic=False)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward(idx, idx)
    if compiled:
        torch._dynamo.reset()
    return sum(token.values()), sum(b for k, b in other.items() if k not in params)


def eager_peak(model, idx):
    """The most bytes with a token dimension alive at once in an eager forward and backward of `model` on idx."""
    tracker = LiveTokenBytes(idx.size(1))
    with tracker:
        model(idx, idx).backward()
    model.zero_grad(set_to_none=True)
    return tracker.peak


MEASURED = {}  # footprints measured in this process, by repr of measure's arguments


def measure(model_class, init_kwargs, config, fp8, compiled):
    """The Footprint of a model class at `config`'s width (any depth), built on the CPU at depths 1 and 2 and a
    probe row: the slope between the two depths is a layer's, the rest is outside the layers. Compiled: the
    bytes saved as Inductor partitions the graph, plus the arch's compiled readout gradient; eager: the most bytes
    alive at once over a forward and backward. bf16 throughout, as on a GPU."""
    from dataclasses import replace

    shape = replace(config, n_layer=0, sequence_len=0)  # a footprint is per layer and per token: any depth, any length
    key = repr((model_class.__module__, model_class.__name__, sorted(init_kwargs.items()), shape, fp8, compiled))
    if key in MEASURED:
        return MEASURED[key]
    T = probe_tokens(config, routed=init_kwargs.get("mod") is not None)
    figures = {}
    state = torch.random.get_rng_state()
    try:
        for depth in (1, 2):
            torch.manual_seed(0)
            model = model_class.initialised(replace(config, n_layer=depth, sequence_len=T), "cpu", **init_kwargs)
            model.set_compute_dtype(torch.bfloat16)
            model.set_fp8(fp8)
            model.train()
            idx = torch.randint(0, config.vocab_size, (1, T))
            token, weights = saved_bytes(model, idx, compiled)
            if compiled:
                token += model.compiled_readout_grad_bytes * T * config.vocab_size
            else:
                token = eager_peak(model, idx)
            figures[depth] = token / T, weights
    finally:
        torch.random.set_rng_state(state)
    (t1, w1), (t2, w2) = figures[1], figures[2]
    MEASURED[key] = Footprint(t2 - t1, 2 * t1 - t2, w2 - w1, 2 * w1 - w2)
    return MEASURED[key]


def compiles(device_type):
    """Whether base_train compiles the model there: on CUDA, unless TORCH_COMPILE_DISABLE=1."""
    return device_type == "cuda" and os.environ.get("TORCH_COMPILE_DISABLE", "0") in ("", "0")


@dataclass
class Memory:
    """A step's memory on one rank, GiB. peak: what torch.cuda.max_memory_allocated would report; needed: the peak
    with the context and the allocator's slack, which must be at most the GPU's memory."""

    device_batch_size: int
    weights: float
    optimizer: float
    gradients: float
    activations: float
    readout: float
    weight_copies: float
    gpu_gib: float
    compiled: bool

    @property
    def peak(self):
        return self.weights + self.optimizer + self.gradients + self.activations + self.readout + self.weight_copies

    @property
    def needed(self):
        return self.peak * (1 + ALLOCATOR_SLACK) + CONTEXT_GIB

    @property
    def fits(self):
        return self.needed <= self.gpu_gib

    def record(self):
        terms = ("weights", "optimizer", "gradients", "activations", "readout", "weight_copies")
        return {
            "device_batch_size": self.device_batch_size,
            **{f"{t}_gib": round(getattr(self, t), 4) for t in terms},
            "peak_gib": round(self.peak, 4),
            "needed_gib": round(self.needed, 4),
            "gpu_gib": self.gpu_gib,
            "fits": self.fits,
            "compiled": self.compiled,
            "allowance": f"peak × {1 + ALLOCATOR_SLACK} + {CONTEXT_GIB} GiB (CUDA context, workspaces)",
        }

    def line(self):
        terms = (
            f"weights {self.weights:.2f} + optimizer {self.optimizer:.2f} + gradients {self.gradients:.2f} + "
            f"activations {self.activations:.2f} + readout {self.readout:.2f} + weight copies "
            f"{self.weight_copies:.2f} = peak {self.peak:.2f} GiB"
        )
        verdict = "fits" if self.fits else "DOES NOT FIT"
        return (
            f"memory per GPU at device batch {self.device_batch_size}: {terms}; with the context and slack "
            f"{self.needed:.2f} of {self.gpu_gib:.1f} GiB: {verdict}"
        )


def state_bytes(groups, world_size):
    """Optimizer state bytes on rank 0 of world_size for param_groups(...) groups: AdamW's two fp32 moments of
    every tensor; Muon's fp32 momentum and variance for the rank's contiguous chunk of each stack."""
    total = 0
    for g in groups:
        params = g["params"]
        if g["kind"] == "adamw":
            total += sum(2 * 4 * p.numel() for p in params)
            continue
        n = -(-len(params) // world_size)  # nanochat.optim.shard_rows: rank 0 holds the largest chunk
        r, c = params[0].shape
        total += 4 * n * (r * c + max(r, c))
    return total


def plan_memory(model, groups, footprint, micro_batch, seq_len, grad_accum, world_size, gpu_gib, compiled):
    """The Memory of a training step of `model` (built at its full depth, on any device) with param_groups groups,
    micro_batch rows of seq_len tokens on each of world_size ranks."""
    tokens = micro_batch * seq_len
    n_layer = model.config.n_layer
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())  # fp32, as the masters
    # the readout's gradient is written first; the others arrive as the backward frees activations. Accumulation keeps
    # them all between micro-batches, and DDP keeps a copy of every gradient in its buckets.
    live_grads = grad_bytes if grad_accum > 1 else model.lm_head.weight.numel() * 4
    if world_size > 1:
        live_grads += grad_bytes
    return Memory(
        device_batch_size=micro_batch,
        weights=weight_bytes / GIB,
        optimizer=state_bytes(groups, world_size) / GIB,
        gradients=live_grads / GIB,
        activations=tokens * footprint.per_token_layer * n_layer / GIB,
        readout=tokens * footprint.per_token_head / GIB,
        weight_copies=(footprint.weights_layer * n_layer + footprint.weights_head) / GIB,
        gpu_gib=gpu_gib,
        compiled=compiled,
    )

