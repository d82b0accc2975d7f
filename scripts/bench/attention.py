"""
Attention alone, FlashAttention-3 against SDPA (nanochat/flash_attention.py, docs/design.md §2): forward and
forward + backward time of one attention call, for a full causal window (L) and the half window of S layers
(SDPA: the mask the model builds; FA3: its own window_size), and the largest differences between the two kernels'
outputs and input gradients, each kernel also against a reference in a wider dtype.

    python -m scripts.bench.attention                    # CUDA: the published shape (16 × 2048, 5 heads × 128, bf16); CPU: a tiny one
    python -m scripts.bench.attention --compile --json attention.json   # gpu_checks' stage: also FA3 under torch.compile

FA3 is timed when it loads (--attn auto); --attn fa3 makes a machine where it cannot an error, --attn sdpa skips it.
The reference is SDPA in fp32 on CUDA (fp64 on the CPU) of the same inputs. The run fails (exit status 1) when FA3's
error against it is more than FA3_SLACK × SDPA's plus 1e-3 (a wrong window costs O(0.1); rounding does not), or when
FA3 compiled differs from FA3 eager. --compile compiles the S-window call with fullgraph=True (graph breaks are
reported, then it compiles without fullgraph): what base_train's torch.compile of the model meets.
"""

import sys
import json
import time
import argparse

import torch

from nanochat import flash_attention as fa
from nanochat.common import UserError, exit_on_user_error

FA3_SLACK = 4.0  # FA3 may be this many times further from the reference than SDPA (plus 1e-3) before it fails


