"""fp8 training (nanochat/fp8.py) on the CPU, and CUDA's rules for every _scaled_mm call.

A CPU's fp8 matmul is fp8.scaled_mm's fp32 product of the fp8 operands (never oneDNN's kernel, which some CPUs lack):
the three matmuls against exact ones within what fp8 rounding allows, the size rule, evaluation in the compute dtype,
a tiny --fp8 run that trains and resumes exactly, the weights quantised once a step (the same losses as at every
call), the ops an fp8 linear launches, one compiled graph with eager's values, and CUDA's rules for every _scaled_mm
call (which the CPU twin does not check): the token padding that meets them changes no value, and MoD's token counts
meet them. runs/test.sh reruns the tests of the matmuls' values with torch, oneDNN and MKL capped at AVX2 (the
cpu_kind mark)."""

import json
import math
import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import TINY_TRAIN
from nanochat import fp8
from nanochat.fp8 import fp8_linear
from nanochat import gpt
from nanochat.gpt import GPT, GPTConfig
from scripts import base_train


# Rounding to a format with m mantissa bits makes a relative error spread evenly over ±2^-(m+1): its rms is
# 2^-(m+1)/√3. A product of two rounded operands adds two such errors (in quadrature, being independent).
E4M3_RMS = 2**-4 / math.sqrt(3)  # 3.6 %
E5M2_RMS = 2**-3 / math.sqrt(3)  # 7.2 %
FORWARD_TOL = math.sqrt(2) * E4M3_RMS  # x and W in e4m3: 5.1 %
BACKWARD_TOL = math.sqrt(E5M2_RMS**2 + E4M3_RMS**2)  # dy in e5m2 times x or W in e4m3: 8.1 %


def rel(a, b):
    return ((a.float() - b).norm() / b.norm()).item()


@pytest.mark.cpu_kind
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_three_matmuls_against_exact_ones_within_fp8_rounding(dtype):
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(256, 512, generator=g).to(dtype).requires_grad_()
        w = (torch.randn(384, 512, generator=g) * 0.05).requires_grad_()
        dy = torch.randn(256, 384, generator=g).to(dtype)
        y = fp8_linear(x, w)
        y.backward(dy)
        x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        (x64 @ w64.t()).backward(dy.double())
        errors = rel(y, x64.detach() @ w64.detach().t()), rel(x.grad, x64.grad), rel(w.grad, w64.grad)
        assert y.dtype == dtype and x.grad.dtype == dtype and w.grad.dtype == torch.float32
        assert errors[0] < FORWARD_TOL and errors[1] < BACKWARD_TOL and errors[2] < BACKWARD_TOL, errors
        assert errors[0] > 0.01, errors  # it really rounds to fp8: bf16 alone would be ~0.3 %


def test_leading_dims_and_a_zero_tensor():
    x = torch.zeros(2, 3, 128)
    y = fp8_linear(x, torch.randn(256, 128))
    assert y.shape == (2, 3, 256) and torch.equal(y, torch.zeros_like(y))  # amax 0: no division by zero


