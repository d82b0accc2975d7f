"""Which attention kernel a run gets, and the CUDA paths' CPU twins.

nanochat/flash_attention.py, docs/design.md §2: rank 0 decides and every rank loads (two gloo ranks), the probe
at the run's own shapes (head dim, GQA, each window; cuDNN alone), the Hopper fallback warning and the GPU presets'
refusal of SDPA, the dry run's line, and the mask-free S window (flex_attention with a block mask) against the
dense-mask reference. The CUDA tests at the end run the real kernels where a GPU is present."""

import contextlib
import json
import os
import socket
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import PROCESSES
from nanochat import flash_attention as fa
from nanochat.common import UserError
from nanochat.gpt import GPT, GPTConfig
from scripts import base_train


FAKE_MS = dict(sdpa=1.0, cudnn=0.9, fa4=0.6, fa3=0.75)  # auto's timings, faked: FA4 the fastest, SDPA the slowest


def fake_kernel_ms(kernel, device, shapes=None):
    return FAKE_MS[kernel]


def fake_hopper(monkeypatch, loads=("fa4", "cudnn", "fa3")):
    """A Hopper GPU as torch.cuda shows it, on which the kernels in `loads` load and pass their probe, timed as
    FAKE_MS says."""
    monkeypatch.setattr(fa, "kernel_ms", fake_kernel_ms)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(
        fa,
        "kernel_unavailable",
        lambda kernel, device, dtype=None, shapes=None: (
            None if kernel == "sdpa" or kernel in loads else f"{kernel} does not load here"
        ),
    )


# ---------------------------------------------------------------------------
# rank 0 decides, every rank loads: two gloo ranks


def _rank(rank, init_file, out_dir):
    """Each scenario on two ranks; rank 1 cannot load fa4 (its loader is faked), rank 0 can."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    os.environ["RANK"] = str(rank)  # print0 prints on rank 0 only
    answers = {}
    fa.kernel_ms = fake_kernel_ms
    try:
        torch.cuda.is_available = lambda: True
        torch.cuda.get_device_capability = lambda device=None: (9, 0)
        for name, requested, rank1_loads, preset in [
            ("both load", "auto", True, ""),
            ("rank 1 cannot", "auto", False, ""),
            ("named, rank 1 cannot", "fa4", False, ""),
            ("rank 0 falls back", "auto", None, ""),
            ("published refused", "auto", None, "published"),
        ]:

            def unavailable(kernel, device, dtype=None, shapes=None, rank1_loads=rank1_loads):
                if kernel == "sdpa" or (rank1_loads is not None and (rank == 0 or rank1_loads)):
                    return None
                return "flash-attn-4 is not installed (pip install flash-attn-4)"

            fa.kernel_unavailable = unavailable
            try:
                # a faked GPU: nothing is allocated
                answers[name] = fa.agree_attention(requested, torch.device("cuda"), torch.bfloat16, True, preset)
            except UserError as e:
                answers[name] = f"UserError: {e}"
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(answers, f)


def answers_of_two_ranks(rank_fn, tmp_path):
    """rank_fn(rank, init file, out dir) on two gloo ranks; each rank's answers, from the rank<r>.json it wrote."""
    import torch.multiprocessing as mp

    # forked: the ranks start with this process's imports (a spawned rank would import torch and the repo again)
    mp.start_processes(rank_fn, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True, start_method="fork")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@PROCESSES
def test_rank0_decides_and_every_rank_loads_or_every_rank_stops(tmp_path):
    r0, r1 = answers_of_two_ranks(_rank, tmp_path)
    assert r0 == r1  # the same decision, or the same one line, on both ranks
    fastest = "Hopper GPU, fa4 the fastest (forward + backward: fa4 0.6 ms, fa3 0.75 ms, cudnn 0.9 ms, sdpa 1 ms)"
    assert r0["both load"] == {"requested": "auto", "kernel": "fa4", "reason": fastest, "timed_ms": FAKE_MS}
    host = socket.gethostname()
    for name in ("rank 1 cannot", "named, rank 1 cannot"):
        assert r0[name] == (
            f"UserError: attention: rank 0 chose fa4 ({fastest if 'named' not in name else 'flash-attn-4 loaded'}), "
            f"but rank(s) 1 ({host}: flash-attn-4 is not installed (pip install flash-attn-4)) cannot run it; "
            "install it on every node, or pass --attn sdpa"
        )
    fell = r0["rank 0 falls back"]  # nothing loads on rank 0: SDPA everywhere, with the warning in the record
    assert fell["kernel"] == "sdpa" and fell["warning"].startswith(
        "--attn auto fell back to SDPA on a Hopper GPU (cudnn: "
    )
    assert r0["published refused"].startswith(
        "UserError: --preset published on a Hopper GPU needs a fast attention kernel"
    )


