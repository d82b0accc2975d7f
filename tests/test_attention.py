"""The attention kernel (nanochat/flash_attention.py): choice, fallback and window paths on the CPU.

Which kernel --attn gets where, the fallback to SDPA, the
sliding-window paths against attention written out by hand, and the FA3 code path run on the CPU with a fake
kernel that does FA3's documented window arithmetic with that hand-written attention."""

import copy
import json
import math
import re
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


class FakeFlash:
    """flash_attn_func as FA3 and FA4 document it, computed by `dense`: (B, T, H, D) layout; query i sees the keys
    i - left .. i + right, both included; causal caps the right side at 0. "No limit" on a side is -1 for FA3 and
    None for FA4, which would take -1 as a bound: this fake refuses it. FA4 returns (out, lse)."""

    def __init__(self, style="fa3"):
        self.style, self.windows = style, []

    def flash_attn_func(self, q, k, v, causal=False, window_size=(-1, -1)):
        (B, T, H, D), KV = q.shape, k.size(2)
        assert k.shape == v.shape == (B, T, KV, D) and H % KV == 0, (q.shape, k.shape)
        self.windows.append(window_size)
        if self.style == "fa4":
            assert all(x is None or x >= 0 for x in window_size), f"FA4 reads {window_size} as bounds: no limit is None"
        left, right = (-1 if x is None else x for x in window_size)
        i, j = torch.arange(T)[:, None], torch.arange(T)[None]
        allowed = torch.ones(T, T, dtype=torch.bool)
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
        if causal:
            allowed &= j <= i
        y = dense(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), allowed).transpose(1, 2)
        return (y, torch.zeros(B, H, T)) if self.style == "fa4" else y


@pytest.fixture
def fake_fa3(monkeypatch):
    """The fake kernel loaded, and accepted in float32 (the real one runs bf16 only)."""
    kernel = FakeFlash("fa3")
    monkeypatch.setattr(fa, "_fa3", kernel)
    monkeypatch.setattr(fa, "FAST_DTYPES", (torch.bfloat16, torch.float32))
    return kernel


@pytest.fixture
def fake_fa4(monkeypatch):
    kernel = FakeFlash("fa4")
    monkeypatch.setattr(fa, "_fa4", kernel.flash_attn_func)
    monkeypatch.setattr(fa, "FAST_DTYPES", (torch.bfloat16, torch.float32))
    return kernel


FAKE_MS = dict(sdpa=1.0, cudnn=0.9, fa4=0.6, fa3=0.75)  # fake_machine's forward + backward times, unless told


