"""scripts/bench/mod.py: the run's device, compiled variants, fp8 beside bf16, issue 48's targets."""

import json

import pytest
import torch

from scripts.bench import mod as bench_mod

pytestmark = pytest.mark.usefixtures("one_torch_thread")
# fmt: off
TINY = [
    "--depth", "1", "--model-dim", "128", "--head-dim", "32", "--max-seq-len", "64", "--vocab-size", "128",
    "--device-batch-size", "2", "--steps", "1", "--warmup", "1",
]
# fmt: on


def test_models_are_built_on_the_runs_device(monkeypatch):
    # the second GPU slot's mod stage timed the slot's CPU: build() put every model there whatever the machine had
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("nanochat.common.autodetect_device_type", lambda: "cuda")
    monkeypatch.setattr(bench_mod, "autodetect_device_type", lambda: "cuda")
    built = []

    class Built(BaseException):  # past the bench's per-variant except Exception
        pass

    def build(cls, config, device="cpu", **kwargs):
        built.append(str(device))
        raise Built  # stop there: this machine has no CUDA device to build on

    monkeypatch.setattr(bench_mod.models, "build", build)
    for argv in (TINY, TINY + ["--layer-repeats", "0"]):  # the sub-layers' model, then the first variant's
        with pytest.raises(Built):
            bench_mod.main(argv)
    assert built == ["cuda", "cuda"]
    args = bench_mod.parse(TINY + ["--device-type", "cpu"])
    assert bench_mod.device_of(args) == torch.device("cpu")  # asked for: the CPU, GPU or not


