"""The memory plan (nanochat/memory.py): predictions, the counts it scales, its batch, its refusals.

Predictions are set against one H200's measured peaks."""

import json

import pytest
import torch

from nag.archs import plan_for
from nanochat import memory
from nanochat.gpus import BY_NAME, gpu_of
from scripts import base_train
from scripts.bench import gpu_checks

# one H200, torch 2.11 + cu130, bf16, compiled whole (docs/LOG.md, "The first GPU run"): torch.cuda.max_memory_allocated
BENCH_SHAPE = ["--depth", "8", "--model-dim", "640", "--head-dim", "128", "--max-seq-len", "2048",
               "--device-batch-size", "16", "--total-batch-size", str(16 * 2048), "--num-iterations", "5"]  # fmt: skip
MEASURED = [
    ("bench gpt", ["--arch", "gpt", *BENCH_SHAPE], 8.70),
    ("bench nag:fused", ["--arch", "nag", "--nag-impl", "fused", *BENCH_SHAPE], 10.74),
    ("base_train nag", [*gpu_checks.NAG_TRAIN], 10.74),
]


def planned(argv, nproc=1):
    args = base_train.parse_args(argv)
    return args, plan_for(args, 32768, nproc)


@pytest.mark.parametrize("what,argv,gib", MEASURED, ids=[m[0] for m in MEASURED])
def test_predicted_peak_within_ten_percent_of_the_h200s(what, argv, gib):
    _, plan = planned([*argv, "--gpu", "h200"])
    assert plan.memory.compiled
    assert plan.memory.peak == pytest.approx(gib, rel=0.10), plan.memory.line()


def test_nag_over_gpt_is_the_readouts_gradient_not_its_activations():
    """The H200 measured NAG's peak 1.23× GPT's while its saved activations cost 1.005×: the plan puts the
    difference in the readout term (the logits' gradient beside the saved logits), not in the layers."""
    gpt = planned([*MEASURED[0][1], "--gpu", "h200"])[1].memory
    nag = planned([*MEASURED[1][1], "--gpu", "h200"])[1].memory
    assert nag.activations / gpt.activations == pytest.approx(1.005, abs=0.003)
    logits_gib = 16 * 2048 * 32768 * 2 / 2**30  # one bf16 logit per token and vocab entry
    assert nag.readout - gpt.readout == pytest.approx(logits_gib, rel=0.03)
    assert nag.peak / gpt.peak == pytest.approx(10.74 / 8.70, rel=0.02)


LOGGED = [("gpt", 24_388, 23_108), ("nag:fused", 24_508, 23_228), ("nag:reference", 29_676, 28_392)]


@pytest.mark.parametrize("variant,counted,distinct", LOGGED)
def test_saved_activations_per_layer_as_logged_and_the_distinct_bytes_the_plan_scales(variant, counted, distinct):
    """docs/LOG.md's counts (compiled, D = 640): the tensors the min-cut partition hands the backward. They count the
    attention output twice (saved as itself and as an alias of its storage): the plan counts distinct storages,
    one bf16 row of 640 (1,280 B) less (the reference, 4 B more: one fp32 per token also saved twice)."""
    from scripts.bench.nag import activations_per_layer
    from nag.archs import model_class
    from nanochat.gpt import GPTConfig

    assert activations_per_layer(variant, 640, 32768, "cpu", True, seq_len=13) == counted
    arch, _, impl = variant.partition(":")
    config = GPTConfig(sequence_len=13, vocab_size=32768, n_layer=8, n_head=5, n_kv_head=5, n_embd=640)
    kwargs = {"impl": impl} if impl else {}
    footprint = memory.measure(model_class(arch), kwargs, config, fp8=False, compiled=True)
    assert footprint.per_token_layer == distinct


def test_a_24_gib_gpu_gets_a_smaller_device_batch_and_more_accumulation_for_the_same_batch():
    _, h100 = planned(["--preset", "published", "--arch", "nag", "--gpu", "h100"], nproc=8)
    args, small = planned(["--preset", "published", "--arch", "nag", "--gpu-memory", "24"], nproc=8)  # auto
    assert h100.memory.fits and h100.device_batch == 16  # the published run's, on 80 GB H100s
    assert small.device_batch < h100.device_batch and small.memory.fits
    assert small.total_batch == h100.total_batch == 2**20
    assert small.grad_accum * small.device_batch == h100.grad_accum * h100.device_batch
    assert args.device_batch_size == small.device_batch  # the run trains with the number chosen
    # the next power of two up would not fit: the largest that does
    doubled = memory.plan_memory(
        small.model,
        _groups(small, args),
        _footprint(small, args),
        2 * small.device_batch,
        2048,
        small.grad_accum // 2,
        8,
        24,
        True,
    )
    assert not doubled.fits


