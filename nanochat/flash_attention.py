"""
The attention kernel: the one place that chooses it and calls it.

docs/design.md §2, "The attention kernel", explains the choice.

    --attn auto   Hopper (compute capability 9.x, bf16): SDPA and each fast kernel that loads and passes its probe
                  are timed at the run's shapes, and the fastest trains (within TIE of it, the simplest: KERNELS'
                  order); no fast kernel passes: SDPA with a warning; anywhere else SDPA
    --attn fa4    FlashAttention-4 from PyPI (pip install flash-attn-4: CuTe-DSL kernels, JIT-compiled on the node)
    --attn cudnn  SDPA's cuDNN backend, bundled with every CUDA build of torch
    --attn fa3    FlashAttention-3 prebuilt for sm_90 on the Hugging Face hub (pip install kernels; needs the hub or
                  its cache at run time)
    --attn sdpa   PyTorch SDPA's default backends

    shapes = attention_shapes(model)  # the run's head dim, query and kv heads, each window: what the probe runs
    attention = agree_attention("auto", device, dtype, is_ddp, shapes=shapes)  # rank 0 decides, every rank loads it
    model.set_attention(attention["kernel"])  # once, before torch.compile (base_train)

Windows count positions. A layer of window w lets a query see itself and the w - 1 positions before it (the
masks' `delta < w` in nanochat/gpt.py). FA3's and FA4's window_size=(left, right) count keys on each side, both
ends included, so w becomes (w - 1, 0). A window that covers the whole row is plain causal: FA3 writes "no limit"
as -1, FA4 as None (FA4 would take -1 as a bound). On CUDA the other kernels run an S window through
flex_attention with a block mask (no (T, T) mask; compiled); on the CPU, the reference, SDPA gets the dense mask.
A block mask is built once per (row length, window, device) and kept (sliding_block_mask); GPT.set_attention builds
the model's own before torch.compile, so the compiled graph reads it instead of building one each forward.
Queries gathered from a row at scattered positions (routed_attention) run flex_attention on CUDA with a block
mask built from their positions in the graph, SDPA with a mask from them on the CPU. Packed rows with several
documents (CORE) and the KV cache keep explicit masks and SDPA.
"""

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from nanochat.common import UserError, print0
from nanochat.distributed import rank0_decides
from nanochat.step_timer import call_ms

CHOICES = ("auto", "fa4", "cudnn", "fa3", "sdpa")
# what a model can be set to, simplest first: SDPA's default and its cuDNN backend (both in torch), FA4 (a package),
# FA3 (the hub's, at run time); `auto` times the fast ones against SDPA, and a tie goes to the simpler
KERNELS = ("sdpa", "cudnn", "fa4", "fa3")
FAST = KERNELS[1:]
TIE = 0.03  # kernels within 3 % of the fastest tie: run-to-run noise, not speed
TIME_TOKENS = 16 * 2048  # auto times each kernel on this many tokens of the run's rows (the published micro-batch)
FAST_DTYPES = (torch.bfloat16,)  # the fast kernels' training dtype; our compute dtype on every SM80+ GPU
FA3_REPO = "varunneal/flash-attention-3"  # the hub repo nanochat loads: FA3 prebuilt for sm_90
FA4_PACKAGE = "flash-attn-4"  # PyPI; imported as flash_attn.cute
MAJORS = {"fa3": (9,), "fa4": (9, 10), "cudnn": (8, 9, 10, 11, 12)}  # compute capabilities each has code for
LOADED = {"fa4": f"{FA4_PACKAGE} loaded", "cudnn": "cuDNN attention runs", "fa3": f"{FA3_REPO} loaded from the hub"}
WHEN = {
    "fa4": f"if {FA4_PACKAGE} loads",
    "cudnn": "if cuDNN attention runs",
    "fa3": f"if {FA3_REPO} loads (the hub or its cache)",
}
CUDNN_FIRST = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]  # flash only where cuDNN declines a call
PROBE_TOL = 0.05  # a probe's largest error against fp32, relative to the reference's largest value: bf16 is ~0.01
PROBE_LEN = 512  # the probe's longest row (tokens): a longer run's row is probed this short, its S windows scaled along

