"""
What the fused NAG kernels compile to on a Hopper GPU, built ahead of time without a GPU.

What the fused NAG kernels compile to on a Hopper GPU (sm_90: H100, H200), built ahead of time
on any machine: Triton ships ptxas and cuobjdump, so this needs neither a GPU nor a driver.

    python -m scripts.bench.kernel_report --dims 640

For each build (forward and backward kernel × D ∈ {640, 768} × bf16/fp32 × both renorm modes):
registers per thread, spilled bytes (local memory), shared memory, the blocks per SM the registers
allow, and the widths of the global loads and stores. The kernels are memory-bound, so the row
tensors must move as 128-bit accesses; narrower ones cannot approach copy bandwidth.

The builds get the specialisation Triton's JIT gives a real launch (nag.kernels): pointers tagged
16-byte aligned (torch allocations are) and D, C tagged divisible by 16 where they are.
"""

import os

# the kernels must be real JIT functions, not the interpreter's: set before triton is imported
# (nag/__init__.py would otherwise select the interpreter on a machine without a GPU)
os.environ["TRITON_INTERPRET"] = "0"

import re  # noqa: E402
import argparse  # noqa: E402
import tempfile  # noqa: E402
import subprocess  # noqa: E402
from collections import Counter  # noqa: E402

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from nag import kernels  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
REGISTERS_PER_SM, WARPS_PER_SM, BLOCKS_PER_SM = 65536, 64, 32
# pointer arguments that are fp32 whatever the input dtype; every other pointer has the input's dtype
FP32_POINTERS = {
    "log_norm_ptr",
    "new_log_norm_ptr",
    "grad_new_log_norm_ptr",
    "coef_ptr",
    "beta_raw_ptr",
    "alpha_ptr",
    "scale_ptr",
    "part_weights_ptr",
    "part_scalars_ptr",
}


def build(kernel, dim, channels, dtype, renorm):
    """Compile one kernel for sm_90 as nag.kernels would launch it; returns the CompiledKernel."""
    if not isinstance(kernel, triton.runtime.jit.JITFunction):
        raise RuntimeError("Triton was imported in interpreter mode: run this as its own process")
    block_d, block_c, num_warps = kernels._launch_config(dim, channels)
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name.endswith("_ptr"):
            signature[name] = "*fp32" if name in FP32_POINTERS else "*" + dtype
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("D", "C"):
            signature[name] = "i32"
            if (dim if name == "D" else channels) % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "n_rows":
            signature[name] = "i32"
        elif name in ("floor", "sqrt_d"):
            signature[name] = "fp32"
        else:
            signature[name] = "constexpr"
    constexprs = dict(
        BLOCK_D=block_d,
        BLOCK_C=block_c,
        PREDICTED=renorm == "predicted",
        HAS_SCALE=True,
        ORTHO_EPS=kernels.ORTHO_EPS,
        RMS_EPS=kernels.RMS_EPS,
        ROWS_PER_PROGRAM=kernels.BACKWARD_ROWS_PER_PROGRAM,
    )  # the backward's, at a full micro-batch
    constexprs = {k: v for k, v in constexprs.items() if k in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=HOPPER, options={"num_warps": num_warps})


def inspect(compiled):
    """Resources and global-memory access widths of a compiled kernel, read from its cubin."""
    cuobjdump = triton.knobs.nvidia.cuobjdump.path
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run(
            [cuobjdump, "--dump-resource-usage", path], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    num_warps = compiled.metadata.num_warps
    # registers are allocated per warp in units of 256 (8 per thread)
    per_warp = -(-registers // 8) * 8 * 32
    blocks = min(REGISTERS_PER_SM // (per_warp * num_warps), WARPS_PER_SM // num_warps, BLOCKS_PER_SM)
    widths = {"LDG": Counter(), "STG": Counter()}
    for op, modifiers in re.findall(r"\b(LDG|STG)\.E((?:\.[A-Z0-9]+)*)", sass):
        width = next((m for m in ("128", "64", "U16", "U8", "S16", "S8") if "." + m in modifiers), "32")
        widths[op][width] += 1
    static_shared = int(re.search(r"SHARED:(\d+)", usage).group(1))
    return dict(
        registers=registers,
        local=int(re.search(r"LOCAL:(\d+)", usage).group(1)),
        shared=static_shared + compiled.metadata.shared,
        num_warps=num_warps,
        blocks_per_sm=blocks,
        loads=dict(widths["LDG"]),
        stores=dict(widths["STG"]),
    )


def report(dims=(640, 768), dtypes=("bf16", "fp32"), channels=32):
    rows = []
    for kernel in (kernels._nag_forward_kernel, kernels._nag_backward_kernel):
        for dim in dims:
            for dtype in dtypes:
                for renorm in ("measured", "predicted"):
                    info = inspect(build(kernel, dim, channels, dtype, renorm))
                    rows.append(dict(kernel=kernel.__name__, dim=dim, dtype=dtype, renorm=renorm, **info))
    return rows


def accesses(counts):
    return ", ".join(f"{n}×{w}" for w, n in sorted(counts.items(), key=lambda kv: -kv[1])) or "-"


def main():
    parser = argparse.ArgumentParser(
        description="sm_90 builds of the fused NAG kernels: registers, spills, access widths"
    )
    parser.add_argument("--dims", default="640,768", help="comma-separated row widths D")
    args = parser.parse_args()
    dims = [int(d) for d in args.dims.split(",")]
    rows = report(dims)
    print(f"triton {triton.__version__}, target sm_{HOPPER.arch}, C = 32 directions")
    print(
        f"{'kernel':22s} {'D':>4s} {'dtype':5s} {'renorm':9s} {'regs':>4s} {'spill B':>7s} {'smem B':>6s} "
        f"{'warps':>5s} {'blocks/SM':>9s}  loads (count×width)       stores"
    )
    for r in rows:
        print(
            f"{r['kernel']:22s} {r['dim']:4d} {r['dtype']:5s} {r['renorm']:9s} {r['registers']:4d} {r['local']:7d} "
            f"{r['shared']:6d} {r['num_warps']:5d} {r['blocks_per_sm']:9d} "
            f" {accesses(r['loads']):25s} {accesses(r['stores'])}"
        )


if __name__ == "__main__":
    main()
