"""
What the fused NAG kernels compile to on a Hopper GPU, built ahead of time without a GPU.

What the fused NAG kernels compile to on a Hopper GPU (sm_90: H100, H200), built ahead of time
on any machine: Triton ships ptxas and cuobjdump, so this needs neither a GPU nor a driver.

    python -m scripts.bench.kernel_report --dims 640

For each build (forward and backward kernel × D ∈ {640, 768} × bf16/fp32 × both renorm modes, then the
one-program gate kernel): registers per thread, spilled bytes (local memory), shared memory, warps, rows
a tile and the share of its lanes that padding D to a power of two leaves idle, the programs per SM that
registers, warps and shared memory allow, the bytes their loads put in flight per SM, the global bytes a
row moves (loads + stores) and a program moves once, the instructions its warps issue a row (a loop's
body once a tile), the µs a micro-batch of 16 × 2048 rows takes on an H200 to issue those and to move
those bytes at copy speed, and the widths of the global accesses (128: 16 bytes a thread; 128a: the same
copied by cp.async into shared memory, the backward's pipeline).

The kernels are memory-bound at heart and latency-bound in practice: the row tensors must move as
128-bit accesses, and an SM must keep enough bytes in flight to cover the memory latency (Little's law:
an H200's ~4.8 TB/s × ~1 µs over 132 SMs is some 36 KB). The bytes a row moves come from the build's
Triton IR (each load and store, its tile shape with the padded columns counted as masked off): they must
equal scripts/bench/nag.py's branch_op_bytes, the least the op can move.

The builds get the specialisation Triton's JIT gives a real launch (nag.kernels): pointers tagged
16-byte aligned (torch allocations are) and D, C tagged divisible by 16 where they are.
"""

import os

# the kernels must be real JIT functions, not the interpreter's: set before triton is imported
# (nag/__init__.py would otherwise select the interpreter on a machine without a GPU)
os.environ["TRITON_INTERPRET"] = "0"

import re  # noqa: E402
import math  # noqa: E402
import argparse  # noqa: E402
import tempfile  # noqa: E402
import subprocess  # noqa: E402
from collections import Counter  # noqa: E402

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from nag import kernels  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
# an H200 running a micro-batch of the published shape: to turn a row's bytes and instructions into time
ROWS, SMS, ISSUE_PER_SM, CLOCK, COPY = 16 * 2048, 132, 4, 1.98e9, 4.24e12  # issue: warp-instructions a cycle; copy:
# B/s, the first H200's measured copy
REGISTERS_PER_SM, WARPS_PER_SM, BLOCKS_PER_SM = 65536, 64, 32
SHARED_PER_SM, SHARED_RESERVED = 228 * 1024, 1024  # bytes; the driver reserves 1 KB of each block's
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
    "grad_coef_ptr",
    "grad_beta_raw_ptr",
    "grad_alpha_ptr",
}
ELEMENT_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "i32": 4, "i64": 8}


def launch(kernel, dim, channels):
    """(constexprs, num_warps) nag.kernels gives this kernel at a full micro-batch (the backward's default rows
    per program)."""
    if kernel is kernels._nag_gate_grad_kernel:
        block_p, block_c, num_warps = kernels._gate_grad_config(channels)
        return dict(BLOCK_P=block_p, BLOCK_C=block_c), num_warps
    backward = kernel is kernels._nag_backward_kernel
    per_thread = kernels.BACKWARD_PER_THREAD if backward else kernels.FORWARD_PER_THREAD
    block_r, block_d, block_c, num_warps = kernels._launch_config(dim, channels, per_thread)
    constexprs = dict(BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_C=block_c)
    if backward:
        constexprs["BLOCK_R"], constexprs["TILES"] = kernels._backward_tiles(kernels.BACKWARD_ROWS_PER_PROGRAM, block_r)
        constexprs["STAGES"] = kernels.BACKWARD_STAGES
    return constexprs, num_warps


def build(kernel, dim, channels, dtype, renorm):
    """Compile one kernel for sm_90 as nag.kernels would launch it; returns (CompiledKernel, its constexprs)."""
    if not isinstance(kernel, triton.runtime.jit.JITFunction):
        raise RuntimeError("Triton was imported in interpreter mode: run this as its own process")
    constexprs, num_warps = launch(kernel, dim, channels)
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name.endswith("_ptr"):
            signature[name] = "*fp32" if name in FP32_POINTERS else "*" + dtype
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("D", "C"):
            signature[name] = "i32"
            if (dim if name == "D" else channels) % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("n_rows", "n_parts"):
            signature[name] = "i32"
        elif name in ("floor", "sqrt_d"):
            signature[name] = "fp32"
        else:
            signature[name] = "constexpr"
    constexprs.update(
        PREDICTED=renorm == "predicted", HAS_SCALE=True, ORTHO_EPS=kernels.ORTHO_EPS, RMS_EPS=kernels.RMS_EPS
    )
    constexprs = {k: v for k, v in constexprs.items() if k in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=HOPPER, options={"num_warps": num_warps}), constexprs


