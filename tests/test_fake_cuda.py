"""The fake-CUDA twin: every arch's training step on cuda:0 tensors, on a machine without a GPU.

The fake-CUDA twin (docs/design.md §2, "The fake-CUDA twin"): every arch's training forward and optimizer step run
on tensors that live on cuda:0, on a machine without a GPU. torch's FakeTensorMode gives a tensor a device, a shape
and a dtype but no values, and runs CUDA's own meta rules on each op: an op that mixes a CPU tensor into CUDA ones
raises, a host read (.item(), .tolist(), bool()) raises, and torch._scaled_mm checks CUDA's layout and
multiple-of-16 rules. The matrix: every arch of nag/archs.py's ARCHS, with each Mixture-of-Depths variant its flags
accept, × the attention paths of plain rows (SDPA, cuDNN, and stand-ins for FA4 and FA3 that check each call
against the real function's signature and argument rules) × fp8 on and off, at a published-like small shape (head
dim 128, GQA 2:1, L and S windows shorter than the row).

What a CPU-only build cannot do inside FakeTensorMode, and what stands in for it:
- Python bindings that open a CUDA device guard (Tensor.__getitem__, __setitem__, __invert__, .contiguous(),
  .to(device), .copy_()) find no CUDA guard on a CPU-only build: guard_free() routes them, for CUDA tensors only,
  to the aten ops they dispatch to. nn.init's draws need a CUDA generator: they draw nothing (no values anyway).
- autograd cannot record an edge to a CUDA leaf (AccumulateGrad aborts the process: "PyTorch is not linked with
  support for cuda devices"), so parameters do not require grad, the forward runs under no_grad, and each parameter
  gets a stand-in gradient of its shape on cuda:0. The backward matmuls of fp8 are checked by running FP8Matmul's
  own backward on the forward's saved operands, once per call (fp8_forward_and_backward).
- torch.compile does not run here: the optimizer runs eager (compile=False) and flex_attention (S windows under
  SDPA and cuDNN on CUDA) runs its higher-order op without dynamo, whose fake implementation checks the call.
- SDPA picks its CUDA backend in C++, which this build lacks: SDPA and cuDNN calls both go through the math
  decomposition on fake tensors, so cuDNN's own shape limits are the GPU's to check (docs/gpu_checks.md).
"""

import contextlib
import sys
import types

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import nag  # noqa: F401  (before triton: the fused NAG kernels' interpreter flag)
from nag import mod as mod_lib
from nag.archs import ARCHS, arch_for_args, plan_for
from nag.kernels import fused_nag_branch
from nanochat import flash_attention as fa
from nanochat import fp8, gpt, step_timer
from nanochat.common import UserError, compute_dtype_for
from nanochat.nonfinite import finite_flags
from nanochat.optim import MuonAdamW
from scripts import base_train

aten = torch.ops.aten
CUDA = torch.device("cuda", 0)
VOCAB = 512
B, T = 2, 256
# the published head dim (128), GQA 2:1 (2 query heads, 1 KV head: the kernels' GQA paths), and an S layer then an L
# one, the S window (half the row; the recipe's quarter window: 128 of 256) shorter than the row
SHAPE = [
    "--depth",
    "2",
    "--model-dim",
    "256",
    "--head-dim",
    "128",
    "--n-kv-head",
    "1",
    "--max-seq-len",
    str(T),
    "--window-pattern",
    "SL",
    "--device-batch-size",
    str(B),
    "--total-batch-size",
    str(B * T),
    "--num-iterations",
    "10",
    "--eval-every",
    "-1",
]
MOD_FLAGS = {  # every Mixture-of-Depths variant worth a trace; each arch takes those its flags accept (arch_for_args)
    "none": [],
    "mlp": ["--mod-blocks", "mlp", "--mod-rate", "0.2"],
    "attn+mlp": ["--mod-blocks", "both", "--mod-rate", "0.2"],
}
ATTENTION = ("sdpa", "cudnn", "fa4", "fa3")
PACKED = mod_lib.capacity(T, 0.2)  # the tokens of a row that a MoD sub-layer computes: 208 of 256


