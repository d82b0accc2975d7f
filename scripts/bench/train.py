"""
Training throughput and peak memory, GPT vs NAG, eager vs compiled, on random tokens.

    python -m scripts.bench.train --depth 2 --model-dim 64 --head-dim 32 --max-seq-len 64 --vocab-size 512 --device-batch-size 4 --steps 2 --warmup 1 --arch gpt,nag
    python -m scripts.bench.train --depth 20 --device-batch-size 32 --max-seq-len 2048   # (GPU): also MFU

Each variant runs in its own process so peak memory is its own (CUDA: max allocated;
CPU: peak resident set size). Ratios to the first variant are measured in the same
invocation, which is what to compare on a noisy machine.

A variant's line splits its step into forward + backward and the optimizer. nag:IMPL picks NAG's update as
--nag-impl does (nag/model.py branch_function): nag:fused the Triton kernels, nag:compiled the reference math under
Inductor, which in a model compiled whole is part of the model's one graph. With two NAG implementations (--arch
gpt,nag:fused,nag:compiled) the later one's ratio line also says which is faster, by how much, and each one's peak
memory.

--compile takes a comma list: off (eager), on (torch.compile of the whole model), blocks (each
transformer block compiled on its own, so identical blocks share one graph and compile once; NAG's
forward never calls a block whole, so there each sub-layer update is the unit: gate, attention or
MLP, branch op). The first step's extra time over a timed step is reported as compile seconds, the model's
(forward and backward) apart from the optimizer's (MuonAdamW compiles its updates on CUDA whatever --compile says),
each with the graphs it compiled; --fresh-cache gives every process empty Inductor and Triton caches so those
seconds are cold ones.
"""

import os
import sys
import json
import time
import shutil
import argparse
import resource
import tempfile
import subprocess

import torch

