"""
What NAG costs over the GPT baseline, per implementation of the branch update.

1. Whole training steps (via scripts.bench.train, one process per variant): GPT vs
   NAG-reference vs NAG-compiled vs NAG-fused, step time and peak memory as ratios to GPT,
   at a small shape and (on CUDA) the published one: 64 blocks, dim 640, seq 2048, batch 16.
2. The branch op alone: the time of its forward and of its backward, each timed alone (the median of
   repeated calls: CUDA events on a GPU; the leaves' grads cleared before each backward, so none is
   accumulated), and the bytes/s each moves (branch_op_bytes: what the fused kernels read and write)
   against the device's measured copy bandwidth (the roofline of a memory-bound op); with
   --op-rows-per-program, the fused backward alone at each number of rows per program.
3. Activation memory: the bytes per token per layer a bf16 training forward saves for backward,
   eager and compiled, GPT vs each NAG impl. It does not depend on the device, so a CPU measures
   the activation share of peak GPU memory without the CPU process's baseline in the way.
4. Launches: the kernels one NAG sub-layer's update (NAGGPT.branch_update: the gain, the rotation,
   the log-norm step; not f or m_down) launches forward and backward, per impl (see count_launches).

    python -m scripts.bench.nag --sections launches --impls fused   # runs on a CPU too (interpreter)

    python -m scripts.bench.nag --sections op --op-rows 256 --impls reference   # a quick look on a CPU
    python -m scripts.bench.nag --shapes small,published --impls reference,compiled,fused   # (GPU)
    python -m scripts.bench.nag --sections op --impls fused --op-rows-per-program 1,2,4,8,16,32   # (GPU) the backward's sweep
"""

import sys
import json
import math
import argparse

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# first: on a machine without a GPU it selects Triton's interpreter before torch imports Triton
import nag  # noqa: F401
from nanochat.step_timer import call_ms

SECTIONS = ("steps", "op", "activations", "launches")  # the four parts above
# launches of the fused update before the gate transforms and the parameter-gradient sums moved into the kernels
# (softmax, softplus and α × warm-up forward; those again and 8 small ops of partial sums and chain rule backward),
# measured by this script's launches section at commit 9716561 (2026-12-01)
FUSED_LAUNCHES_BEFORE = {"forward": 4, "backward": 13}
SHAPES = {
    # name: (depth, model dim, head dim, seq len, device batch)
    "small": (4, 256, 64, 256, 8),
    "published": (64, 640, 128, 2048, 16),
}


def parse():
    on_cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=str, default="small,published" if on_cuda else "small")
    p.add_argument("--impls", type=str, default="reference,compiled,fused" if on_cuda else "reference,compiled")
    p.add_argument(
        "--compile",
        type=str,
        default="on" if on_cuda else "off",
        choices=["off", "on", "both"],
        help="torch.compile the whole model in the step benchmark (the targets are for compiled models)",
    )
    p.add_argument("--steps", type=int, default=10 if on_cuda else 3)
    p.add_argument("--warmup", type=int, default=3 if on_cuda else 1)
    p.add_argument("--vocab-size", type=int, default=32768 if on_cuda else 4096)
    p.add_argument(
        "--sections",
        type=str,
        default=",".join(SECTIONS),
        help="comma list of the parts to run: steps (1), op (2), activations (3), launches (4)",
    )
    p.add_argument("--op-rows", type=int, default=16 * 2048 if on_cuda else 2048)
    p.add_argument("--op-dim", type=int, default=640)
    p.add_argument(
        "--op-rows-per-program",
        type=str,
        default="",
        help="comma list: time the fused backward alone at each number of rows per program (e.g. 1,2,4,8,16,32)",
    )
    p.add_argument("--json", type=str, default="", help="also write the figures of the sections run here")
    return p.parse_args()


def timed(fn, iters, device_type, setup=None):
    """Seconds of one call of fn: the median of `iters` calls, each timed alone (nanochat.step_timer.call_ms)."""
    return call_ms(fn, device_type, reps=iters, setup=setup) / 1e3


def copy_bandwidth(device, device_type, nbytes):
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    dt = timed(lambda: dst.copy_(src), 10 if device_type == "cuda" else 3, device_type)
    return 2 * nbytes / dt  # read + write