# ---------------------------------------------------------------------------
# guard-free bindings: Python-level Tensor methods that open a CUDA device guard, routed to their aten ops


def index_parts(x, idx):
    """x after the int / slice / None / Ellipsis parts of a __getitem__ index (views, as Python indexing makes them),
    and the tensor parts as aten.index's list (None for the dims they leave alone)."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    used = sum(
        i.dim() if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1
        for i in idx
        if i is not None and i is not Ellipsis
    )
    dim, indices = 0, []
    for i in idx:
        if i is Ellipsis:
            n = x.dim() - used
            dim, indices = dim + n, indices + [None] * n
        elif i is None:
            x, dim, indices = aten.unsqueeze(x, dim), dim + 1, indices + [None]
        elif isinstance(i, bool):
            raise NotImplementedError("guard_free: a Python bool index")
        elif isinstance(i, (int, torch.SymInt)):
            x = aten.select.int(x, dim, i)
        elif isinstance(i, slice):
            x = aten.slice.Tensor(x, dim, i.start, i.stop, 1 if i.step is None else i.step)
            dim, indices = dim + 1, indices + [None]
        elif isinstance(i, torch.Tensor):
            dim, indices = dim + (i.dim() if i.dtype == torch.bool else 1), indices + [i]
        else:
            raise NotImplementedError(f"guard_free: an index of type {type(i).__name__}")
    while indices and indices[-1] is None:
        indices.pop()
    return x, indices


def getitem(x, idx):
    x, indices = index_parts(x, idx)
    return aten.index.Tensor(x, indices) if indices else x


def setitem(x, idx, value):
    view, indices = index_parts(x, idx)
    if not isinstance(value, torch.Tensor):
        value = torch.full((), value, dtype=x.dtype, device=x.device)
    if indices:
        aten.index_put_(view, indices, value)
    else:
        aten.copy_(view, value)


def to(x, *args, **kwargs):
    copy = kwargs.pop("copy", False)
    device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    if device is not None and device.type == "cuda" and device.index is None:
        device = CUDA
    if not copy and device in (None, x.device) and dtype in (None, x.dtype) and memory_format is None:
        return x
    return aten._to_copy(x, dtype=dtype or x.dtype, device=device or x.device)


def contiguous(x, memory_format=torch.contiguous_format):
    return x if x.is_contiguous(memory_format=memory_format) else aten.clone(x, memory_format=memory_format)


def host_read(x, *args, **kwargs):
    """.tolist(): a read of the first value, which FakeTensorMode refuses as any host read (data-dependent)."""
    return aten._local_scalar_dense(aten.select.int(aten.reshape(x, (-1,)), 0, 0))


def no_draw(x, *args, **kwargs):
    return x


ROUTES = {
    "__getitem__": getitem,
    "__setitem__": setitem,
    "to": to,
    "cuda": lambda x, device=None, non_blocking=False, memory_format=None: to(x, CUDA),
    "contiguous": contiguous,
    "copy_": lambda x, src, non_blocking=False: aten.copy_(x, src),
    "__invert__": lambda x: aten.bitwise_not(x),
    "new_tensor": lambda x, data, dtype=None, device=None, requires_grad=False: to(
        torch.tensor(data, dtype=dtype or x.dtype), device or x.device
    ),
    "tolist": host_read,
    "nonzero": lambda x, *args, **kwargs: aten.nonzero(x),  # a data-dependent shape: refused as a host read
    "uniform_": no_draw,
    "normal_": no_draw,
}


@contextlib.contextmanager
def guard_free():
    """ROUTES in place of torch.Tensor's own methods, for tensors on CUDA (any other tensor takes the real method)."""
    saved = {name: torch.Tensor.__dict__.get(name) for name in ROUTES}
    originals = {name: getattr(torch.Tensor, name) for name in ROUTES}

    def routed(name):
        original, route = originals[name], ROUTES[name]

        def method(self, *args, **kwargs):
            return (route if self.device.type == "cuda" else original)(self, *args, **kwargs)

        method.__name__ = name
        return method

    for name in ROUTES:
        setattr(torch.Tensor, name, routed(name))
    try:
        yield
    finally:
        for name, method in saved.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)


