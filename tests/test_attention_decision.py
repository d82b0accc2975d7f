"""Which attention kernel a run gets, and the CUDA paths' CPU twins (nanochat/flash_attention.py, docs/design.md §2):
rank 0 decides and every rank loads (two gloo ranks), the Hopper fallback warning and the GPU presets' refusal of
SDPA, the dry run's line, and the mask-free S window (flex_attention with a block mask) against the dense-mask
reference. The CUDA tests at the end run the real kernels where a GPU is present."""

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from nanochat import flash_attention as fa
from nanochat.common import UserError
from nanochat.gpt import GPT, GPTConfig
from scripts import base_train

def fake_hopper(monkeypatch, loads=("fa4", "cudnn", "fa3")):
    """A Hopper GPU as torch.cuda shows it, on which the kernels in `loads` load and pass their probe."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fa, "kernel_unavailable", lambda kernel, device, dtype=None:
                        None if kernel == "sdpa" or kernel in loads else f"{kernel} does not load here")


# ---------------------------------------------------------------------------
# rank 0 decides, every rank loads: two gloo ranks


def _rank(rank, init_file, out_dir):
    """Each scenario on two ranks; rank 1 cannot load fa4 (its loader is faked), rank 0 can."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    os.environ["RANK"] = str(rank)  # print0 prints on rank 0 only
    answers = {}
    try:
        torch.cuda.is_available = lambda: True
        torch.cuda.get_device_capability = lambda device=None: (9, 0)
        for name, requested, rank1_loads, preset in [("both load", "auto", True, ""), ("rank 1 cannot", "auto", False, ""),
                                                     ("named, rank 1 cannot", "fa4", False, ""),
                                                     ("rank 0 falls back", "auto", None, ""),
                                                     ("published refused", "auto", None, "published")]:
            def unavailable(kernel, device, dtype=None, rank1_loads=rank1_loads):
                if kernel == "sdpa" or (rank1_loads is not None and (rank == 0 or rank1_loads)):
                    return None
                return "flash-attn-4 is not installed (pip install flash-attn-4)"
            fa.kernel_unavailable = unavailable
            try:
                answers[name] = fa.agree_attention(requested, torch.device("cuda"), torch.bfloat16, True, preset)  # a faked GPU: nothing is allocated
            except UserError as e:
                answers[name] = f"UserError: {e}"
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(answers, f)


def test_rank0_decides_and_every_rank_loads_or_every_rank_stops(tmp_path):
    import torch.multiprocessing as mp
    # forked: the ranks start with this process's imports (a spawned rank would import torch and the repo again)
    mp.start_processes(_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True, start_method="fork")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0 == r1  # the same decision, or the same one line, on both ranks
    assert r0["both load"] == {"requested": "auto", "kernel": "fa4", "reason": "Hopper GPU, flash-attn-4 loaded"}
    host = socket.gethostname()
    for name in ("rank 1 cannot", "named, rank 1 cannot"):
        assert r0[name] == (f"UserError: attention: rank 0 chose fa4 ({'Hopper GPU, ' if 'named' not in name else ''}flash-attn-4 "
                            f"loaded), but rank(s) 1 ({host}: flash-attn-4 is not installed (pip install flash-attn-4)) cannot run it; "
                            "install it on every node, or pass --attn sdpa")
    fell = r0["rank 0 falls back"]  # nothing loads on rank 0: SDPA everywhere, with the warning in the record
    assert fell["kernel"] == "sdpa" and fell["warning"].startswith("--attn auto fell back to SDPA on a Hopper GPU (fa4: ")
    assert r0["published refused"].startswith("UserError: --preset published on a Hopper GPU needs a fast attention kernel")


# ---------------------------------------------------------------------------
# the Hopper fallback warning and the GPU presets' refusal of SDPA


@pytest.mark.parametrize("requested, kernel, hopper, preset, refused", [
    ("auto", "sdpa", True, "published", True),
    ("auto", "sdpa", True, "d20", True),  # every GPU preset
    ("sdpa", "sdpa", True, "published", False),  # asked for explicitly
    ("auto", "fa4", True, "published", False), ("auto", "cudnn", True, "published", False),
    ("auto", "sdpa", False, "published", False),  # not Hopper: SDPA is what there is
    ("auto", "sdpa", True, "", False),  # no GPU preset: the warning only
])
def test_gpu_presets_refuse_sdpa_on_hopper_unless_asked(requested, kernel, hopper, preset, refused):
    check = lambda: fa.check_preset_attention(requested, kernel, hopper, preset, "fa4: not installed")
    if not refused:
        assert check() is None
        return
    with pytest.raises(UserError) as e:
        check()
    assert str(e.value) == (f"--preset {preset} on a Hopper GPU needs a fast attention kernel, but --attn auto found none "
                            "(fa4: not installed); pip install flash-attn-4, or pass --attn sdpa to train with SDPA anyway")