def branch_op_bytes(dim, channels, esize, rows=1):
    """(forward, backward) bytes the fused branch op moves for `rows` rows at the least, from nag/kernels.py's kernels:
    the rows of D and of C channels in the inputs' dtype (esize bytes), the log-norms in fp32.
    Forward (_nag_forward_kernel) reads res, branch, logits and log_norm, writes new_res and new_log_norm:
    3 D-rows + C + 2 log-norms. Backward (_nag_backward_kernel) reads res, branch, logits and the two output grads
    (grad_new_res, grad_new_log_norm), writes the grads of res, branch and logits: 5 D-rows + 2 C + 1 log-norm.
    log_norm's grad is grad_new_log_norm itself (no kernel writes it), and the gate's per-program partial sums
    (C + 2 floats per program of up to 16 rows) are left out. At D = 640, C = 32, bf16: 3,912 and 6,532 B a row."""
    row, logits = dim * esize, channels * esize
    forward = 3 * row + logits + 2 * 4
    backward = (3 * row + logits + 4) + (2 * row + logits)  # reads, writes
    return rows * forward, rows * backward


def bench_op(args, impls):
    from nag.model import branch_function

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_type)
    dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
    N, D, C = args.op_rows, args.op_dim, 32
    esize = torch.finfo(dtype).bits // 8
    torch.manual_seed(0)
    res = torch.randn(N, D, device=device)
    res = (res * torch.rsqrt(res.square().mean(-1, keepdim=True))).to(dtype).requires_grad_()
    log_norm = torch.zeros(N, 1, device=device).requires_grad_()
    out = torch.randn(N, D, device=device, dtype=dtype).requires_grad_()
    logits = torch.randn(N, C, device=device, dtype=dtype).requires_grad_()
    coef = torch.zeros(C, device=device).requires_grad_()
    beta = torch.full((1,), 0.5413, device=device).requires_grad_()
    alpha = torch.full((1,), 0.3, device=device).requires_grad_()
    g_dir = torch.randn(N, D, device=device, dtype=dtype)
    g_ln = torch.randn(N, 1, device=device)
    leaves = (res, log_norm, out, logits, coef, beta, alpha)
    fwd_bytes, bwd_bytes = branch_op_bytes(D, C, esize, N)
    bw = copy_bandwidth(device, device_type, 2**30 if device_type == "cuda" else 2**26)
    print(
        f"\nbranch op: {N:,} rows × D={D}, C={C}, {str(dtype).replace('torch.', '')} on {device_type}; "
        f"measured copy bandwidth {bw / 1e9:,.1f} GB/s; bytes a row at the least: forward {fwd_bytes // N:,}, "
        f"backward {bwd_bytes // N:,}"
    )
    figures = {
        "rows": N,
        "dim": D,
        "directions": C,
        "dtype": str(dtype).replace("torch.", ""),
        "device": device_type,
        "copy_gbps": bw / 1e9,
        "forward_bytes_per_row": fwd_bytes // N,
        "backward_bytes_per_row": bwd_bytes // N,
        "impls": {},
    }
    iters = 20 if device_type == "cuda" else 3
    for impl in impls:
        if impl == "fused" and device_type != "cuda":
            print(
                "  fused: skipped on CPU (Triton runs in its interpreter here); `python -m "
                "scripts.bench.kernel_report` shows its sm_90 build"
            )
            continue
        fn = branch_function(impl)
        args_ = (res, log_norm, out, logits, coef, beta, alpha, 1e-6, "measured")
        held = {}

        def clear():  # the leaves' grads (none accumulates into the next backward) and the last call's graph
            for x in leaves:
                x.grad = None
            held.clear()

        def forward():  # as training runs it: autograd records
            held["out"] = fn(*args_)

        def cleared_forward():
            clear()
            forward()

        t_fwd = timed(forward, iters, device_type, setup=clear)
        t_bwd = timed(lambda: torch.autograd.backward(held["out"], (g_dir, g_ln)), iters, device_type, cleared_forward)
        print(
            f"  {impl:9s} forward {1e3 * t_fwd:8.3f} ms ({fwd_bytes / t_fwd / 1e9:8.1f} GB/s, "
            f"{100 * fwd_bytes / t_fwd / bw:5.1f}% of copy) | backward {1e3 * t_bwd:8.3f} ms "
            f"({bwd_bytes / t_bwd / 1e9:8.1f} GB/s, {100 * bwd_bytes / t_bwd / bw:5.1f}% of copy)"
        )
        figures["impls"][impl] = {
            "forward_ms": 1e3 * t_fwd,
            "forward_gbps": fwd_bytes / t_fwd / 1e9,
            "forward_of_copy": fwd_bytes / t_fwd / bw,
            "backward_ms": 1e3 * t_bwd,
            "backward_gbps": bwd_bytes / t_bwd / 1e9,
            "backward_of_copy": bwd_bytes / t_bwd / bw,
        }
    if args.op_rows_per_program:
        values = [int(k) for k in args.op_rows_per_program.split(",") if k.strip()]
        backward = (g_dir, g_ln, res, out, logits, coef, beta, alpha, None, 1e-6, "measured")
        figures["rows_per_program"] = sweep_rows_per_program(backward, values, bwd_bytes, bw, iters, device_type)
    done = figures["impls"]
    if "fused" in done and "compiled" in done:  # our kernels against Inductor's compile of the reference
        figures["fused_vs_compiled"] = {
            d: done["compiled"][f"{d}_ms"] / done["fused"][f"{d}_ms"] for d in ("forward", "backward")
        }
        print(
            "  fused against compiled (Inductor): forward {forward:.2f}×, backward {backward:.2f}× as fast".format(
                **figures["fused_vs_compiled"]
            )
        )
    return figures