def fake_machine(monkeypatch, cuda=True, capability=(9, 0), kernels="loads", fa4="missing", cudnn="runs", ms=FAKE_MS):
    """torch.cuda, the kernels package and flash-attn-4 as a machine would show them: kernels and fa4 load, are
    missing, or are broken; cudnn runs or fails its probe (every other probe passes); auto's timing of each kernel
    gives ms[kernel]."""
    monkeypatch.setattr(fa, "kernel_ms", lambda kernel, device, shapes=None: ms[kernel])
    monkeypatch.setattr(fa, "_fa3", None)
    monkeypatch.setattr(fa, "_fa4", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    def probe(kernel, device):
        if kernel == "cudnn" and cudnn != "runs":
            raise fa.KernelUnavailable("cudnn failed its probe (RuntimeError: No available kernel.)")

    monkeypatch.setattr(fa, "probe", probe)
    loaded = []
    if fa4 == "missing":
        monkeypatch.setitem(sys.modules, "flash_attn", None)  # import flash_attn.cute raises ImportError
    else:
        cute = types.ModuleType("flash_attn.cute")
        if fa4 == "broken":  # a dependency that does not import (the CUDA DSL, say)

            def __getattr__(name):
                raise ImportError("libcuda.so.1: cannot open shared object file", name="cutlass")

            cute.__getattr__ = __getattr__
        else:
            cute.flash_attn_func = lambda *a, **kw: loaded.append("fa4")
        monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
        monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    if kernels == "missing":
        monkeypatch.setitem(sys.modules, "kernels", None)  # import kernels raises ImportError
        return loaded
    module = types.ModuleType("kernels")

    def get_kernel(repo):
        if kernels == "broken":
            raise OSError("no network and no cached copy\nsecond line")
        loaded.append(repo)
        return types.SimpleNamespace(flash_attn_interface=FakeFlash())

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


NONE_LOAD = dict(kernels="missing", cudnn="fails")
NONE_LOAD_REASON = (
    "cudnn: cudnn failed its probe (RuntimeError: No available kernel.); fa4: flash-attn-4 is not installed (pip "
    "install flash-attn-4); fa3: the kernels package is not installed (pip install kernels)"
)
FASTEST = "Hopper GPU, {} the fastest (forward + backward: {})"


@pytest.mark.parametrize(
    "machine, requested, kernel, reason",
    [
        (dict(cuda=False), "auto", "sdpa", "no CUDA"),
        (dict(capability=(8, 0), fa4="loads"), "auto", "sdpa", "compute capability 8.0"),
        (dict(capability=(10, 0), fa4="loads"), "auto", "sdpa", "compute capability 10.0"),
        # auto: SDPA and every fast kernel that passes, timed; the fastest trains
        (dict(fa4="loads"), "auto", "fa4", FASTEST.format("fa4", "fa4 0.6 ms, fa3 0.75 ms, cudnn 0.9 ms, sdpa 1 ms")),
        (dict(), "auto", "fa3", FASTEST.format("fa3", "fa3 0.75 ms, cudnn 0.9 ms, sdpa 1 ms")),
        (dict(cudnn="fails"), "auto", "fa3", FASTEST.format("fa3", "fa3 0.75 ms, sdpa 1 ms")),
        # the first GPU run's full causal figures: SDPA's flash beat cuDNN, and auto took cuDNN untimed
        (
            dict(kernels="missing", ms=dict(sdpa=1.02, cudnn=1.09)),
            "auto",
            "sdpa",
            FASTEST.format("sdpa", "sdpa 1.02 ms, cudnn 1.09 ms"),
        ),
        (
            dict(kernels="missing", ms=dict(sdpa=1.0, cudnn=0.98)),  # a tie goes to the simpler
            "auto",
            "sdpa",
            "Hopper GPU, sdpa within 3% of the fastest, and simpler (forward + backward: cudnn 0.98 ms, sdpa 1 ms)",
        ),
        (
            dict(cudnn="fails", kernels="broken"),
            "auto",
            "sdpa",
            "cudnn: cudnn failed its probe (RuntimeError: No available kernel.); "
            "fa4: flash-attn-4 is not installed (pip install flash-attn-4); "
            f"fa3: {fa.FA3_REPO} did not load (OSError: no network and no cached copy)",
        ),
        (NONE_LOAD, "auto", "sdpa", NONE_LOAD_REASON),
        (dict(fa4="broken", kernels="missing"), "auto", "cudnn", FASTEST.format("cudnn", "cudnn 0.9 ms, sdpa 1 ms")),
        (dict(), "fa3", "fa3", f"{fa.FA3_REPO} loaded from the hub"),
        (
            dict(fa4="loads", capability=(10, 0)),
            "fa4",
            "fa4",
            "flash-attn-4 loaded",
        ),  # named, FA4 runs on Blackwell too
        (dict(capability=(8, 0)), "cudnn", "cudnn", "cuDNN attention runs"),
        (dict(), "sdpa", "sdpa", "--attn sdpa"),
    ],
)
def test_dispatch_table(monkeypatch, machine, requested, kernel, reason):
    loaded = fake_machine(monkeypatch, **machine)
    assert fa.resolve_attention(requested, "cuda") == (kernel, reason)
    if kernel == "fa3":
        assert loaded == [fa.FA3_REPO] and fa._fa3 is not None
        assert fa.resolve_attention("fa3", "cuda:0")[0] == "fa3" and loaded == [fa.FA3_REPO]  # loaded once
    if kernel == "fa4":
        assert fa._fa4 is not None


def test_dispatch_other_devices_and_dtypes(monkeypatch):
    fake_machine(monkeypatch, fa4="loads")
    assert fa.resolve_attention("auto", "cpu") == ("sdpa", "device cpu")  # --device-type cpu on a GPU node
    assert fa.resolve_attention("auto", "cuda", torch.float32) == ("sdpa", "compute dtype float32")
    assert fa.resolve_attention("auto", "cuda", torch.bfloat16)[0] == "fa4"


@pytest.mark.parametrize(
    "requested, machine, why",
    [
        ("fa3", dict(cuda=False), "no CUDA"),
        ("fa3", dict(capability=(8, 6)), "compute capability 8.6"),
        ("fa3", dict(kernels="missing"), "the kernels package is not installed"),
        ("fa4", dict(), "flash-attn-4 is not installed (pip install flash-attn-4)"),
        (
            "fa4",
            dict(fa4="broken"),
            "flash-attn-4 did not import (ImportError: libcuda.so.1: cannot open shared object file)",
        ),
        ("fa4", dict(fa4="loads", capability=(8, 0)), "compute capability 8.0"),
        ("cudnn", dict(cudnn="fails"), "cudnn failed its probe"),
        ("cudnn", dict(capability=(7, 5)), "compute capability 7.5"),
    ],
)
def test_a_named_kernel_where_it_cannot_run_is_one_line(monkeypatch, requested, machine, why):
    fake_machine(monkeypatch, **machine)
    with pytest.raises(UserError) as e:
        fa.resolve_attention(requested, "cuda")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"--attn {requested} cannot run here: ") and why in msg
    assert msg.endswith("--attn auto picks what can")
    with pytest.raises(UserError, match="--attn must be one of auto, fa4, cudnn, fa3, sdpa"):
        fa.resolve_attention("flash", "cuda")


