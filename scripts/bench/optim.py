"""
Count one optimizer step per rank on the meta device, MuonAdamW replicated vs sharded.

One optimizer step per rank, counted on the meta device (nothing allocated, nothing run): aten ops, bytes read and
written, matmul FLOPs and the state held, for MuonAdamW replicated (every rank updates every matrix, as before) and
sharded over --world-size ranks (each rank its chunk of every Muon stack, then one all-gather per stack).

    python -m scripts.bench.optim
    python -m scripts.bench.optim --preset d20 --arch nag --world-size 4

Counting rule: each aten op the eager step dispatches counts once, except views and allocations of uninitialised
memory (they move no data). Its bytes are those of its tensor operands read (every input; an in-place op's first
operand too, unless it only overwrites it: copy, fill) plus those written (its outputs, or the operands it updates
in place). Matmul FLOPs are 2·m·n·k per product. The sharded step's all-gather counts as one op per stack that writes
the gathered stack and reads this rank's chunk. Polar Express runs in bf16, as on CUDA. torch.compile, on by default
on CUDA, fuses the elementwise ops (fewer bytes and launches, the same FLOPs); the meta device cannot run it, so the
eager step is what is counted. The roofline time takes each op at max(bytes / bandwidth, FLOPs / peak) of one H100
(the all-gather's memory traffic included, its time on the network not).

Then the launches of one optimizer step as base_train runs it (gated, with after_optimizer_step) at depth 8 and 64,
eager on the CPU at a tiny width (launches do not depend on the width while no tensor crosses FUSE_MIN_NUMEL): the
ops LaunchCounter (scripts/bench/nag.py) counts, and the tensors those ops take in lists. A step free of depth has
the same launches at both depths; its lists grow only where they hold one tensor per layer.
"""

import json
import argparse
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nanochat.gpus import peak_flops_of
from nanochat.optim import MuonAdamW
from scripts.bench.nag import LaunchCounter

H100_BYTES_PER_S = 3.35e12  # SXM HBM3 bandwidth
H100_BF16_FLOPS = peak_flops_of("NVIDIA H100 80GB HBM3")  # the dense bf16 peak, from nanochat/gpus.py's table
MATMULS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.baddbmm.default,
}
FREE = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default, torch.ops.aten.empty_like.default}
OVERWRITE = {"copy_", "_foreach_copy_", "fill_", "zero_"}  # in place, but the old value is not read


def nbytes(x):
    return sum(t.numel() * t.element_size() for t in tree_leaves(x) if isinstance(t, torch.Tensor))


class Count(TorchDispatchMode):
    """Sums ops, bytes and FLOPs of what runs under it, per kind of optimizer group (set `kind` before each part)."""

    def __init__(self):
        super().__init__()
        self.kind, self.totals = None, {}

    def add(self, ops=0, read=0, written=0, flops=0, roofline_s=0.0, kind=None):
        t = self.totals.setdefault(kind or self.kind, {"ops": 0, "bytes": 0, "flops": 0, "roofline_s": 0.0})
        t["ops"] += ops
        t["bytes"] += read + written
        t["flops"] += flops
        t["roofline_s"] += roofline_s

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace != "aten" or func.is_view or func in FREE:  # (the profiler's markers are ops too)
            return out
        read = written = 0
        bound = func._schema.arguments
        values = list(args) + [kwargs.get(a.name) for a in bound[len(args) :]]
        for arg, value in zip(bound, values):
            mutated = arg.alias_info is not None and arg.alias_info.is_write
            if mutated:
                written += nbytes(value)
            if not arg.is_out and not (mutated and func.__name__.split(".")[0] in OVERWRITE):
                read += nbytes(value)
        if not any(a.alias_info is not None and a.alias_info.is_write for a in bound):
            written += nbytes(out)  # a functional op: its outputs are new tensors
        flops = 0
        if func in MATMULS:
            a, b = args[-2], args[-1]
            flops = 2 * a.numel() * b.size(-1)  # (…, m, k) @ (…, k, n): 2·m·k·n per batch entry
        self.add(1, read, written, flops, max((read + written) / H100_BYTES_PER_S, flops / H100_BF16_FLOPS))
        return out


class Done:
    """The handle of an all-gather that was only counted."""

    def wait(self):
        pass


class Counted(MuonAdamW):
    """MuonAdamW on the meta device as on CUDA: Polar Express in bf16, and each all-gather counted instead of run."""

    counter = None

    def ortho_dtype(self, tensor):
        return torch.bfloat16

    def all_gather(self, out, inp):
        self.counter.add(
            1,
            read=nbytes(inp),
            written=nbytes(out),
            roofline_s=(nbytes(inp) + nbytes(out)) / H100_BYTES_PER_S,
            kind="all-gather",
        )
        return Done()

    def step_muon(self, group, gate=None):
        self.counter.kind = "muon"
        finish = super().step_muon(group, gate)
        if finish is None:
            return None

        def counted_finish():  # the gathered matrices copied into the weights: the all-gather's part
            self.counter.kind = "all-gather"
            finish()

        return counted_finish

    def step_adamw(self, group, gate=None):
        self.counter.kind = "adamw"
        super().step_adamw(group, gate)


def count_step(groups, rank, world_size):
    """Totals per kind of one step of rank `rank` after a first step (which creates the state), and the state's
    bytes."""
    for g in groups:
        for p in g["params"]:
            p.grad = torch.empty_like(p)
    opt = Counted(groups, rank=rank, world_size=world_size, compile=False)
    opt.counter = Count()
    opt.step()
    opt.counter = count = Count()
    with count:
        opt.step()
    state = sum(nbytes(list(s.values())) for s in opt.state.values())
    return count.totals, state