def sweep_rows_per_program(backward, values, nbytes, bw, iters, device_type):
    """The fused backward alone (its row kernel and the gate kernel that sums the partials) at each number of rows per
    program, against the default nag.kernels picks for these rows: GB/s each, the best value and its gain."""
    from nag import kernels

    default = kernels._rows_per_program(backward[2].size(0))
    op = torch.ops.nag.fused_branch_backward.default
    print(f"  fused backward alone by rows per program (the default here: {default}):")
    gbps = {}
    for k in dict.fromkeys(values + [default]):  # in order, the default too, once
        with torch.no_grad():
            t = timed(lambda: op(*backward, k), iters, device_type)
        gbps[k] = nbytes / t / 1e9
        print(
            f"    {k:3d} rows per program {1e3 * t:8.3f} ms "
            f"({gbps[k]:8.1f} GB/s, {100 * nbytes / t / bw:5.1f}% of copy)"
        )
    best = max(gbps, key=gbps.get)
    print(f"    best {best} rows per program: {gbps[best] / gbps[default]:.3f}× the default's GB/s")
    return {
        "default": default,
        "best": best,
        "gain_over_default": gbps[best] / gbps[default],
        "backward_gbps": {str(k): v for k, v in gbps.items()},
    }


def saved_activations(variant, depth, seq_len, dim, vocab_size, device, compiled):
    """Bytes that one bf16 training forward keeps for backward in tensors with a sequence dimension
    (so parameters and their bf16 casts do not count). Eager: the distinct storages autograd saves.
    Compiled: the tensors AOTAutograd's min-cut partitioner, as Inductor calls it, passes to the
    backward graph (the graphs then run uncompiled: only the partition matters here)."""
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from scripts.bench import models

    config = models.train_config(
        [
            "--depth",
            str(depth),
            "--model-dim",
            str(dim),
            "--max-seq-len",
            str(seq_len),
            "--head-dim",
            str(math.gcd(dim, 128)),
        ],
        vocab_size,
    )  # the published 128 if D allows
    model = models.variant(variant, config, device)
    model.set_compute_dtype(torch.bfloat16)
    idx = torch.randint(0, vocab_size, (1, seq_len), device=device)
    if compiled:
        sizes = []

        def partition(joint, inputs, **kwargs):
            fw, bw = min_cut_rematerialization_partition(joint, inputs, compiler="inductor", **kwargs)
            for node in bw.graph.nodes:
                val = node.meta.get("val")
                if (
                    node.op == "placeholder"
                    and not node.name.startswith("tangents")
                    and isinstance(val, torch.Tensor)
                    and seq_len in val.shape
                ):
                    sizes.append(val.numel() * val.element_size())
            return fw, bw

        def backend(gm, example_inputs):
            return aot_module_simplified(
                gm, example_inputs, fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g, partition_fn=partition
            )

        torch._dynamo.reset()
        torch.compile(model, backend=backend, dynamic=False, fullgraph=True)(idx, idx)
        return sum(sizes)
    storages = {}

    def keep(t):
        if seq_len in t.shape:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model(idx, idx)
    return sum(storages.values())