def test_no_cuda_device_and_bad_lists_are_one_line(script_error, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    no_gpu = script_error(bench_mod.main, *TINY, "--device-type", "cuda")
    assert no_gpu == "error: --device-type cuda: torch sees no CUDA device"
    assert "--precision takes a comma list of bf16, fp8" in script_error(bench_mod.main, *TINY, "--precision", "fp4")
    assert "--blocks takes a comma list of attn, mlp, both" in script_error(bench_mod.main, *TINY, "--blocks", "x")
    assert "--rates must be in [0, 0.95)" in script_error(bench_mod.main, *TINY, "--rates", "0.2,1")


def test_json_holds_every_variant_and_the_targets(tmp_path, capsys):
    # rate 0 is the reference (full depth, the first precision); each MoD variant runs in each precision
    path = tmp_path / "mod.json"
    rows = bench_mod.main(
        TINY + ["--rates", "0,0.2,0.4", "--blocks", "both", "--precision", "bf16,fp8", "--layer-repeats", "0"]
        + ["--json", str(path)]
    )
    d = json.loads(path.read_text())
    got = [(r["blocks"], r["rate"], r["precision"]) for r in d["results"]]
    assert got == [
        ("none", 0.0, "bf16"),
        ("both", 0.2, "bf16"),
        ("both", 0.4, "bf16"),
        ("both", 0.2, "fp8"),
        ("both", 0.4, "fp8"),
    ]
    assert [(b, r) for b, r, _ in rows] == [(b, r) for b, r, _ in got]
    assert d["device"] == "cpu" and d["compiled"] is False and d["layers"] is None  # a CPU's default: eager
    assert all(r["peak_mem_gib"] is None for r in d["results"])  # CUDA's alone
    fp8 = {r["precision"]: r["fp8_layers"] for r in d["results"]}
    assert fp8["bf16"] == 0 and fp8["fp8"] > 0
    mod = [r for r in d["results"] if r["blocks"] != "none"]
    assert all(0 < r["skip_attn"] < 1 and 0 < r["skip_mlp"] < 1 and "overflow_mlp" in r for r in mod)
    # the step-time targets, both blocks against full depth, and fp8 against bf16 at each rate
    assert [(c["what"], c["target"]) for c in d["claims"]] == [
        ("both 20% / full depth, step time", 0.90),
        ("both 40% / full depth, step time", 0.75),
        ("both 20% fp8 / bf16, step time", 1.0),
        ("both 40% fp8 / bf16, step time", 1.0),
    ]
    ms = {(r["rate"], r["precision"]): r["step_ms"] for r in d["results"]}
    assert d["claims"][0]["value"] == pytest.approx(ms[0.2, "bf16"] / ms[0.0, "bf16"])
    assert d["claims"][3]["value"] == pytest.approx(ms[0.4, "fp8"] / ms[0.4, "bf16"])
    out = capsys.readouterr().out
    assert "both 40% / full depth, step time: " in out and ("PASS, target at most 0.75×" in out or "FAIL" in out)


def test_targets_pass_and_fail_with_peak_memory():
    # a GPU's results: the verdicts, and peak memory against full depth's
    r = lambda blocks, rate, precision, ms, gib: dict(
        blocks=blocks, rate=rate, precision=precision, step_ms=ms, peak_mem_gib=gib
    )
    got = bench_mod.claims(
        [r("none", 0.0, "bf16", 50.0, 10.0), r("both", 0.2, "bf16", 44.0, 9.0), r("both", 0.4, "bf16", 40.0, 10.5)]
        + [r("mlp", 0.4, "bf16", 45.0, 9.5), r("both", 0.2, "fp8", 46.0, 8.0)]
    )
    assert [(c["what"], round(c["value"], 3), c["ok"]) for c in got] == [
        ("both 20% / full depth, step time", 0.88, True),
        ("both 20% / full depth, peak memory", 0.9, True),
        ("both 40% / full depth, step time", 0.8, False),
        ("both 40% / full depth, peak memory", 1.05, False),
        ("mlp 40% / full depth, peak memory", 0.95, True),  # no step-time target for one block alone
        ("both 20% fp8 / bf16, step time", 1.045, False),
    ]
    assert bench_mod.claim_line(got[2]) == "both 40% / full depth, step time: 0.800× (FAIL, target at most 0.75×)"


def test_the_sub_layers_alone_compiled_have_one_graph(monkeypatch, capsys):
    # --compile on: each sub-layer, full and at each rate, also compiled; MoD's has static shapes, so it compiles
    # whole (fullgraph: a host read or a shape from data would break it), and the MLP's target line follows
    compile_ = torch.compile
    compiled = []

    def eager_backend(fn, **kwargs):  # dynamo's trace without Inductor's C++ build
        compiled.append(fn)
        return compile_(fn, backend="eager", fullgraph=True, dynamic=kwargs.get("dynamic"))

    monkeypatch.setattr(torch, "compile", eager_backend)
    args = bench_mod.parse(TINY + ["--layer-repeats", "1"])
    torch._dynamo.reset()
    try:
        out = bench_mod.layer_bench(args, [0.4], torch.device("cpu"), compiled=True)
    finally:
        torch._dynamo.reset()
    assert len(compiled) == 4  # attention and MLP, full and at 40 %
    assert set(out["mlp"][0.4]) == set(out["attn"]["full"]) == {"eager", "compiled"}
    text = capsys.readouterr().out
    assert "  mlp   40%  compiled |" in text and "mlp 40% compiled / full mlp compiled, time: " in text


def test_compiled_variants_count_their_graphs_and_compile_once(monkeypatch, tmp_path):
    # --compile on: each variant's model compiled whole; its first steps compile it, the timed ones compile nothing
    # (MoD's shapes are static), and the JSON says so per variant (gpu_checks' mod line names any later graph)
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="eager", dynamic=kw.get("dynamic")))
    path = tmp_path / "mod.json"
    torch._dynamo.reset()
    try:
        bench_mod.main(
            TINY + ["--rates", "0.4", "--blocks", "both", "--compile", "on", "--layer-repeats", "0", "--steps", "2"]
            + ["--json", str(path)]
        )
    finally:
        torch._dynamo.reset()
    d = json.loads(path.read_text())
    assert d["compiled"] is True and [r["blocks"] for r in d["results"]] == ["none", "both"]
    assert all(r["graphs"] >= 1 and r["later_graphs"] == 0 for r in d["results"]), d["results"]


def test_a_variant_that_fails_leaves_the_others_figures(monkeypatch, tmp_path, capsys):
    # on a GPU slot one variant's failure (fp8's compile, say) must not cost the others' figures: they are printed
    # and written, the failure is named, and the exit status says it
    from nanochat.gpt import GPT

    set_fp8 = GPT.set_fp8

    def no_fp8(self, enabled):
        if enabled:
            raise RuntimeError("no fp8 on this machine")
        return set_fp8(self, enabled)

    monkeypatch.setattr(GPT, "set_fp8", no_fp8)
    path = tmp_path / "mod.json"
    argv = TINY + ["--rates", "0.4", "--blocks", "both", "--precision", "bf16,fp8", "--layer-repeats", "0"]
    with pytest.raises(SystemExit) as e:
        bench_mod.main(argv + ["--json", str(path)])
    assert e.value.code == "error: 1 of 3 variants failed: both 40% fp8: RuntimeError: no fp8 on this machine"
    d = json.loads(path.read_text())
    assert [(r["blocks"], r["precision"]) for r in d["results"]] == [("none", "bf16"), ("both", "bf16")]
    assert [c["what"] for c in d["claims"]] == ["both 40% / full depth, step time"] and len(d["failed"]) == 1
    assert "failed: both 40% fp8: RuntimeError" in capsys.readouterr().out