# ---------------------------------------------------------------------------
# the probe at the run's own shapes: head dim, GQA, each window, forward and backward


class Flaky:
    """flash_attn_func on the CPU (window_size as FA3/FA4 take it: left of None or -1 is no limit, else left + 1
    positions), failing where a real build might: in the backward at head dim 128, or on any window."""

    def __init__(self, fails=None):
        self.fails = fails

    def __call__(self, q, k, v, causal=True, window_size=(None, 0)):
        left, T = window_size[0], q.size(1)
        if self.fails == "window" and left not in (None, -1):
            raise RuntimeError("no local-attention kernel for this build")
        y = fa.masked_attention(
            *(t.transpose(1, 2) for t in (q, k, v)), fa.window_mask(T, T if left in (None, -1) else left + 1, q.device)
        ).transpose(1, 2)
        if self.fails == "head dim 128" and q.size(-1) == 128:
            y.register_hook(refuse_head_dim_128)
        return y, None  # FA4 also returns the log-sum-exp


def refuse_head_dim_128(grad):
    raise RuntimeError("backward: head dim 128 is not supported on sm90")


def cpu_stands_in_for_hopper(fa4, fa3):
    """fa4 and fa3 'loaded' (no import, no hub) as the given fakes, timed as FAKE_MS says; the CPU passes for a Hopper
    GPU; nothing probed yet. cuDNN is real: on the CPU, SDPA under cuDNN alone has no backend, so cudnn fails its
    probe (as it should)."""
    fa.device_unfit = lambda device, dtype=None, majors=(9,): None
    fa._fa4, fa._fa3, fa._probed = fa4, types.SimpleNamespace(flash_attn_func=fa3), set()
    fa.kernel_ms = fake_kernel_ms


def scenario_shapes():
    """Three runs' attention: 4 query heads on 2 kv heads, rows of 64 tokens, S windows of 32."""
    shapes = lambda head_dim, windows: fa.AttentionShapes(
        head_dim=head_dim, n_head=4, n_kv_head=2, seq_len=64, windows=windows
    )
    return {
        "hd 64, L and S": shapes(64, (64, 32)),
        "hd 128, L": shapes(128, (64,)),
        "hd 128, L and S": shapes(128, (64, 32)),
    }