def activations_per_layer(variant, dim, vocab_size, device, compiled, seq_len=199, depths=(1, 3)):
    """Activation bytes per token per layer: the slope between two depths, so that the embedding and the lm_head
    cancel out. Sequence length 199 is prime: no model width can equal it."""
    low, high = (saved_activations(variant, depth, seq_len, dim, vocab_size, device, compiled) for depth in depths)
    return (high - low) / ((depths[1] - depths[0]) * seq_len)


def activation_memory(args, impls):
    """The activations_per_layer table, eager and compiled, each variant against GPT."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    D = args.op_dim
    print(f"\nactivations saved for backward per token per layer (bf16, D={D}; rows = D-sized bf16 vectors):")
    per_layer = {}
    for variant in ["gpt"] + [f"nag:{i}" for i in impls]:
        cells = []
        for compiled in (False, True):
            b = per_layer[variant, compiled] = activations_per_layer(variant, D, args.vocab_size, device, compiled)
            cells.append(
                f"{'compiled' if compiled else 'eager'} {b:8,.0f} B ({b / (2 * D):4.1f} rows, "
                f"{b / per_layer['gpt', compiled]:.3f}× gpt)"
            )
        print(f"  {variant:13s} " + " | ".join(cells))
    return per_layer


class LaunchCounter(TorchDispatchMode):
    """Counts the kernel launches of the code run inside it. The rule: every launch of a Triton kernel of
    nag.kernels, plus every aten op dispatched outside those launches that returns a tensor and is neither
    a view nor an allocation (on CUDA each such op launches at least one kernel; views, empty tensors and
    ops on dtypes or shapes launch none).
    The same count on a CPU (kernels interpreted) as on a GPU. Ops the Triton interpreter dispatches to
    move a launch's arguments are not counted: the launch is one."""

    ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}

    def __init__(self):
        super().__init__()
        self.aten, self.triton, self.in_launch = [], [], False

    @property
    def total(self):
        return len(self.aten) + len(self.triton)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "nag":
            # a custom op of nag.kernels launches nothing itself: count what its Python body runs
            from torch._library.custom_ops import _maybe_get_opdef

            with self:
                return _maybe_get_opdef(func)._init_fn(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        makes_tensor = any(isinstance(t, torch.Tensor) for t in torch.utils._pytree.tree_leaves(out))
        if makes_tensor and not (self.in_launch or func.is_view or name in self.ALLOCATIONS):
            self.aten.append(name)
        return out

    def __enter__(self):
        self.depth = getattr(self, "depth", 0) + 1
        if self.depth == 1:
            self.count_kernels()
        return super().__enter__()

    def __exit__(self, *exc):
        self.depth -= 1
        if self.depth == 0:
            from nag import kernels

            for k, v in self.saved.items():
                setattr(kernels, k, v)
        return super().__exit__(*exc)

    def count_kernels(self):
        from triton.runtime.jit import KernelInterface
        from nag import kernels

        counter = self

        class Counted:
            def __init__(self, kernel):
                self.kernel = kernel

            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    counter.triton.append(self.kernel.__name__)
                    counter.in_launch = True
                    try:
                        return self.kernel[grid](*args, **kwargs)
                    finally:
                        counter.in_launch = False

                return launch

        # the launch helpers look their kernels up in the module at call time; the kernels are the
        # *_kernel functions (the other @triton.jit functions are helpers they call)
        self.saved = {
            k: v for k, v in vars(kernels).items() if isinstance(v, KernelInterface) and k.endswith("_kernel")
        }
        for k, v in self.saved.items():
            setattr(kernels, k, Counted(v))


def count_launches(impl, device="cpu", rows=6, dim=96, channels=8):
    """(forward, backward) LaunchCounters of one NAGGPT.branch_update on (rows, dim) inputs in bf16, the
    backward taking the gradients of its four inputs and of the gate's coef, β_raw and α. The count does not
    depend on the number of rows, so a few interpreted rows give the figure of a full micro-batch."""
    from nag.model import NAGGPT, NAGConfig
    from nanochat.gpt import GPTConfig

    model = NAGGPT(
        GPTConfig(sequence_len=rows, vocab_size=64, n_layer=1, n_head=1, n_kv_head=1, n_embd=dim),
        nag=NAGConfig(directions=channels),
        impl=impl,
        device=device,
    )
    model.init_weights()
    br = model.gates.branch(2)  # the MLP's
    gen = torch.Generator().manual_seed(0)
    res_dir = torch.randn(rows, dim, generator=gen).to(device, torch.bfloat16).requires_grad_()
    log_norm = torch.zeros(rows, 1, device=device).requires_grad_()
    out = torch.randn(rows, dim, generator=gen).to(device, torch.bfloat16).requires_grad_()
    mod_logits = torch.randn(rows, channels, generator=gen).to(device, torch.bfloat16).requires_grad_()
    grads = [
        torch.randn(rows, dim, generator=gen).to(device, torch.bfloat16),
        torch.randn(rows, 1, generator=gen).to(device),
    ]
    with LaunchCounter() as forward:
        new_dir, new_log_norm = model.branch_update(br, res_dir, log_norm, out, mod_logits)
    with LaunchCounter() as backward:
        torch.autograd.grad(
            (new_dir, new_log_norm), (res_dir, log_norm, out, mod_logits, br.coef, br.beta_raw, br.alpha), grads
        )
    return forward, backward


def launches(args, impls):
    """The count_launches table: kernels per sub-layer update, forward and backward."""
    print("\nkernel launches per NAG sub-layer update (NAGGPT.branch_update; Triton + other aten ops):")
    figures = {}
    for impl in impls:
        if impl == "compiled":
            continue  # Inductor decides its own launches; not counted here
        fwd, bwd = count_launches(impl)
        figures[impl] = {
            "forward": fwd.total,
            "backward": bwd.total,
            "forward_ops": fwd.triton + fwd.aten,
            "backward_ops": bwd.triton + bwd.aten,
        }
        print(
            f"  {impl:9s} forward {fwd.total:3d} ({len(fwd.triton)} Triton) | backward {bwd.total:3d} "
            f"({len(bwd.triton)} Triton) | per step of a {SHAPES['published'][0]}-block model: "
            f"{2 * SHAPES['published'][0] * (fwd.total + bwd.total):,}"
        )
        if impl == "fused":
            before = FUSED_LAUNCHES_BEFORE
            print(
                f"            before folding (commit 9716561): forward {before['forward']} | backward "
                f"{before['backward']} | per step of a {SHAPES['published'][0]}-block model: "
                f"{2 * SHAPES['published'][0] * sum(before.values()):,}"
            )
            figures[impl]["before"] = before
        print(f"            forward: {' '.join(fwd.triton + fwd.aten)}")
        print(f"            backward: {' '.join(bwd.triton + bwd.aten)}")
    return figures


def main():
    args = parse()
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    sections = {x.strip() for x in args.sections.split(",") if x.strip()}
    if sections - set(SECTIONS):
        sys.exit(f"error: unknown sections {sorted(sections - set(SECTIONS))} (choose from {', '.join(SECTIONS)})")
    figures = {}
    if "steps" in sections:
        from scripts.bench import train as bench_train

        for shape in args.shapes.split(","):
            if shape not in SHAPES:
                sys.exit(f"error: unknown shape {shape!r} (choose from {', '.join(SHAPES)})")
            depth, dim, head_dim, seq, batch = SHAPES[shape]
            argv = [
                "--depth",
                str(depth),
                "--model-dim",
                str(dim),
                "--head-dim",
                str(head_dim),
                "--max-seq-len",
                str(seq),
                "--device-batch-size",
                str(batch),
                "--vocab-size",
                str(args.vocab_size),
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
                "--compile",
                args.compile,
            ]
            print(f"\n=== {shape}: {depth} blocks × dim {dim}, seq {seq}, batch {batch} ===", flush=True)
            variants = ["gpt"] + [f"nag:{i}" for i in impls]
            results = bench_train.benchmark(bench_train.parse(argv), variants, argv)
            bench_train.print_ratios(results)
            figures.setdefault("steps", {})[shape] = {"results": results, "ratios": bench_train.ratios(results)}
    if "op" in sections:
        figures["op"] = bench_op(args, impls)
    if "activations" in sections:
        per_layer = activation_memory(args, impls)
        figures["activations"] = [
            {"variant": v, "compiled": c, "bytes_per_token_per_layer": b} for (v, c), b in per_layer.items()
        ]
    if "launches" in sections:
        figures["launches"] = launches(args, impls)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
