"""
fp8 training of the linear layers: tensorwise dynamic scaling around torch._scaled_mm (scaled_mm).

docs/design.md §2, "fp8", explains the design.

    model.set_fp8(True)    # base_train --fp8: every Linear the size rule admits runs its three matmuls in fp8
    fp8_linear(x, weight)  # x @ weight.T; x and dy quantised at each call, a weight once per value it takes

A linear layer makes three matmuls per step: y = x·Wᵀ forward, and dx = dy·W, dW = dyᵀ·x backward. Each operand
is scaled by one number (the tensor's largest |value| mapped to the format's largest finite value), cast to fp8, and
the scaled matmul multiplies the inverse scales back in. Inputs and weights use float8_e4m3fn (3 mantissa bits,
range ±448), gradients float8_e5m2 (2 mantissa bits, range ±57,344: gradients span more decades). The fp32 master
weights and the optimizer are untouched; only the matmuls change. Facts from nanochat's nanochat/fp8.py (tensorwise
scaling, e4m3 / e5m2, fast accumulation in the forward only, dims in multiples of 16); the code is this project's.

Compiled, the quantisation is Inductor's: dynamo keeps FP8Matmul as one node, AOTAutograd traces its forward and
backward into aten ops, and Inductor fuses each operand's amax, scale and cast with the ops around them (a few
kernels, no graph break). Eager, a weight is quantised once until it changes (quantised_weight), not at each of a
step's micro-batches.

Only training runs in fp8 (the layer's `training` flag): evaluation, sampling and export stay in the compute dtype,
as nanochat evaluates. FLOPs and MFU are counted as for bf16 (its peak), so an fp8 run's MFU shows its speed-up.
"""

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MIN_DIM = 128  # a smaller matmul gains less from fp8 than its scaling passes cost (gates and routers of a few channels)
MULTIPLE = 16  # CUDA _scaled_mm's rule for the inner dim and the second operand's (admits; pad_rows for the tokens)
MIN_CAPABILITY = (8, 9)  # CUDA: fp8 tensor cores from Ada and Hopper on


def admits(in_features, out_features):
    """The size rule: which Linear layers run in fp8 (the others stay in the compute dtype)."""
    return all(d >= MIN_DIM and d % MULTIPLE == 0 for d in (in_features, out_features))


def cannot_run(device):
    """Why fp8 training cannot run on `device`, or None. Every CPU runs it (scaled_mm: the twin of the tests)."""
    device = torch.device(device)
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"device {device.type} has no fp8 matmul"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return (
            f"compute capability {capability[0]}.{capability[1]} has no fp8 tensor cores "
            "(needs 8.9: Ada, Hopper or newer)"
        )
    return None


def scaled_mm(a, b, scale_a, scale_b, out_dtype, use_fast_accum=False):
    """a·b times both inverse scales, in out_dtype: torch._scaled_mm on a GPU. On a CPU the same product is written
    out in fp32 (fp8 values and their pairwise products are exact there; only the order of the sums is the
    machine's): torch would hand a CPU with AMX to oneDNN, whose fp8 matmul needs AVX512-FP16 (none below it, e.g.
    under ONEDNN_MAX_CPU_ISA=AVX2) and ran ~400× slower than this on the developers' box (docs/LOG.md, 2026-12-04)."""
    if a.device.type == "cpu":
        return ((a.float() @ b.float()) * (scale_a * scale_b)).to(out_dtype)
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=use_fast_accum)


@torch.no_grad()
def quantise(t, dtype):
    """(t scaled into dtype's range and cast, the inverse scale): one scale for the whole tensor."""
    top = torch.finfo(dtype).max
    # max |t| in one pass over t in its own dtype (exact there), not three over an fp32 copy (float, abs, max)
    amax = torch.linalg.vector_norm(t, float("inf"))
    scale = (top / amax.double().clamp(min=1e-12)).float()  # in float64: compiled and eager give the same scale
    return (t.float() * scale).clamp(-top, top).to(dtype), scale.reciprocal()


def quantised_weight(weight):
    """quantise(weight, E4M3), kept on a Parameter until it changes: micro-batches 2..N of a step and their backwards
    reuse the first one's. Every write to a weight (the optimizer's foreach copy, a checkpoint load) bumps its
    _version; a new tensor under .data has another data_ptr. Not under torch.compile: the graph quantises the weight
    itself, fused by Inductor (a cache outside the graph would break it), nor in inference mode (its tensors cannot be
    saved for a later backward), nor for other tensors (fake ones have no data, a plain tensor is no layer's weight)."""
    if torch.compiler.is_compiling() or torch.is_inference_mode_enabled() or type(weight) is not torch.nn.Parameter:
        return quantise(weight, E4M3)
    key = (weight._version, weight.data_ptr())
    cached = getattr(weight, "fp8_cache", None)
    if cached is None or cached[0] != key:
        cached = weight.fp8_cache = (key, *quantise(weight, E4M3))
    return cached[1:]


def pad_rows(t):
    """t with zero rows up to a multiple of 16 (t itself when none are missing: a static shape, no branch on data):
    CUDA's _scaled_mm wants its inner dim so, and dW's is the token count, MoD's B·capacity a multiple of 8 only at
    short rows. Zero rows add exact zeros, keep the amax."""
    missing = -t.size(0) % MULTIPLE
    return torch.nn.functional.pad(t, (0, 0, 0, missing)) if missing else t


def column_major(t):
    """The same 2-D values laid out column by column: _scaled_mm wants its second operand so."""
    return t.t().contiguous().t()


class FP8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        """x (N, in) in the compute dtype, weight (out, in) fp32: x·Wᵀ (N, out) in x's dtype."""
        n = x.size(0)
        xq, x_inv = quantise(pad_rows(x), E4M3)  # padded for dW = dyᵀ·x; y takes the N real rows (M is free)
        wq, w_inv = quantised_weight(weight)
        ctx.save_for_backward(xq, x_inv, wq, w_inv)
        ctx.weight_dtype = weight.dtype
        # wq is (out, in) row-major, so wq.t() is already column-major: no copy
        return scaled_mm(xq[:n], wq.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=x.dtype, use_fast_accum=True)

    @staticmethod
    def backward(ctx, dy):
        xq, x_inv, wq, w_inv = ctx.saved_tensors
        n = dy.size(0)
        dyq, dy_inv = quantise(pad_rows(dy), E5M2)
        # exact accumulation in the backward: the gradients feed the optimizer's statistics
        dx = scaled_mm(
            dyq[:n], column_major(wq), scale_a=dy_inv, scale_b=w_inv, out_dtype=dy.dtype, use_fast_accum=False
        )
        dw = scaled_mm(
            dyq.t().contiguous(),
            column_major(xq),
            scale_a=dy_inv,
            scale_b=x_inv,
            out_dtype=dy.dtype,
            use_fast_accum=False,
        )
        return dx, dw.to(ctx.weight_dtype)


def opaque_to_compile():
    """FP8Matmul as one node for dynamo, which then traces none of its Python (AOTAutograd traces its forward and
    backward into aten ops for Inductor to fuse). GPT.set_fp8(True) calls this, before any compile; not done at
    import, since registering imports torch._dynamo (over a second at every start)."""
    import torch._dynamo

    torch._dynamo.allow_in_graph(FP8Matmul)


def fp8_linear(x, weight):
    """x @ weight.T with fp8 matmuls, for any leading dims of x."""
    lead = x.shape[:-1]
    y = FP8Matmul.apply(x.reshape(-1, x.size(-1)), weight)
    return y.reshape(*lead, y.size(-1))