def _shapes_rank(rank, init_file, out_dir):
    """--attn auto on two ranks with fa4 failing at head dim 128 and fa3 failing on windows; last, rank 1's fa4
    alone refuses windows."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    os.environ["RANK"] = str(rank)
    answers, runs = {}, scenario_shapes()
    try:
        for name, fa4_fails in [(n, "head dim 128") for n in runs] + [
            ("rank 1's fa4 refuses windows", "window" if rank else None)
        ]:
            cpu_stands_in_for_hopper(Flaky(fa4_fails), Flaky("window"))
            try:
                answers[name] = fa.agree_attention(
                    "auto", torch.device("cpu"), torch.bfloat16, True, shapes=runs.get(name, runs["hd 64, L and S"])
                )
            except UserError as e:
                answers[name] = f"UserError: {e}"
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(answers, f)


@PROCESSES
def test_auto_passes_over_a_kernel_that_fails_the_runs_shapes_and_every_rank_probes_them(tmp_path):
    r0, r1 = answers_of_two_ranks(_shapes_rank, tmp_path)
    assert r0 == r1
    heads = "4 heads / 2 kv heads"
    fa4_fails = (
        f"fa4: fa4 failed its probe at head dim 128, {heads}, L window 64 "
        "(RuntimeError: backward: head dim 128 is not supported on sm90)"
    )
    fastest = "Hopper GPU, {} the fastest (forward + backward: {} ms, sdpa 1 ms)"
    # head dim 64 and windows: fa4 runs both, and is timed against SDPA; cudnn (no CPU backend) and fa3 (no windows)
    # are passed over
    hd64 = r0["hd 64, L and S"]
    assert hd64["kernel"] == "fa4" and hd64["reason"] == fastest.format("fa4", "fa4 0.6")
    assert hd64["timed_ms"] == {"sdpa": 1.0, "fa4": 0.6}
    assert [x.split(":")[0] for x in hd64["passed_over"]] == ["cudnn", "fa3"]
    # fa4 fails at head dim 128 (its backward), cudnn has no CPU backend, fa3 takes plain causal rows
    fa3 = r0["hd 128, L"]
    assert fa3["kernel"] == "fa3" and fa3["reason"] == fastest.format("fa3", "fa3 0.75")
    assert fa3["passed_over"][0].startswith(
        f"cudnn: cudnn failed its probe at head dim 128, {heads}, L window 64 (RuntimeError: "
    )
    assert fa3["passed_over"][1] == fa4_fails
    none = r0["hd 128, L and S"]  # and fa3 fails the S window: SDPA, with every reason, each naming its shape
    assert none["kernel"] == "sdpa" and "probed" not in none and "timed_ms" not in none
    assert none["reason"].startswith("cudnn: ") and f"; {fa4_fails}; fa3: " in none["reason"]
    assert none["reason"].endswith(
        f"; fa3: fa3 failed its probe at head dim 128, {heads}, S window 32 of 64 "
        "(RuntimeError: no local-attention kernel for this build)"
    )
    # rank 0 chose fa4 at the run's shapes; rank 1 probes the same shapes
    assert r0["rank 1's fa4 refuses windows"] == (
        f"UserError: attention: rank 0 chose fa4 ({fastest.format('fa4', 'fa4 0.6')}), but rank(s) 1 "
        f"({socket.gethostname()}: fa4 failed its probe at head dim 64, {heads}, S window 32 of 64 (RuntimeError: no "
        "local-attention kernel for this build)) cannot run it; install it on every node, or pass --attn sdpa"
    )


def test_the_record_keeps_each_shape_the_kernel_passed(monkeypatch):
    """config.json's attention entry: per window of the run, the shape probed and that it passed. A long row is
    probed short (fa.PROBE_LEN tokens) with its S window scaled along, so the window still cuts the row."""
    for name in ("device_unfit", "_fa4", "_fa3", "_probed", "kernel_ms"):
        monkeypatch.setattr(fa, name, getattr(fa, name))  # cpu_stands_in_for_hopper sets them: restored after
    cpu_stands_in_for_hopper(Flaky("window"), Flaky())
    shapes = fa.AttentionShapes(
        head_dim=16, n_head=4, n_kv_head=1, seq_len=2 * fa.PROBE_LEN, windows=(2 * fa.PROBE_LEN, fa.PROBE_LEN // 2)
    )
    record = fa.agree_attention("auto", "cpu", torch.bfloat16, False, shapes=shapes)
    at = dict(head_dim=16, n_head=4, n_kv_head=1, seq_len=2 * fa.PROBE_LEN, probe_len=fa.PROBE_LEN)
    assert record["kernel"] == "fa3" and record["probed"] == [
        dict(at, window=2 * fa.PROBE_LEN, probe_window=fa.PROBE_LEN, ok=True),  # L: the whole (short) row
        # S: a quarter of the row, as in the run
        dict(at, window=fa.PROBE_LEN // 2, probe_window=fa.PROBE_LEN // 4, ok=True),
    ]
    assert record["timed_ms"] == {"sdpa": 1.0, "fa3": 0.75} and record["passed_over"][1] == (
        f"fa4: fa4 failed its probe at head dim 16, 4 heads / 1 kv heads, S window "
        f"{fa.PROBE_LEN // 2} of {2 * fa.PROBE_LEN} (RuntimeError: no local-attention kernel for this build)"
    )
    assert json.loads(json.dumps(record)) == record  # config.json takes it as it is
    assert ("fa3", "cpu", shapes) in fa._probed  # probed once per kernel, device and shapes
    assert fa.agree_attention("sdpa", "cpu", torch.bfloat16, False, shapes=shapes) == {
        "requested": "sdpa",
        "kernel": "sdpa",
        "reason": "--attn sdpa",
    }  # SDPA is not probed


def test_the_cudnn_probe_runs_cudnn_alone_at_the_runs_shapes(monkeypatch):
    """cuDNN's probe asks for cuDNN and nothing else (no flash to take a call it declines), with the run's head dim and
    GQA: a raise there (on the CPU, no backend at all) marks cudnn unavailable; a call it takes passes."""
    monkeypatch.setattr(fa, "device_unfit", lambda device, dtype=None, majors=(9,): None)
    monkeypatch.setattr(fa, "_probed", set())
    asked, shapes_seen, real = [], [], fa.sdpa_kernel
    monkeypatch.setattr(
        fa, "sdpa_kernel", lambda backends, set_priority=False: asked.append(backends) or real(backends, set_priority)
    )
    masked = fa.masked_attention
    monkeypatch.setattr(
        fa,
        "masked_attention",
        lambda q, k, v, mask: (
            shapes_seen.append((tuple(q.shape), tuple(k.shape), mask is None)) or masked(q, k, v, mask)
        ),
    )
    shapes = fa.AttentionShapes(head_dim=128, n_head=4, n_kv_head=2, seq_len=64, windows=(64, 32))
    why = fa.kernel_unavailable("cudnn", "cpu", torch.bfloat16, shapes=shapes)
    assert why.startswith(
        "cudnn failed its probe at head dim 128, 4 heads / 2 kv heads, L window 64 (RuntimeError: No viable backend"
    )
    assert asked == [fa.SDPBackend.CUDNN_ATTENTION]  # alone: not a priority list with flash behind it
    assert shapes_seen == [((1, 4, 64, 128), (1, 2, 64, 128), True)]  # (B, H, T, D): the run's head dim and GQA, causal
    with pytest.raises(UserError, match=r"^--attn cudnn cannot run here: cudnn failed its probe at head dim 128"):
        fa.resolve_attention("cudnn", "cpu", torch.bfloat16, shapes)
    asked.clear()
    shapes_seen.clear()
    monkeypatch.setattr(
        fa, "sdpa_kernel", lambda backends, set_priority=False: asked.append(backends) or contextlib.nullcontext()
    )
    # cuDNN takes it (the CPU's SDPA stands in)
    assert fa.kernel_unavailable("cudnn", "cpu", torch.bfloat16, shapes=shapes) is None
    assert asked == [fa.SDPBackend.CUDNN_ATTENTION]  # the L window; the S window runs what training runs there
    # cuDNN and the fp32 reference, then S: the kernel, the reference
    assert [s[2] for s in shapes_seen] == [True, True, False, False]


def test_base_train_probes_the_models_own_shapes(run_base, monkeypatch):
    """base_train passes the model's attention shapes to agree_attention: head dim, heads, kv heads, each window."""
    from conftest import TINY_TRAIN

    seen = []

    class Stop(Exception):
        pass

    def agree(*args, shapes=None):
        seen.append(shapes)
        raise Stop

    monkeypatch.setattr(base_train, "agree_attention", agree)
    with pytest.raises(Stop):
        base_train.main(
            TINY_TRAIN + ["--run", "s", "--num-iterations", "2", "--window-pattern", "SL", "--n-kv-head", "1"]
        )
    assert seen == [fa.AttentionShapes(head_dim=32, n_head=2, n_kv_head=1, seq_len=64, windows=(64, 32))]