def test_each_optional_package_is_imported_by_its_loader_only():
    source = open(fa.__file__).read()
    assert source.count("from kernels import") == 1 and not re.search(r"^\s*import kernels", source, re.M)
    assert source.count("from flash_attn") == 1 and not re.search(r"^\s*import flash_attn", source, re.M)
    assert "from kernels import get_kernel" in source[source.index("def load_fa3") : source.index("def load_fa4")]
    assert (
        "from flash_attn.cute import flash_attn_func"
        in source[source.index("def load_fa4") : source.index("def load_kernel")]
    )


class Recorder:
    """A fast kernel on the CPU for the probe: dense attention in the inputs' dtype, or a wrong answer, or an error."""

    def __init__(self, answer):
        self.answer = answer

    def __call__(self, q, k, v, causal=False, window_size=None):
        if self.answer == "raises":
            raise RuntimeError("CUDA error: no kernel image is available for execution on the device")
        y = dense(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window_allowed(q.size(1), q.size(1))
        ).transpose(1, 2)
        return (y if self.answer == "right" else y.flip(1)), None


@pytest.mark.parametrize(
    "answer, why",
    [
        ("right", None),
        ("wrong", "fa4 failed its probe (relative error "),
        ("raises", "fa4 failed its probe (RuntimeError: CUDA error: no kernel image"),
    ],
)
def test_the_probe_catches_a_kernel_that_loads_but_cannot_run(monkeypatch, answer, why):
    monkeypatch.setattr(fa, "_fa4", Recorder(answer))
    monkeypatch.setattr(fa, "_probed", set())
    monkeypatch.setattr(fa, "load_fa4", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    # the CPU stands in for the GPU
    monkeypatch.setattr(fa, "device_unfit", lambda device, dtype=None, majors=(9,): None)
    got = fa.kernel_unavailable("fa4", "cpu", torch.bfloat16)
    assert got == why if why is None else got.startswith(why)
    assert (("fa4", "cpu") in fa._probed) == (why is None)  # probed once per device


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
    monkeypatch.setattr(fa, "FAST_DTYPES", (torch.bfloat16,))
    q, k, v = torch.randn(1, 16, 4, 8), torch.randn(1, 16, 2, 8), torch.randn(1, 16, 2, 8)
    y = fa.causal_attention(q, k, v, 8, "fa3")
    assert fake_fa3.windows == []  # float32: the kernel was never called
    assert torch.allclose(y, fa.causal_attention(q, k, v, 8, "sdpa"))


# ---------------------------------------------------------------------------
# sliding windows against the written-out attention


def window_allowed(T, w):
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    return (j <= i) & (i - j < w)


@pytest.mark.parametrize(
    "T, w, H, KV", [(16, 4, 2, 2), (32, 16, 4, 2), (31, 16, 4, 1), (16, 1, 2, 1), (16, 16, 2, 2), (8, 32, 4, 2)]
)
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
# the FA3 and FA4 code paths, with the fake kernels


@pytest.fixture(params=["fa3", "fa4"])
def fake_flash(request, monkeypatch):
    """(kernel name, its fake) for each of FA3 and FA4."""
    kernel = FakeFlash(request.param)
    if request.param == "fa3":
        monkeypatch.setattr(fa, "_fa3", kernel)
    else:
        monkeypatch.setattr(fa, "_fa4", kernel.flash_attn_func)
    monkeypatch.setattr(fa, "FAST_DTYPES", (torch.bfloat16, torch.float32))
    return request.param, kernel


@pytest.mark.parametrize("T, w", [(32, 16), (32, 1), (20, 16), (16, 32)])
def test_flash_adapters_pass_layout_and_window(fake_flash, T, w):
    name, kernel = fake_flash
    q, k, v = torch.randn(2, T, 4, 16), torch.randn(2, T, 2, 16), torch.randn(2, T, 2, 16)
    y = fa.causal_attention(q, k, v, w, name)
    no_limit = -1 if name == "fa3" else None  # FA4 would read -1 as a bound
    assert kernel.windows == [(w - 1, 0) if w < T else (no_limit, 0)]  # w positions = itself and w - 1 before
    assert y.shape == q.shape
    want = dense(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window_allowed(T, w)).transpose(1, 2)
    assert torch.allclose(y, want, atol=1e-5)
    assert torch.allclose(y, fa.causal_attention(q, k, v, w, "sdpa"), atol=1e-5)


def test_fa3_kernels_tuple_output_is_unpacked(fake_fa3, monkeypatch):
    call = fake_fa3.flash_attn_func
    # builds that return (out, lse)
    monkeypatch.setattr(fake_fa3, "flash_attn_func", lambda *a, **kw: (call(*a, **kw), torch.zeros(1)))
    q = torch.randn(1, 8, 2, 8)
    assert fa.causal_attention(q, q, q, 4, "fa3").shape == q.shape


@pytest.mark.parametrize("cls", [GPT, NAGGPT])
def test_model_on_a_flash_kernel_equals_model_on_sdpa(fake_flash, cls):
    name, kernel = fake_flash
    sdpa = build(cls)
    model = copy.deepcopy(sdpa)
    model.set_attention(name)
    assert model.attention_masks(32, "cpu") == [None, None, None]  # plain rows: no mask, the kernel takes the window
    x = torch.randint(0, 128, (2, 32))
    loss = model(x, x)
    # S = 16 positions, the last layer L
    assert kernel.windows == [(15, 0), (15, 0), (-1 if name == "fa3" else None, 0)]
    want = sdpa(x, x)
    assert torch.allclose(loss, want, atol=1e-5)
    loss.backward()
    want.backward()
    for (n, p), q in zip(model.named_parameters(), sdpa.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4), n


def test_fa3_leaves_packed_rows_mod_and_the_kv_cache_to_masks(fake_fa3):
    sdpa = build()
    model = copy.deepcopy(sdpa)
    model.set_attention("fa3")
    # packed evaluation rows keep their masks and SDPA: the kernel is never called
    positions = torch.cat([torch.arange(12), torch.arange(20)])[None]
    allowed = positions[0][:, None] >= positions[0][None]
    allowed[12:, :12] = False
    x = torch.randint(0, 128, (1, 32))
    assert torch.allclose(
        model(x, positions=positions, allowed=allowed[None]),
        sdpa(x, positions=positions, allowed=allowed[None]),
        atol=1e-5,
    )
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
    assert [(r["kernel"], r["window"], r["window_tokens"]) for r in d["results"]] == [
        ("sdpa", "L", 64),
        ("sdpa", "S", 32),
    ]
    assert all(r["fwd_bwd_ms"] > 0 and r["bwd_ms"] > 0 and r["err_out"] < 1e-5 for r in d["results"])
    ms = {r["window"]: r["fwd_bwd_ms"] for r in d["results"]}
    assert d["window_vs_full"] == {"sdpa": ms["S"] / ms["L"]}  # the S window's cost against the full row's
    assert (
        d["attention"] == {"requested": "auto", "kernel": "sdpa", "reason": "no CUDA"}
        and d["vs_sdpa"] == []
        and d["ok"]
    )
    # why each was not run
    assert d["kernels"] == {"sdpa": "timed", "cudnn": "no CUDA", "fa3": "no CUDA", "fa4": "no CUDA"}
    # routed attention: each row's capacity at a 20 % skip rate (56 of 64), SDPA with the mask on the CPU
    routed = d["routed"]
    assert [(r["kernel"], r["window"], r["queries"]) for r in routed["rows"]] == [
        ("routed", "L", 56),
        ("routed", "S", 56),
    ]
    assert all(r["agree"] and r["err_out"] < 1e-5 and r["fwd_bwd_ms"] > 0 for r in routed["rows"])
    assert routed["compile"] == [] and routed["ok"]
    figures = gpu_checks.attention_figures(d)
    assert figures.startswith("fwd+bwd sdpa L ") and f"; S / L sdpa {ms['S'] / ms['L']:.2f}×; " in figures
    assert figures.endswith(
        "not run: cudnn (no CUDA), fa3 (no CUDA), fa4 (no CUDA)"
    )
    for named in ("fa3", "fa4", "cudnn"):  # a named kernel where it cannot run: the one line, exit status 1
        with pytest.raises(SystemExit):
            bench_attention.main(["--attn", named])


def test_bench_compiles_routed_attention_once_for_two_batches_of_positions(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    d = bench_attention.main(["--steps", "1", "--warmup", "0", "--windows", "S", "--compile"])
    (compiled,) = d["routed"]["compile"]
    assert compiled["window"] == "S" and compiled["graphs"] == 1 and compiled["max_diff_vs_eager"] < 1e-5
    assert compiled["ok"] and d["ok"]


@pytest.mark.parametrize("wrong", [False, True])
def test_bench_compares_every_kernel_that_loads_with_sdpa(fake_flash, monkeypatch, capsys, wrong):
    name, kernel = fake_flash
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(fa, "choose_kernel", lambda requested, device, dtype, shapes: (name, "fake kernel", [], {}))
    monkeypatch.setattr(
        fa, "kernel_unavailable", lambda k, device, dtype=None, shapes=None: None if k == name else "not this one"
    )
    if wrong:  # a kernel that reads left as the window itself: one key too many
        call = kernel.flash_attn_func
        fake = lambda q, k, v, causal, window_size: call(
            q,
            k,
            v,
            causal=causal,
            window_size=(window_size[0] + 1 if window_size[0] not in (None, -1) else window_size[0], 0),
        )
        monkeypatch.setattr(
            fa, "_fa3", types.SimpleNamespace(flash_attn_func=fake)
        ) if name == "fa3" else monkeypatch.setattr(fa, "_fa4", fake)
        with pytest.raises(SystemExit):
            bench_attention.main(["--steps", "1", "--warmup", "0", "--kv-heads", "1"])
        assert "DISAGREE" in capsys.readouterr().out
        return
    d = bench_attention.main(["--steps", "1", "--warmup", "0", "--kv-heads", "1"])
    assert [(x["kernel"], x["window"], x["agree"]) for x in d["vs_sdpa"]] == [(name, "L", True), (name, "S", True)]
    assert all(x[key] < 1e-5 for x in d["vs_sdpa"] for key in ("out", "grad_q", "grad_k", "grad_v"))
    assert d["fa3_vs_sdpa"] == (d["vs_sdpa"] if name == "fa3" else [])  # what gpu_checks' headline reads
    assert d["kernels"][name] == "timed" and list(d["kernels"]) == ["sdpa", name] + [
        k for k in ("cudnn", "fa3", "fa4") if k != name
    ]
    assert f"S: {name} " in gpu_checks.attention_figures(d)


def test_gpu_checks_attention_figures_and_headline(tmp_path):
    d = {
        "attention": {"requested": "auto", "kernel": "fa3", "reason": "Hopper GPU, kernel loaded"},
        "kernels": {
            "sdpa": "timed",
            "fa3": "timed",
            "cudnn": "cudnn failed its probe",
            "fa4": "flash-attn-4 is not installed",
        },
        "results": [
            {"kernel": k, "window": w, "fwd_bwd_ms": ms}
            for k, w, ms in (
                ("sdpa", "L", 4.0),
                ("fa3", "L", 2.5),
                ("sdpa-mask", "S", 3.6),
                ("sdpa", "S", 3.0),
                ("fa3", "S", 1.5),
            )
        ],
        "vs_sdpa": [
            {
                "kernel": k,
                "vs": vs,
                "window": w,
                "speedup": s,
                "out": 4e-3,
                "grad_q": 8e-3,
                "grad_k": 1e-2,
                "grad_v": 6e-3,
            }
            for k, vs, w, s in (("fa3", "sdpa", "L", 1.6), ("sdpa", "sdpa-mask", "S", 1.2), ("fa3", "sdpa", "S", 2.0))
        ],
        "compile": {"kernel": "fa3", "fullgraph": True, "compile_s": 9.0, "fwd_bwd_ms": 1.4},
    }
    d["fa3_vs_sdpa"] = [x for x in d["vs_sdpa"] if x["kernel"] == "fa3"]
    assert gpu_checks.attention_figures(d) == (
        "fwd+bwd sdpa L 4.00 ms; fa3 L 2.50 ms; sdpa-mask S 3.60 ms; sdpa S 3.00 ms; fa3 S 1.50 ms; "
        "L: fa3 1.60× as fast as sdpa, |difference| out 4.0e-03, grads 1.0e-02; "
        "S: sdpa 1.20× as fast as sdpa-mask, |difference| out 4.0e-03, grads 1.0e-02; "
        "S: fa3 2.00× as fast as sdpa, |difference| out 4.0e-03, grads 1.0e-02; "
        "not run: cudnn (cudnn failed its probe), fa4 (flash-attn-4 "
        "is not installed); fa3 compiled: fullgraph, 9 s, 1.40 ms"
    )
    old = {k: v for k, v in d.items() if k not in ("vs_sdpa", "kernels")}  # a JSON from before: FA3 and SDPA only
    assert gpu_checks.attention_figures(old).startswith("fwd+bwd sdpa L 4.00 ms; fa3 L 2.50 ms;")
    (tmp_path / "attention.json").write_text(json.dumps(d))
    lines = gpu_checks.headline(str(tmp_path))
    assert (
        "- attention alone, window S, 16 × 2048, 5 heads × 128: "
        "FA3 1.50 ms, SDPA 3.00 ms forward + backward (2.00×); "
        "outputs differ by at most 4.0e-03" in lines
    )
    # the windowed path against full causal, and what --attn auto chose by timing, and why
    reason = "Hopper GPU, fa3 the fastest (forward + backward: fa3 4 ms, sdpa 7 ms)"
    d["attention"] = {"requested": "auto", "kernel": "fa3", "reason": reason, "timed_ms": {"sdpa": 7.0, "fa3": 4.0}}
    d["window_vs_full"] = {"sdpa": 0.75, "fa3": 0.6}
    figures = gpu_checks.attention_figures(d)
    assert "fa3 S 1.50 ms; S / L sdpa 0.75×, fa3 0.60×; L: fa3 1.60× as fast" in figures
    assert figures.endswith(f"; --attn auto chose fa3: {reason}; fa3 compiled: fullgraph, 9 s, 1.40 ms")
    (tmp_path / "attention.json").write_text(json.dumps(d))
    assert (
        "- attention alone, 16 × 2048, 5 heads × 128, forward + backward of the S window against full causal: "
        f"sdpa 0.75×, fa3 0.60× (at most 1 wanted); --attn auto chose fa3 ({reason})"
    ) in gpu_checks.headline(str(tmp_path))