# ---------------------------------------------------------------------------
# the model on fake cuda:0, as base_train's set_up makes it


def flags_for(arch, mod):
    return base_train.parse_args(SHAPE + ["--arch", arch] + MOD_FLAGS[mod])


def accepted(arch, mod):
    """Whether base_train takes this arch with these MoD flags (the registry's rules, not a list kept here)."""
    try:
        args = flags_for(arch, mod)
        _, spec = arch_for_args(args)
        spec.init_kwargs(args)
    except UserError:
        return False
    return True


VARIANTS = [(arch, mod) for arch in ARCHS for mod in MOD_FLAGS if accepted(arch, mod)]


def to_fake_cuda(model, mode):
    """Every parameter and buffer of a model built on the meta device as a fake tensor on cuda:0 (fp32 masters).
    Parameters do not require grad: autograd cannot record an edge to a CUDA leaf on this build (module docstring)."""
    convert = mode.fake_tensor_converter
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                m._parameters[name] = nn.Parameter(
                    convert.from_meta_and_device(mode, p.detach(), CUDA), requires_grad=False
                )
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = convert.from_meta_and_device(mode, b, CUDA)
    return model


class Twin:
    """One arch × MoD variant on fake cuda:0: base_train's plan, its model initialised and in the compute dtype of a
    Hopper GPU (bf16), and the FakeTensorMode its tensors belong to."""

    def __init__(self, arch, mod):
        self.args = flags_for(arch, mod)
        self.plan = plan_for(self.args, VOCAB, 1)
        self.mode = FakeTensorMode(allow_non_fake_inputs=False)
        self.model = to_fake_cuda(self.plan.model, self.mode)
        with self.mode, guard_free(), hopper():
            self.model.init_weights()  # on the device, as base_train: the fused NAG update, since it is CUDA
            self.model.set_compute_dtype(compute_dtype_for("cuda"))


@contextlib.contextmanager
def hopper():
    """torch.cuda as a Hopper GPU shows it, for what reads the compute capability (compute_dtype_for, fp8)."""
    saved = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    try:
        yield
    finally:
        torch.cuda.get_device_capability = saved


TWINS = {}


def twin(arch, mod):
    """Built once per session: the attention and fp8 variants reuse it (each step takes a fresh optimizer)."""
    if (arch, mod) not in TWINS:
        TWINS[arch, mod] = Twin(arch, mod)
    return TWINS[arch, mod]


# ---------------------------------------------------------------------------
# stand-ins for the kernels that only run on a GPU: FA4 (flash_attn.cute) and FA3 (the hub's flash_attn_interface)


