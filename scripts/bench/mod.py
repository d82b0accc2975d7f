"""
Mixture-of-Depths: training step time and FLOPs per token against the skip rate.

It measures each set of skippable blocks, on random tokens, and compares the time saved
with the FLOPs saved (docs/mod.md).

    OMP_NUM_THREADS=1 python -m scripts.bench.mod                          # the CPU demo model (d4, dim 256, T 256)
    OMP_NUM_THREADS=1 python -m scripts.bench.mod --depth 8 --rates 0,0.2,0.4 --blocks attn,mlp,both
    python -m scripts.bench.mod --arch gpt-router --depth 2 --model-dim 64 --head-dim 32 --max-seq-len 64 --vocab-size 512 --steps 2   # the router baseline, tiny

The reference is the same arch without MoD. The variants take their steps in turn, so that on a
shared machine they all meet the same load; the median step time of each is shown. "FLOPs saved" is what the realised
skip rates save in the training-FLOPs convention of base_train; "time saved" is measured. The gap is the gather /
scatter, the padded queries of the attention and the extra modulator evaluation for the score.
"""

import time
import argparse

import torch

from nag.archs import model_class
from nag.mod import ModConfig, BLOCKS, attention_executed, mlp_executed, savable_flops
from scripts.bench import models


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=str, default="nag", choices=["nag", "gpt-router"])
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--model-dim", type=int, default=256)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--device-batch-size", type=int, default=8)
    p.add_argument("--rates", type=str, default="0.2,0.4")
    p.add_argument("--blocks", type=str, default="attn,mlp,both")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant (the median is shown)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--layer-repeats", type=int, default=8, help="timed forward + backward passes per sub-layer variant")
    return p.parse_args(argv)


def build(args, mod):
    from nag.model import NAGConfig

    kwargs = {"nag": NAGConfig(alpha_warmup_tokens=0)} if args.arch == "nag" else {}
    if mod is not None or args.arch == "gpt-router":
        kwargs["mod"] = mod or ModConfig(rate=0.0)
    return models.build(model_class(args.arch), models.shape_config(args), "cpu", **kwargs)


class Variant:
    """One model with its optimizer and fixed batch; step() is one timed training step."""

    def __init__(self, args, mod):
        self.model = build(args, mod)
        self.optimizer = self.model.setup_optimizer()
        g = torch.Generator().manual_seed(0)
        shape = (args.device_batch_size, args.max_seq_len)
        self.x = torch.randint(0, args.vocab_size, shape, generator=g)
        self.y = torch.randint(0, args.vocab_size, shape, generator=g)
        self.times = []

    def step(self):
        t0 = time.perf_counter()
        self.model(self.x, self.y).backward()
        self.optimizer.step()
        self.model.after_optimizer_step()
        self.model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    def result(self):
        m = self.model.step_metrics().get("mod", {})
        times = sorted(self.times)
        return {
            "step_ms": 1000 * times[len(times) // 2],
            "flops": m.get("flops_per_token", self.model.estimate_flops()),
            "skip_attn": m.get("skip_attn", 0.0),
            "skip_mlp": m.get("skip_mlp", 0.0),
        }


def layer_bench(args, rates):
    """One attention and one MLP sub-layer alone (forward + backward), full and gathered at each rate: where
    the savings come from, without the rest of the step (embedding, lm_head, NAG updates) diluting them."""
    model = build(args, None)
    block, cos_sin = model.blocks[0], model.rotary(args.max_seq_len)
    B, T, D = args.device_batch_size, args.max_seq_len, args.model_dim
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, D, generator=g, requires_grad=True)
    saved, full = savable_flops(model), model.estimate_flops()
    # a sub-layer's own FLOPs: what a skip saves, plus (attention) the keys and values every token still makes
    per_layer = {
        "attn": saved[("attn", 0)] + 6 * (block.attn.c_k.weight.numel() + block.attn.c_v.weight.numel()),
        "mlp": saved[("mlp", 0)],
    }
    variants = {("attn", None): lambda: block.attn(x, cos_sin, None), ("mlp", None): lambda: block.mlp(x)}
    for rate in rates:
        execute = torch.rand(B, T, generator=g) >= rate
        variants[("attn", rate)] = lambda e=execute: attention_executed(block.attn, x, cos_sin, None, e)
        variants[("mlp", rate)] = lambda e=execute: mlp_executed(block.mlp, x, e)
    times = {k: [] for k in variants}
    for i in range(2 + args.layer_repeats):
        for k, fn in variants.items():
            t0 = time.perf_counter()
            fn().square().sum().backward()
            if i >= 2:
                times[k].append(time.perf_counter() - t0)
    print(
        "one sub-layer alone, forward + backward, median of "
        f"{args.layer_repeats} (a whole training step is {full:,} FLOPs/token)"
    )
    for kind in ("attn", "mlp"):
        ref = sorted(times[(kind, None)])[args.layer_repeats // 2]
        print(f"  {kind:4s} full  | {1000 * ref:8.1f} ms")
        for rate in rates:
            t = sorted(times[(kind, rate)])[args.layer_repeats // 2]
            print(
                f"  {kind:4s} {100 * rate:3.0f}%  | {1000 * t:8.1f} ms | FLOPs saved "
                f"{100 * rate * saved[(kind, 0)] / per_layer[kind]:5.1f}% | time saved {100 * (1 - t / ref):5.1f}%"
            )


def main(argv=None):
    args = parse(argv)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    blocks = [b.strip() for b in args.blocks.split(",") if b.strip()]
    bad = [b for b in blocks if b not in BLOCKS]
    if bad:
        raise SystemExit(f"error: --blocks takes {', '.join(BLOCKS)} (got {bad[0]!r})")
    layer_bench(args, rates)
    keys = [("none", 0.0)] + [(b, r) for b in blocks for r in rates]
    variants = {k: Variant(args, None if k[0] == "none" else ModConfig(blocks=k[0], rate=k[1])) for k in keys}
    # round robin: on a shared machine every variant meets the same load, step for step
    for i in range(args.warmup + args.steps):
        for v in variants.values():
            dt = v.step()
            if i >= args.warmup:
                v.times.append(dt)
            elif i == args.warmup - 1:
                v.model.step_metrics()  # drop the warm-up's skip rates
    print(
        f"{args.arch} d{args.depth} dim {args.model_dim} | batch {args.device_batch_size}×{args.max_seq_len} | "
        f"CPU threads {torch.get_num_threads()} | median of {args.steps} steps, variants interleaved"
    )
    print(
        f"{'blocks':6s} {'rate':>5s} | {'ms/step':>9s} | {'FLOPs/token':>12s} | {'skip attn':>9s} {'skip mlp':>8s} | "
        f"{'FLOPs saved':>11s} | {'time saved':>10s}"
    )
    rows = [(b, r, variants[(b, r)].result()) for b, r in keys]
    ref = rows[0][2]
    for b, rate, r in rows:
        print(
            f"{b:6s} {100 * rate:4.0f}% | {r['step_ms']:9.1f} | {r['flops']:12,d} | {100 * r['skip_attn']:8.1f}% "
            f"{100 * r['skip_mlp']:7.1f}% | {100 * (1 - r['flops'] / ref['flops']):10.1f}% | "
            f"{100 * (1 - r['step_ms'] / ref['step_ms']):9.1f}%",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    main()