# ---------------------------------------------------------------------------
# the Hopper fallback warning and the GPU presets' refusal of SDPA


@pytest.mark.parametrize(
    "requested, kernel, hopper, preset, refused",
    [
        ("auto", "sdpa", True, "published", True),
        ("auto", "sdpa", True, "d20", True),  # every GPU preset
        ("sdpa", "sdpa", True, "published", False),  # asked for explicitly
        ("auto", "fa4", True, "published", False),
        ("auto", "cudnn", True, "published", False),
        ("auto", "sdpa", False, "published", False),  # not Hopper: SDPA is what there is
        ("auto", "sdpa", True, "", False),  # no GPU preset: the warning only
    ],
)
def test_gpu_presets_refuse_sdpa_on_hopper_unless_asked(requested, kernel, hopper, preset, refused):
    check = lambda: fa.check_preset_attention(requested, kernel, hopper, preset, "fa4: not installed")
    if not refused:
        assert check() is None
        return
    with pytest.raises(UserError) as e:
        check()
    assert str(e.value) == (
        f"--preset {preset} on a Hopper GPU needs a fast attention kernel, but --attn auto found none "
        "(fa4: not installed); pip install flash-attn-4, or pass --attn sdpa to train with SDPA anyway"
    )


def test_auto_falling_back_on_hopper_warns_and_records_it(monkeypatch, capsys):
    fake_hopper(monkeypatch, loads=())
    record = fa.agree_attention("auto", "cuda", torch.bfloat16, False)
    reason = "cudnn: cudnn does not load here; fa4: fa4 does not load here; fa3: fa3 does not load here"
    assert record == {
        "requested": "auto",
        "kernel": "sdpa",
        "reason": reason,
        "warning": fa.fallback_warning("auto", "sdpa", reason, True),
    }
    assert capsys.readouterr().out == f"warning: {record['warning']}\n"
    assert "attention runs slower than it could: pip install flash-attn-4" in record["warning"]
    with pytest.raises(UserError, match="^--preset published on a Hopper GPU needs a fast attention kernel"):
        fa.agree_attention("auto", "cuda", torch.bfloat16, False, "published")
    assert fa.agree_attention("sdpa", "cuda", torch.bfloat16, False, "published") == {
        "requested": "sdpa",
        "kernel": "sdpa",
        "reason": "--attn sdpa",
    }  # asked for: no warning, no refusal
    fake_hopper(monkeypatch, loads=("cudnn",))
    assert fa.agree_attention("auto", "cuda", torch.bfloat16, False, "published") == {
        "requested": "auto",
        "kernel": "cudnn",
        "reason": "Hopper GPU, cudnn the fastest (forward + backward: cudnn 0.9 ms, sdpa 1 ms)",
        "passed_over": ["fa4: fa4 does not load here", "fa3: fa3 does not load here"],
        "timed_ms": {"sdpa": 1.0, "cudnn": 0.9},
    }  # what auto passed over, and why, and what it timed
    # SDPA timed faster than the fast kernel that passed (the first H200's full causal figures): no fallback, so
    # neither a warning nor the preset's refusal
    monkeypatch.setattr(fa, "kernel_ms", lambda kernel, device, shapes=None: {"sdpa": 1.02, "cudnn": 1.09}[kernel])
    record = fa.agree_attention("auto", "cuda", torch.bfloat16, False, "published")
    assert record["kernel"] == "sdpa" and "warning" not in record
    assert record["timed_ms"] == {"sdpa": 1.02, "cudnn": 1.09}
    # the fast kernel's timing fails (out of memory at the run's size, say): a fallback again, the reason says why
    monkeypatch.setattr(fa, "kernel_ms", lambda kernel, device, shapes=None: 1.0 if kernel == "sdpa" else 1 / 0)
    record = fa.agree_attention("auto", "cuda", torch.bfloat16, False)
    assert record["kernel"] == "sdpa" and "timed_ms" not in record and record["warning"]
    assert record["reason"] == (
        "fa4: fa4 does not load here; fa3: fa3 does not load here; "
        "cudnn: its timing failed (ZeroDivisionError: division by zero)"
    )
    capsys.readouterr()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100: SDPA, no warning
    assert "warning" not in fa.agree_attention("auto", "cuda", torch.bfloat16, False, "published")
    assert capsys.readouterr().out == ""


