"""
Sampling speed with and without the KV cache (docs/design.md §9), and whether the tokens match.

Greedy tokens per second after a prompt of
random tokens, the whole sequence recomputed for every token (uncached) against one prefill and one token per
step (cached), and whether both give the same tokens.

    OMP_NUM_THREADS=1 python -m scripts.bench.sample                     # the demo preset's shape (4 × 256, seq 256), random weights, GPT and NAG
    OMP_NUM_THREADS=1 python -m scripts.bench.sample --arch gpt,nag,nag-mod --json
    python -m scripts.bench.sample --run cpu-gpt --run cpu-nag           # trained checkpoints instead

Random weights: init_weights, then the zero-initialised output projections get small random values, so that every
sub-layer contributes. nag-mod is NAG with MoD over both blocks at --mod-rate, its thresholds calibrated on random
tokens. The two modes take turns, so that on a shared machine both meet the same load; the median of --repeats
runs of each is shown. Times include the prefill.
"""

import json
import time
import argparse

import torch

from nanochat.engine import generate
from nag.archs import model_class
from nag.mod import ModConfig, calibrate
from scripts.bench import models

ARCHS = ("gpt", "nag", "nag-mod")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=str, default="gpt,nag", help=f"random-weight models, any of {','.join(ARCHS)}")
    p.add_argument(
        "--run", type=str, action="append", default=[], help="a checkpoint instead (repeatable; its latest step)"
    )
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--model-dim", type=int, default=256)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--mod-rate", type=float, default=0.2, help="skip rate of nag-mod")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each mode (the median is shown)")
    p.add_argument("--device-type", type=str, default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--json", action="store_true", help="print the rows as one JSON line at the end")
    return p.parse_args(argv)


def build(args, arch, device):
    from nag.model import NAGConfig

    kwargs = {} if arch == "gpt" else {"nag": NAGConfig(alpha_warmup_tokens=0)}
    if arch == "nag-mod":
        kwargs["mod"] = ModConfig("both", args.mod_rate)
    model = models.build(model_class("gpt" if arch == "gpt" else "nag"), models.shape_config(args), device, **kwargs)
    g = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for block in model.blocks:
            for lin in (block.attn.c_proj, block.mlp.c_proj):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g, device=device) * args.model_dim**-0.5)
    if arch == "nag-mod":
        calibrate(model, iter([(random_tokens(args, (8, args.max_seq_len), seed, device),) for seed in range(4)]), 4)
    model.eval()
    return model


def random_tokens(args, shape, seed, device):
    return torch.randint(0, args.vocab_size, shape, generator=torch.Generator().manual_seed(seed)).to(device)


def timed(model, prompt, args, use_cache, device):
    t0 = time.perf_counter()
    out = list(generate(model, prompt, args.max_tokens, temperature=0, use_cache=use_cache))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def bench(name, model, args, device):
    vocab = model.config.vocab_size
    prompt = (random_tokens(args, (args.prompt_tokens,), 0, device) % vocab).tolist()
    timed(model, prompt[:4], args, True, device)  # warm-up
    timed(model, prompt[:4], args, False, device)
    times = {True: [], False: []}
    outs = {}
    for _ in range(args.repeats):
        for use_cache in (False, True):
            dt, outs[use_cache] = timed(model, prompt, args, use_cache, device)
            times[use_cache].append(dt)
    n = len(outs[True])
    rate = {c: n / sorted(t)[len(t) // 2] for c, t in times.items()}
    return {
        "model": name,
        "prompt_tokens": len(prompt),
        "tokens": n,
        "uncached_tok_s": rate[False],
        "cached_tok_s": rate[True],
        "speedup": rate[True] / rate[False],
        "same_tokens": outs[True] == outs[False],
    }


def main(argv=None):
    args = parse(argv)
    device = torch.device(args.device_type)
    named_models = []
    if args.run:
        from nag.archs import load_model
        from nanochat.run_dir import resolve_run_dir

        for run in args.run:
            model, meta = load_model(resolve_run_dir(run), None, device)
            if "tokens" in meta:
                model.set_tokens_seen(meta["tokens"])
            named_models.append((f"{run} ({meta['arch']})", model))
    else:
        for arch in [a.strip() for a in args.arch.split(",") if a.strip()]:
            if arch not in ARCHS:
                raise SystemExit(f"error: --arch takes {', '.join(ARCHS)} (got {arch!r})")
            named_models.append((arch, build(args, arch, device)))
    shape = named_models[0][1].config
    print(
        f"{shape.n_layer} layers × {shape.n_embd}, seq {shape.sequence_len}, vocab {shape.vocab_size} | prompt "
        f"{args.prompt_tokens} tokens, {args.max_tokens} generated, greedy | {device.type}, {torch.get_num_threads()} "
        f"thread(s), median of {args.repeats}"
    )
    print(f"{'model':24s} | {'uncached tok/s':>14s} | {'cached tok/s':>12s} | {'speed-up':>8s} | same tokens")
    rows = []
    for name, model in named_models:
        r = bench(name, model, args, device)
        rows.append(r)
        print(
            f"{name:24s} | {r['uncached_tok_s']:14.1f} | {r['cached_tok_s']:12.1f} | {r['speedup']:7.2f}x | "
            f"{'yes' if r['same_tokens'] else 'NO'}",
            flush=True,
        )
    if args.json:
        print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
