"""
Benchmark every attention kernel that loads against SDPA: time and output differences.

Attention alone, every kernel that loads against SDPA (nanochat/flash_attention.py, docs/design.md §2): forward,
backward and forward + backward time of one attention call (each the median of --steps calls timed alone: CUDA
events on a GPU), for a full causal window (L) and the half window of S layers, each kernel's S time against its L
time (a window should cost no more than the full row), and the largest differences between each kernel's outputs
and input gradients and SDPA's, each kernel also against a reference in a wider dtype. "attention" is the record
base_train would keep at this shape: the kernel --attn resolves to and why (auto: the timings it chose by).

    python -m scripts.bench.attention                    # CUDA: the published shape (16 × 2048, 5 heads × 128, bf16); CPU: a tiny one
    python -m scripts.bench.attention --compile --json attention.json   # gpu_checks' stage: also the chosen kernel compiled

The kernels: sdpa (L: SDPA's default backend, flash on Hopper; S: flex_attention with a block mask on CUDA, the
dense mask on the CPU), cudnn (SDPA's cuDNN backend; S as sdpa), fa3 (the hub's FlashAttention-3), fa4
(flash-attn-4), each only where it loads and passes its probe; the JSON says why not for the others. On CUDA the
S window also times sdpa-mask: SDPA with the dense (T, T) mask the model built before flex_attention.
--attn auto runs every kernel that loads; --attn NAME runs SDPA and NAME (an error where NAME cannot run); --attn
sdpa runs SDPA alone. The reference is SDPA in fp32 on CUDA (fp64 on the CPU) of the same inputs. The run fails
(exit status 1) when a kernel's error against it is more than SLACK × the baseline's plus 1e-3 (the baseline:
sdpa-mask for S on CUDA, else sdpa; a wrong window costs O(0.1), rounding does not), or when the compiled call
differs from eager. --compile compiles the S-window call of the kernel --attn resolves to (what training would
run) with fullgraph=True (a graph break is reported, then it compiles without fullgraph): what base_train's
torch.compile of the model meets.

"routed": attention of queries gathered at given positions (routed_attention: Mixture-of-Depths' attention, each
row's capacity at a 20 % skip rate, positions drawn per row), per window: flex_attention with a block mask built from
the positions on CUDA against SDPA with the gathered dense mask (routed-mask, MoD's path before), SDPA with that
mask on the CPU; with --compile also compiled with fullgraph=True over two batches of positions (graphs: 1 wanted).
"""

import sys
import json
import time
import argparse

import torch

from nanochat import flash_attention as fa
from nanochat.common import UserError, exit_on_user_error
from nanochat.step_timer import call_ms
from nag.mod import capacity

SLACK = 4.0  # a kernel may be this many times further from the reference than the baseline (plus 1e-3) before it fails
FAST = ("cudnn", "fa3", "fa4")  # timed after sdpa, each where it loads
ROUTED_SKIP = 0.2  # the routed section's rows keep MoD's capacity at this skip rate


def parse(argv=None):
    on_cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16 if on_cuda else 2)
    p.add_argument("--seq-len", type=int, default=2048 if on_cuda else 64)
    p.add_argument("--heads", type=int, default=5)
    p.add_argument("--kv-heads", type=int, default=0, help="GQA: key/value heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=128 if on_cuda else 16)
    p.add_argument("--windows", type=str, default="L,S", help="L = the whole row, S = half of it (as --window-pattern)")
    p.add_argument(
        "--attn",
        type=str,
        default="auto",
        choices=fa.CHOICES,
        help="which kernels: auto = SDPA and every other that loads; NAME = SDPA and NAME; sdpa = SDPA alone",
    )
    p.add_argument("--steps", type=int, default=10 if on_cuda else 2)
    p.add_argument("--warmup", type=int, default=3 if on_cuda else 1)
    p.add_argument("--compile", action="store_true", help="also the chosen kernel compiled, against eager, S window")
    p.add_argument("--json", type=str, default="", help="also write the figures here")
    return p.parse_args(argv)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, args, device, setup=None):
    """Milliseconds of one call: the median of --steps calls after --warmup, each timed alone (setup: before each,
    not timed)."""
    return call_ms(fn, device, reps=args.steps, warmup=args.warmup, setup=setup)