def test_the_fastest_kernel_trains_and_a_tie_goes_to_the_simplest():
    assert fa.fastest({"sdpa": 1.02, "cudnn": 1.09}) == "sdpa"  # the first H200's full causal figures
    assert fa.fastest({"sdpa": 1.0, "cudnn": 0.8, "fa4": 0.6, "fa3": 0.61}) == "fa4"
    assert fa.fastest({"sdpa": 1.0, "cudnn": 0.99, "fa4": 0.98}) == "sdpa"  # within TIE: noise, not speed
    assert fa.fastest({"fa3": 0.6, "fa4": 0.61, "cudnn": 0.7}) == "fa4"  # FA4 is simpler than the hub's FA3
    assert fa.KERNELS == ("sdpa", "cudnn", "fa4", "fa3") and fa.TIE == 0.03


def test_kernel_ms_times_training_calls_with_the_grads_cleared(monkeypatch):
    """kernel_ms's own path on the CPU, tiny: every window of the run, forward + backward as causal_attention runs it,
    in bf16, on the run's rows (tokens // row length of them), the inputs' grads None before each call."""
    seen, call = [], fa.causal_attention

    def spy(q, k, v, window, kernel):
        seen.append((window, kernel, q.shape, q.dtype, q.grad is None and k.grad is None and v.grad is None))
        return call(q, k, v, window, kernel)

    monkeypatch.setattr(fa, "causal_attention", spy)
    shapes = fa.AttentionShapes(head_dim=8, n_head=4, n_kv_head=2, seq_len=32, windows=(32, 16))
    ms = fa.kernel_ms("sdpa", "cpu", shapes, tokens=64)
    assert ms > 0 and len(seen) == 24  # each window: 2 warm-up calls and 10 timed
    assert {s[:4] for s in seen} == {
        (w, "sdpa", torch.Size([2, 32, 4, 8]), torch.bfloat16) for w in (32, 16)
    } and all(s[4] for s in seen)


