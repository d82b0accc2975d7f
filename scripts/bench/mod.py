"""
Mixture-of-Depths: step time, peak memory and FLOPs per token by skip rate, on the run's device.

It measures each set of skippable blocks, on random tokens, compares the time saved with the FLOPs saved
(docs/mod.md) and holds the step times against issue 48's targets.

    OMP_NUM_THREADS=1 python -m scripts.bench.mod                          # the CPU demo model (d4, dim 256, T 256)
    OMP_NUM_THREADS=1 python -m scripts.bench.mod --depth 8 --rates 0,0.2,0.4 --blocks attn,mlp,both
    OMP_NUM_THREADS=1 python -m scripts.bench.mod --compile on --steps 0 --rates 0.4   # the sub-layers alone, compiled
    python -m scripts.bench.mod --depth 8 --model-dim 640 --head-dim 128 --max-seq-len 2048 --device-batch-size 16 --vocab-size 32768 --blocks both --precision bf16,fp8 --json mod.json   # (GPU)
    python -m scripts.bench.mod --arch gpt-router --depth 2 --model-dim 64 --head-dim 32 --max-seq-len 64 --vocab-size 512 --steps 2   # the router baseline, tiny

The reference is the same arch without MoD (rate 0 in --rates is that reference, which always runs), in the first
--precision; each MoD variant runs in every precision. A variant's step is base_train's whole training step
(forward, backward, optimizer), compiled whole with --compile on. That is the default where base_train compiles, on
CUDA; on a CPU base_train runs eager, and Inductor would build C++ for every variant (20 s and more each on a 2-core
box), so the CPU's default is off and --compile on asks for it.

Each variant takes its first steps before the next one is built, so its compile and its own memory are its alone.
The timed steps then go round the variants in turn, so that on a shared machine they all meet the same load, and the
median of each is shown (CUDA events on a GPU: nanochat.step_timer.call_ms). Peak memory (CUDA) is a variant's own
tensors (weights, optimizer state, batch, what its compile keeps) plus the most its step allocated above them.
"FLOPs saved" is what the realised skip rates save in base_train's convention (for a sub-layer alone: the tokens
beyond each row's capacity, which it does not compute); "time saved" is measured. The gap is the gather / scatter,
the chosen tokens under the threshold (computed, then dropped) and the score.
"""

import sys
import json
import time
import argparse
import statistics

import torch

from nag.archs import model_class
from nag.mod import ModConfig, BLOCKS, attention_executed, mlp_executed, savable_flops, capacity, check_rate
from nanochat.common import UserError, exit_on_user_error, autodetect_device_type, compute_dtype_for
from nanochat.step_timer import call_ms
from scripts.bench import models

# issue 48: a step with both blocks at this skip rate takes at most this share of full depth's step
STEP_TARGETS = {0.2: 0.90, 0.4: 0.75}
# and on the CPU, one MLP sub-layer at 40 % skipped, compiled, at most this share of the full MLP's time compiled
MLP_TARGET = (0.4, 0.75)
PRECISIONS = ("bf16", "fp8")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=str, default="nag", choices=["nag", "gpt-router"])
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--model-dim", type=int, default=256)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--device-batch-size", type=int, default=8)
    p.add_argument("--rates", type=str, default="0.2,0.4", help="skip rates; 0 is the reference, which always runs")
    p.add_argument("--blocks", type=str, default="attn,mlp,both")
    p.add_argument(
        "--precision", type=str, default="bf16", help="comma list of bf16, fp8 (base_train --fp8); MoD runs in each"
    )
    p.add_argument("--device-type", type=str, default="", choices=["", "cpu", "cuda"], help="default: cuda if any")
    p.add_argument(
        "--compile",
        type=str,
        default="",
        choices=["", "on", "off"],
        help="torch.compile each model whole, and the sub-layers alone (default: on for CUDA, off for a CPU)",
    )
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant (the median is shown); 0: none")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation happens in the first)")
    p.add_argument(
        "--layer-repeats", type=int, default=8, help="timed forward + backward passes per sub-layer variant; 0: none"
    )
    p.add_argument("--json", type=str, default="", help="also write the results here")
    return p.parse_args(argv)


def listed(spec, allowed, flag):
    values = [v.strip() for v in spec.split(",") if v.strip()]
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise UserError(f"{flag} takes a comma list of {', '.join(allowed)} (got {spec!r})")
    return values


