"""fp8 training (nanochat/fp8.py) on the CPU, whose _scaled_mm runs the same math: the three matmuls against exact ones
within what fp8 rounding allows, the size rule, evaluation in the compute dtype, and a tiny --fp8 run that trains and
resumes exactly."""

import json
import math
import os

import pytest
import torch

from conftest import TINY_TRAIN
from nanochat import fp8
from nanochat.common import UserError
from nanochat.fp8 import fp8_linear
from nanochat.gpt import GPT, GPTConfig
from scripts import base_train

# Rounding to a format with m mantissa bits makes a relative error spread evenly over ±2^-(m+1): its rms is
# 2^-(m+1)/√3. A product of two rounded operands adds two such errors (in quadrature, being independent).
E4M3_RMS = 2 ** -4 / math.sqrt(3)  # 3.6 %
E5M2_RMS = 2 ** -3 / math.sqrt(3)  # 7.2 %
FORWARD_TOL = math.sqrt(2) * E4M3_RMS  # x and W in e4m3: 5.1 %
BACKWARD_TOL = math.sqrt(E5M2_RMS ** 2 + E4M3_RMS ** 2)  # dy in e5m2 times x or W in e4m3: 8.1 %


def rel(a, b):
    return ((a.float() - b).norm() / b.norm()).item()


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
    assert chosen == [f"blocks.{i}.{m}" for i in range(2) for m in ("attn.c_q", "attn.c_k", "attn.c_v", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")] + ["lm_head"]
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


FP8_TINY = TINY_TRAIN + ["--model-dim", "128", "--fp8", "--run", "f8"]  # 128 wide: the size rule admits the block matrices


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
    assert [(r["step"], r["train_loss"], r.get("val_bpb")) for r in resumed] == [(r["step"], r["train_loss"], r.get("val_bpb")) for r in full]
    # without --fp8 it is another setting: refused as any other
    err = script_error(base_train.main, *[a for a in common if a != "--fp8"], "--resume", "latest")
    assert "--fp8 True → False" in err


def test_compiled_fp8_is_one_graph_equal_to_eager():
    """torch.compile (inductor on the CPU, as on CUDA) takes the fp8 matmul as one opaque node: no graph break, the
    same values forward and backward."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, 128, generator=g), torch.randn(256, 128, generator=g)

    def loss(x, w):
        return torch.relu(fp8_linear(x, w)).square().mean()
    grads = []
    for fn in (loss, torch.compile(loss, fullgraph=True)):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        value = fn(xs, ws)
        value.backward()
        grads.append((value.detach(), xs.grad, ws.grad))
    assert not torch._dynamo.utils.counters["graph_break"]
    for eager, compiled in zip(*grads):
        assert torch.allclose(eager, compiled, rtol=1e-5, atol=1e-7)


def test_the_step_benchmark_measures_fp8_and_the_host_reads():
    """scripts.bench.train's variant (gpu_checks' fp8, fp8_d24 and host_reads stages), in process on a tiny model."""
    from scripts.bench import train as bench
    args = bench.parse(["--depth", "2", "--model-dim", "128", "--head-dim", "32", "--max-seq-len", "32", "--vocab-size", "512",
                        "--device-batch-size", "2", "--steps", "1", "--warmup", "1", "--device-type", "cpu"])
    r = bench.run_variant(args, "gpt", "off", "fp8", 2)
    assert (r["precision"], r["fp8_layers"], r["host_reads"]) == ("fp8", 13, 2) and r["step_ms"] > 0 and math.isfinite(r["last_loss"])
    assert bench.ratios([dict(r, precision="bf16", host_reads=1), r])[0]["what"] == "gpt fp8, 2 host read(s) / bf16, 1 (eager)"