_fa3 = None  # the loaded kernels' flash_attn_func owners, once per process
_fa4 = None
_probed = set()  # (kernel, device[, shapes]) that passed the probe


class KernelUnavailable(Exception):
    """Why a kernel did not load or run, in a few words."""


def first_line(e):
    return f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0][:160]


def load_fa3():
    """The FA3 interface, loaded on the first call. Raises KernelUnavailable with a short reason."""
    global _fa3
    if _fa3 is None:
        try:
            from kernels import get_kernel  # the optional extra: imported here and nowhere else
        except ImportError:
            raise KernelUnavailable("the kernels package is not installed (pip install kernels)") from None
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        try:
            _fa3 = get_kernel(FA3_REPO).flash_attn_interface
        except Exception as e:  # no network and no cached copy, a build that does not match this torch, ...
            raise KernelUnavailable(f"{FA3_REPO} did not load ({first_line(e)})") from None
    return _fa3


def load_fa4():
    """FA4's flash_attn_func, imported on the first call. torch.compile does not trace it (a graph break per call):
    its kernels are compiled by CuTe DSL on first use, which dynamo cannot follow."""
    global _fa4
    if _fa4 is None:
        try:
            from flash_attn.cute import flash_attn_func  # the gpu extra: imported here and nowhere else
        except ImportError as e:
            if getattr(e, "name", None) in ("flash_attn", "flash_attn.cute"):
                raise KernelUnavailable(f"{FA4_PACKAGE} is not installed (pip install {FA4_PACKAGE})") from None
            raise KernelUnavailable(f"{FA4_PACKAGE} did not import ({first_line(e)})") from None
        except Exception as e:  # a CUDA library or driver it cannot use
            raise KernelUnavailable(f"{FA4_PACKAGE} did not import ({first_line(e)})") from None
        _fa4 = torch.compiler.disable(flash_attn_func)
    return _fa4


def load_kernel(kernel):
    """Load a kernel's interface once per process (cuDNN and SDPA come with torch: nothing to load)."""
    if kernel == "fa3":
        load_fa3()
    elif kernel == "fa4":
        load_fa4()


