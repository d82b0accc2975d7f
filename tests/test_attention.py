"""The attention kernel (nanochat/flash_attention.py): which kernel --attn gets where, the fallback to SDPA, the
sliding-window paths against attention written out by hand, and the FA3 code path run on the CPU with a fake
kernel that does FA3's documented window arithmetic with that hand-written attention."""

import copy
import json
import math
import sys
import types

import pytest
import torch

from nanochat import flash_attention as fa
from nanochat.common import UserError
from nanochat.engine import generate
from nanochat.gpt import GPT, GPTConfig
from nag.mod import attention_executed
from nag.model import NAGGPT
from scripts.bench import attention as bench_attention, gpu_checks

CFG = dict(sequence_len=32, vocab_size=128, n_layer=3, n_head=4, n_kv_head=2, n_embd=64, window_pattern="SSL")


def dense(q, k, v, allowed):
    """softmax(QKᵀ/√d + mask)V, written out: q (B, H, Tq, D), k, v (B, KV, Tk, D), allowed broadcast to
    (B, H, Tq, Tk). GQA: query head h reads kv head h // (H / KV)."""
    rep = q.size(1) // k.size(1)
    k, v = (t.repeat_interleave(rep, dim=1) for t in (k, v))
    bias = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, -math.inf)
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.size(-1)) + bias, dim=-1) @ v


class FakeFA3:
    """flash_attn_func as FA3 documents it, computed by `dense`: (B, T, H, D) layout; query i sees the keys
    i - left .. i + right, both included, -1 = no limit on that side; causal caps the right side at 0."""

    def __init__(self):
        self.windows = []

    def flash_attn_func(self, q, k, v, causal=False, window_size=(-1, -1)):
        (B, T, H, D), KV = q.shape, k.size(2)
        assert k.shape == v.shape == (B, T, KV, D) and H % KV == 0, (q.shape, k.shape)
        self.windows.append(window_size)
        left, right = window_size
        i, j = torch.arange(T)[:, None], torch.arange(T)[None]
        allowed = torch.ones(T, T, dtype=torch.bool)
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
        if causal:
            allowed &= j <= i
        return dense(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), allowed).transpose(1, 2)


@pytest.fixture
def fake_fa3(monkeypatch):
    """The fake kernel loaded, and accepted in float32 (the real one runs bf16 only)."""
    kernel = FakeFA3()
    monkeypatch.setattr(fa, "_fa3", kernel)
    monkeypatch.setattr(fa, "FA3_DTYPES", (torch.bfloat16, torch.float32))
    return kernel