from scripts.bench import models


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--arch", type=str, default="gpt,nag", help="comma list of gpt, nag, or nag:IMPL (reference|compiled|fused)"
    )
    p.add_argument(
        "--compile",
        type=str,
        default="off",
        help="comma list of off, on (whole model), blocks (each block on its own); both = off,on",
    )
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--model-dim", type=int, default=-1, help="-1: depth × 64, as base_train")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--device-batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument(
        "--warmup", type=int, default=3, help="untimed steps first, at least one (compilation happens in the first)"
    )
    p.add_argument("--device-type", type=str, default="")
    p.add_argument("--json", type=str, default="", help="also write the results here")
    p.add_argument(
        "--fresh-cache",
        action="store_true",
        help="empty Inductor and Triton caches in every process (cold compile seconds)",
    )
    p.add_argument(
        "--precision", type=str, default="bf16", help="comma list of bf16, fp8 (base_train --fp8: nanochat/fp8.py)"
    )
    p.add_argument(
        "--host-reads",
        type=str,
        default="1",
        help="comma list of host reads per step: 1 = base_train's (the finite flags veto the update on the device, "
        "read with the loss), 2 = the flags read before the update is queued (the order before)",
    )
    p.add_argument("--worker", type=str, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def compile_blocks(model):
    """torch.compile each block on its own (in place). Identical blocks hit one cached graph, so the compile
    cost does not grow with depth; the embedding, the head and the loss stay eager."""
    if hasattr(model, "sublayer"):  # NAG calls block.attn and block.mlp between branch updates, never block(x)
        model.sublayer = torch.compile(model.sublayer, dynamic=False)
    else:
        for block in model.blocks:
            block.compile(dynamic=False)


def run_variant(args, variant, mode, precision="bf16", reads=1):
    from torch._dynamo.utils import counters
    from nanochat.common import autodetect_device_type, compute_dtype_for
    from nanochat.gpus import peak_flops
    from nanochat import optim
    from nanochat.nonfinite import finite_flags

    device_type = args.device_type or autodetect_device_type()
    device = torch.device(device_type)
    config = models.train_config(
        [
            "--depth",
            str(args.depth),
            "--model-dim",
            str(args.model_dim),
            "--head-dim",
            str(args.head_dim),
            "--max-seq-len",
            str(args.max_seq_len),
        ],
        args.vocab_size,
    )
    model = models.variant(variant, config, device)
    model.set_compute_dtype(compute_dtype_for(device_type))
    fp8_layers = model.set_fp8(precision == "fp8")
    optimizer = model.setup_optimizer()
    fwd = torch.compile(model, dynamic=False) if mode == "on" else model
    if mode == "blocks":
        compile_blocks(model)
    B, T = args.device_batch_size, args.max_seq_len
    x = torch.randint(0, args.vocab_size, (B, T), device=device)
    y = torch.randint(0, args.vocab_size, (B, T), device=device)

    def sync():
        if device_type == "cuda":
            torch.cuda.synchronize()

    # where a step's time goes: marks after the backward and after the optimizer (CUDA events: device time, no
    # extra sync; on a CPU the work is done when the call returns)
    cuda = device_type == "cuda"

    def now():
        if cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def between(a, b):
        return a.elapsed_time(b) / 1000 if cuda else b - a

    split = {"fwd_bwd": 0.0, "optim": 0.0}

    def fwd_bwd():
        loss = fwd(x, y)
        loss.backward()
        return loss

    def optim_step(gate=None):
        optimizer.step(gate)
        model.after_optimizer_step()
        model.zero_grad(set_to_none=True)

    def step(timed=False):
        """base_train's step: the finite check's flags gate the update on the device and are read with the loss
        (reads=1), or read before the update is queued (reads=2: the device drains while the host queues the
        optimizer)."""
        t0 = now()
        loss = fwd_bwd()
        flags = finite_flags(model, loss.detach())
        if reads == 2:
            flags.all().item()
        t1 = now()
        optim_step(flags.all())
        t2 = now()
        value = torch.cat([loss.detach().reshape(1), flags]).tolist()[0]  # syncs
        if timed:
            split["fwd_bwd"] += between(t0, t1)
            split["optim"] += between(t1, t2)
        return value

    # the first step, where everything compiles: wall time of its two halves and the graphs each compiled
    sync()
    t0 = time.time()
    loss = fwd_bwd()
    sync()
    first_fwd_bwd_s, model_graphs = time.time() - t0, counters["stats"]["unique_graphs"]
    t0 = time.time()
    optim_step(finite_flags(model, loss.detach()).all())  # gated like every later step: one graph per update function
    sync()
    first_optim_s, optim_graphs = time.time() - t0, counters["stats"]["unique_graphs"] - model_graphs
    first_loss = last_loss = loss.item()
    for _ in range(args.warmup - 1):
        step()
    sync()
    t0 = time.time()
    for _ in range(args.steps):
        last_loss = step(timed=True)
    sync()
    dt = (time.time() - t0) / args.steps
    tok_per_sec = B * T / dt
    result = {
        "arch": variant,
        "compile": mode,
        "precision": precision,
        "fp8_layers": len(fp8_layers),
        "host_reads": reads,
        "step_ms": 1000 * dt,
        "tok_per_sec": tok_per_sec,
        "fwd_bwd_ms": 1000 * split["fwd_bwd"] / args.steps,
        "optim_ms": 1000 * split["optim"] / args.steps,
        "first_step_s": first_fwd_bwd_s + first_optim_s,
        "fresh_cache": args.fresh_cache,
        "model_compile_s": max(first_fwd_bwd_s - split["fwd_bwd"] / args.steps, 0.0),
        "model_graphs": model_graphs,
        "optim_compile_s": max(first_optim_s - split["optim"] / args.steps, 0.0),
        "optim_graphs": optim_graphs,
        # the update functions behind its graphs
        "optim_compiled": sorted(fn.__name__ for fn in getattr(optim, "COMPILED", {})),
        # recompiles past the first step: 0
        "later_graphs": counters["stats"]["unique_graphs"] - model_graphs - optim_graphs,
        "first_loss": first_loss,
        "last_loss": last_loss,
        "params": sum(p.numel() for p in model.parameters()),
        "flops_per_token": model.estimate_flops(),
        "device": device_type,
        "depth": args.depth,
        "dim": model.config.n_embd,
        "tokens_per_step": B * T,
    }
    if device_type == "cuda":
        result["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["peak_flops"] = peak_flops("cuda")
        if result["peak_flops"]:
            result["mfu"] = model.estimate_flops() * tok_per_sec / result["peak_flops"]
    else:
        result["peak_mem_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB → GiB
    return result


def main():
    args = parse()
    if args.worker:
        variant, mode, precision, reads = args.worker.split("@")
        print("RESULT " + json.dumps(run_variant(args, variant, mode, precision, int(reads))), flush=True)
        return
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    results = benchmark(args, archs, sys.argv[1:])
    print_ratios(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "results": results, "ratios": ratios(results)}, f, indent=1)
    if len(results) < len(archs) * len(compile_modes(args.compile)) * len(
        listed(args.precision, PRECISIONS, "--precision")
    ) * len(listed(args.host_reads, READS, "--host-reads")):
        sys.exit(1)  # a variant failed (its error is printed above)


VARIANTS = ("gpt", "nag", "nag:reference", "nag:compiled", "nag:fused")
COMPILE_MODES = ("off", "on", "blocks")
PRECISIONS = ("bf16", "fp8")
READS = ("1", "2")


def listed(spec, allowed, flag):
    values = [v.strip() for v in spec.split(",") if v.strip()]
    if not values or any(v not in allowed for v in values):
        sys.exit(f"error: unknown {flag} {spec!r} (a comma list of {', '.join(allowed)})")
    return values


def compile_modes(spec):
    modes = [m.strip() for m in spec.replace("both", "off,on").split(",") if m.strip()]
    bad = [m for m in modes if m not in COMPILE_MODES]
    if bad or not modes:
        sys.exit(f"error: unknown --compile {spec!r} (a comma list of {', '.join(COMPILE_MODES)}, or both)")
    return modes


def benchmark(args, archs, argv):
    """Run every (variant, compile mode) pair in its own process; print a line each; return the results."""
    bad = [a for a in archs if a not in VARIANTS]
    if bad:
        sys.exit(f"error: unknown arch {bad} (choose from {', '.join(VARIANTS)})")
    results = []
    combos = [
        (mode, arch, precision, reads)
        for mode in compile_modes(args.compile)
        for arch in archs
        for precision in listed(args.precision, PRECISIONS, "--precision")
        for reads in listed(args.host_reads, READS, "--host-reads")
    ]
    for mode, arch, precision, reads in combos:
        cmd = [sys.executable, "-m", "scripts.bench.train", "--worker", f"{arch}@{mode}@{precision}@{reads}"] + list(
            argv
        )
        env = dict(os.environ)
        cache = tempfile.mkdtemp(prefix="bench_train_cache_") if args.fresh_cache else None
        if cache:
            env.update(
                TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"), TRITON_CACHE_DIR=os.path.join(cache, "triton")
            )
        try:
            out = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                env=env,
                cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
            )
        finally:
            if cache:
                shutil.rmtree(cache, ignore_errors=True)
        line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            print(f"{arch} compile={mode}: failed\n{out.stderr[-2000:]}", flush=True)
            continue
        r = json.loads(line[len("RESULT ") :])
        results.append(r)
        print(variant_line(r), flush=True)
    if results:
        print(
            f"config: depth {args.depth}, dim {results[0]['dim']}, batch "
            f"{args.device_batch_size}×{args.max_seq_len}, device {results[0]['device']}"
        )
    return results


LABELS = {"off": "eager   ", "on": "compiled", "blocks": "blocks  "}
NAMES = {"off": "eager", "on": "compiled", "blocks": "compiled per block"}


def variant_line(r):
    """A variant's line: its step time split into forward + backward and the optimizer, throughput, peak memory,
    compile seconds."""
    return (
        f"{r['arch']:13s} {LABELS[r['compile']]} {r['precision']} {r['host_reads']} read(s) | "
        f"{r['step_ms']:9.1f} ms/step (fwd+bwd {r['fwd_bwd_ms']:.1f}, optimizer {r['optim_ms']:.1f}) | "
        f"{r['tok_per_sec']:12,.0f} tok/s | peak {r['peak_mem_gib']:.2f} GiB | compile: model "
        f"{r['model_compile_s']:.1f} s ({r['model_graphs']} graph(s)), "
        f"optimizer {r['optim_compile_s']:.1f} s ({r['optim_graphs']})"
        + (f" | mfu {100 * r['mfu']:.1f}%" if "mfu" in r else "")
    )


def faster(a, b):
    """Which of two variants (two NAG implementations) is faster and by how much, each one's step split and peak
    memory beside it: the line a choice of implementation is made from."""
    fast, slow = sorted((a, b), key=lambda r: r["step_ms"])
    light = min((a, b), key=lambda r: r["peak_mem_gib"])
    pair = lambda key, fmt: f"{fast[key]:{fmt}} vs {slow[key]:{fmt}}"
    return (
        f"{fast['arch']} is {slow['step_ms'] / fast['step_ms']:.3f}× as fast as {slow['arch']} "
        f"({pair('step_ms', '.1f')} ms a step: fwd+bwd {pair('fwd_bwd_ms', '.1f')}, optimizer "
        f"{pair('optim_ms', '.1f')}), peak memory {pair('peak_mem_gib', '.1f')} GiB "
        f"({light['arch']} {abs(a['peak_mem_gib'] - b['peak_mem_gib']):.1f} GiB less)"
    )


def ratios(results):
    """Every variant against the first one compiled the same way (GPT when listed first), every NAG implementation
    against the first one listed (with which is faster: `faster`), and every compiled-per-block variant against the
    same arch compiled whole: what, the step time and peak memory ratios."""
    out = []
    base = [r for r in results if r.get("precision", "bf16") == "bf16" and r.get("host_reads", 1) == 1]
    for r in base:
        first = next(f for f in base if f["compile"] == r["compile"])
        nag = next((n for n in base if n["compile"] == r["compile"] and n["arch"].startswith("nag")), None)
        if r is not first:
            out.append((f"{r['arch']} / {first['arch']} ({NAMES[r['compile']]})", r, first))
        if r["arch"].startswith("nag") and nag is not first and r is not nag:
            out.append((f"{r['arch']} / {nag['arch']} ({NAMES[r['compile']]})", r, nag))
    for r in base:
        whole = next((w for w in base if w["arch"] == r["arch"] and w["compile"] == "on"), None)
        if whole and r["compile"] == "blocks":
            out.append((f"{r['arch']} per block / whole", r, whole))
    # the same arch and compile mode in bf16 with base_train's one read: fp8's gain, the old read's cost
    for r in results:
        same = next((b for b in base if b["arch"] == r["arch"] and b["compile"] == r["compile"]), None)
        if same and r is not same:
            what = f"{r['precision']}, {r['host_reads']} host read(s) / bf16, 1"
            out.append((f"{r['arch']} {what} ({NAMES[r['compile']]})", r, same))
    two_impls = lambda a, b: a["arch"] != b["arch"] and a["arch"].startswith("nag") and b["arch"].startswith("nag")
    return [
        {
            "what": what,
            "step_time": r["step_ms"] / base["step_ms"],
            "peak_mem": r["peak_mem_gib"] / base["peak_mem_gib"],
            "model_compile_s": [r["model_compile_s"], base["model_compile_s"]],
            **({"faster": faster(r, base)} if two_impls(r, base) else {}),
        }
        for what, r, base in out
    ]


def print_ratios(results):
    for q in ratios(results):
        print(
            f"{q['what']}: step time {q['step_time']:.3f}×, peak memory {q['peak_mem']:.3f}×"
            + (
                f", model compile {q['model_compile_s'][0]:.1f} s vs {q['model_compile_s'][1]:.1f} s"
                if q["what"].endswith("whole")
                else ""
            )
            + (f": {q['faster']}" if "faster" in q else "")
        )


if __name__ == "__main__":
    main()