def _groups(plan, args):
    from nanochat.optim import param_groups

    return param_groups(plan.optimizer_groups(args))


def _footprint(plan, args):
    from nag.archs import arch_spec

    spec = arch_spec(plan.arch)
    kwargs = plan.model.kwargs_on("cuda", spec.init_kwargs(args))
    return memory.measure(type(plan.model), kwargs, plan.config, args.fp8, True)


def test_a_given_device_batch_that_does_not_fit_is_refused_naming_the_largest_that_does(script_error):
    err = script_error(
        base_train.main, "--preset", "published", "--arch", "gpt", "--dry-run", "1", "--gpu", "rtx4090",
        "--device-batch-size", "16",
    )  # fmt: skip
    assert "does not fit the RTX 4090's 24.0 GiB at --device-batch-size 16" in err
    assert "the largest that fits is 4 (--device-batch-size 4, or auto)" in err


def test_a_run_that_fits_at_no_batch_is_refused_in_one_line(script_error):
    err = script_error(base_train.main, "--preset", "published", "--arch", "nag", "--dry-run", "8", "--gpu-memory", "3")
    assert "does not fit 3 GiB even at device batch 1" in err


def test_the_plan_line_carries_every_term_and_the_chosen_batch(capsys):
    base_train.main(["--preset", "published", "--arch", "gpt", "--dry-run", "8", "--gpu", "a100-40gb"])
    out = capsys.readouterr().out
    record = json.loads(next(line for line in out.splitlines() if line.startswith("PLAN "))[5:])
    m = record["memory"]
    terms = ("weights", "optimizer", "gradients", "activations", "readout", "weight_copies")
    assert m["peak_gib"] == pytest.approx(sum(m[f"{t}_gib"] for t in terms), abs=1e-3)
    assert m["fits"] and m["needed_gib"] <= m["gpu_gib"] == BY_NAME["a100-40gb"].memory_gib
    assert record["device_batch_size"] == m["device_batch_size"] == 8
    assert record["grad_accum_steps"] * 8 * 2048 * 8 == record["total_batch_size"]
    assert record["gpu"] == {"gpu": "a100-40gb", "label": "A100 40GB", "memory_gib": 39.6, "peak_flops": 312e12}
    assert "A100 40GB: memory per GPU at device batch 8:" in out and "fits" in out


def test_a_cpu_run_plans_no_gpu_memory_and_auto_takes_what_the_batch_allows(capsys):
    argv = ["--depth", "2", "--model-dim", "64", "--head-dim", "32", "--max-seq-len", "64", "--total-batch-size",
            "256", "--num-iterations", "3", "--device-type", "cpu"]  # fmt: skip
    args, plan = planned([*argv, "--device-batch-size", "auto"])
    assert plan.memory is None and plan.device_batch == 4 and plan.grad_accum == 1  # 256 tokens: 4 rows of 64
    assert args.device_batch_size == 4
    args, plan = planned([*argv[:-6], "--num-iterations", "3", "--device-type", "cpu"])  # the default batch rule
    assert plan.device_batch == memory.DEFAULT_BATCH


def test_gpu_table_names_and_form_factors():
    assert gpu_of("NVIDIA GeForce RTX 5090").name == "rtx5090"
    assert gpu_of("NVIDIA H100 PCIe").name == "h100-pcie" and gpu_of("NVIDIA H100 80GB HBM3").name == "h100"
    assert gpu_of("NVIDIA A100-SXM4-40GB").name == "a100-40gb" and gpu_of("NVIDIA A100-SXM4-80GB").name == "a100"
    assert gpu_of("NVIDIA L4") is None
    for g in BY_NAME.values():
        assert g.peak_flops > 50e12 and 20 < g.memory_gib < 200, g


