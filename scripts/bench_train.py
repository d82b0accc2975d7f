"""
Training throughput and peak memory, GPT vs NAG, eager vs compiled, on random tokens.

    python -m scripts.bench_train --depth 2 --model-dim 64 --head-dim 32 --max-seq-len 64 --vocab-size 512 --device-batch-size 4 --steps 2 --warmup 1 --arch gpt,nag
    python -m scripts.bench_train --depth 20 --device-batch-size 32 --max-seq-len 2048   # (GPU): also MFU

Each variant runs in its own process so peak memory is its own (CUDA: max allocated;
CPU: peak resident set size). Ratios to the first variant are measured in the same
invocation, which is what to compare on a noisy machine.
"""

import os
import sys
import json
import time
import argparse
import resource
import subprocess

import torch


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=str, default="gpt,nag", help="comma list of gpt, nag, or nag:IMPL (reference|compiled|fused)")
    p.add_argument("--compile", type=str, default="off", choices=["off", "on", "both"])
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--aspect-ratio", type=int, default=64)
    p.add_argument("--model-dim", type=int, default=-1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--device-batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--device-type", type=str, default="")
    p.add_argument("--worker", type=str, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build_variant(variant, train_argv, vocab_size, device):
    """An initialised model for variant gpt, nag or nag:IMPL, shaped by base_train's flags in train_argv."""
    from scripts.archs import model_class
    from scripts.base_train import build_parser, model_config_from_args
    config = model_config_from_args(build_parser().parse_args(train_argv), vocab_size)
    arch, _, impl = variant.partition(":")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = model_class(arch)(config, **({"impl": impl} if impl else {}))
    model.to_empty(device=device)
    model.init_weights()
    return model


def run_variant(args, variant, compiled):
    from nanochat.common import autodetect_device_type, compute_dtype_for
    from scripts.base_train import PEAK_FLOPS
    device_type = args.device_type or autodetect_device_type()
    device = torch.device(device_type)
    model = build_variant(variant, ["--depth", str(args.depth), "--aspect-ratio", str(args.aspect_ratio),
                                    "--model-dim", str(args.model_dim), "--head-dim", str(args.head_dim),
                                    "--max-seq-len", str(args.max_seq_len)], args.vocab_size, device)
    model.set_compute_dtype(compute_dtype_for(device_type))
    optimizer = model.setup_optimizer()
    fwd = torch.compile(model, dynamic=False) if compiled else model
    B, T = args.device_batch_size, args.max_seq_len
    x = torch.randint(0, args.vocab_size, (B, T), device=device)
    y = torch.randint(0, args.vocab_size, (B, T), device=device)

    def step():
        loss = fwd(x, y)
        loss.backward()
        optimizer.step()
        model.after_optimizer_step()
        model.zero_grad(set_to_none=True)
        return loss.item()  # syncs

    for _ in range(args.warmup):
        step()
    if device_type == "cuda":
        torch.cuda.synchronize()
    t0 = time.time()
    for _ in range(args.steps):
        step()
    if device_type == "cuda":
        torch.cuda.synchronize()
    dt = (time.time() - t0) / args.steps
    tok_per_sec = B * T / dt
    result = {"arch": variant, "compiled": compiled, "step_ms": 1000 * dt, "tok_per_sec": tok_per_sec,
              "params": sum(p.numel() for p in model.parameters()), "flops_per_token": model.estimate_flops(),
              "device": device_type, "dim": model.config.n_embd}
    if device_type == "cuda":
        result["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        peak = next((v for k, v in PEAK_FLOPS.items() if k in torch.cuda.get_device_name()), None)
        if peak:
            result["mfu"] = model.estimate_flops() * tok_per_sec / peak
    else:
        result["peak_mem_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB → GiB
    return result


def main():
    args = parse()
    if args.worker:
        variant, compiled = args.worker.rsplit("@", 1)
        print("RESULT " + json.dumps(run_variant(args, variant, compiled == "1")), flush=True)
        return
    results = benchmark(args, [a.strip() for a in args.arch.split(",") if a.strip()], sys.argv[1:])
    print_ratios(results)


VARIANTS = ("gpt", "nag", "nag:reference", "nag:compiled", "nag:fused")


def benchmark(args, archs, argv):
    """Run every (variant, compiled) pair in its own process; print a line each; return the results."""
    bad = [a for a in archs if a not in VARIANTS]
    if bad:
        sys.exit(f"error: unknown arch {bad} (choose from {', '.join(VARIANTS)})")
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    results = []
    for compiled in modes:
        for arch in archs:
            cmd = [sys.executable, "-m", "scripts.bench_train", "--worker", f"{arch}@{int(compiled)}"] + list(argv)
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
            if line is None:
                print(f"{arch} compiled={compiled}: failed\n{out.stderr[-2000:]}")
                continue
            r = json.loads(line[len("RESULT "):])
            results.append(r)
            print(f"{arch:13s} {'compiled' if compiled else 'eager   '} | {r['step_ms']:9.1f} ms/step | {r['tok_per_sec']:12,.0f} tok/s | "
                  f"peak {r['peak_mem_gib']:.2f} GiB" + (f" | mfu {100 * r['mfu']:.1f}%" if 'mfu' in r else ""), flush=True)
    if results:
        print(f"config: depth {args.depth}, dim {results[0]['dim']}, batch {args.device_batch_size}×{args.max_seq_len}, device {results[0]['device']}")
    return results


def print_ratios(results):
    """Every variant against the GPT baseline compiled the same way."""
    for compiled in (False, True):
        gpt = next((r for r in results if r["arch"] == "gpt" and r["compiled"] == compiled), None)
        for r in results:
            if gpt and r is not gpt and r["compiled"] == compiled:
                print(f"{r['arch']} / gpt ({'compiled' if compiled else 'eager'}): step time {r['step_ms'] / gpt['step_ms']:.3f}×, "
                      f"peak memory {r['peak_mem_gib'] / gpt['peak_mem_gib']:.3f}×")


if __name__ == "__main__":
    main()