class StepLaunches(LaunchCounter):
    """LaunchCounter's launches, with the in-place ops that return nothing (_foreach_add_ and kin launch too), and
    `listed`: the tensors the ops take as a list (foreach ops, cat, stack). On CUDA such an op launches a kernel per
    chunk of its list (tens of tensors each), so the launches are counted once per op, and listed says how long the
    lists grow."""

    def __init__(self):
        super().__init__()
        self.listed = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if not self.in_launch:
            writes = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
            if writes and not func._schema.returns:
                self.aten.append(func.overloadpacket.__name__)
            if args and isinstance(args[0], (list, tuple)):
                self.listed += len(args[0])
        return out


LAUNCH_DEPTHS = (8, 64)
# launches do not depend on the width, but for a tensor that counts as large at one depth and small at the other
# (nanochat.optim.FUSE_MIN_NUMEL: it gets a select of its own): at this width none is large at either depth
LAUNCH_WIDTH = 8


def step_launches(arch, depth):
    """{"launches", "listed"} of one optimizer step of `arch` at `depth` as base_train takes it (gated, then
    after_optimizer_step), after a first step that made the optimizer's state: eager, on the CPU, LAUNCH_WIDTH wide."""
    from nag.archs import plan_for
    from nag.train_flags import parse_args

    shape = ["--depth", str(depth), "--model-dim", str(LAUNCH_WIDTH), "--head-dim", str(LAUNCH_WIDTH)]
    shape += ["--max-seq-len", "16", "--num-iterations", "1"]
    args = parse_args(["--arch", arch, "--device-type", "cpu", *shape])
    plan = plan_for(args, 64, 1)
    model = plan.model.to_empty(device="cpu")
    model.init_weights()
    opt = MuonAdamW(plan.optimizer_groups(args))
    for counted in (False, True):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        with StepLaunches() if counted else contextlib.nullcontext() as count:
            opt.step(torch.tensor(True))
            model.after_optimizer_step()
    return {"launches": count.total, "listed": count.listed}


def plan_groups(preset, arch):
    from nag.archs import plan_for
    from nag.presets import get_preset
    from nag.train_flags import parse_args

    args = parse_args(["--preset", preset, "--arch", arch])
    plan = plan_for(args, get_preset(preset)["vocab"], 1)  # the groups do not depend on the process count
    return plan.optimizer_groups(args), plan


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="published", help="the model shape: a base_train preset (nag/presets.py)")
    p.add_argument("--arch", default="gpt,nag", help="comma list of archs (nag/archs.py)")
    p.add_argument(
        "--world-size", type=int, default=8, help="ranks the sharded optimizer is cut over (rank 0 is counted)"
    )
    p.add_argument("--json", default="", help="also write the figures to this file")
    args = p.parse_args(argv)
    results = []
    for arch in args.arch.split(","):
        groups, plan = plan_groups(args.preset, arch)
        for layout, world in (("replicated", 1), ("sharded", args.world_size)):
            totals, state = count_step(groups, 0, world)
            results.append(
                {
                    "arch": arch,
                    "layout": layout,
                    "world_size": world,
                    "state_bytes": state,
                    "by_kind": totals,
                    **{k: sum(t[k] for t in totals.values()) for k in ("ops", "bytes", "flops", "roofline_s")},
                }
            )
        print(
            f"{arch}: --preset {args.preset}, d{plan.config.n_layer} × {plan.config.n_embd}, "
            f"{sum(p.numel() for g in groups for p in g['params']):,} params; one step on rank 0 of {args.world_size}"
        )
    print()
    print(
        "| arch | layout | aten ops | GB read+written | TFLOP | roofline "
        "ms (H100) | optimizer state GB | Muon / AdamW / gather GB |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for r in results:
        kinds = " / ".join(
            f"{r['by_kind'].get(k, {}).get('bytes', 0) / 1e9:.1f}" for k in ("muon", "adamw", "all-gather")
        )
        print(
            f"| {r['arch']} | {r['layout']} ({r['world_size']}) | {r['ops']:,} | {r['bytes'] / 1e9:.1f} | "
            f"{r['flops'] / 1e12:.2f} | {r['roofline_s'] * 1e3:.1f} | {r['state_bytes'] / 1e9:.2f} | {kinds} |"
        )
    print()
    for rep, sh in zip(results[::2], results[1::2]):
        print(
            f"{rep['arch']}: sharded / replicated per rank: bytes 1/{rep['bytes'] / sh['bytes']:.1f}, "
            f"FLOPs 1/{rep['flops'] / sh['flops']:.1f}, roofline 1/{rep['roofline_s'] / sh['roofline_s']:.1f}, "
            f"state 1/{rep['state_bytes'] / sh['state_bytes']:.1f}"
        )
    launches = {arch: {d: step_launches(arch, d) for d in LAUNCH_DEPTHS} for arch in args.arch.split(",")}
    print()
    print(
        "Launches of one optimizer step, base_train's (gated, after_optimizer_step), eager on the CPU, "
        f"{LAUNCH_WIDTH} wide:"
    )
    print("| arch | " + " | ".join(f"depth {d}: launches (tensors in lists)" for d in LAUNCH_DEPTHS) + " |")
    print("|---|" + "---:|" * len(LAUNCH_DEPTHS))
    for arch, by_depth in launches.items():
        print(f"| {arch} | " + " | ".join(f"{n['launches']:,} ({n['listed']:,})" for n in by_depth.values()) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"preset": args.preset, "world_size": args.world_size, "results": results, "launches": launches},
                f,
                indent=1,
            )
    return results


if __name__ == "__main__":
    main()