def fake_machine(monkeypatch, cuda=True, capability=(9, 0), kernels="loads"):
    """torch.cuda and the kernels package as a machine would show them; kernels: loads, missing, or broken."""
    monkeypatch.setattr(fa, "_fa3", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    if kernels == "missing":
        monkeypatch.setitem(sys.modules, "kernels", None)  # import kernels raises ImportError
        return
    module = types.ModuleType("kernels")
    loaded = []

    def get_kernel(repo):
        if kernels == "broken":
            raise OSError("no network and no cached copy\nsecond line")
        loaded.append(repo)
        return types.SimpleNamespace(flash_attn_interface=FakeFA3())

    module.get_kernel = get_kernel
    monkeypatch.setitem(sys.modules, "kernels", module)
    return loaded


def build(cls=GPT, seed=0, **kw):
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = cls(GPTConfig(**dict(CFG, **kw)))
    model.to_empty(device="cpu")
    model.init_weights()
    with torch.no_grad():  # the output projections start at zero: give attention something to pass on
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


# ---------------------------------------------------------------------------
# which kernel


@pytest.mark.parametrize("machine, requested, kernel, reason", [
    (dict(cuda=False), "auto", "sdpa", "no CUDA"),
    (dict(capability=(8, 0)), "auto", "sdpa", "compute capability 8.0"),
    (dict(capability=(10, 0)), "auto", "sdpa", "compute capability 10.0"),
    (dict(kernels="missing"), "auto", "sdpa", "the kernels package is not installed (pip install kernels)"),
    (dict(kernels="broken"), "auto", "sdpa", f"{fa.FA3_REPO} did not load (OSError: no network and no cached copy)"),
    (dict(), "auto", "fa3", "Hopper GPU, kernel loaded"),
    (dict(), "fa3", "fa3", "Hopper GPU, kernel loaded"),
    (dict(), "sdpa", "sdpa", "--attn sdpa"),
])
def test_dispatch_table(monkeypatch, machine, requested, kernel, reason):
    loaded = fake_machine(monkeypatch, **machine)
    assert fa.resolve_attention(requested, "cuda") == (kernel, reason)
    if kernel == "fa3":
        assert loaded == [fa.FA3_REPO] and fa._fa3 is not None
        assert fa.resolve_attention("auto", "cuda:0")[0] == "fa3" and loaded == [fa.FA3_REPO]  # loaded once


def test_dispatch_other_devices_and_dtypes(monkeypatch):
    fake_machine(monkeypatch)
    assert fa.resolve_attention("auto", "cpu") == ("sdpa", "device cpu")  # --device-type cpu on a GPU node
    assert fa.resolve_attention("auto", "cuda", torch.float32) == ("sdpa", "compute dtype float32")
    assert fa.resolve_attention("auto", "cuda", torch.bfloat16)[0] == "fa3"


@pytest.mark.parametrize("machine, why", [(dict(cuda=False), "no CUDA"), (dict(capability=(8, 6)), "compute capability 8.6"),
                                          (dict(kernels="missing"), "the kernels package is not installed")])
def test_fa3_where_it_cannot_run_is_one_line(monkeypatch, machine, why):
    fake_machine(monkeypatch, **machine)
    with pytest.raises(UserError) as e:
        fa.resolve_attention("fa3", "cuda")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--attn fa3: FlashAttention-3 cannot run here: ") and why in msg
    assert msg.endswith("--attn auto falls back to SDPA")
    with pytest.raises(UserError, match="--attn must be one of auto, fa3, sdpa"):
        fa.resolve_attention("flash", "cuda")


def test_the_kernels_package_is_imported_by_the_loader_only():
    source = open(fa.__file__).read()
    assert source.count("from kernels import") == 1 and "import kernels" not in source
    loader = source[source.index("def load_fa3"):source.index("def fa3_unavailable")]
    assert "from kernels import get_kernel" in loader


# ---------------------------------------------------------------------------
# the fallback: a model on SDPA, whatever was asked


def test_fallback_to_sdpa_trains_as_before(monkeypatch):
    fake_machine(monkeypatch, cuda=False)
    kernel, _ = fa.resolve_attention("auto", "cpu")
    model, ref = build(), build()
    model.set_attention(kernel)
    assert model.attention == "sdpa" and all(b.attn.kernel == "sdpa" for b in model.blocks)
    x = torch.randint(0, 128, (2, 32))
    assert torch.equal(model(x, x), ref(x, x))  # the default kernel, bit for bit
    assert model.attention_masks(32, "cpu")[0] is not None  # SDPA's S layers keep their mask


def test_fa3_kernel_in_another_dtype_runs_sdpa(fake_fa3, monkeypatch):
    monkeypatch.setattr(fa, "FA3_DTYPES", (torch.bfloat16,))
    q, k, v = torch.randn(1, 16, 4, 8), torch.randn(1, 16, 2, 8), torch.randn(1, 16, 2, 8)
    y = fa.causal_attention(q, k, v, 8, "fa3")
    assert fake_fa3.windows == []  # float32: the kernel was never called
    assert torch.allclose(y, fa.causal_attention(q, k, v, 8, "sdpa"))


# ---------------------------------------------------------------------------
# sliding windows against the written-out attention


def window_allowed(T, w):
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    return (j <= i) & (i - j < w)


@pytest.mark.parametrize("T, w, H, KV", [(16, 4, 2, 2), (32, 16, 4, 2), (31, 16, 4, 1), (16, 1, 2, 1), (16, 16, 2, 2), (8, 32, 4, 2)])
def test_sliding_window_mask_path_equals_dense(T, w, H, KV):
    torch.manual_seed(T + w)
    q, k, v = torch.randn(2, H, T, 16), torch.randn(2, KV, T, 16), torch.randn(2, KV, T, 16)
    want = dense(q, k, v, window_allowed(T, w))
    model = build(window_pattern="SL", sequence_len=2 * w, n_head=H, n_kv_head=KV, n_layer=2)  # layer 0's window is w
    assert model.windows[0] == w
    mask = model.attention_masks(T, "cpu")[0]  # the mask the model builds for that layer
    got = fa.masked_attention(q, k, v, mask)  # None (the window covers the row): is_causal
    assert torch.allclose(got, want, atol=1e-5)
    # the same from the kernel's own entry (B, T, H, D), which builds its mask when no one gave one
    got = fa.causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), w).transpose(1, 2)
    assert torch.allclose(got, want, atol=1e-5)