def global_bytes(ttir, dim, channels, block_r, block_d, block_c):
    """Global bytes (loads, stores) a row moves, and (loads, stores) a program moves once, from the Triton IR.
    An access whose tile starts with the BLOCK_R rows is a row access (its padded columns masked off: BLOCK_D
    counts as D, BLOCK_C as C); any other (the gate parameters, the partial sums) is a program's. In a kernel
    with a loop over tiles (the backward), the row accesses are the loop body's, and all others a program's.
    None where shapes cannot tell them apart (no loop and BLOCK_R = BLOCK_C: the forward at D ≤ 128)."""
    looped = "scf.for" in ttir
    if not looped and block_r == block_c:
        return None
    per_row, per_program = Counter(), Counter()
    in_loop = False
    for line in ttir.splitlines():
        if "scf.for" in line:
            in_loop = True
        elif "scf.yield" in line:
            in_loop = False
        op = re.search(r"\btt\.(load|store)\b.*: (?:tensor<((?:\d+x)*)!tt\.ptr<(\w+)>>|!tt\.ptr<(\w+)>)", line)
        if not op:
            continue
        kind, dims, element = op.group(1), [int(d) for d in (op.group(2) or "").split("x") if d], op.group(3)
        element = element or op.group(4)
        size = {block_d: dim, block_c: channels}
        if in_loop if looped else dims and dims[0] == block_r:
            per_row[kind] += math.prod(size.get(d, d) for d in dims[1:]) * ELEMENT_BYTES[element]
        else:
            per_program[kind] += math.prod(size.get(d, d) for d in dims) * ELEMENT_BYTES[element]
    return (per_row["load"], per_row["store"]), (per_program["load"], per_program["store"])