def test_live_token_bytes_follow_allocations_and_frees():
    """The eager tracker: storages with a token dimension count while alive, views count once."""
    T = 13
    with memory.LiveTokenBytes(T) as tracker:
        a = torch.ones(T, 100)  # 5,200 B
        b = a.view(100, T) * 2  # a new 5,200 B
        v = b[:, :4]  # a view: nothing new
        del a
        c = torch.zeros(T, 10)  # 520 B, after a was freed
        torch.ones(7, 7)  # no token dimension
    assert tracker.peak == 10_400 and tracker.now == 5_720
    del b, v, c


def test_eager_peak_holds_more_than_the_saved_tensors():
    """Eager, the readout's backward holds its fp32 gradients beside the saved logits: the eager peak per token is
    above what autograd saves."""
    from nag.archs import model_class
    from nanochat.gpt import GPTConfig

    config = GPTConfig(sequence_len=13, vocab_size=4096, n_layer=2, n_head=2, n_kv_head=2, n_embd=128)
    eager = memory.measure(model_class("gpt"), {}, config, fp8=False, compiled=False)
    compiled = memory.measure(model_class("gpt"), {}, config, fp8=False, compiled=True)
    assert eager.per_token_head > compiled.per_token_head > 2 * 4096
    assert eager.per_token_layer >= compiled.per_token_layer > 0


def test_gpu_checks_sets_each_prediction_beside_its_measurement():
    """The GPU run's judge: the step stage's models and base_train's runs, predicted against measured."""
    step = {"results": [{"arch": "gpt", "depth": 8, "tokens_per_step": 32768, "peak_mem_gib": 8.70}]}
    base = {"peak_mem_gib": 10.74, "predicted_peak_gib": 10.75}
    mod = {"peak_mem_gib": 9.0, "predicted_peak_gib": 12.0}
    text = gpu_checks.memory_plan_figures(step, base, mod)
    gpt = planned([*MEASURED[0][1], "--gpu", "h200"])[1].memory.peak
    assert text.startswith(f"gpt {gpt:.2f} predicted / 8.70 GiB measured (") and "within 10%" in text
    assert "base_train nag 10.75 predicted / 10.74 GiB measured (+0.1%, within 10%)" in text
    assert "base_train fp8 MoD 12.00 predicted / 9.00 GiB measured (+33.3%, OUTSIDE 10%)" in text


def test_a_real_run_plans_for_the_gpu_torch_sees(monkeypatch):
    """The CPU twin of a CUDA run's plan (device_type "cuda"): the memory torch reports for the current device, the
    table's entry for its name (MFU), compiled unless TORCH_COMPILE_DISABLE=1; --gpu-memory wins over the card."""
    import nanochat.plan

    monkeypatch.setattr(nanochat.plan, "gpu_here", lambda: ("NVIDIA GeForce RTX 4090", 24_563 / 1024))
    argv = ["--preset", "published", "--arch", "gpt"]
    args = base_train.parse_args(argv)
    plan = plan_for(args, 32768, 8, "cuda")
    assert plan.target.gpu.name == "rtx4090" and plan.memory.gpu_gib == pytest.approx(23.99, abs=0.01)
    assert plan.device_batch == 4 and plan.memory.compiled and plan.memory.fits
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    args = base_train.parse_args([*argv, "--gpu-memory", "12"])
    plan = plan_for(args, 32768, 8, "cuda")
    assert not plan.memory.compiled and plan.memory.gpu_gib == 12 and plan.memory.fits
    assert plan.device_batch < 4  # eager saves more than compiled


def test_gradients_alive_at_the_peak():
    """One micro-batch on one rank: the readout's gradient alone (written first). Accumulating: all of them, kept
    between micro-batches; under DDP one more copy in its buckets. fp32, as the masters."""
    one = planned([*MEASURED[0][1], "--gpu", "h200"])[1]
    assert one.grad_accum == 1 and one.memory.gradients * 2**30 == 32768 * 640 * 4
    _, node = planned(["--preset", "published", "--arch", "gpt", "--gpu", "h100"], nproc=8)
    params = sum(p.numel() for p in node.model.parameters())
    assert node.grad_accum > 1 and node.memory.gradients * 2**30 == 2 * 4 * params
    assert node.memory.weights * 2**30 == 4 * params