@dataclass(frozen=True)
class AttentionShapes:
    """The attention a run trains, as a kernel sees it: head dim, query heads and kv heads (GQA when fewer), the row
    length, and each distinct window in tokens (the row length: an L layer, plain causal; shorter: an S layer)."""

    head_dim: int
    n_head: int
    n_kv_head: int
    seq_len: int
    windows: tuple  # distinct, longest first

    def cases(self):
        """One probe per window: {head_dim, n_head, n_kv_head, seq_len, window, probe_len, probe_window}. The row is
        at most PROBE_LEN tokens; an S window keeps its share of the row (1024 of 2048 → 256 of 512), so it still
        cuts the row and the kernel's windowed code runs (FA3/FA4 build it apart); an L window covers the row."""
        T = min(self.seq_len, PROBE_LEN)
        return [
            dict(
                head_dim=self.head_dim,
                n_head=self.n_head,
                n_kv_head=self.n_kv_head,
                seq_len=self.seq_len,
                window=w,
                probe_len=T,
                probe_window=T if w >= self.seq_len else max(1, w * T // self.seq_len),
            )
            for w in self.windows
        ]


# used when no run's shapes are given
GENERIC_SHAPES = AttentionShapes(head_dim=64, n_head=2, n_kv_head=2, seq_len=128, windows=(128,))


def attention_shapes(model):
    """AttentionShapes of a model (built on any device, meta included): its first block's attention, its windows."""
    attn, T = model.blocks[0].attn, model.config.sequence_len
    return AttentionShapes(
        attn.head_dim, attn.n_head, attn.n_kv_head, T, tuple(sorted({min(w, T) for w in model.windows}, reverse=True))
    )


def describe(case):
    """A probe case in words: 'head dim 128, 12 heads / 4 kv heads, S window 1024 of 2048'."""
    w, T = case["window"], case["seq_len"]
    return f"head dim {case['head_dim']}, {case['n_head']} heads / {case['n_kv_head']} kv heads, " + (
        f"L window {w}" if w >= T else f"S window {w} of {T}"
    )


def probe(kernel, device, shapes=None):
    """Forward + backward of `kernel`, as training calls it, against fp32 SDPA with the dense mask, once per window of
    the run (shapes: AttentionShapes; None: a generic 1 × 128 row, 2 heads × 64, causal). A kernel that loads but
    cannot run the run's shapes on this GPU (or computes something else) is caught here, once, not at the first
    training step. Returns the cases with ok=True; raises KernelUnavailable naming the first case that failed."""
    cases = (shapes or GENERIC_SHAPES).cases()
    key = (kernel, str(device)) if shapes is None else (kernel, str(device), shapes)
    if key not in _probed:
        for case in cases:
            at = "" if shapes is None else f" at {describe(case)}"
            T, w = case["probe_len"], case["probe_window"]
            g = torch.Generator().manual_seed(0)
            q, k, v, dy = (
                torch.randn(1, T, h, case["head_dim"], generator=g)
                for h in (case["n_head"], case["n_kv_head"], case["n_kv_head"], case["n_head"])
            )
            # cudnn: its L layers run SDPA with cuDNN first; the probe runs cuDNN alone. Its S layers, like every other
            # kernel's call, run what training runs (on CUDA, flex_attention)
            call = cudnn_only if kernel == "cudnn" and w >= T else (lambda *x: causal_attention(*x, w, kernel))
            try:
                q, k, v, dy = (t.to(device) for t in (q, k, v, dy))
                got = grads(call, (q, k, v), dy, torch.bfloat16)
            except Exception as e:
                raise KernelUnavailable(f"{kernel} failed its probe{at} ({first_line(e)})") from None
            want = grads(lambda *x: dense_attention(*x, w), (q, k, v), dy, torch.float32)
            err = max(((a.float() - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want))
            if not err <= PROBE_TOL:
                raise KernelUnavailable(f"{kernel} failed its probe{at} (relative error {err:.2g} against fp32)")
        _probed.add(key)
    return [dict(case, ok=True) for case in cases]


def dense_attention(q, k, v, window):
    """The reference: SDPA with the dense window mask (none for a full row). q (B, T, H, D); k, v (B, T, KV, D)."""
    T = q.size(1)
    mask = None if window >= T else window_mask(T, window, q.device)
    return masked_attention(*(t.transpose(1, 2) for t in (q, k, v)), mask).transpose(1, 2)


def cudnn_only(q, k, v):
    """The probe's cuDNN call: cuDNN alone, no other backend to fall back on, so a call cuDNN declines (a head dim,
    GQA) raises instead of passing on flash's behalf: the record never names a kernel that did not run."""
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return masked_attention(*(t.transpose(1, 2) for t in (q, k, v)), None).transpose(1, 2)


def grads(fn, inputs, dy, dtype):
    """fn's output and input gradients, on copies of inputs in dtype."""
    xs = [x.detach().to(dtype).requires_grad_() for x in inputs]
    y = fn(*xs)
    y.backward(dy.to(dtype))
    return [y.detach()] + [x.grad for x in xs]


def is_hopper(device):
    device = torch.device(device)
    return torch.cuda.is_available() and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def device_unfit(device, dtype=None, majors=(9,)):
    """Why no fast kernel runs on `device` in `dtype` (no CUDA, another device or compute capability, another
    dtype), or None."""
    device = torch.device(device)
    if not torch.cuda.is_available():
        return "no CUDA"
    if device.type != "cuda":
        return f"device {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in majors:
        return f"compute capability {major}.{minor}"
    if dtype is not None and dtype not in FAST_DTYPES:
        return f"compute dtype {str(dtype).replace('torch.', '')}"
    return None


def kernel_unavailable(kernel, device, dtype=None, shapes=None):
    """Why `kernel` cannot run on `device` in `dtype` at the run's attention shapes (AttentionShapes; None: the
    generic probe), or None when it can (it is then loaded and probed)."""
    if kernel == "sdpa":
        return None
    why = device_unfit(device, dtype, MAJORS[kernel])
    if why is not None:
        return why
    try:
        load_kernel(kernel)
        if shapes is None:  # the generic probe: probe's two-argument call, as before shapes existed
            probe(kernel, torch.device(device))
        else:
            probe(kernel, torch.device(device), shapes)
    except KernelUnavailable as e:
        return str(e)
    return None


def kernel_ms(kernel, device, shapes=None, tokens=TIME_TOKENS):
    """Milliseconds of one forward + backward of `kernel` as training calls it, at the run's shapes (AttentionShapes;
    None: the generic probe's) in bf16, on rows of the run's length, `tokens` tokens in all, summed over the run's
    windows (each distinct one once): call_ms's median, the inputs' grads set to None before each call, so that no
    gradient accumulation is timed."""
    s = shapes or GENERIC_SHAPES
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, dy = (
        torch.randn(max(1, tokens // s.seq_len), s.seq_len, h, s.head_dim, generator=g, device=device)
        .to(FAST_DTYPES[0])
        for h in (s.n_head, s.n_kv_head, s.n_kv_head, s.n_head)
    )
    xs = [t.requires_grad_() for t in (q, k, v)]

    def zero_grads():
        for x in xs:
            x.grad = None

    return sum(
        call_ms(lambda: causal_attention(q, k, v, w, kernel).backward(dy), device, setup=zero_grads)
        for w in s.windows
    )


def fastest(times):
    """The kernel to train with of times {kernel: ms}: the simplest (KERNELS' order) within TIE of the fastest."""
    best = min(times.values())
    return next(k for k in KERNELS if k in times and times[k] <= (1 + TIE) * best)


def timing_reason(kernel, times):
    """Why auto chose `kernel` from times {kernel: ms}, with every time, fastest first."""
    order = sorted(times, key=times.get)
    why = "the fastest" if kernel == order[0] else f"within {100 * TIE:.0f}% of the fastest, and simpler"
    ms = ", ".join(f"{k} {times[k]:.3g} ms" for k in order)
    return f"Hopper GPU, {kernel} {why} (forward + backward: {ms})"


def choose_kernel(requested, device, dtype=None, shapes=None):
    """(kernel, reason, passed_over, timed) for --attn: one of KERNELS, why, the "kernel: why" of each fast kernel
    `auto` could not use, and the milliseconds auto timed ({kernel: ms}; empty where it timed no fast kernel, so
    SDPA is a fallback). "auto" never raises; a named kernel where it cannot run is a one-line UserError."""
    if requested not in CHOICES:
        raise UserError(f"--attn must be one of {', '.join(CHOICES)} (got {requested!r})")
    if requested == "sdpa":
        return "sdpa", "--attn sdpa", [], {}
    if requested != "auto":
        why = kernel_unavailable(requested, device, dtype, shapes=shapes)
        if why is not None:
            raise UserError(f"--attn {requested} cannot run here: {why}; --attn auto picks what can")
        return requested, LOADED[requested], [], {}
    why = device_unfit(device, dtype)
    if why is not None:
        return "sdpa", why, [], {}
    whys, passed = [], []
    for kernel in FAST:
        why = kernel_unavailable(kernel, device, dtype, shapes=shapes)
        if why is None:
            passed.append(kernel)
        else:
            whys.append(f"{kernel}: {why}")
    if not passed:
        return "sdpa", "; ".join(whys), whys, {}
    timed = {}
    for kernel in ["sdpa"] + passed:
        try:
            timed[kernel] = kernel_ms(kernel, device, shapes)
        except Exception as e:  # out of memory at the run's size, a kernel that fails past the probe's shape
            whys.append(f"{kernel}: its timing failed ({first_line(e)})")
    if not set(timed) - {"sdpa"}:
        return "sdpa", "; ".join(whys), whys, {}
    kernel = fastest(timed)
    return kernel, timing_reason(kernel, timed), whys, timed


def resolve_attention(requested, device, dtype=None, shapes=None):
    """(kernel, reason) for --attn (choose_kernel without what auto passed over and timed)."""
    return choose_kernel(requested, device, dtype, shapes)[:2]


def fallback_warning(requested, kernel, reason, hopper):
    """The warning of `--attn auto` that ends on plain SDPA on a Hopper GPU by default, no fast kernel timed (hopper:
    on a Hopper GPU and auto timed none; SDPA that won the timing is no fallback); None otherwise."""
    if requested == "auto" and kernel == "sdpa" and hopper:
        return (
            f"--attn auto fell back to SDPA on a Hopper GPU ({reason}); attention runs slower than it could: "
            f"pip install {FA4_PACKAGE} (runs/setup_env.sh does on GPU nodes), or pass --attn sdpa to mean it"
        )
    return None


def check_preset_attention(requested, kernel, hopper, gpu_preset, reason=""):
    """A GPU preset (one marked "gpu" by its caller) on a Hopper GPU trains with the fastest kernel there is: SDPA
    only when --attn sdpa says so or auto timed it fastest (hopper: as fallback_warning's), since the preset's
    published time and cost assume a fast one."""
    if gpu_preset and hopper and kernel == "sdpa" and requested != "sdpa":
        raise UserError(
            f"--preset {gpu_preset} on a Hopper GPU needs a fast attention kernel, but --attn {requested} found "
            f"none ({reason}); pip install {FA4_PACKAGE}, or pass --attn sdpa to train with SDPA anyway"
        )


def agree_attention(requested, device, dtype, is_ddp, gpu_preset="", shapes=None):
    """The run's attention record {requested, kernel, reason[, passed_over][, timed_ms][, probed][, warning]}: rank 0
    resolves
    --attn (and applies the preset rule), every rank loads and probes that kernel on its own GPU, at the run's
    shapes. If any rank cannot, every rank stops with one UserError naming those ranks: no rank trains with another
    kernel than the one recorded. gpu_preset: the name of a GPU preset (--preset), else "". shapes: the run's
    AttentionShapes (attention_shapes(model)); None probes a generic shape. passed_over: the fast kernels auto could
    not use, and why; timed_ms: what auto timed, {kernel: ms}; probed: the chosen fast kernel's probe cases
    (AttentionShapes.cases), each passed."""

    def decide():
        kernel, reason, passed_over, timed = choose_kernel(requested, device, dtype, shapes)
        fell_back = is_hopper(device) and not timed  # SDPA that won auto's timing is no fallback
        check_preset_attention(requested, kernel, fell_back, gpu_preset, reason)
        record = {"requested": requested, "kernel": kernel, "reason": reason}
        if passed_over and timed:  # on a fallback, the reason lists them
            record["passed_over"] = passed_over
        if timed:
            record["timed_ms"] = timed
        if shapes is not None and kernel != "sdpa":  # it passed every case (SDPA is not probed)
            record["probed"] = [dict(case, ok=True) for case in shapes.cases()]
        warning = fallback_warning(requested, kernel, reason, fell_back)
        if warning:
            record["warning"] = warning
        return record

    record = rank0_decides(decide, is_ddp)
    if is_ddp:
        why = None if dist.get_rank() == 0 else kernel_unavailable(record["kernel"], device, dtype, shapes=shapes)
        views = [None] * dist.get_world_size()
        dist.all_gather_object(views, (why, socket.gethostname()))
        failed = [f"{r} ({host}: {w})" for r, (w, host) in enumerate(views) if w is not None]
        if failed:
            raise UserError(
                f"attention: rank 0 chose {record['kernel']} ({record['reason']}), but rank(s) {'; '.join(failed)} "
                f"cannot run it; install it on every node, or pass --attn sdpa"
            )
    if "warning" in record:
        print0(f"warning: {record['warning']}")
    return record


def expected_attention(requested, gpu_preset=""):
    """What --attn will resolve to, said without a GPU (the dry run): {requested, order, expects}."""
    if requested == "sdpa":
        order, text = ["sdpa"], "--attn sdpa → sdpa everywhere"
    elif requested == "auto":
        order = list(KERNELS)
        text = (
            "--attn auto → on a Hopper GPU (bf16) the fastest of sdpa, "
            + ", ".join(f"{k} {WHEN[k]}" for k in FAST)
            + f", timed at the run's shapes (within {100 * TIE:.0f}%, the first of {', '.join(KERNELS)}); sdpa with "
            "a warning when no fast kernel passes its probe; sdpa elsewhere (CPU, other GPUs)"
        )
    else:
        order, text = (
            [requested],
            f"--attn {requested} → {requested} {WHEN[requested]}, else the run stops with one line",
        )
    if gpu_preset and requested == "auto":
        text += f"; --preset {gpu_preset} refuses that fallback on Hopper unless --attn sdpa"
    return {"requested": requested, "order": order, "expects": text}


def window_mask(T, window, device):
    """(T, T) bool: query i sees key j when 0 <= i - j < window."""
    delta = torch.arange(T, device=device)[:, None] - torch.arange(T, device=device)[None]
    return (delta >= 0) & (delta < window)


def flex_windows(device):
    """Whether S windows on `device` run through flex_attention with a block mask (CUDA) rather than SDPA with the
    dense mask (the CPU: flex_attention has no backward there)."""
    return torch.device(device).type == "cuda"


def mask_free(kernel, device):
    """Whether plain rows of `kernel` on `device` need no mask from the model: the kernel takes the window itself
    (FA3, FA4), or, on CUDA, flex_attention does. The CPU keeps SDPA with the dense masks."""
    return kernel in ("fa3", "fa4") or flex_windows(device)


def causal_attention(q, k, v, window, kernel="sdpa"):
    """Attention over a plain row: each query sees itself and the window - 1 positions before it.
    q (B, T, H, D); k, v (B, T, KV, D) with KV dividing H (GQA). Returns (B, T, H, D)."""
    T = q.size(1)
    full = window >= T
    if kernel in ("fa3", "fa4") and q.dtype in FAST_DTYPES:  # any other dtype falls back to SDPA: same math
        if kernel == "fa3":
            y = _fa3.flash_attn_func(q, k, v, causal=True, window_size=(-1 if full else window - 1, 0))
        else:
            y = _fa4(q, k, v, causal=True, window_size=(None if full else window - 1, 0))
        return y[0] if isinstance(y, tuple) else y  # some builds also return the log-sum-exp
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if not full and flex_windows(q.device):
        y = sliding_window_attention(q, k, v, window)
    elif full and kernel == "cudnn" and q.dtype in FAST_DTYPES:
        with sdpa_kernel(CUDNN_FIRST, set_priority=True):
            y = masked_attention(q, k, v, None)
    else:
        y = masked_attention(q, k, v, None if full else window_mask(T, window, q.device))
    return y.transpose(1, 2)


_flex_compiled = None


def flex():
    """flex_attention compiled once per process: uncompiled it would build the whole score matrix. Inside a graph
    being compiled, the op itself: the graph compiles it, and torch.compile cannot be called while tracing."""
    global _flex_compiled
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling():
        return flex_attention
    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    return _flex_compiled


_block_masks = {}  # (T, window, device, block) -> BlockMask: built once each, outside any compiled graph


def sliding_block_mask(T, window, device, block=128):
    """flex_attention's BlockMask of the causal window: query blocks skip the key blocks no query of theirs sees.
    Built on the first call for (T, window, device, block) and kept: building one costs more than the attention it
    serves (eager, it evaluates the window on every (query, key) pair). Inside a graph torch.compile is tracing, a
    kept mask is read as the graph's input; one not kept yet is built in the graph and not kept (a mask kept during
    tracing would make the next call recompile), nor is one of fake tensors (FakeTensorMode has no values)."""
    key = (T, window, str(torch.device(device)), block)
    if key in _block_masks:
        return _block_masks[key]
    from torch.nn.attention.flex_attention import create_block_mask
    from torch._subclasses.fake_tensor import is_fake

    def within(b, h, i, j):
        return (i >= j) & (i - j < window)

    mask = create_block_mask(within, None, None, T, T, device=device, BLOCK_SIZE=block)
    if not torch.compiler.is_compiling() and not is_fake(mask.kv_num_blocks):
        _block_masks[key] = mask
    return mask


def prepare_windows(T, windows, device):
    """Build the block masks of a model's S windows (those shorter than its rows of T) where flex_attention runs them,
    so that torch.compile, which comes after (GPT.set_attention), finds them built."""
    if flex_windows(device):
        for w in sorted(set(windows)):
            if w < T:
                sliding_block_mask(T, w, device)


def sliding_window_attention(q, k, v, window, block=128):
    """q (B, H, T, D); k, v (B, KV, T, D): causal attention within `window` positions, without a (T, T) mask."""
    mask = sliding_block_mask(q.size(2), window, q.device, block)
    return flex()(q, k, v, block_mask=mask, enable_gqa=k.size(1) != q.size(1))


def routed_mask(q_positions, Tk, window):
    """(B, 1, Tq, Tk) bool: the query at position p (q_positions (B, Tq)) sees key j when p - window < j <= p."""
    delta = q_positions[:, None, :, None] - torch.arange(Tk, device=q_positions.device)
    return (delta >= 0) & (delta < window)


def routed_block_mask(q_positions, Tk, window, block=128):
    """flex_attention's BlockMask of queries at q_positions (B, Tq) over keys 0..Tk-1 (routed_mask's rule): built on
    the device from the positions, no host read. The positions change every call, so nothing is kept. A Tq that is no
    multiple of `block` leaves its last query block part empty; flex_attention bounds the indices of that tail."""
    from torch.nn.attention.flex_attention import create_block_mask

    def visible(b, h, i, j):
        delta = q_positions[b, i] - j
        return (delta >= 0) & (delta < window)

    B, Tq = q_positions.shape
    return create_block_mask(visible, B, None, Tq, Tk, device=q_positions.device, BLOCK_SIZE=block)


_routed_block_mask_compiled = None


def routed_block_mask_builder(q_positions):
    """What builds a routed block mask: compiled once per process, so that the (B, Tq, Tk) pairs are reduced to blocks
    as they are made and never stored (eager, create_block_mask writes the whole mask first); inside a graph being
    traced, or on fake tensors (no values to compile with), routed_block_mask itself."""
    from torch._subclasses.fake_tensor import is_fake

    global _routed_block_mask_compiled
    if torch.compiler.is_compiling() or is_fake(q_positions):
        return routed_block_mask
    if _routed_block_mask_compiled is None:
        _routed_block_mask_compiled = torch.compile(routed_block_mask, dynamic=False)
    return _routed_block_mask_compiled


def routed_attention(q, k, v, q_positions, window):
    """Attention of queries gathered from a row at given positions: q (B, H, Tq, D), the queries at q_positions
    (B, Tq) long, ascending and distinct in each row; k, v (B, KV, Tk, D), keys at positions 0..Tk-1, KV dividing H.
    The query at position p sees key j when p - window < j <= p (window >= Tk: plain causal). Returns (B, H, Tq, D)
    in q's dtype. Static shapes and no host read: the mask comes from the positions, on the device. On CUDA,
    flex_attention with a block mask (query blocks skip the key blocks none of their queries sees); on the CPU, where
    flex_attention has no backward and its forward is slower than SDPA's, eager or compiled, SDPA with routed_mask."""
    if flex_windows(q.device):
        mask = routed_block_mask_builder(q_positions)(q_positions, k.size(2), window)
        return flex()(q, k, v, block_mask=mask, enable_gqa=k.size(1) != q.size(1))
    return masked_attention(q, k, v, routed_mask(q_positions, k.size(2), window))


def masked_attention(q, k, v, mask):
    """SDPA: q (B, H, Tq, D); k, v (B, KV, Tk, D). mask: a bool mask of the keys each query sees (broadcast to
    (B, H, Tq, Tk)), or None for plain causal attention (Tq == Tk: is_causal aligns queries with the first keys)."""
    gqa = k.size(1) != q.size(1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