def attend(kernel, q, k, v, window):
    """One attention call as the model makes it on plain rows (B, T, H, D) in and out; sdpa-mask: SDPA with the
    dense window mask (the reference's path, and the model's on the CPU)."""
    if kernel != "sdpa-mask":
        return fa.causal_attention(q, k, v, window, kernel)
    T = q.size(1)
    mask = None if window >= T else fa.window_mask(T, window, q.device)[None, None]
    return fa.masked_attention(*(t.transpose(1, 2) for t in (q, k, v)), mask).transpose(1, 2)


def forward_backward(fn, inputs, dy):
    """Output and input gradients of fn, inputs detached copies."""
    xs = [x.detach().requires_grad_() for x in inputs]
    y = fn(*xs)
    y.backward(dy)
    return [y.detach()] + [x.grad for x in xs]


def max_diff(a, b):
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


def attention_flops(B, T, H, D, window):
    """Forward FLOPs: QKᵀ and PV over the keys each query sees (2 matmuls × 2 FLOPs per multiply-add)."""
    keys = sum(min(i + 1, window) for i in range(T))
    return 4 * B * H * D * keys


def first_line(e):
    return f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0][:200]


def pick_kernels(requested, device, dtype, shapes):
    """The kernels to time (sdpa first) and, for each other one, why it is not timed."""
    wanted = FAST if requested == "auto" else [k for k in FAST if k == requested]
    skipped = {k: f"--attn {requested}" for k in FAST if k not in wanted}
    for k in wanted:
        why = fa.kernel_unavailable(k, device, dtype, shapes=shapes)
        if why is not None:
            skipped[k] = why
    return ["sdpa"] + [k for k in wanted if k not in skipped], skipped


def compile_check(kernel, inputs, dy, window, eager, args, device):
    """The S-window call under torch.compile (fullgraph first) against eager: same output and gradients?"""
    import torch._dynamo

    out = {"kernel": kernel, "window": window}
    for fullgraph in (True, False):
        torch._dynamo.reset()
        fn = torch.compile(
            lambda q, k, v: fa.causal_attention(q, k, v, window, kernel), fullgraph=fullgraph, dynamic=False
        )
        try:
            t0 = time.perf_counter()
            got = forward_backward(fn, inputs, dy)
            sync(device)
            out.update(fullgraph=fullgraph, compile_s=time.perf_counter() - t0, max_diff_vs_eager=max_diff(got, eager))
            out["fwd_bwd_ms"] = timed(lambda: forward_backward(fn, inputs, dy), args, device)
            return out
        except Exception as e:  # a graph break under fullgraph: say so, then compile as base_train does
            out["graph_break" if fullgraph else "error"] = first_line(e)
    return out


def routed_inputs(q, k, v, dy, seed):
    """The routed section's call from a plain row's inputs (B, T, H, D): each row's capacity of queries at positions
    drawn apart per row (ascending), as (B, H, Tq, D), keys and values (B, KV, T, D), the output grad, positions."""
    B, T = q.shape[:2]
    g = torch.Generator(device=q.device).manual_seed(seed)
    Tq = capacity(T, ROUTED_SKIP)
    positions = torch.stack(
        [torch.randperm(T, generator=g, device=q.device)[:Tq].sort().values for _ in range(B)]
    )
    rows = positions[:, :, None, None].expand(B, Tq, *q.shape[2:])
    routed_q, routed_dy = (torch.gather(t, 1, rows).transpose(1, 2) for t in (q, dy))
    return routed_q, k.transpose(1, 2), v.transpose(1, 2), routed_dy, positions