def test_packed_rows_mask_equals_dense():
    # two documents in one row, positions restarting at the second; the window counts positions
    T, w = 24, 6
    positions = torch.cat([torch.arange(10), torch.arange(14)])[None]
    doc = torch.cat([torch.zeros(10), torch.ones(14)]).long()
    allowed = (doc[:, None] == doc[None]) & (positions[0][:, None] >= positions[0][None])
    model = build(window_pattern="SL", sequence_len=2 * w, n_layer=2)
    mask = model.attention_masks(T, "cpu", positions, allowed[None])[0]
    q, k, v = torch.randn(1, 4, T, 16), torch.randn(1, 2, T, 16), torch.randn(1, 2, T, 16)
    delta = positions[0][:, None] - positions[0][None]
    want = dense(q, k, v, allowed & (delta < w))
    assert torch.allclose(fa.masked_attention(q, k, v, mask), want, atol=1e-5)


# ---------------------------------------------------------------------------
# the FA3 code path, with the fake kernel


@pytest.mark.parametrize("T, w", [(32, 16), (32, 1), (20, 16), (16, 32)])
def test_fa3_adapter_passes_layout_and_window(fake_fa3, T, w):
    q, k, v = torch.randn(2, T, 4, 16), torch.randn(2, T, 2, 16), torch.randn(2, T, 2, 16)
    y = fa.causal_attention(q, k, v, w, "fa3")
    assert fake_fa3.windows == [(w - 1, 0) if w < T else (-1, 0)]  # w positions = itself and w - 1 before
    assert y.shape == q.shape
    want = dense(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window_allowed(T, w)).transpose(1, 2)
    assert torch.allclose(y, want, atol=1e-5)
    assert torch.allclose(y, fa.causal_attention(q, k, v, w, "sdpa"), atol=1e-5)


def test_fa3_kernels_tuple_output_is_unpacked(fake_fa3, monkeypatch):
    call = fake_fa3.flash_attn_func
    monkeypatch.setattr(fake_fa3, "flash_attn_func", lambda *a, **kw: (call(*a, **kw), torch.zeros(1)))  # (out, lse) builds
    q = torch.randn(1, 8, 2, 8)
    assert fa.causal_attention(q, q, q, 4, "fa3").shape == q.shape


@pytest.mark.parametrize("cls", [GPT, NAGGPT])
def test_model_on_fa3_equals_model_on_sdpa(fake_fa3, cls):
    sdpa = build(cls)
    model = copy.deepcopy(sdpa)
    model.set_attention("fa3")
    assert model.attention_masks(32, "cpu") == [None, None, None]  # plain rows: no mask, the kernel takes the window
    x = torch.randint(0, 128, (2, 32))
    loss = model(x, x)
    assert fake_fa3.windows == [(15, 0), (15, 0), (-1, 0)]  # S = 16 positions, the last layer L
    want = sdpa(x, x)
    assert torch.allclose(loss, want, atol=1e-5)
    loss.backward()
    want.backward()
    for (name, p), q in zip(model.named_parameters(), sdpa.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4), name


def test_fa3_leaves_packed_rows_mod_and_the_kv_cache_to_masks(fake_fa3):
    sdpa = build()
    model = copy.deepcopy(sdpa)
    model.set_attention("fa3")
    # packed evaluation rows keep their masks and SDPA: the kernel is never called
    positions = torch.cat([torch.arange(12), torch.arange(20)])[None]
    allowed = positions[0][:, None] >= positions[0][None]
    allowed[12:, :12] = False
    x = torch.randint(0, 128, (1, 32))
    assert torch.allclose(model(x, positions=positions, allowed=allowed[None]), sdpa(x, positions=positions, allowed=allowed[None]), atol=1e-5)
    assert fake_fa3.windows == []
    # the KV cache decodes with explicit masks: the same tokens as SDPA's model, the kernel never called
    prompt = x[0, :5].tolist()
    assert list(generate(model, prompt, 12, temperature=0)) == list(generate(sdpa, prompt, 12, temperature=0))
    assert fake_fa3.windows == []
    # MoD's gathered queries: a plain row's None mask is the layer's window, as the mask SDPA is given
    block, cos_sin = model.blocks[0], model.rotary(32)
    h = torch.randn(2, 32, 64)
    execute = torch.rand(2, 32) > 0.4
    mask = sdpa.attention_masks(32, "cpu")[0]
    want = attention_executed(sdpa.blocks[0].attn, h, cos_sin, mask, execute)
    assert torch.allclose(attention_executed(block.attn, h, cos_sin, None, execute), want, atol=1e-5)
    assert fake_fa3.windows == []