class FlashStandIn:
    """flash_attn_func of FA4 or FA3 with the real one's signature (an unknown argument is a TypeError), the checks the
    real one makes of its arguments, and an output of the real shape, dtype and device (no values): q (B, T, H, D),
    k and v (B, Tk, KV, D) with KV dividing H (GQA), bf16 or fp16 alike, on CUDA, head dim at most 256 and a multiple
    of 8, window_size = (left, right) keys on each side, both ends included. "No limit" is None for FA4, which would
    read -1 as a bound (4.0.0b36's _resolve_causal_local_window), and -1 for FA3, whose op takes ints. FA4 returns
    (out, lse), lse None unless a gradient or return_lse needs it; FA3 returns out (with return_attn_probs, (out, lse)).
    Each call is recorded: (q shape, k shape, dtype, causal, window_size)."""

    def __init__(self, style):
        self.style, self.calls = style, []
        self.flash_attn_func = self.fa4 if style == "fa4" else self.fa3

    def fa4(
        self,
        q,
        k,
        v,
        softmax_scale=None,
        causal=False,
        window_size=(None, None),
        learnable_sink=None,
        softcap=0.0,
        num_splits=1,
        pack_gqa=None,
        deterministic=False,
        mask_mod=None,
        full_block_cnt=None,
        full_block_idx=None,
        mask_block_cnt=None,
        mask_block_idx=None,
        block_size=None,
        return_lse=False,
    ):
        out, lse = self.check(q, k, v, causal, window_size)
        return out, (lse if return_lse or any(t.requires_grad for t in (q, k, v)) else None)

    def fa3(
        self,
        q,
        k,
        v,
        softmax_scale=None,
        causal=False,
        qv=None,
        q_descale=None,
        k_descale=None,
        v_descale=None,
        window_size=(-1, -1),
        attention_chunk=0,
        softcap=0.0,
        num_splits=1,
        pack_gqa=None,
        deterministic=False,
        sm_margin=0,
        return_attn_probs=False,
    ):
        out, lse = self.check(q, k, v, causal, window_size)
        return (out, lse) if return_attn_probs else out

    def check(self, q, k, v, causal, window_size):
        assert all(isinstance(t, torch.Tensor) and t.is_cuda for t in (q, k, v)), "inputs must be on CUDA device"
        assert q.dim() == k.dim() == v.dim() == 4, f"(B, T, H, D) expected: {q.shape}, {k.shape}, {v.shape}"
        (b, t, h, d), (tk, kv) = q.shape, k.shape[1:3]
        assert tuple(k.shape) == (b, tk, kv, d) and tuple(v.shape[:3]) == (b, tk, kv), (q.shape, k.shape, v.shape)
        assert h % kv == 0, f"num_head {h} must be divisible by num_head_kv {kv}"
        assert q.dtype in (torch.float16, torch.bfloat16) and q.dtype == k.dtype == v.dtype, (q.dtype, k.dtype, v.dtype)
        assert d <= 256 and d % 8 == 0 and v.size(-1) % 8 == 0, f"head dim {d}"
        assert all(x.stride(-1) == 1 for x in (q, k, v)), "the last dim contiguous (else the kernel copies)"
        assert isinstance(window_size, (tuple, list)) and len(window_size) == 2, window_size
        if self.style == "fa4":
            assert all(w is None or (isinstance(w, int) and w >= 0) for w in window_size), (
                f"FA4 reads {window_size} as bounds: no limit is None"
            )
        else:
            assert all(isinstance(w, int) and w >= -1 for w in window_size), (
                f"FA3 takes ints, -1 for no limit: {window_size}"
            )
        self.calls.append((tuple(q.shape), tuple(k.shape), q.dtype, causal, tuple(window_size)))
        out = q.new_empty((b, t, h, v.size(-1)))
        return out, torch.empty((b, h, t), dtype=torch.float32, device=q.device)


def expected_window(style, window):
    """What causal_attention must pass as window_size for a layer of `window` positions on rows of T."""
    if window >= T:
        return (None, 0) if style == "fa4" else (-1, 0)
    return (window - 1, 0)


@contextlib.contextmanager
def kernel_installed(kernel, monkeypatch):
    """The kernel's stand-in where nanochat/flash_attention.py imports it from (flash_attn.cute for FA4, the hub's
    kernels.get_kernel for FA3), loaded afresh by the module's own loaders; flex_attention without dynamo. Yields the
    stand-in (None for SDPA and cuDNN, which torch brings)."""
    monkeypatch.setattr(fa, "_fa4", None)
    monkeypatch.setattr(fa, "_fa3", None)
    from torch.nn.attention import flex_attention as flex

    monkeypatch.setattr(fa, "_flex_compiled", flex.flex_attention)  # flex() compiles; the twin cannot
    monkeypatch.setattr(flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)  # the op itself, not through dynamo
    stand_in = None
    if kernel in ("fa4", "fa3"):
        stand_in = FlashStandIn(kernel)
        if kernel == "fa4":
            monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
            monkeypatch.setitem(
                sys.modules, "flash_attn.cute", types.SimpleNamespace(flash_attn_func=stand_in.flash_attn_func)
            )
        else:
            hub = types.SimpleNamespace(flash_attn_interface=stand_in)
            monkeypatch.setitem(
                sys.modules,
                "kernels",
                types.SimpleNamespace(get_kernel=lambda repo: hub if repo == fa.FA3_REPO else None),
            )
    yield stand_in