def rates_of(spec):
    try:
        rates = sorted({float(r) for r in spec.split(",") if r.strip()})
    except ValueError:
        raise UserError(f"--rates takes a comma list of skip rates (got {spec!r})") from None
    for r in rates:
        check_rate(r, "--rates")
    return [r for r in rates if r > 0]  # 0: the reference, full depth


def device_of(args):
    device_type = args.device_type or autodetect_device_type()
    if device_type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device-type cuda: torch sees no CUDA device")
    return torch.device(device_type if device_type in ("cuda", "cpu") else "cpu")


def build(args, mod, device="cpu"):
    from nag.model import NAGConfig

    kwargs = {"nag": NAGConfig(alpha_warmup_tokens=0)} if args.arch == "nag" else {}
    if mod is not None or args.arch == "gpt-router":
        kwargs["mod"] = mod or ModConfig(rate=0.0)
    model = models.build(model_class(args.arch), models.shape_config(args), device, **kwargs)
    model.set_compute_dtype(compute_dtype_for(device.type))
    return model


def graphs():
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def allocated(device):
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


class Variant:
    """One model with its optimizer and fixed batch; step() is one training step. Built and warmed up alone: the
    CUDA memory it holds after its first steps is its own, and the first step's extra time is its compile."""

    def __init__(self, args, key, device, compiled):
        blocks, rate, precision = key
        self.key, self.device, self.times, self.step_peak, self.later_graphs = key, device, [], 0, 0
        before, graphs_before = allocated(device), graphs()
        self.model = build(args, None if blocks == "none" else ModConfig(blocks=blocks, rate=rate), device)
        self.fp8_layers = len(self.model.set_fp8(precision == "fp8"))
        self.optimizer = self.model.setup_optimizer()
        self.forward = torch.compile(self.model, dynamic=False) if compiled else self.model
        g = torch.Generator().manual_seed(0)
        shape = (args.device_batch_size, args.max_seq_len)
        self.x = torch.randint(0, args.vocab_size, shape, generator=g).to(device)
        self.y = torch.randint(0, args.vocab_size, shape, generator=g).to(device)
        t0 = time.perf_counter()
        self.step()
        self.sync()
        self.first_s = time.perf_counter() - t0
        for _ in range(args.warmup - 1):
            self.step()
        self.sync()
        self.own, self.graphs = allocated(device) - before, graphs() - graphs_before
        self.model.step_metrics()  # drop the warm-up's skip rates

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self):
        self.forward(self.x, self.y).backward()
        self.optimizer.step()
        self.model.after_optimizer_step()
        self.model.zero_grad(set_to_none=True)

    def timed_step(self):
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        before = graphs()
        self.times.append(call_ms(self.step, self.device, reps=1, warmup=0))
        self.later_graphs += graphs() - before  # static shapes: 0, whatever the batch's scores
        if cuda:
            self.step_peak = max(self.step_peak, torch.cuda.max_memory_allocated(self.device) - base)

    def result(self):
        m = self.model.step_metrics().get("mod", {})
        blocks, rate, precision = self.key
        ms = statistics.median(self.times)
        return {
            "blocks": blocks,
            "rate": rate,
            "precision": precision,
            "fp8_layers": self.fp8_layers,
            "step_ms": ms,
            "compile_s": max(self.first_s - ms / 1e3, 0.0),
            "graphs": self.graphs,  # compiled in its first steps: 1 for a model compiled whole without a break
            "later_graphs": self.later_graphs,
            "peak_mem_gib": (self.own + self.step_peak) / 2**30 if self.device.type == "cuda" else None,
            "flops": m.get("flops_per_token", self.model.estimate_flops()),
            **{k: m.get(k, 0.0) for k in ("skip_attn", "skip_mlp")},
            # the tokens over the threshold that did not fit a row's capacity, and the capacity (nag/mod.py)
            **{k: m[k] for k in ("overflow_attn", "overflow_mlp", "overflow_rows", "capacity") if k in m},
        }


def name(key):
    blocks, rate, precision = key
    return ("full depth" if blocks == "none" else f"{blocks} {100 * rate:.0f}%") + f" {precision}"