def test_auto_falling_back_on_hopper_warns_and_records_it(monkeypatch, capsys):
    fake_hopper(monkeypatch, loads=())
    record = fa.agree_attention("auto", "cuda", torch.bfloat16, False)
    reason = "fa4: fa4 does not load here; cudnn: cudnn does not load here; fa3: fa3 does not load here"
    assert record == {"requested": "auto", "kernel": "sdpa", "reason": reason, "warning": fa.fallback_warning("auto", "sdpa", reason, True)}
    assert capsys.readouterr().out == f"warning: {record['warning']}\n"
    assert "attention runs slower than it could: pip install flash-attn-4" in record["warning"]
    with pytest.raises(UserError, match="^--preset published on a Hopper GPU needs a fast attention kernel"):
        fa.agree_attention("auto", "cuda", torch.bfloat16, False, "published")
    assert fa.agree_attention("sdpa", "cuda", torch.bfloat16, False, "published") == {
        "requested": "sdpa", "kernel": "sdpa", "reason": "--attn sdpa"}  # asked for: no warning, no refusal
    fake_hopper(monkeypatch, loads=("cudnn",))
    assert fa.agree_attention("auto", "cuda", torch.bfloat16, False, "published") == {
        "requested": "auto", "kernel": "cudnn", "reason": "Hopper GPU, cuDNN attention runs"}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100: SDPA, no warning
    assert "warning" not in fa.agree_attention("auto", "cuda", torch.bfloat16, False, "published")
    assert capsys.readouterr().out == ""


def test_the_dry_run_names_the_kernel_it_expects(capsys):
    base_train.main(["--preset", "published", "--arch", "gpt", "--dry-run", "8"])
    out = capsys.readouterr().out.splitlines()
    plan = json.loads(next(l for l in out if l.startswith("PLAN "))[5:])
    line = ("--attn auto → on a Hopper GPU (bf16) fa4 if flash-attn-4 loads, else cudnn if cuDNN attention runs, else fa3 if "
            f"{fa.FA3_REPO} loads (the hub or its cache), else sdpa with a warning; sdpa elsewhere (CPU, other GPUs); "
            "--preset published refuses sdpa on Hopper unless --attn sdpa")
    assert plan["attention"] == {"requested": "auto", "order": ["fa4", "cudnn", "fa3", "sdpa"], "expects": line}
    assert f"attention: {line}" in out
    assert fa.expected_attention("sdpa", "published")["expects"] == "--attn sdpa → sdpa everywhere"
    assert fa.expected_attention("fa3")["expects"] == f"--attn fa3 → fa3 if {fa.FA3_REPO} loads (the hub or its cache), else the run stops with one line"


# ---------------------------------------------------------------------------
# the S window without a dense mask: flex_attention's block mask against the dense-mask SDPA reference


def dense_reference(q, k, v, window):
    T = q.size(2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=fa.window_mask(T, window, q.device), enable_gqa=k.size(1) != q.size(1))


def test_the_block_mask_skips_exactly_the_blocks_outside_the_window():
    T, w, block = 64, 24, 16
    mask = fa.sliding_block_mask(T, w, "cpu", block)
    dense = mask.to_dense()[0, 0].bool()  # (query blocks, key blocks) that the kernel visits
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    seen = ((i >= j) & (i - j < w)).view(T // block, block, T // block, block).any(3).any(1)
    assert torch.equal(dense, seen)  # every block some query sees, and no other
    assert not dense[3, 0] and dense[3, 2] and dense[3, 3] and not dense[0, 1]  # the far past and the future are skipped


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
    monkeypatch.setattr(fa, "sliding_block_mask", lambda T, w, device, block=128: blocks(T, w, device, 16))  # several blocks
    torch.manual_seed(1)
    q, k, v, dy = torch.randn(2, 4, 48, 16), torch.randn(2, 1, 48, 16), torch.randn(2, 1, 48, 16), torch.randn(2, 4, 48, 16)
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    ys = [t.clone().requires_grad_() for t in (q, k, v)]
    got = fa.sliding_window_attention(*xs, 20)
    got.backward(dy)
    want = dense_reference(*ys, 20)
    want.backward(dy)
    assert torch.allclose(got, want, atol=1e-5)
    for a, b in zip(xs, ys):
        assert torch.allclose(a.grad, b.grad, atol=1e-5)


def test_plain_rows_on_cuda_build_no_mask_while_the_cpu_keeps_them():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPTConfig(sequence_len=32, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=32, window_pattern="SL"))
    assert model.attention == "sdpa"
    assert model.attention_masks(32, "cuda") == [None, None]  # flex_attention takes the window on CUDA: nothing allocated
    masks = model.attention_masks(32, "meta")  # anywhere else: the dense mask, as before
    assert masks[0].shape == (1, 1, 32, 32) and masks[1] is None
    assert [fa.mask_free(k, d) for k in ("sdpa", "cudnn", "fa3", "fa4") for d in ("cpu", "cuda")] == [
        False, True, False, True, True, True, True, True]


def test_cudnn_prefers_cudnn_and_only_there(monkeypatch):
    calls = []
    real = fa.sdpa_kernel
    monkeypatch.setattr(fa, "sdpa_kernel", lambda backends, set_priority=False: calls.append((backends, set_priority)) or real(backends))
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