def loop_instructions(sass):
    """(instructions, of which in the loop body) of a kernel's SASS: the body runs from the target of the one
    backward branch to it (none: 0). The branch to itself past the exit is not a loop."""
    code = [(int(address, 16), text) for address, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    body = 0
    for address, text in code:
        jump = re.search(r"\bBRA\s+0x([0-9a-f]+)", text)
        if jump and int(jump.group(1), 16) < address:
            body = sum(int(jump.group(1), 16) <= a <= address for a, _ in code)
    return len(code), body


def inspect(compiled):
    """Resources, global-memory access widths and instruction counts of a compiled kernel, read from its cubin."""
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
    shared = int(re.search(r"SHARED:(\d+)", usage).group(1)) + compiled.metadata.shared
    # registers are allocated per warp in units of 256 (8 per thread)
    per_warp = -(-registers // 8) * 8 * 32
    blocks = min(
        REGISTERS_PER_SM // (per_warp * num_warps),
        WARPS_PER_SM // num_warps,
        BLOCKS_PER_SM,
        SHARED_PER_SM // (shared + SHARED_RESERVED),
    )
    widths = {"LDG": Counter(), "STG": Counter()}
    # LDGSTS: cp.async, a load the pipeliner copies straight into shared memory
    for op, modifiers in re.findall(r"\b(LDGSTS|LDG|STG)\.E((?:\.[A-Z0-9]+)*)", sass):
        width = next((m for m in ("128", "64", "U16", "U8", "S16", "S8") if "." + m in modifiers), "32")
        widths["STG" if op == "STG" else "LDG"][width + ("a" if op == "LDGSTS" else "")] += 1
    instructions, loop_body = loop_instructions(sass)
    return dict(
        instructions=instructions,
        loop_body=loop_body,
        registers=registers,
        local=int(re.search(r"LOCAL:(\d+)", usage).group(1)),
        shared=shared,
        num_warps=num_warps,
        blocks_per_sm=blocks,
        loads=dict(widths["LDG"]),
        stores=dict(widths["STG"]),
    )


def describe(kernel, dim, channels, dtype, renorm):
    """One report row: inspect's figures, the tile, the bytes a row and a program move, the bytes in flight per SM."""
    compiled, constexprs = build(kernel, dim, channels, dtype, renorm)
    info = inspect(compiled)
    # a program has one tile's loads in flight; the backward's pipeline, the next STAGES − 1 tiles' (up to its TILES)
    tiles_in_flight = max(1, min(constexprs.get("STAGES", 1) - 1, constexprs.get("TILES", 1)))
    block_r = constexprs.get("BLOCK_R", 0)
    row, program = (0, 0), (0, 0)
    if block_r:
        row, program = global_bytes(
            compiled.asm["ttir"], dim, channels, block_r, constexprs["BLOCK_D"], constexprs["BLOCK_C"]
        ) or ((None, None), (None, None))
    in_flight = None if row[0] is None else info["blocks_per_sm"] * block_r * row[0] * tiles_in_flight
    # instructions each warp issues for a tile: the loop body, plus the rest over the program's tiles
    tiles = constexprs.get("TILES", 1)
    per_tile = info["loop_body"] + (info["instructions"] - info["loop_body"]) / tiles
    return dict(
        kernel=kernel.__name__,
        dim=dim,
        dtype=dtype,
        renorm=renorm,
        **info,
        rows_per_tile=block_r,
        idle_lanes=1 - dim / constexprs["BLOCK_D"] if block_r else 0.0,
        row_bytes=dict(loads=row[0], stores=row[1]),
        program_bytes=dict(loads=program[0], stores=program[1]),
        in_flight_per_sm=in_flight,
        warp_instructions_per_row=per_tile * info["num_warps"] / block_r if block_r else None,
    )


def report(dims=(640, 768), dtypes=("bf16", "fp32"), channels=32):
    rows = []
    for kernel in (kernels._nag_forward_kernel, kernels._nag_backward_kernel):
        for dim in dims:
            for dtype in dtypes:
                for renorm in ("measured", "predicted"):
                    rows.append(describe(kernel, dim, channels, dtype, renorm))
    # one program over the backward's partial sums: neither D nor the input dtype changes it
    rows.append(describe(kernels._nag_gate_grad_kernel, dims[0], channels, "fp32", "measured"))
    return rows


def accesses(counts):
    return ", ".join(f"{n}×{w}" for w, n in sorted(counts.items(), key=lambda kv: -kv[1])) or "-"


def main():
    parser = argparse.ArgumentParser(
        description="sm_90 builds of the fused NAG kernels: registers, spills, programs and bytes in flight per SM, "
        "bytes per row, access widths"
    )
    parser.add_argument("--dims", default="640,768", help="comma-separated row widths D")
    args = parser.parse_args()
    dims = [int(d) for d in args.dims.split(",")]
    rows = report(dims)
    print(f"triton {triton.__version__}, target sm_{HOPPER.arch}, C = 32 directions")
    print(
        f"{'kernel':22s} {'D':>4s} {'dtype':5s} {'renorm':9s} {'regs':>4s} {'spill':>5s} {'smem B':>6s} "
        f"{'warps':>5s} {'rows':>4s} {'idle':>4s} {'progs/SM':>8s} {'KB flight/SM':>12s} {'B/row ld+st':>12s} "
        f"{'B/prog':>7s} {'instr/row':>9s} {'µs issue':>8s} {'bytes':>5s}  loads (count×width)       stores"
    )
    for r in rows:
        if r["rows_per_tile"]:
            build = f"{r['dim']:4d} {r['dtype']:5s} {r['renorm']:9s}"
            known = r["in_flight_per_sm"] is not None
            per_row = f"{r['row_bytes']['loads']:,}+{r['row_bytes']['stores']:,}" if known else "?"
            in_flight = f"{r['in_flight_per_sm'] / 1024:.1f}" if known else "?"
            per_program = f"{sum(r['program_bytes'].values()):,}" if known else "?"
            # the time a micro-batch's rows take to issue their instructions, and to move their bytes at copy speed
            issue = r["warp_instructions_per_row"] * ROWS / (SMS * ISSUE_PER_SM * CLOCK)
            moved = f"{1e6 * sum(r['row_bytes'].values()) * ROWS / COPY:.0f}" if known else "?"
            tile = (
                f"{r['rows_per_tile']:4d} {100 * r['idle_lanes']:3.0f}% {r['blocks_per_sm']:8d} "
                f"{in_flight:>12s} {per_row:>12s} {per_program:>7s} {r['warp_instructions_per_row']:9,.0f} "
                f"{1e6 * issue:8.0f} {moved:>5s}"
            )
        else:  # the gate kernel: one program over the partial sums, no rows
            build = f"{'-':>4s} {'fp32':5s} {'-':9s}"
            tile = f"{'-':>4s} {'-':>4s} {'-':>8s} {'-':>12s} {'-':>12s} {'-':>7s} {'-':>9s} {'-':>8s} {'-':>5s}"
        print(
            f"{r['kernel']:22s} {build} {r['registers']:4d} {r['local']:5d} {r['shared']:6d} {r['num_warps']:5d} "
            f"{tile}  {accesses(r['loads']):25s} {accesses(r['stores'])}"
        )


if __name__ == "__main__":
    main()