def claims(results):
    """Issue 48's targets against the results: both blocks at 20 / 40 % skipped against full depth's step time, every
    MoD variant's peak memory against full depth's (CUDA), each later precision against the first at the same
    blocks and rate. [{what, value, target, ok}]: ok when value <= target."""
    ref, first = results[0], results[0]["precision"]
    out = []
    if ref["blocks"] != "none":
        return out  # the reference failed: nothing to hold the others against
    claim = lambda what, value, target: out.append({"what": what, "value": value, "target": target})
    for r in results[1:]:
        mod = f"{r['blocks']} {100 * r['rate']:.0f}%"
        if r["precision"] == first:
            if r["blocks"] == "both" and r["rate"] in STEP_TARGETS:
                claim(f"{mod} / full depth, step time", r["step_ms"] / ref["step_ms"], STEP_TARGETS[r["rate"]])
            if r["peak_mem_gib"] and ref["peak_mem_gib"]:
                claim(f"{mod} / full depth, peak memory", r["peak_mem_gib"] / ref["peak_mem_gib"], 1.0)
            continue
        same = [x for x in results if (x["blocks"], x["rate"], x["precision"]) == (r["blocks"], r["rate"], first)]
        if same:  # (its variant in the first precision ran)
            claim(f"{mod} {r['precision']} / {first}, step time", r["step_ms"] / same[0]["step_ms"], 1.0)
    return [{**c, "ok": c["value"] <= c["target"]} for c in out]


def claim_line(c):
    return f"{c['what']}: {c['value']:.3f}× ({'PASS' if c['ok'] else 'FAIL'}, target at most {c['target']:.2f}×)"


def layer_bench(args, rates, device, compiled):
    """One attention and one MLP sub-layer alone (forward + backward), full and gathered at each rate, eager and (with
    --compile on) compiled: where the savings come from, without the rest of the step (embedding, lm_head, NAG
    updates) diluting them. Returns {kind: {"full" or rate: {"eager": ms, "compiled": ms}}}."""
    model = build(args, None, device)
    block, cos_sin = model.blocks[0], model.rotary(args.max_seq_len)
    B, T, D = args.device_batch_size, args.max_seq_len, args.model_dim
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, D, generator=g).to(device, model.compute_dtype).requires_grad_()  # as the model feeds it
    saved, full = savable_flops(model), model.estimate_flops()
    # a sub-layer's own FLOPs: what a skip saves, plus (attention) the keys and values every token still makes
    per_layer = {
        "attn": saved[("attn", 0)] + 6 * (block.attn.c_k.weight.numel() + block.attn.c_v.weight.numel()),
        "mlp": saved[("mlp", 0)],
    }
    fns = {("attn", "full"): lambda: block.attn(x, cos_sin, None), ("mlp", "full"): lambda: block.mlp(x)}
    for rate in rates:
        # the tokens over the threshold: `rate` of them skip at random; each row computes its capacity of them
        execute, cap = (torch.rand(B, T, generator=g) >= rate).to(device), capacity(T, rate)
        fns[("attn", rate)] = lambda e=execute, n=cap: attention_executed(block.attn, x, cos_sin, None, e, n)
        fns[("mlp", rate)] = lambda e=execute, n=cap: mlp_executed(block.mlp, x, e, n)
    modes = ["eager"] + (["compiled"] if compiled else [])
    compile_ = lambda fn, mode: torch.compile(fn, dynamic=False) if mode == "compiled" else fn
    variants = {(k, mode): compile_(fn, mode) for k, fn in fns.items() for mode in modes}
    run = lambda fn: fn().square().sum().backward()
    for fn in variants.values():  # compiles here
        run(fn)
    times = {k: [] for k in variants}
    for _ in range(args.layer_repeats):
        for k, fn in variants.items():
            times[k].append(call_ms(lambda: run(fn), device, reps=1, warmup=0))
    print(
        f"one sub-layer alone, forward + backward, median of {args.layer_repeats} (a whole training step is "
        f"{full:,} FLOPs/token)"
    )
    out = {}
    for (kind, which), mode in variants:
        ms = statistics.median(times[((kind, which), mode)])
        out.setdefault(kind, {}).setdefault("full" if which == "full" else which, {})[mode] = ms
    for kind in ("attn", "mlp"):
        for mode in modes:
            ref = out[kind]["full"][mode]
            print(f"  {kind:4s} full  {mode:8s} | {ref:8.2f} ms")
            for rate in rates:
                t = out[kind][rate][mode]
                # what the sub-layer no longer computes: each row's tokens beyond its capacity
                unrun = 1 - capacity(T, rate) / T
                print(
                    f"  {kind:4s} {100 * rate:3.0f}%  {mode:8s} | {t:8.2f} ms | FLOPs saved "
                    f"{100 * unrun * saved[(kind, 0)] / per_layer[kind]:5.1f}% | time saved {100 * (1 - t / ref):5.1f}%"
                )
    rate, target = MLP_TARGET
    if compiled and rate in rates:
        c = {"what": f"mlp {100 * rate:.0f}% compiled / full mlp compiled, time", "target": target}
        c["value"] = out["mlp"][rate]["compiled"] / out["mlp"]["full"]["compiled"]
        print("  " + claim_line({**c, "ok": c["value"] <= target}))
    return out