# ---------------------------------------------------------------------------
# scripts/bench/attention.py and its gpu_checks stage, on the CPU


def test_bench_runs_on_the_cpu_with_sdpa_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = tmp_path / "attention.json"
    d = bench_attention.main(["--steps", "1", "--warmup", "0", "--json", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(d))
    assert [(r["kernel"], r["window"], r["window_tokens"]) for r in d["results"]] == [("sdpa", "L", 64), ("sdpa", "S", 32)]
    assert all(r["fwd_bwd_ms"] > 0 and r["err_out"] < 1e-5 for r in d["results"])
    assert d["attention"] == {"requested": "auto", "kernel": "sdpa", "reason": "no CUDA"} and d["fa3_vs_sdpa"] == [] and d["ok"]
    figures = gpu_checks.attention_figures(d)
    assert figures.startswith("fwd+bwd sdpa L ") and figures.endswith("FA3 not run: no CUDA")
    with pytest.raises(SystemExit):  # --attn fa3 where it cannot run: the one line, exit status 1
        bench_attention.main(["--attn", "fa3"])


@pytest.mark.parametrize("wrong", [False, True])
def test_bench_compares_fa3_with_sdpa(fake_fa3, monkeypatch, capsys, wrong):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(fa, "resolve_attention", lambda requested, device, dtype=None: ("fa3", "fake kernel"))
    if wrong:  # a kernel that reads left as the window itself: one key too many
        call = fake_fa3.flash_attn_func
        monkeypatch.setattr(fake_fa3, "flash_attn_func", lambda q, k, v, causal, window_size: call(
            q, k, v, causal=causal, window_size=(window_size[0] + 1 if window_size[0] >= 0 else -1, 0)))
        with pytest.raises(SystemExit):
            bench_attention.main(["--steps", "1", "--warmup", "0", "--kv-heads", "1"])
        assert "DISAGREE" in capsys.readouterr().out
        return
    d = bench_attention.main(["--steps", "1", "--warmup", "0", "--kv-heads", "1"])
    assert [(x["window"], x["agree"]) for x in d["fa3_vs_sdpa"]] == [("L", True), ("S", True)]
    assert all(x[key] < 1e-5 for x in d["fa3_vs_sdpa"] for key in ("out", "grad_q", "grad_k", "grad_v"))
    assert "S: fa3 " in gpu_checks.attention_figures(d)


def test_gpu_checks_attention_figures_and_headline(tmp_path):
    d = {"attention": {"requested": "auto", "kernel": "fa3", "reason": "Hopper GPU, kernel loaded"},
         "results": [{"kernel": k, "window": w, "fwd_bwd_ms": ms} for k, w, ms in
                     (("sdpa", "L", 4.0), ("fa3", "L", 2.5), ("sdpa", "S", 3.0), ("fa3", "S", 1.5))],
         "fa3_vs_sdpa": [{"window": w, "speedup": s, "out": 4e-3, "grad_q": 8e-3, "grad_k": 1e-2, "grad_v": 6e-3}
                         for w, s in (("L", 1.6), ("S", 2.0))],
         "compile": {"kernel": "fa3", "fullgraph": True, "compile_s": 9.0, "fwd_bwd_ms": 1.4}}
    assert gpu_checks.attention_figures(d) == (
        "fwd+bwd sdpa L 4.00 ms; fa3 L 2.50 ms; sdpa S 3.00 ms; fa3 S 1.50 ms; L: fa3 1.60× as fast, |fa3 − sdpa| out 4.0e-03, "
        "grads 1.0e-02; S: fa3 2.00× as fast, |fa3 − sdpa| out 4.0e-03, grads 1.0e-02; fa3 compiled: fullgraph, 9 s, 1.40 ms")
    (tmp_path / "attention.json").write_text(json.dumps(d))
    lines = gpu_checks.headline(str(tmp_path))
    assert "- attention alone, window S, 16 × 2048, 5 heads × 128: FA3 1.50 ms, SDPA 3.00 ms forward + backward (2.00×); " \
           "outputs differ by at most 4.0e-03" in lines