def routed_mask_attention(q, k, v, positions, window):
    """SDPA with the dense (B, 1, Tq, Tk) mask: the rows of the plain row's window mask at the positions."""
    return fa.masked_attention(q, k, v, fa.window_mask(k.size(2), window, q.device)[positions][:, None])


def routed_section(args, q, k, v, dy, windows, ref_dtype, device):
    """routed_attention (and on CUDA routed-mask) per window: time, error against the reference in ref_dtype, and
    with --compile the compiled call over two batches of positions. Returns {rows, compile, ok}."""
    import torch._dynamo.testing

    rq, rk, rv, rdy, positions = routed_inputs(q, k, v, dy, seed=1)
    kernels = {"routed": fa.routed_attention}
    if device.type == "cuda":  # on the CPU routed_attention is this path
        kernels["routed-mask"] = routed_mask_attention
    rows, compiled, ok = [], [], True
    for name, window in windows.items():
        wide = [t.to(ref_dtype) for t in (rq, rk, rv, rdy)]
        ref = forward_backward(lambda *x: routed_mask_attention(*x, positions, window), wide[:3], wide[3])
        by_kernel, outs = {}, {}
        for kern, call in kernels.items():
            fn = lambda *x, call=call: call(*x, positions, window)
            outs[kern] = forward_backward(fn, (rq, rk, rv), rdy)
            row = {
                "kernel": kern,
                "window": name,
                "window_tokens": window,
                "queries": rq.size(2),
                "fwd_ms": timed(lambda: fn(rq, rk, rv), args, device),
                "fwd_bwd_ms": timed(lambda: forward_backward(fn, (rq, rk, rv), rdy), args, device),
                "err_out": max_diff(outs[kern][:1], ref[:1]),
                "err_grad": max_diff(outs[kern][1:], ref[1:]),
            }
            rows.append(row)
            by_kernel[kern] = row
        base = by_kernel.get("routed-mask", by_kernel["routed"])
        routed = by_kernel["routed"]
        routed["agree"] = all(routed[e] <= SLACK * base[e] + 1e-3 for e in ("err_out", "err_grad"))
        ok &= routed["agree"]
        times = [f"{r['kernel']} fwd {r['fwd_ms']:.3f} ms fwd+bwd {r['fwd_bwd_ms']:.3f} ms" for r in by_kernel.values()]
        print(
            f"routed {name} (window {window}), {rq.size(2)} of {k.size(1)} queries per row: "
            + ", ".join(times)
            + f" | vs reference: out {routed['err_out']:.2e}, grads {routed['err_grad']:.2e} | "
            + ("agree" if routed["agree"] else "DISAGREE"),
            flush=True,
        )
        if args.compile:
            counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
            fn = torch.compile(fa.routed_attention, backend=counter, fullgraph=True, dynamic=False)
            out = {"window": name}
            try:
                t0 = time.perf_counter()
                got = forward_backward(lambda *x: fn(*x, positions, window), (rq, rk, rv), rdy)
                sync(device)
                out["compile_s"] = time.perf_counter() - t0
                out["max_diff_vs_eager"] = max_diff(got, outs["routed"])
                out["fwd_bwd_ms"] = timed(
                    lambda: forward_backward(lambda *x: fn(*x, positions, window), (rq, rk, rv), rdy), args, device
                )
                other = routed_inputs(q, k, v, dy, seed=2)  # new positions: the same shapes, no other graph
                forward_backward(lambda *x: fn(*x, other[4], window), other[:3], other[3])
                out["graphs"] = counter.frame_count
                out["ok"] = out["graphs"] == 1 and out["max_diff_vs_eager"] <= SLACK * max(
                    routed["err_out"], routed["err_grad"]
                ) + 1e-3
            except Exception as e:  # a graph break under fullgraph, a kernel that does not compile
                out.update(error=first_line(e), ok=False)
            ok &= out["ok"]
            compiled.append(out)
            print(
                f"routed {name} compiled: "
                + (
                    f"compile {out['compile_s']:.1f} s, fwd+bwd {out['fwd_bwd_ms']:.3f} ms, {out['graphs']} graph(s) "
                    f"for two batches of positions, max diff vs eager {out['max_diff_vs_eager']:.2e}"
                    if "error" not in out
                    else f"failed: {out['error']}"
                ),
                flush=True,
            )
    return {"rows": rows, "compile": compiled, "ok": ok}