def test_the_dry_run_names_the_kernel_it_expects(capsys):
    base_train.main(["--preset", "published", "--arch", "gpt", "--dry-run", "8"])
    out = capsys.readouterr().out.splitlines()
    plan = json.loads(next(l for l in out if l.startswith("PLAN "))[5:])
    line = (
        "--attn auto → on a Hopper GPU (bf16) the fastest of sdpa, cudnn if cuDNN attention runs, fa4 if "
        f"flash-attn-4 loads, fa3 if {fa.FA3_REPO} loads (the hub or its cache), timed at the run's shapes (within "
        "3%, the first of sdpa, cudnn, fa4, fa3); sdpa with a warning when no fast kernel passes its probe; sdpa "
        "elsewhere (CPU, other GPUs); --preset published refuses that fallback on Hopper unless --attn sdpa"
    )
    assert plan["attention"] == {"requested": "auto", "order": ["sdpa", "cudnn", "fa4", "fa3"], "expects": line}
    assert f"attention: {line}" in out
    assert fa.expected_attention("sdpa", "published")["expects"] == "--attn sdpa → sdpa everywhere"
    assert (
        fa.expected_attention("fa3")["expects"]
        == f"--attn fa3 → fa3 if {fa.FA3_REPO} loads (the hub or its cache), else the run stops with one line"
    )


# ---------------------------------------------------------------------------
# the S window without a dense mask: flex_attention's block mask against the dense-mask SDPA reference


def dense_reference(q, k, v, window):
    T = q.size(2)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=fa.window_mask(T, window, q.device), enable_gqa=k.size(1) != q.size(1)
    )