def main(argv=None):
    args = parse(argv)
    with exit_on_user_error():
        return run(args, sys.argv[1:] if argv is None else argv)


def run(args, argv):
    rates = rates_of(args.rates)
    blocks = listed(args.blocks, BLOCKS, "--blocks")
    precisions = listed(args.precision, PRECISIONS, "--precision")
    device = device_of(args)
    compiled = args.compile == "on" or (args.compile == "" and device.type == "cuda")
    # one process compiles every variant's model: each is a recompile of the same forward, which dynamo caps (8)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    layers = layer_bench(args, rates, device, compiled) if args.layer_repeats > 0 else None
    if args.steps <= 0:
        return []
    keys = [("none", 0.0, precisions[0])] + [(b, r, p) for p in precisions for b in blocks for r in rates]
    variants, failed = [], []
    for key in keys:
        try:
            variants.append(Variant(args, key, device, compiled))
        except Exception as e:  # a variant that fails (its compile, fp8 on this GPU) leaves the others' figures
            failed.append(f"{name(key)}: {type(e).__name__}: {str(e).strip()[:300]}")
            print(f"failed: {failed[-1]}", flush=True)
    if not variants:
        sys.exit("error: every variant failed")
    # round robin: on a shared machine every variant meets the same load, step for step
    for _ in range(args.steps):
        for v in variants:
            v.timed_step()
    where = f"CPU threads {torch.get_num_threads()}" if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(
        f"{args.arch} d{args.depth} dim {args.model_dim} | batch {args.device_batch_size}×{args.max_seq_len} | "
        f"{where}, {'compiled' if compiled else 'eager'} | median of {args.steps} steps, variants interleaved"
    )
    print(
        f"{'blocks':6s} {'rate':>5s} {'prec':4s} | {'ms/step':>9s} | {'peak GiB':>8s} | {'compile s':>9s} "
        f"{'graphs':>6s} | {'FLOPs/token':>12s} | {'skip attn':>9s} {'skip mlp':>8s} | {'FLOPs saved':>11s} | "
        f"{'time saved':>10s}"
    )
    results = [v.result() for v in variants]
    ref = results[0]
    for r in results:
        peak = f"{r['peak_mem_gib']:8.2f}" if r["peak_mem_gib"] is not None else f"{'-':>8s}"
        print(
            f"{r['blocks']:6s} {100 * r['rate']:4.0f}% {r['precision']:4s} | {r['step_ms']:9.1f} | {peak} | "
            f"{r['compile_s']:9.1f} {r['graphs']:>3d}+{r['later_graphs']:<2d} | {r['flops']:12,d} | "
            f"{100 * r['skip_attn']:8.1f}% {100 * r['skip_mlp']:7.1f}% | "
            f"{100 * (1 - r['flops'] / ref['flops']):10.1f}% | {100 * (1 - r['step_ms'] / ref['step_ms']):9.1f}%",
            flush=True,
        )
    checked = claims(results)
    for c in checked:
        print(claim_line(c))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "argv": list(argv),
                    "arch": args.arch,
                    "device": device.type,
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                    "compiled": compiled,
                    "depth": args.depth,
                    "dim": args.model_dim,
                    "tokens_per_step": args.device_batch_size * args.max_seq_len,
                    "results": results,
                    "claims": checked,
                    "layers": layers,
                    "failed": failed,
                },
                f,
                indent=1,
            )
    if failed:
        sys.exit(f"error: {len(failed)} of {len(keys)} variants failed: {'; '.join(failed)}")
    return [(r["blocks"], r["rate"], r) for r in results]


if __name__ == "__main__":
    main()