def run(args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ref_dtype = torch.float32 if device.type == "cuda" else torch.float64
    B, T, H, D = args.batch, args.seq_len, args.heads, args.head_dim
    KV = args.kv_heads or H
    if H % KV:
        raise UserError(f"--heads {H} must be a multiple of --kv-heads {KV}")
    windows = [w.strip().upper() for w in args.windows.split(",") if w.strip()]
    if not windows or any(w not in ("L", "S") for w in windows):
        raise UserError(f"--windows takes L and S (got {args.windows!r})")
    tokens = {name: T if name == "L" else T // 2 for name in windows}
    shapes = fa.AttentionShapes(D, H, KV, T, tuple(sorted(set(tokens.values()), reverse=True)))
    # what training would run at this shape, as base_train records it (auto: probed and timed, rank 0 alone)
    record = fa.agree_attention(args.attn, device, dtype, False, shapes=shapes)
    kernel, reason = record["kernel"], record["reason"]
    kernels, skipped = pick_kernels(args.attn, device, dtype, shapes)
    print(
        f"attention: {kernel} ({reason}) | timing {', '.join(kernels)} "
        f"| {device.type} {dtype} | batch {B} × {T} tokens, "
        f"{H} heads ({KV} kv) × {D}" + "".join(f"\n  {k} not run: {why}" for k, why in skipped.items()),
        flush=True,
    )

    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, dy = (torch.randn(B, T, h, D, generator=g, device=device, dtype=dtype) for h in (H, KV, KV, H))
    rows, diffs, compiled = [], [], None
    compile_at = "S" if "S" in windows else windows[-1]  # the call that passes a window
    for name in windows:
        window = tokens[name]
        ref = forward_backward(
            lambda *x: attend("sdpa-mask", *x, window), [t.to(ref_dtype) for t in (q, k, v)], dy.to(ref_dtype)
        )
        masked = name == "S" and device.type == "cuda"  # only there does sdpa run another path than the mask
        outs, by_kernel = {}, {}
        flops = attention_flops(B, T, H, D, window)
        for kern in (["sdpa-mask"] if masked else []) + kernels:
            fn = lambda *x, kern=kern: attend(kern, *x, window)
            outs[kern] = forward_backward(fn, (q, k, v), dy)
            fwd = timed(lambda: fn(q, k, v), args, device)
            both = timed(lambda: forward_backward(fn, (q, k, v), dy), args, device)
            held = {}  # the output of the forward whose backward is timed

            def forward(fn=fn):
                held["y"] = fn(*(x.detach().requires_grad_() for x in (q, k, v)))

            bwd = timed(lambda: held["y"].backward(dy), args, device, setup=forward)
            row = {
                "kernel": kern,
                "window": name,
                "window_tokens": window,
                "fwd_ms": fwd,
                "bwd_ms": bwd,
                "fwd_bwd_ms": both,
                "tflops": 3.5 * flops / (both / 1e3) / 1e12,  # backward ≈ 2.5 × forward
                "err_out": max_diff(outs[kern][:1], ref[:1]),
                "err_grad": max_diff(outs[kern][1:], ref[1:]),
            }
            rows.append(row)
            by_kernel[kern] = row
            print(
                f"{name} (window {window}) {kern:9s}  fwd {fwd:8.3f} ms  bwd {bwd:8.3f} ms  fwd+bwd {both:8.3f} ms  "
                f"{row['tflops']:6.3g} "
                f"TFLOP/s  vs reference: out {row['err_out']:.2e}, grads {row['err_grad']:.2e}",
                flush=True,
            )
        base = by_kernel["sdpa-mask" if masked else "sdpa"]  # the trusted path: every other one's error is held to its
        for kern in [k for k in by_kernel if k != base["kernel"]]:
            other = "sdpa-mask" if kern == "sdpa" else "sdpa"  # differences and speed against SDPA as the model runs it
            a, b, row = outs[kern], outs[other], by_kernel[kern]
            d = {
                "kernel": kern,
                "vs": other,
                "window": name,
                "out": max_diff(a[:1], b[:1]),
                "grad_q": max_diff(a[1:2], b[1:2]),
                "grad_k": max_diff(a[2:3], b[2:3]),
                "grad_v": max_diff(a[3:], b[3:]),
                "speedup": by_kernel[other]["fwd_bwd_ms"] / row["fwd_bwd_ms"],
                "agree": all(row[e] <= SLACK * base[e] + 1e-3 for e in ("err_out", "err_grad")),
            }
            diffs.append(d)
            print(
                f"{name} {kern} − {other}: out {d['out']:.2e}, grad q {d['grad_q']:.2e} k {d['grad_k']:.2e} v "
                f"{d['grad_v']:.2e} | {kern} {d['speedup']:.2f}× as fast | {'agree' if d['agree'] else 'DISAGREE'}",
                flush=True,
            )
        if args.compile and name == compile_at:
            compiled = compile_check(kernel, (q, k, v), dy, window, outs[kernel], args, device)
            # compiled may differ from eager by rounding, not by more than the kernel's own error
            eager = by_kernel[kernel]
            compiled["ok"] = (
                compiled.get("max_diff_vs_eager", float("inf"))
                <= SLACK * max(eager["err_out"], eager["err_grad"]) + 1e-3
            )
            print(
                f"compiled {compiled['kernel']}, window {window}: "
                + (
                    f"fullgraph {compiled['fullgraph']}, compile {compiled['compile_s']:.1f} s, "
                    f"{compiled['fwd_bwd_ms']:.3f} ms, max diff vs eager {compiled['max_diff_vs_eager']:.2e}"
                    if "compile_s" in compiled
                    else f"failed: {compiled['error']}"
                ),
                flush=True,
            )
    ms = {(r["kernel"], r["window"]): r["fwd_bwd_ms"] for r in rows}
    window_vs_full = {k: ms[k, "S"] / ms[k, "L"] for k in kernels if (k, "S") in ms and (k, "L") in ms}
    if window_vs_full:
        print(
            "S window / full causal (L), forward + backward: "
            + ", ".join(f"{k} {x:.2f}×" for k, x in window_vs_full.items())
            + f" ({'each at most 1' if max(window_vs_full.values()) <= 1 else 'MORE THAN 1: a window costs more'})",
            flush=True,
        )
    routed = routed_section(args, q, k, v, dy, tokens, ref_dtype, device)
    ok = all(d["agree"] for d in diffs) and (compiled is None or compiled["ok"]) and routed["ok"]
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype).replace("torch.", ""),
        "shape": {"batch": B, "seq_len": T, "heads": H, "kv_heads": KV, "head_dim": D},
        "attention": record,
        "window_vs_full": window_vs_full,
        "kernels": {**{k: "timed" for k in kernels}, **skipped},
        "results": rows,
        "vs_sdpa": diffs,
        "fa3_vs_sdpa": [d for d in diffs if d["kernel"] == "fa3"],
        "compile": compiled,
        "routed": routed,
        "ok": ok,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def main(argv=None):
    with exit_on_user_error():
        result = run(parse(argv))
    if not result["ok"]:
        print(
            "error: a kernel disagrees with SDPA beyond rounding, or compiled with eager, or routed attention "
            "with its reference or across batches of positions (figures above)",
            file=sys.stderr,
        )
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