def test_the_block_mask_skips_exactly_the_blocks_outside_the_window():
    T, w, block = 64, 24, 16
    mask = fa.sliding_block_mask(T, w, "cpu", block)
    dense = mask.to_dense()[0, 0].bool()  # (query blocks, key blocks) that the kernel visits
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    seen = ((i >= j) & (i - j < w)).view(T // block, block, T // block, block).any(3).any(1)
    assert torch.equal(dense, seen)  # every block some query sees, and no other
    # the far past and the future are skipped
    assert not dense[3, 0] and dense[3, 2] and dense[3, 3] and not dense[0, 1]


def test_flex_window_path_equals_the_dense_mask_reference_compiled_forward(monkeypatch):
    """The compiled kernel walks the block mask (on the CPU: forward only, as flex_attention allows)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 64, 16), torch.randn(2, 2, 64, 16), torch.randn(2, 2, 64, 16)
    with torch.no_grad():
        got = fa.flex()(q, k, v, block_mask=fa.sliding_block_mask(64, 24, "cpu", 16), enable_gqa=True)
    assert torch.allclose(got, dense_reference(q, k, v, 24), atol=1e-5)


def test_flex_window_path_equals_the_dense_mask_reference_forward_and_backward(monkeypatch):
    """Gradients: flex_attention refuses autograd on the CPU; its eager path (the same mask_mod, applied densely)
    runs once that refusal is lifted."""
    from torch.nn.attention import flex_attention as fx

    monkeypatch.setattr(fx, "_validate_device", lambda *a: None)
    monkeypatch.setattr(fa, "flex", lambda: fx.flex_attention)
    blocks = fa.sliding_block_mask
    # blocks of 16, so a short row spans several
    monkeypatch.setattr(fa, "sliding_block_mask", lambda T, w, device, block=128: blocks(T, w, device, 16))
    torch.manual_seed(1)
    q, k, v, dy = (
        torch.randn(2, 4, 48, 16),
        torch.randn(2, 1, 48, 16),
        torch.randn(2, 1, 48, 16),
        torch.randn(2, 4, 48, 16),
    )
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    ys = [t.clone().requires_grad_() for t in (q, k, v)]
    got = fa.sliding_window_attention(*xs, 20)
    got.backward(dy)
    want = dense_reference(*ys, 20)
    want.backward(dy)
    assert torch.allclose(got, want, atol=1e-5)
    for a, b in zip(xs, ys):
        assert torch.allclose(a.grad, b.grad, atol=1e-5)


@pytest.fixture
def counted_block_masks(monkeypatch):
    """CUDA's S-window path on the CPU: flex_attention eager (forward only, as the CPU allows), the kept masks
    emptied, and every create_block_mask call counted: the list of the row lengths it was built for."""
    from torch.nn.attention import flex_attention as fx

    built, real = [], fx.create_block_mask
    monkeypatch.setattr(fx, "create_block_mask", lambda *a, **kw: built.append(a[3]) or real(*a, **kw))
    monkeypatch.setattr(fa, "flex_windows", lambda device: True)
    monkeypatch.setattr(fa, "flex", lambda: fx.flex_attention)
    monkeypatch.setattr(fa, "_block_masks", {})
    return built


def test_a_window_block_mask_is_built_once_per_row_length_and_window(counted_block_masks):
    """Three S layers of one window: one create_block_mask on the first forward (it used to be one per S layer per
    forward), none after; rows of another length build theirs once. The output is the dense masks' (the CPU's)."""
    config = GPTConfig(
        sequence_len=32, vocab_size=64, n_layer=4, n_head=2, n_kv_head=1, n_embd=32, window_pattern="SSSL"
    )
    torch.manual_seed(0)
    model = GPT.initialised(config)
    with torch.no_grad():
        for p in model.parameters():  # the output projections start at zero: give attention something to pass on
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randint(0, 64, (2, 32))
    per_forward = []
    with torch.no_grad():
        for T in (32, 32, 32, 24, 24):
            before = len(counted_block_masks)
            y = model(x[:, :T])
            per_forward.append(len(counted_block_masks) - before)
        flex_windows = fa.flex_windows
        fa.flex_windows = lambda device: False  # the CPU's own path: SDPA with the dense masks
        try:
            assert torch.allclose(y, model(x[:, :24]), atol=1e-5)
        finally:
            fa.flex_windows = flex_windows
    assert per_forward == [1, 0, 0, 1, 0] and counted_block_masks == [32, 24]


def test_set_attention_builds_the_masks_before_compile_and_the_graph_reads_them(counted_block_masks):
    """GPT.set_attention (before torch.compile) builds the S window's mask; a compiled call then builds none (the graph
    takes the kept mask as an input), and a mask not kept yet is built inside the graph but not kept."""
    config = GPTConfig(sequence_len=32, vocab_size=64, n_layer=3, n_head=2, n_kv_head=2, n_embd=32, window_pattern="SL")
    model = GPT.initialised(config)
    model.set_attention("sdpa")
    assert counted_block_masks == [32] and list(fa._block_masks) == [(32, 16, "cpu", 128)]
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 32)))
    assert counted_block_masks == [32]  # the forward found it
    torch._dynamo.reset()
    compiled = torch.compile(fa.sliding_window_attention, backend="aot_eager", fullgraph=True, dynamic=False)
    q = torch.randn(1, 2, 32, 16)
    with torch.no_grad():
        y = compiled(q, q, q, 16)
        assert counted_block_masks == [32]  # traced without building: the mask is the graph's input
        assert torch.allclose(y, dense_reference(q, q, q, 16), atol=1e-5)
        compiled(q[:, :, :24], q[:, :, :24], q[:, :, :24], 16)  # no mask kept for 24: built in the graph
    assert list(fa._block_masks) == [(32, 16, "cpu", 128)]
    torch._dynamo.reset()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # the fake-CUDA twin's masks have no values: not kept
        fa.sliding_block_mask(64, 24, "cpu")
    assert list(fa._block_masks) == [(32, 16, "cpu", 128)]


def test_plain_rows_on_cuda_build_no_mask_while_the_cpu_keeps_them():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(
            GPTConfig(sequence_len=32, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=32, window_pattern="SL")
        )
    assert model.attention == "sdpa"
    # flex_attention takes the window on CUDA: nothing allocated
    assert model.attention_masks(32, "cuda") == [None, None]
    masks = model.attention_masks(32, "meta")  # anywhere else: the dense mask, as before
    assert masks[0].shape == (1, 1, 32, 32) and masks[1] is None
    assert [fa.mask_free(k, d) for k in ("sdpa", "cudnn", "fa3", "fa4") for d in ("cpu", "cuda")] == [
        False,
        True,
        False,
        True,
        True,
        True,
        True,
        True,
    ]


def test_cudnn_prefers_cudnn_and_only_there(monkeypatch):
    calls = []
    real = fa.sdpa_kernel
    monkeypatch.setattr(
        fa, "sdpa_kernel", lambda backends, set_priority=False: calls.append((backends, set_priority)) or real(backends)
    )
    q = torch.randn(1, 16, 2, 8, dtype=torch.bfloat16)
    fa.causal_attention(q, q, q, 16, "cudnn")  # a full window in bf16: SDPA with cuDNN first
    assert calls == [(fa.CUDNN_FIRST, True)] and fa.CUDNN_FIRST[0] == fa.SDPBackend.CUDNN_ATTENTION
    fa.causal_attention(q.float(), q.float(), q.float(), 16, "cudnn")  # float32: SDPA's defaults, as sdpa
    fa.causal_attention(q, q, q, 8, "cudnn")  # an S window on the CPU: the dense mask
    assert len(calls) == 1


# ---------------------------------------------------------------------------
# CUDA: the real kernels


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [1024, 2048])
@pytest.mark.parametrize("kernel", ["sdpa", "cudnn", "fa3", "fa4"])
def test_cuda_kernels_equal_the_dense_reference(kernel, window):
    """At the published head size, S and L windows, GQA: each kernel that loads here, forward and backward."""
    device = torch.device("cuda")
    why = fa.kernel_unavailable(kernel, device, torch.bfloat16)
    if why is not None:
        pytest.skip(why)
    torch.manual_seed(0)
    q, k, v, dy = (torch.randn(2, 2048, h, 128, device=device, dtype=torch.bfloat16) for h in (4, 2, 2, 4))
    grads = lambda fn, dt: fa.grads(fn, (q, k, v), dy, dt)
    got = grads(lambda *x: fa.causal_attention(*x, window, kernel), torch.bfloat16)
    want = grads(lambda *x: dense_reference(*(t.transpose(1, 2) for t in x), window).transpose(1, 2), torch.float32)
    for a, b in zip(got, want):
        assert (a.float() - b).abs().max() <= 0.02 * b.abs().max()


def test_a_fallback_warning_opens_and_closes_the_run(run_base, monkeypatch, capsys):
    """--attn auto that fell back on a Hopper GPU: the warning is the run's first word and its last (a long log's end
    is where it is read), and config.json keeps it. Faked here: the CPU never falls back."""
    from conftest import TINY_TRAIN
    from scripts import base_train

    warned = {"warning": "--attn auto fell back to SDPA (faked)"}
    monkeypatch.setattr(fa, "fallback_warning", lambda *a: warned["warning"])  # as on a Hopper GPU where nothing loads
    run_dir = base_train.main(TINY_TRAIN + ["--run", "w", "--num-iterations", "2", "--eval-every", "-1"])
    lines = capsys.readouterr().out.splitlines()
    said = [i for i, line in enumerate(lines) if line == "warning: --attn auto fell back to SDPA (faked)"]
    assert len(said) == 2 and said[-1] == len(lines) - 1, lines
    assert json.load(open(os.path.join(run_dir, "config.json")))["attention"]["warning"] == warned["warning"]