# ---------------------------------------------------------------------------
# fp8: every _scaled_mm call recorded, each forward's backward matmuls run too


class ScaledMMs:
    """torch._scaled_mm recorded: (a dtype, b dtype, a shape, b shape) of each call. The op itself runs on the fake
    CUDA operands, so CUDA's meta kernel checks the layouts and the multiples of 16; the scales are checked here."""

    def __init__(self):
        self.calls, self.original = [], torch._scaled_mm

    def __call__(self, a, b, scale_a, scale_b, out_dtype=None, **kwargs):
        assert all(s.dtype == torch.float32 and s.dim() == 0 and s.is_cuda for s in (scale_a, scale_b)), (
            scale_a,
            scale_b,
        )
        assert out_dtype is not None
        self.calls.append((a.dtype, b.dtype, tuple(a.shape), tuple(b.shape)))
        return self.original(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, **kwargs)


class Ctx:
    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def fp8_forward_and_backward(x, weight):
    """FP8Matmul.apply in the twin: its forward, then its own backward on a stand-in dy of y's shape (autograd cannot
    run it here): dx = dy·W and dW = dyᵀ·x with the token dim padded, as CUDA will be asked to compute them."""
    ctx = Ctx()
    y = fp8.FP8Matmul.forward(ctx, x, weight)
    dx, dw = fp8.FP8Matmul.backward(ctx, torch.empty_like(y))
    assert (dx.shape, dx.dtype, dx.device) == (x.shape, x.dtype, x.device), (dx.shape, x.shape)
    assert (dw.shape, dw.dtype, dw.device) == (weight.shape, weight.dtype, weight.device), (dw.shape, weight.shape)
    return y


# ---------------------------------------------------------------------------
# one training step on fake cuda:0


class CpuWork(TorchDispatchMode):
    """The ops of the step that make a tensor on the CPU. CUDA takes a few such tensors without a word (a 0-dim one as
    a scalar; a CPU index tensor, copied to the device at every call: a hidden host-to-device copy and sync), and so
    does FakeTensorMode; a training step that keeps its work on the GPU makes none."""

    supports_higher_order_operators = True  # flex_attention passes through

    def __init__(self):
        super().__init__()
        self.ops, self.cpu = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self.cpu.append(f"{func} -> {tuple(t.shape)}")
        return out


class Trace:
    """What one twin step saw."""

    def __init__(self):
        self.reads, self.scaled_mm, self.kernel, self.loss, self.gate, self.optimizer = [], None, None, None, None, None
        self.work = CpuWork()