def parse(argv=None):
    on_cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16 if on_cuda else 2)
    p.add_argument("--seq-len", type=int, default=2048 if on_cuda else 64)
    p.add_argument("--heads", type=int, default=5)
    p.add_argument("--kv-heads", type=int, default=0, help="GQA: key/value heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=128 if on_cuda else 16)
    p.add_argument("--windows", type=str, default="L,S", help="L = the whole row, S = half of it (as --window-pattern)")
    p.add_argument("--attn", type=str, default="auto", choices=fa.CHOICES, help="which kernels: auto = SDPA, and FA3 where it loads")
    p.add_argument("--steps", type=int, default=10 if on_cuda else 2)
    p.add_argument("--warmup", type=int, default=3 if on_cuda else 1)
    p.add_argument("--compile", action="store_true", help="also FA3 (else SDPA) compiled, against eager, S window")
    p.add_argument("--json", type=str, default="", help="also write the figures here")
    return p.parse_args(argv)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, steps, warmup, device):
    """Milliseconds per call, after warmup calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    return 1e3 * (time.perf_counter() - t0) / steps


def attend(kernel, q, k, v, window, mask):
    """One attention call as the model makes it on plain rows: FA3 with the layer's window, or SDPA with the
    shared window mask the model builds (is_causal where the window covers the row). (B, T, H, D) in and out."""
    if kernel == "fa3" or mask is None:
        return fa.causal_attention(q, k, v, window, kernel)
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


def compile_check(kernel, inputs, dy, window, eager, args, device):
    """The S-window call under torch.compile (fullgraph first) against eager: same output and gradients?"""
    import torch._dynamo
    out = {"kernel": kernel, "window": window}
    for fullgraph in (True, False):
        torch._dynamo.reset()
        fn = torch.compile(lambda q, k, v: fa.causal_attention(q, k, v, window, kernel), fullgraph=fullgraph, dynamic=False)
        try:
            t0 = time.perf_counter()
            got = forward_backward(fn, inputs, dy)
            sync(device)
            out.update(fullgraph=fullgraph, compile_s=time.perf_counter() - t0, max_diff_vs_eager=max_diff(got, eager))
            out["fwd_bwd_ms"] = timed(lambda: forward_backward(fn, inputs, dy), args.steps, args.warmup, device)
            return out
        except Exception as e:  # a graph break under fullgraph: say so, then compile as base_train does
            out["graph_break" if fullgraph else "error"] = first_line(e)
    return out


def run(args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ref_dtype = torch.float32 if device.type == "cuda" else torch.float64
    kernel, reason = fa.resolve_attention(args.attn, device, dtype)
    kernels = ["sdpa"] + (["fa3"] if kernel == "fa3" else [])
    B, T, H, D = args.batch, args.seq_len, args.heads, args.head_dim
    KV = args.kv_heads or H
    if H % KV:
        raise UserError(f"--heads {H} must be a multiple of --kv-heads {KV}")
    windows = [w.strip().upper() for w in args.windows.split(",") if w.strip()]
    if not windows or any(w not in ("L", "S") for w in windows):
        raise UserError(f"--windows takes L and S (got {args.windows!r})")
    print(f"attention: {kernel} ({reason}) | {device.type} {dtype} | batch {B} × {T} tokens, {H} heads ({KV} kv) × {D}", flush=True)

    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, dy = (torch.randn(B, T, h, D, generator=g, device=device, dtype=dtype) for h in (H, KV, KV, H))
    rows, diffs, compiled = [], [], None
    compile_at = "S" if "S" in windows else windows[-1]  # the call that passes a window
    for name in windows:
        window = T if name == "L" else T // 2
        mask = None if window >= T else fa.window_mask(T, window, device)[None, None]
        ref = forward_backward(lambda *x: attend("sdpa", *x, window, mask), [t.to(ref_dtype) for t in (q, k, v)], dy.to(ref_dtype))
        outs = {}
        flops = attention_flops(B, T, H, D, window)
        for kern in kernels:
            fn = lambda *x, kern=kern: attend(kern, *x, window, mask)
            outs[kern] = forward_backward(fn, (q, k, v), dy)
            fwd = timed(lambda: fn(q, k, v), args.steps, args.warmup, device)
            both = timed(lambda: forward_backward(fn, (q, k, v), dy), args.steps, args.warmup, device)
            row = {"kernel": kern, "window": name, "window_tokens": window, "fwd_ms": fwd, "fwd_bwd_ms": both,
                   "tflops": 3.5 * flops / (both / 1e3) / 1e12,  # backward ≈ 2.5 × forward
                   "err_out": max_diff(outs[kern][:1], ref[:1]), "err_grad": max_diff(outs[kern][1:], ref[1:])}
            rows.append(row)
            print(f"{name} (window {window}) {kern:4s}  fwd {fwd:8.3f} ms  fwd+bwd {both:8.3f} ms  {row['tflops']:6.3g} TFLOP/s  "
                  f"vs reference: out {row['err_out']:.2e}, grads {row['err_grad']:.2e}", flush=True)
        if "fa3" in outs:
            a, b = outs["fa3"], outs["sdpa"]
            d = {"window": name, "out": max_diff(a[:1], b[:1]), "grad_q": max_diff(a[1:2], b[1:2]), "grad_k": max_diff(a[2:3], b[2:3]),
                 "grad_v": max_diff(a[3:], b[3:])}
            fa3_row, sdpa_row = rows[-1], rows[-2]
            d["speedup"] = sdpa_row["fwd_bwd_ms"] / fa3_row["fwd_bwd_ms"]
            d["agree"] = all(fa3_row[e] <= FA3_SLACK * sdpa_row[e] + 1e-3 for e in ("err_out", "err_grad"))
            diffs.append(d)
            print(f"{name} fa3 − sdpa: out {d['out']:.2e}, grad q {d['grad_q']:.2e} k {d['grad_k']:.2e} v {d['grad_v']:.2e} | "
                  f"fa3 {d['speedup']:.2f}× as fast | {'agree' if d['agree'] else 'DISAGREE'}", flush=True)
        if args.compile and name == compile_at:
            compiled = compile_check(kernels[-1], (q, k, v), dy, window, outs[kernels[-1]], args, device)
            eager = rows[-1]  # compiled may differ from eager by rounding, not by more than the kernel's own error
            compiled["ok"] = compiled.get("max_diff_vs_eager", float("inf")) <= FA3_SLACK * max(eager["err_out"], eager["err_grad"]) + 1e-3
            print(f"compiled {compiled['kernel']}, window {window}: " + (
                f"fullgraph {compiled['fullgraph']}, compile {compiled['compile_s']:.1f} s, {compiled['fwd_bwd_ms']:.3f} ms, "
                f"max diff vs eager {compiled['max_diff_vs_eager']:.2e}" if "compile_s" in compiled else f"failed: {compiled['error']}"), flush=True)
    ok = all(d["agree"] for d in diffs) and (compiled is None or compiled["ok"])
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype).replace("torch.", ""),
              "shape": {"batch": B, "seq_len": T, "heads": H, "kv_heads": KV, "head_dim": D},
              "attention": {"requested": args.attn, "kernel": kernel, "reason": reason},
              "results": rows, "fa3_vs_sdpa": diffs, "compile": compiled, "ok": ok}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def main(argv=None):
    with exit_on_user_error():
        result = run(parse(argv))
    if not result["ok"]:
        print("error: FA3 disagrees with SDPA beyond rounding, or compiled with eager (figures above)", file=sys.stderr)
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