def test_the_size_rule_and_evaluation_in_the_compute_dtype():
    cfg = GPTConfig(sequence_len=32, vocab_size=512, n_layer=2, n_head=2, n_kv_head=2, n_embd=128)
    model = GPT.initialised(cfg)
    chosen = model.set_fp8(True)
    assert chosen == [
        f"blocks.{i}.{m}"
        for i in range(2)
        for m in ("attn.c_q", "attn.c_k", "attn.c_v", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    ] + ["lm_head"]
    assert fp8.admits(128, 512) and not fp8.admits(64, 512) and not fp8.admits(136, 512 + 8) and not fp8.admits(128, 8)
    x = torch.randint(0, 512, (2, 32))
    model.eval()
    with torch.no_grad():
        evaluated = model(x)
        model.set_fp8(False)
        assert torch.equal(evaluated, model(x))  # evaluation never runs in fp8
        model.set_fp8(True)
        model.train()
        trained = model(x)
    assert not torch.equal(trained, evaluated) and rel(trained, evaluated.double()) < 0.1


def test_a_gpu_without_fp8_is_refused(monkeypatch):
    assert fp8.cannot_run("cpu") is None and "mps" in fp8.cannot_run("mps")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "compute capability 8.0 has no fp8 tensor cores" in fp8.cannot_run("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8.cannot_run("cuda") is None


# 128 wide: the size rule admits the block matrices
FP8_TINY = TINY_TRAIN + ["--model-dim", "128", "--fp8", "--run", "f8"]


@pytest.mark.cpu_kind
def test_a_cpu_needs_no_fp8_kernel_of_its_own(monkeypatch):
    """On a CPU the three matmuls never reach torch._scaled_mm: torch hands it to oneDNN on a CPU with AMX, where
    oneDNN capped below AVX512-FP16 has none ("could not create a primitive descriptor", as on the stand-in below)."""

    def no_kernel(*args, **kwargs):
        raise RuntimeError("could not create a primitive descriptor for the matmul primitive")

    monkeypatch.setattr(torch, "_scaled_mm", no_kernel)
    x, w = torch.randn(64, 128, requires_grad=True), torch.randn(256, 128, requires_grad=True)
    fp8_linear(x, w).square().sum().backward()
    assert x.grad.abs().sum() > 0 and w.grad.abs().sum() > 0 and fp8.cannot_run("cpu") is None


def test_a_tiny_fp8_run_trains_records_and_resumes_exactly(run_base, capsys, script_error):
    common = FP8_TINY + ["--num-iterations", "8", "--eval-every", "4", "--save-every", "4"]
    run_dir = base_train.main(common)
    assert "fp8: 13 linear layers in training" in capsys.readouterr().out
    full = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    cfg = json.load(open(os.path.join(run_dir, "config.json")))
    assert cfg["args"]["fp8"] is True
    assert full[-1]["train_loss"] < full[1]["train_loss"]
    base_train.main(common + ["--resume", "4"])
    resumed = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [(r["step"], r["train_loss"], r.get("val_bpb")) for r in resumed] == [
        (r["step"], r["train_loss"], r.get("val_bpb")) for r in full
    ]
    # left out of a resume, it is the run's: a resume states only what it changes
    capsys.readouterr()
    base_train.main([a for a in common if a != "--fp8"] + ["--resume", "latest"])
    assert "already finished its 8 steps; nothing to do" in capsys.readouterr().out


def weight_quantisations(monkeypatch):
    """The shapes of the weights fp8.quantise scales (its e4m3 calls on Parameters), in order."""
    calls, quantise = [], fp8.quantise

    def recording(t, dtype):
        if isinstance(t, torch.nn.Parameter):
            calls.append(tuple(t.shape))
        return quantise(t, dtype)

    monkeypatch.setattr(fp8, "quantise", recording)
    return calls


def test_a_weight_is_quantised_once_until_it_changes(monkeypatch):
    """Micro-batches 2..N and every backward reuse the weight's first quantisation, until the weight changes (an
    in-place update, a new tensor under .data): the same fp8 values a fresh quantisation gives, bit for bit."""
    quantised = weight_quantisations(monkeypatch)
    g = torch.Generator().manual_seed(2)
    w = torch.nn.Parameter(torch.randn(256, 128, generator=g) * 0.05)
    x, dy = torch.randn(48, 128, generator=g).bfloat16(), torch.randn(48, 256, generator=g).bfloat16()

    def fresh():  # a plain tensor: no cache
        xs, ws = x.clone().requires_grad_(), w.detach().clone().requires_grad_()
        y = fp8_linear(xs, ws)
        y.backward(dy)
        return y, xs.grad, ws.grad

    for change in [None, None, None, lambda: w.mul_(0.5), None, lambda: setattr(w, "data", w.detach() * 2)]:
        if change:
            with torch.no_grad():
                change()
        xs, w.grad = x.clone().requires_grad_(), None
        y = fp8_linear(xs, w)
        y.backward(dy)
        for got, want in zip((y, xs.grad, w.grad), fresh()):
            assert torch.equal(got, want)
    assert quantised == [(256, 128)] * 3  # once, once after the update, once for the new tensor
    with torch.no_grad():
        w.mul_(0.5)
    with torch.inference_mode():  # tensors made here cannot be saved for a backward: it keeps none
        fp8_linear(x, w)
    fp8_linear(x.clone().requires_grad_(), w).backward(dy)
    assert quantised == [(256, 128)] * 5


def test_one_fp8_linear_launches_few_ops():
    """An fp8 linear's forward and backward on a GPU's path (the meta device, where fp8.scaled_mm calls
    torch._scaled_mm): one pass for each operand's amax, and the weight quantised by the first micro-batch only."""
    from scripts.bench.nag import LaunchCounter

    x = torch.randn(512, 256, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(384, 256, device="meta"))
    launches = []
    for _ in range(2):
        with LaunchCounter() as forward:
            y = fp8_linear(x, w)
        dy = torch.ones_like(y)
        with LaunchCounter() as backward:
            y.backward(dy)
        launches.append((forward.total, backward.total))
        x.grad = w.grad = None
    # per operand: amax (1), its scale and inverse (6 scalar ops), the cast (x and dy: float, mul, clamp, to; W: mul,
    # clamp, to); 3 transposed copies in the backward, dW's cast to fp32 and the matmuls (was 25 + 19: float, abs and
    # max for each amax, the weight at each call)
    x_or_dy, weight = 1 + 6 + 4, 1 + 6 + 3
    assert launches == [(x_or_dy + weight + 1, x_or_dy + 3 + 1 + 2), (x_or_dy + 1, x_or_dy + 3 + 1 + 2)], launches
    assert forward.aten.count("linalg_vector_norm") == 1 and backward.aten.count("linalg_vector_norm") == 1


@pytest.mark.cpu_kind
def test_compiled_fp8_is_one_graph_equal_to_eager():
    """torch.compile (inductor on the CPU, as on CUDA) takes a stack of fp8 gpt.Linear layers as one graph, forward
    and backward, with eager's values; the graph quantises the weights itself (Inductor fuses amax, scale and cast),
    beside the caches an eager micro-batch filled, which it neither reads nor writes."""
    fp8.opaque_to_compile()  # what GPT.set_fp8(True) does
    torch.manual_seed(3)
    stack = torch.nn.Sequential(gpt.Linear(128, 256), torch.nn.ReLU(), gpt.Linear(256, 128))
    for m in stack[0], stack[2]:
        m.fp8 = True
    x = torch.randn(32, 128)

    def step(fn):
        stack.zero_grad(set_to_none=True)
        loss = fn(x).float().square().mean()
        loss.backward()
        return [loss.detach()] + [m.weight.grad for m in (stack[0], stack[2])]

    eager = step(stack)
    keys = [m.weight.fp8_cache[0] for m in (stack[0], stack[2])]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = step(torch.compile(stack, fullgraph=True))
    assert not torch._dynamo.utils.counters["graph_break"]
    for a, b in zip(eager, compiled):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    assert [m.weight.fp8_cache[0] for m in (stack[0], stack[2])] == keys  # the graph neither read nor wrote them


def test_micro_batches_reuse_the_weights_and_train_as_without(run_base, monkeypatch):
    """base_train --fp8 with 2 micro-batches a step: each weight quantised once a step (the optimizer's update bumps
    its version), and the same losses as quantising it at every call."""
    quantised = weight_quantisations(monkeypatch)
    args = FP8_TINY + ["--total-batch-size", "512", "--num-iterations", "3", "--eval-every", "-1"]

    def losses(run):
        run_dir = base_train.main(args + ["--run", run])
        return [json.loads(line)["train_loss"] for line in open(os.path.join(run_dir, "metrics.jsonl"))]

    cached = losses("cached")
    assert len(quantised) == 13 * 3
    monkeypatch.setattr(fp8, "quantised_weight", lambda w: fp8.quantise(w, fp8.E4M3))
    assert losses("every-call") == cached and len(quantised) == 13 * 3 + 13 * 3 * 2


def test_set_fp8_makes_the_matmul_one_opaque_node_for_compile(monkeypatch):
    """GPT.set_fp8(True) registers FP8Matmul with dynamo (not at import: that would import dynamo in every command):
    the traced graph calls it as one node, where dynamo would otherwise trace into its forward and backward."""
    from nanochat import gpt

    registered = []
    monkeypatch.setattr(gpt, "opaque_to_compile", lambda: registered.append(fp8.opaque_to_compile()))
    torch._dynamo.reset()
    with torch.device("meta"):
        model = gpt.GPT(gpt.GPTConfig(sequence_len=64, vocab_size=256, n_layer=1, n_head=1, n_kv_head=1, n_embd=128))
    model.set_fp8(False)
    assert registered == []
    model.set_fp8(True)
    assert registered == [None]
    graphs = []

    def record(gm, inputs):
        graphs.append(gm)
        return gm.forward

    x, w = torch.randn(32, 128, requires_grad=True), torch.randn(128, 128, requires_grad=True)
    torch.compile(lambda x, w: fp8_linear(x, w).sum(), backend=record, fullgraph=True)(x, w)
    calls = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert len(calls) == 1 and "autograd_function_apply" not in calls[0], calls


def test_the_step_benchmark_measures_fp8_and_the_host_reads():
    """scripts.bench.train's variant (gpu_checks' fp8, fp8_d24 and host_reads stages), in process on a tiny model."""
    from scripts.bench import train as bench

    args = bench.parse(
        [
            "--depth",
            "2",
            "--model-dim",
            "128",
            "--head-dim",
            "32",
            "--max-seq-len",
            "32",
            "--vocab-size",
            "512",
            "--device-batch-size",
            "2",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--device-type",
            "cpu",
        ]
    )
    r = bench.run_variant(args, "gpt", "off", "fp8", 2)
    assert (
        (r["precision"], r["fp8_layers"], r["host_reads"]) == ("fp8", 13, 2)
        and r["step_ms"] > 0
        and math.isfinite(r["last_loss"])
    )
    assert (
        bench.ratios([dict(r, precision="bf16", host_reads=1), r])[0]["what"]
        == "gpt fp8, 2 host read(s) / bf16, 1 (eager)"
    )


# ---------------------------------------------------------------------------
# CUDA's rules for _scaled_mm, checked on the CPU (whose kernel takes any shape and layout)

SCALED_MM = torch._scaled_mm  # CUDA's, run on fake CUDA tensors: its meta kernel checks shapes and layouts
CPU_SCALED_MM = fp8.scaled_mm  # the CPU twin, for references


def check_cuda_rules(a, b, scale_a, scale_b, out_dtype=None, **kw):
    """Raise unless CUDA's _scaled_mm takes this tensorwise call: its rules as aten/src/ATen/native/cuda/Blas.cpp
    checks them (K and both dims of the second operand multiples of 16; M, the first operand's rows, may be any), then
    the CUDA meta kernel (torch's own checks) on fake CUDA tensors of the same shapes and strides."""
    assert a.dtype in (fp8.E4M3, fp8.E5M2) and b.dtype in (fp8.E4M3, fp8.E5M2), (a.dtype, b.dtype)
    assert a.stride(1) == 1 and b.stride(0) == 1, (
        f"the first operand row-major, the second column-major: {a.stride()}, {b.stride()}"
    )
    assert all(d % 16 == 0 for d in b.shape), f"K and N multiples of 16: {tuple(a.shape)} @ {tuple(b.shape)}"
    assert all(s.dtype == torch.float32 and s.dim() == 0 for s in (scale_a, scale_b)) and out_dtype is not None
    with FakeTensorMode(allow_non_fake_inputs=False):

        def fake(t):
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")

        SCALED_MM(fake(a), fake(b), scale_a=fake(scale_a), scale_b=fake(scale_b), out_dtype=out_dtype, **kw)


@pytest.fixture
def cuda_rules(monkeypatch):
    """Every scaled_mm call (nanochat/fp8.py's three) checked against CUDA's rules; the calls' operand shapes."""
    calls = []

    def checked(a, b, **kw):
        check_cuda_rules(a, b, **kw)
        calls.append((tuple(a.shape), tuple(b.shape)))
        return CPU_SCALED_MM(a, b, **kw)

    monkeypatch.setattr(fp8, "scaled_mm", checked)
    return calls


def test_the_checker_refuses_what_cuda_refuses():
    s = torch.tensor(1.0)
    a, b = torch.zeros(256, 512).to(fp8.E4M3), torch.zeros(128, 512).to(fp8.E4M3).t()
    check_cuda_rules(a, b, scale_a=s, scale_b=s, out_dtype=torch.bfloat16)
    check_cuda_rules(a[:250], b, scale_a=s, scale_b=s, out_dtype=torch.bfloat16)  # M is free
    for bad_a, bad_b, why in [
        (a[:, :500], b[:500], "multiples of 16"),
        (a, b.contiguous(), "column-major"),
        (a.t().contiguous().t(), b, "row-major"),
    ]:
        with pytest.raises(AssertionError, match=why):
            check_cuda_rules(bad_a, bad_b, scale_a=s, scale_b=s, out_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="divisible by 16"):  # the CUDA meta kernel, on its own
        with FakeTensorMode():
            x = torch.empty(256, 500, dtype=fp8.E5M2, device="cuda")
            SCALED_MM(
                x,
                torch.empty(128, 500, dtype=fp8.E4M3, device="cuda").t(),
                scale_a=torch.empty((), device="cuda"),
                scale_b=torch.empty((), device="cuda"),
                out_dtype=torch.bfloat16,
            )


def zero_rows_below(t, rows):
    """t (fp8) with zero rows below it up to `rows`, written out by hand: the reference for fp8.pad_rows."""
    out = torch.zeros(rows, t.size(1), dtype=t.dtype)
    out[: t.size(0)] = t
    return out


def check_padded_matmuls(n, calls):
    """fp8_linear's three matmuls at N = n tokens, each against a reference on the same shapes, bit for bit; and dW
    against the exact product of the unpadded operands. calls: cuda_rules' record of the _scaled_mm calls."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 128, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(256, 128, generator=g) * 0.05).requires_grad_()
    dy = torch.randn(n, 256, generator=g).bfloat16()
    y = fp8_linear(x, w)
    y.backward(dy)
    padded = -(-n // 16) * 16
    # dW's K padded
    assert calls == [((n, 128), (128, 256)), ((n, 256), (256, 128)), ((256, padded), (padded, 128))]
    assert y.shape == (n, 256) and x.grad.shape == (n, 128)
    xq, x_inv = fp8.quantise(x.detach(), fp8.E4M3)
    wq, w_inv = fp8.quantise(w.detach(), fp8.E4M3)
    dyq, dy_inv = fp8.quantise(dy, fp8.E5M2)
    # y and dx take the N real rows (M is free): the same products of the unpadded quantised operands
    y_ref = CPU_SCALED_MM(xq, wq.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=torch.bfloat16, use_fast_accum=True)
    dx_ref = CPU_SCALED_MM(dyq, fp8.column_major(wq), scale_a=dy_inv, scale_b=w_inv, out_dtype=torch.bfloat16)
    assert torch.equal(y, y_ref) and torch.equal(x.grad, dx_ref)
    # dW: the unpadded quantised operands with zero rows below them, the same product on the same shapes (a kernel
    # sums K = 500 and K = 512 in other orders: the unpadded product differs in its last bits on some CPUs)
    xq_pad, dyq_pad = zero_rows_below(xq, padded), zero_rows_below(dyq, padded)
    dw_ref = CPU_SCALED_MM(
        dyq_pad.t().contiguous(), fp8.column_major(xq_pad), scale_a=dy_inv, scale_b=x_inv, out_dtype=torch.bfloat16
    )
    assert torch.equal(w.grad, dw_ref.float())
    # and the zero rows change no value: dW is the exact product of the unpadded operands within the rounding of an
    # fp32 sum in any order (the products, the two scalings and each partial sum round by at most 2^-24 relative:
    # (K + 2)·2^-24·Σ|a·b| in all, to first order) and of the bf16 result (half an ulp: 2^-8 relative)
    a, b = dyq.double() * dy_inv.item(), xq.double() * x_inv.item()
    exact = a.t() @ b
    fp32_sums = (padded + 2) * 2**-24 * (a.abs().t() @ b.abs())
    assert ((w.grad.double() - exact).abs() <= 2**-8 * (exact.abs() + fp32_sums) + fp32_sums).all()


@pytest.mark.cpu_kind
@pytest.mark.parametrize("n", [500, 37, 512])
def test_padded_tokens_meet_cuda_rules_and_change_no_value(n, cuda_rules):
    """MoD packs any token count N; dW = dyᵀ·x has N as its inner dim. fp8.py pads x and dy to a multiple of 16 rows
    with zeros for it: zero rows add exact zeros and leave every amax, hence every scale, as it is."""
    check_padded_matmuls(n, cuda_rules)
    x = torch.randn(n, 128).requires_grad_()
    assert (fp8.pad_rows(x) is x) == (n % 16 == 0)  # no copy when N needs no padding
    fp8.FP8Matmul.apply(x, torch.randn(256, 128)).mul_(2)  # y is no view of the padded product: in-place ops allowed


@pytest.mark.cpu_kind
@pytest.mark.parametrize("where", ["ones", "above"])
def test_the_padding_check_catches_padding_bugs(where, cuda_rules, monkeypatch):
    """check_padded_matmuls fails on a padding that changes values: pad rows of ones (dW takes their products), or
    zero rows above the real ones (y and dx then take the first N rows: pad rows, real rows cut off)."""

    def bad_pad_rows(t):
        missing = -t.size(0) % fp8.MULTIPLE
        rows = (0, missing) if where == "ones" else (missing, 0)
        return torch.nn.functional.pad(t, (0, 0, *rows), value=1.0 if where == "ones" else 0.0)

    monkeypatch.setattr(fp8, "pad_rows", bad_pad_rows)
    with pytest.raises(AssertionError):
        check_padded_matmuls(500, cuda_rules)


@pytest.mark.parametrize("mod", [["--arch", "nag"], ["--arch", "gpt-router"]], ids=["nag-mod", "router-mod"])
def test_a_tiny_fp8_mod_run_meets_cuda_rules(mod, run_base, cuda_rules, monkeypatch):
    """MoD's gathered sub-layers run on B·capacity tokens, a multiple of 8 at T = 64 (nag/mod.py capacity): with one
    row a micro-batch (4 a step) 56, no multiple of 16, padded to one."""
    tokens = []

    def recording(x, weight):
        tokens.append(x.numel() // x.size(-1))
        return fp8_linear(x, weight)

    monkeypatch.setattr(gpt, "fp8_linear", recording)
    one_row = ["--device-batch-size", "1", "--num-iterations", "2", "--eval-every", "-1"]
    base_train.main(FP8_TINY + mod + ["--mod-rate", "0.2"] + one_row)
    assert cuda_rules and len(cuda_rules) == 3 * len(tokens)
    assert any(n % 16 for n in tokens), sorted(set(tokens))