def twin_step(arch, mod, attention, use_fp8, monkeypatch):
    """base_train's training step for one variant on fake cuda:0: the forward (training mode, the chosen attention
    kernel and fp8 setting), stand-in gradients, the finite flags as the gate, and base_train's optimizer_step
    (schedules, MuonAdamW.step(gate), after_optimizer_step). Raises where CUDA would refuse what the step asks."""
    tw = twin(arch, mod)
    model, trace = tw.model, Trace()
    mms = trace.scaled_mm = ScaledMMs()

    def counted_read(tensor):  # every host read of a step goes through read_values: counted, answered with numbers
        trace.reads.append(sys._getframe(1).f_code.co_name)
        return 1 if tensor.dim() == 0 else [1] * tensor.numel()

    monkeypatch.setattr(step_timer, "read_values", counted_read)
    monkeypatch.setattr(torch, "_scaled_mm", mms)
    monkeypatch.setattr(fp8.FP8Matmul, "apply", fp8_forward_and_backward)
    with tw.mode, guard_free(), hopper(), kernel_installed(attention, monkeypatch) as kernel:
        trace.kernel = kernel
        model.zero_grad(set_to_none=True)  # what a step that raised before its update left behind
        model.set_fp8(use_fp8)
        model.set_attention(attention)
        model.train()
        trace.optimizer = MuonAdamW(tw.plan.optimizer_groups(tw.args), compile=False)  # torch.compile: not here
        with trace.work:
            model.set_tokens_seen(0)
            x = torch.empty((B, T), dtype=torch.long, device=CUDA)  # token ids with no values, as the loader's
            with torch.no_grad():
                trace.loss = model(x, torch.empty_like(x))
            for p in model.parameters():
                p.grad = torch.empty_like(p)  # stand-in gradients: fp32 like the masters, on cuda:0
            trace.gate = finite_flags(model, trace.loss).all()
            run = types.SimpleNamespace(plan=tw.plan, args=tw.args, optimizer=trace.optimizer, model=model)
            base_train.optimizer_step(run, 0, gate=trace.gate)
    return trace


def fp8_layers(model):
    return [m for m in model.modules() if isinstance(m, gpt.Linear) and m.fp8]


def attention_skipped(model):
    mod = getattr(model, "mod", None)
    return mod is not None and mod.skips("attn")


# attention MoD packs its queries and attends with masked SDPA under every kernel: its rows run under sdpa alone
STEPS = [
    (arch, mod, attention, use_fp8)
    for arch, mod in VARIANTS
    for attention in ATTENTION
    for use_fp8 in (False, True)
    if "attn" not in mod or attention == "sdpa"
]


@pytest.mark.parametrize(
    "arch, mod, attention, use_fp8", STEPS, ids=[f"{a}-{m}-{k}-{'fp8' if f else 'bf16'}" for a, m, k, f in STEPS]
)
def test_a_training_step_on_fake_cuda(arch, mod, attention, use_fp8, monkeypatch):
    trace = twin_step(arch, mod, attention, use_fp8, monkeypatch)
    model = twin(arch, mod).model
    # every parameter, buffer and optimizer state on cuda:0; the loss and the gate (the finite flags) too
    assert all(p.device == CUDA and p.dtype == torch.float32 and p.grad is None for p in model.parameters())
    assert all(b.device == CUDA for b in model.buffers())
    state = [v for s in trace.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    assert state and all(v.device == CUDA for v in state)
    assert trace.loss.device == CUDA and trace.loss.dim() == 0
    assert trace.gate.device == CUDA and trace.gate.dtype == torch.bool and trace.gate.dim() == 0
    assert trace.work.cpu == [] and trace.work.ops > 1000  # not even a CPU scalar or index in the step
    # host reads: none, MoD's packing included (a fixed capacity per row, docs/mod.md)
    assert trace.reads == []
    # fp8: each admitted Linear's forward in e4m3, its two backward matmuls with dy in e5m2
    layers = len(fp8_layers(model))
    assert layers == (2 * 6 + 1 if use_fp8 else 0)  # every block matrix and lm_head at this width
    kinds = [(a, b) for a, b, _, _ in trace.scaled_mm.calls]
    assert kinds == [(fp8.E4M3, fp8.E4M3), (fp8.E5M2, fp8.E4M3), (fp8.E5M2, fp8.E4M3)] * layers
    tokens = {a[0] for _, _, a, _ in trace.scaled_mm.calls[::3]}  # N of each forward (its M: free)
    assert tokens == (
        set()
        if not use_fp8
        else {B * T}
        if mod == "none"
        else {B * T, B * PACKED}
    )  # MoD's packed counts: B·capacity, attention's queries and the MLP's tokens
    # the kernel's calls: one per layer that attends over plain rows, with its window in the kernel's convention
    if trace.kernel is not None:
        plain = [] if attention_skipped(model) else model.windows
        assert [c[4] for c in trace.kernel.calls] == [expected_window(attention, w) for w in plain]
        heads, kv_heads, head_dim = (
            model.config.n_head,
            model.config.n_kv_head,
            model.config.n_embd // model.config.n_head,
        )
        assert all(
            c[:4] == ((B, T, heads, head_dim), (B, T, kv_heads, head_dim), torch.bfloat16, True)
            for c in trace.kernel.calls
        )


def test_the_matrix_covers_every_arch_and_mod():
    assert {a for a, _ in VARIANTS} == set(ARCHS)
    assert set(VARIANTS) >= {
        ("gpt", "none"),
        ("gpt-router", "mlp"),
        ("gpt-router", "attn+mlp"),
        ("nag", "mlp"),
        ("nag", "attn+mlp"),
        ("gpt-recipe", "none"),
        ("nag-recipe", "none"),
    }
    assert ("gpt", "mlp") not in VARIANTS and ("gpt-recipe", "mlp") not in VARIANTS  # refused by their flags
    model = twin("gpt", "none").model
    assert [w < T for w in model.windows] == [True, False]  # an S layer and an L one
    assert model.config.n_embd // model.config.n_head == 128 and model.config.n_head == 2 * model.config.n_kv_head
    assert twin("nag", "none").model.branch_fn is fused_nag_branch  # the update a CUDA run takes (nag/kernels.py)


# ---------------------------------------------------------------------------
# the twin can fail


def test_a_cpu_tensor_in_the_forward_is_caught(monkeypatch):
    forward = gpt.MLP.forward
    monkeypatch.setattr(gpt.MLP, "forward", lambda self, x: forward(self, x) + torch.zeros(x.size(-1)))  # no device
    with pytest.raises(RuntimeError, match="found at least two devices, cuda:0 and cpu"):
        twin_step("gpt", "none", "sdpa", False, monkeypatch)


def test_a_cpu_index_in_the_forward_is_caught(monkeypatch):
    """CUDA (and FakeTensorMode) index a CUDA tensor with a CPU index, copying it over at every call: the step's
    audit of CPU work names it."""
    forward = gpt.MLP.forward
    monkeypatch.setattr(gpt.MLP, "forward", lambda self, x: forward(self, x)[..., torch.arange(x.size(-1))])
    trace = twin_step("gpt", "none", "sdpa", False, monkeypatch)
    assert trace.work.cpu and all("arange" in op for op in trace.work.cpu), trace.work.cpu


@pytest.mark.parametrize("read", ["item", "tolist", "bool"])
def test_a_host_read_in_the_optimizer_step_is_caught(read, monkeypatch):
    step = MuonAdamW.step

    def reading(self, gate=None):
        {"item": lambda: gate.item(), "tolist": lambda: gate.tolist(), "bool": lambda: bool(gate)}[read]()
        return step(self, gate)

    monkeypatch.setattr(MuonAdamW, "step", reading)
    with pytest.raises(DataDependentOutputException):
        twin_step("nag", "none", "fa4", False, monkeypatch)


def test_unpadded_tokens_in_the_fp8_backward_are_caught(monkeypatch):
    """MLP MoD packs N = B·capacity tokens, here B·205 = 410 (a capacity below 256 rounds to 8s, so B·capacity can miss
    16); without fp8.py's zero rows dW = dyᵀ·x has 410 as its inner dim, which CUDA's _scaled_mm refuses (the bug of
    docs/design.md §2, "fp8 training")."""
    monkeypatch.setattr(fp8, "pad_rows", lambda t: t)
    monkeypatch.setattr(mod_lib, "capacity", lambda T, rate: 205)
    with pytest.raises(RuntimeError, match="divisible by 16"):
        twin_step("nag", "mlp", "sdpa", True, monkeypatch)


def test_scaled_mm_with_an_inner_dim_of_500_is_refused():
    with FakeTensorMode(), guard_free():
        s = torch.empty((), device=CUDA)
        dy, x = torch.empty(256, 500, dtype=fp8.E5M2, device=CUDA), torch.empty(128, 500, dtype=fp8.E4M3, device=CUDA)
        with pytest.raises(RuntimeError, match="divisible by 16"):
            torch._scaled_mm(dy, x.t(), scale_a=s, scale_b=s, out_dtype=torch.bfloat16)
        torch._scaled_mm(dy[:, :496], x[:, :496].t(), scale_a=s, scale_b=s, out_dtype=torch.bfloat16)  # 496 = 31·16


def test_the_flash_stand_ins_refuse_what_the_kernels_refuse():
    with FakeTensorMode(), guard_free():
        q, k = (torch.empty(2, 64, h, 128, dtype=torch.bfloat16, device=CUDA) for h in (4, 2))
        fa4, fa3 = FlashStandIn("fa4"), FlashStandIn("fa3")
        out, lse = fa4.flash_attn_func(q, k, k, causal=True, window_size=(None, 0))
        assert out.shape == q.shape and lse is None  # no gradient asked for: no log-sum-exp
        assert fa3.flash_attn_func(q, k, k, causal=True, window_size=(31, 0)).shape == q.shape
        for bad in [
            lambda: fa4.flash_attn_func(q, k, k, causal=True, window_size=(-1, 0)),  # -1 is a bound to FA4
            lambda: fa3.flash_attn_func(q, k, k, causal=True, window_size=(None, 0)),  # FA3's op takes ints
            lambda: fa3.flash_attn_func(q.float(), k.float(), k.float(), causal=True),  # fp32
            # 3 KV heads for 4 query heads
            lambda: fa4.flash_attn_func(q, q[:, :, :3], q[:, :, :3], causal=True),
            lambda: fa4.flash_attn_func(q, k.cpu(), k.cpu(), causal=True),
        ]:
            with pytest.raises(AssertionError):
                bad()
        with pytest.raises(TypeError):
            fa4.flash_attn_func(q, k, k, causal=True, window=(None, 0))  # not its signature
        # (B, H, T, D) by mistake is a legal call to the kernel (4 positions of 64 heads against 2): the matrix's own
        # check of the recorded shapes, (B, T, H, D) of the model, is what catches it
        fa4.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), causal=True)
        assert fa4.calls[-1][:2] == ((2, 4, 64, 128), (2, 2, 64, 128))


def test_guard_free_indexing_is_python_indexing():
    """The routes, applied to CPU tensors with values, give what Python's indexing gives."""
    x = torch.arange(2 * 3 * 4 * 5.0).reshape(2, 3, 4, 5)
    rows = torch.tensor([1, 0])
    for idx in [
        1,
        (slice(None), 2),
        (..., 1),
        (None, 0, ..., slice(1, 4, 2)),
        (slice(None), rows),
        (0, slice(None), rows),
        (rows, slice(None), rows),
        (x[:, :, :, 0] > 10,),
        (slice(None), None, slice(0, 2)),
    ]:
        assert torch.equal(getitem(x, idx), x[idx]), idx
        y, z = x.clone(), x.clone()
        setitem(y, idx, -1.0)
        z[idx] = -1.0
        assert torch.equal(y, z), idx
    assert to(x, torch.bfloat16).dtype == torch.bfloat16 and to(x, "cpu") is x
    assert torch.equal(contiguous(x.transpose(0, 1)), x.transpose(0, 1).contiguous())
    before = {name: torch.Tensor.__dict__.get(name) for name in ROUTES}
    with guard_free():
        assert torch.Tensor.__getitem__ is not torch._C.TensorBase.__getitem__
    assert {name: torch.Tensor.__dict__.get(name) for name in ROUTES} == before  # torch's own methods back
