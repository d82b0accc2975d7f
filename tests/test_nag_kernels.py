"""
The fused NAG Triton kernels (nag/kernels.py) against the reference math in nag/functional.py.

Without a GPU, nag.kernels selects Triton's interpreter (TRITON_INTERPRET=1),
which runs the kernels on CPU tensors, slowly: shapes stay small. On a CUDA
machine the CPU variants are skipped (compiled kernels need CUDA tensors) and
the CUDA variants run instead.
"""

import os
import sys
import json
import subprocess

import numpy
import pytest
import torch
import triton

from nag.functional import nag_branch
from nag.kernels import fused_nag_branch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny shapes, and the interpreter runs one program at a time


def version(module):
    return tuple(int(x) for x in module.__version__.split(".")[:2])


# Triton's interpreter before 3.7 makes a runtime loop bound (the gate kernel's loop over partials) a one-element
# array, which NumPy 2.4 no longer turns into an int (triton-lang/triton#9171): no interpreted test can pass there
OLD_INTERPRETER = INTERPRETED and version(triton) < (3, 7) and version(numpy) >= (2, 4)
DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            not INTERPRETED or OLD_INTERPRETER,
            reason=(
                f"Triton {triton.__version__}'s interpreter cannot run "
                f"with NumPy {numpy.__version__}: pip install 'numpy<2.4'"
                if OLD_INTERPRETER
                else "CPU tensors need TRITON_INTERPRET=1"
            ),
        ),
    ),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_inputs(lead, dim, channels=32, dtype=torch.float32, device="cpu", alpha=0.7, beta_raw=0.3, seed=0):
    """The seven tensor inputs of nag_branch, leaf tensors requiring grad."""
    gen = torch.Generator().manual_seed(seed)
    res_dir = torch.randn(*lead, dim, generator=gen)
    res_dir = res_dir * torch.rsqrt(res_dir.pow(2).mean(-1, keepdim=True))
    inputs = [
        res_dir.to(dtype),
        torch.randn(*lead, 1, generator=gen),  # log_norm stays fp32
        (2 * torch.randn(*lead, dim, generator=gen) + 0.3).to(dtype),
        (2 * torch.randn(*lead, channels, generator=gen)).to(dtype),
        torch.randn(channels, generator=gen),
        torch.tensor([beta_raw]),
        torch.tensor([alpha]),
    ]
    return [t.to(device).requires_grad_() for t in inputs]


def run(fn, inputs, floor, renorm, seed=1):
    """Outputs and the gradients of all seven inputs under a random upstream gradient."""
    new_dir, new_log_norm = fn(*inputs, floor, renorm)
    gen = torch.Generator().manual_seed(seed)
    up_dir = torch.randn(new_dir.shape, generator=gen).to(new_dir.device)
    up_log_norm = torch.randn(new_log_norm.shape, generator=gen).to(new_dir.device)
    loss = (new_dir.float() * up_dir).sum() + (new_log_norm * up_log_norm).sum()
    grads = torch.autograd.grad(loss, inputs)
    return [new_dir, new_log_norm], list(grads)


def fresh(inputs):
    return [t.detach().clone().requires_grad_() for t in inputs]


def assert_matches(actual, expected, tol):
    for a, e in zip(actual, expected):
        assert a.shape == e.shape and a.dtype == e.dtype
        a, e = a.detach().double(), e.detach().double()
        scale = e.abs().max().item() if e.numel() else 0.0
        torch.testing.assert_close(a, e, rtol=tol, atol=tol * max(scale, 1e-6))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("renorm", ["measured", "predicted"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("rows, dim, channels", [(7, 96, 5), (13, 640, 32), (7, 768, 32)])
def test_matches_reference(device, renorm, dtype, tol, rows, dim, channels):
    inputs = make_inputs((rows,), dim, channels, dtype=dtype, device=device)
    fused_out, fused_grads = run(fused_nag_branch, inputs, 1e-6, renorm)
    ref_out, ref_grads = run(nag_branch, fresh(inputs), 1e-6, renorm)
    assert_matches(fused_out, ref_out, tol)
    assert_matches(fused_grads, ref_grads, tol)
    # the update really moved the state, so the comparison is not vacuous
    assert (ref_out[0].float() - inputs[0].float()).abs().max() > 0.1


@pytest.mark.parametrize("device", DEVICES)
def test_leading_dims_and_dtypes(device):
    inputs = make_inputs((2, 3), 96, 32, dtype=torch.bfloat16, device=device)
    (new_dir, new_log_norm), grads = run(fused_nag_branch, inputs, 1e-6, "measured")
    assert new_dir.shape == (2, 3, 96) and new_dir.dtype == torch.bfloat16
    assert new_log_norm.shape == (2, 3, 1) and new_log_norm.dtype == torch.float32
    for grad, tensor in zip(grads, inputs):
        assert grad.shape == tensor.shape and grad.dtype == tensor.dtype
    ref_out, ref_grads = run(nag_branch, fresh(inputs), 1e-6, "measured")
    assert_matches([new_dir, new_log_norm], ref_out, 3e-2)
    assert_matches(grads, ref_grads, 3e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("renorm", ["measured", "predicted"])
def test_zero_gain(device, renorm):
    inputs = make_inputs((7,), 96, 32, device=device, alpha=0.0)
    fused_out, fused_grads = run(fused_nag_branch, inputs, 1e-6, renorm)
    ref_out, ref_grads = run(nag_branch, fresh(inputs), 1e-6, renorm)
    torch.testing.assert_close(fused_out[0], inputs[0].detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(fused_out[1], inputs[1].detach(), rtol=0, atol=0)
    assert_matches(fused_grads, ref_grads, 2e-5)
    assert fused_grads[6].abs().item() > 0  # α still learns from a closed gate


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy sees the inf/nan
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("floor", [0.0, 1e-6])
@pytest.mark.parametrize("per_program", [1, 16])  # a row a backward program, or all 7 rows in one tile of 16
def test_floor_and_failure1(device, dtype, floor, per_program, monkeypatch):
    # all logits very negative: u == 0; β = softplus(−1) < 1
    monkeypatch.setattr("nag.kernels._rows_per_program", lambda n: per_program)
    inputs = make_inputs((7,), 96, 32, dtype=dtype, device=device, beta_raw=-1.0)
    with torch.no_grad():
        inputs[3].fill_(-200.0)
    fused_out, fused_grads = run(fused_nag_branch, inputs, floor, "measured")
    ref_out, ref_grads = run(nag_branch, fresh(inputs), floor, "measured")
    for fused, ref in zip(fused_grads, ref_grads):
        assert torch.equal(torch.isfinite(fused), torch.isfinite(ref))
    logits_grad = fused_grads[3]
    if floor == 0.0:
        assert not torch.isfinite(logits_grad).any()
    else:
        assert all(torch.isfinite(g).all() for g in fused_grads)
        assert_matches(fused_grads, ref_grads, 2e-5 if dtype == torch.float32 else 3e-2)
    assert_matches(fused_out, ref_out, 2e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("used", [0, 1])
def test_one_output_unused(device, used):
    # the backward must cope with a missing upstream gradient for either output
    inputs = make_inputs((5,), 96, 32, device=device)
    ref_inputs = fresh(inputs)
    fused = torch.autograd.grad(fused_nag_branch(*inputs, 1e-6)[used].float().sum(), inputs, materialize_grads=True)
    ref = torch.autograd.grad(nag_branch(*ref_inputs, 1e-6)[used].float().sum(), ref_inputs, materialize_grads=True)
    assert_matches(fused, ref, 2e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("renorm", ["measured", "predicted"])
def test_alpha_scale(device, renorm):
    # the warm-up factor goes in as alpha_scale, applied in the kernels: α's gradient carries it, the scale gets none
    inputs = make_inputs((7,), 96, 32, device=device)
    scale = torch.tensor([0.37], device=device)
    fused_out, fused_grads = run(lambda *a: fused_nag_branch(*a, alpha_scale=scale), inputs, 1e-6, renorm)
    ref_out, ref_grads = run(lambda *a: nag_branch(*a, alpha_scale=scale), fresh(inputs), 1e-6, renorm)
    assert_matches(fused_out, ref_out, 2e-5)
    assert_matches(fused_grads, ref_grads, 2e-5)
    unscaled, _ = run(fused_nag_branch, fresh(inputs), 1e-6, renorm)
    assert (unscaled[1] - fused_out[1]).abs().max() > 1e-3  # the scale was applied


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows, per_program", [(7, 3), (13, 4), (0, 1)])
def test_rows_split_over_programs(device, rows, per_program, monkeypatch):
    # several rows per backward program, the last program short (it redoes a row and keeps nothing of it),
    # and no rows at all (the parameter gradients are then 0); real shapes split only past 4,096 rows
    monkeypatch.setattr("nag.kernels._rows_per_program", lambda n: per_program)
    inputs = make_inputs((rows,), 96, 32, device=device)
    fused_out, fused_grads = run(fused_nag_branch, inputs, 1e-6, "measured")
    ref_out, ref_grads = run(nag_branch, fresh(inputs), 1e-6, "measured")
    assert_matches(fused_out, ref_out, 2e-5)
    assert_matches(fused_grads, ref_grads, 2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_per_program_leaves_the_gradients(device):
    # the values the branch-op bench sweeps (scripts/bench/nag.py --op-rows-per-program): each row's gradients are
    # the same to the bit in the interpreter (to fp32 rounding on a GPU), the parameter ones to fp32 rounding (their
    # partial sums are grouped by program); 11 rows, so most values leave the last program short and 16, 32 give one
    # program that redoes rows
    res_dir, _, branch_out, mod_logits, coef, beta_raw, alpha = [
        t.detach() for t in make_inputs((11,), 96, 8, device=device)
    ]
    gen = torch.Generator().manual_seed(3)
    up = [torch.randn(11, 96, generator=gen).to(device), torch.randn(11, 1, generator=gen).to(device)]

    def grads(rows_per_program):
        return torch.ops.nag.fused_branch_backward(
            *up, res_dir, branch_out, mod_logits, coef, beta_raw, alpha, None, 1e-6, "measured", rows_per_program
        )

    default = grads(0)
    inputs = fresh([res_dir, torch.zeros(11, 1, device=device), branch_out, mod_logits, coef, beta_raw, alpha])
    ref = torch.autograd.grad(nag_branch(*inputs, 1e-6, "measured"), [inputs[i] for i in (0, 2, 3, 4, 5, 6)], up)
    assert_matches(default, ref, 2e-5)
    for k in (1, 2, 4, 8, 16, 32):
        got = grads(k)
        for a, b in zip(got[:3], default[:3]):
            if device == "cpu":
                assert torch.equal(a, b), k
            else:  # a tile of other rows may lay a row over the threads otherwise: another order of its sums
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * b.abs().max().item())
        for a, b in zip(got[3:], default[3:]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * b.abs().max().item())
    assert default[3].abs().max() > 0 and default[5].abs().item() > 0  # the sums are not vacuous


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dim, rows, renorm, scaled",
    [
        (640, 19, "measured", False),
        (640, 3, "predicted", True),
        (640, 1, "measured", True),
        (640, 1, "predicted", False),
        (97, 19, "predicted", True),
        (97, 3, "measured", False),
        (97, 1, "predicted", False),
    ],
)
def test_tiles_match_reference(device, dim, rows, renorm, scaled, monkeypatch):
    # the tiles a full micro-batch gets (16 rows a backward program: at D = 640, 8 pipelined tiles of 2 rows, and
    # forward tiles of 4; at D = 97, one backward tile of 16, forward ones of 32): 19 rows make 2 backward programs,
    # the second cut short; 3 rows are fewer than a tile, and 1 is one row; an odd D pads its columns. Forward and
    # backward, both renorm modes, with and without alpha_scale; the parameter gradients come out the same twice
    from nag import kernels

    monkeypatch.setattr("nag.kernels._rows_per_program", lambda n: kernels.BACKWARD_ROWS_PER_PROGRAM)
    inputs = make_inputs((rows,), dim, 32, device=device)
    scale = torch.tensor([0.37], device=device) if scaled else None
    fused_out, fused_grads = run(lambda *a: fused_nag_branch(*a, alpha_scale=scale), inputs, 1e-6, renorm)
    ref_out, ref_grads = run(lambda *a: nag_branch(*a, alpha_scale=scale), fresh(inputs), 1e-6, renorm)
    assert_matches(fused_out, ref_out, 2e-5)
    assert_matches(fused_grads, ref_grads, 2e-5)
    _, again = run(lambda *a: fused_nag_branch(*a, alpha_scale=scale), fresh(inputs), 1e-6, renorm)
    for a, b in zip(fused_grads, again):
        assert torch.equal(a, b)


def test_tiles_by_width():
    # the rule of nag.kernels._launch_config: 8 warps, each thread 16 (forward) or 8 (backward) elements of a row
    # vector, D padded to a power of two; a backward program of 16 rows at D = 640 is 8 tiles of 2 rows
    from nag import kernels

    assert kernels._launch_config(640, 32, kernels.FORWARD_PER_THREAD) == (4, 1024, 32, 8)
    assert kernels._launch_config(640, 32, kernels.BACKWARD_PER_THREAD) == (2, 1024, 32, 8)
    assert kernels._launch_config(97, 5, kernels.BACKWARD_PER_THREAD) == (16, 128, 8, 8)
    assert kernels._launch_config(4096, 32, kernels.BACKWARD_PER_THREAD) == (1, 4096, 32, 16)
    assert kernels._backward_tiles(16, 2) == (2, 8)
    assert kernels._backward_tiles(1, 2) == (1, 1)
    assert kernels._backward_tiles(5, 16) == (4, 2)  # rounded up to whole tiles: 8 rows


@pytest.mark.parametrize("device", DEVICES)
def test_launches_per_sublayer(device):
    # one NAG sub-layer update is 1 kernel forward and 2 backward, no eager op around them (was 4 and 13);
    # the count of scripts/bench/nag.py --sections launches, so that no small op creeps back in
    from scripts.bench.nag import count_launches

    forward, backward = count_launches("fused", device=device)
    assert forward.triton == ["_nag_forward_kernel"] and forward.aten == []
    assert backward.triton == ["_nag_backward_kernel", "_nag_gate_grad_kernel"] and backward.aten == []


@pytest.mark.parametrize("device", DEVICES)
def test_parameter_grads_deterministic(device):
    inputs = make_inputs((13,), 96, 32, device=device)
    _, first = run(fused_nag_branch, inputs, 1e-6, "measured")
    _, second = run(fused_nag_branch, inputs, 1e-6, "measured")
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_saves_only_its_inputs(device):
    # the backward recomputes every row quantity, so the op costs no activation memory of its own
    def saved_storages(fn, inputs):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            fn(*inputs, 1e-6, "measured")
        return {t.untyped_storage().data_ptr() for t in saved}

    inputs = make_inputs((5,), 96, 32, device=device)
    input_storages = {t.untyped_storage().data_ptr() for t in inputs}
    fused = saved_storages(fused_nag_branch, inputs)
    assert fused and fused <= input_storages
    assert not saved_storages(nag_branch, fresh(inputs)) <= input_storages  # the reference saves intermediates


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is only selected without a GPU")
def test_triton_imported_before_nag_is_a_clear_error():
    # torch._functorch imports triton.language; nag then sets the flag too late for tl.sum and friends
    code = "import torch._functorch.aot_autograd, nag, nag.kernels"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0 and "ImportError: Triton was imported before nag" in out.stderr, out.stderr[-2000:]


def test_unknown_renorm_rejected():
    inputs = make_inputs((3,), 96, 32)
    with pytest.raises(ValueError):
        fused_nag_branch(*inputs, 1e-6, "exact")


@pytest.mark.parametrize("device", DEVICES)
def test_custom_op_registration(device):
    # schema, fake (meta) kernel, autograd registration and AOT dispatch
    inputs = [t.detach() for t in make_inputs((3,), 96, 8, device=device)]
    inputs[1].requires_grad_()
    inputs[2].requires_grad_()
    torch.library.opcheck(torch.ops.nag.fused_branch.default, (*inputs, None, 1e-6, "measured"))
    torch.library.opcheck(
        torch.ops.nag.fused_branch.default, (*inputs, torch.tensor([0.5], device=device), 1e-6, "predicted")
    )


def non_contiguous(t, layout):
    """The same values in a non-contiguous layout: "transposed" (last two dims, 1-D tensors sliced instead)
    or "sliced" (every other element of a twice-as-large buffer, in every dim)."""
    if layout == "transposed" and t.ndim >= 2:
        return t.mT.contiguous().mT
    return torch.stack([t, torch.zeros_like(t)], dim=-1)[..., 0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["transposed", "sliced"])
@pytest.mark.parametrize("op", ["forward", "backward"])
def test_custom_ops_on_non_contiguous_inputs(device, layout, op):
    # the real ops return contiguous tensors whatever the inputs' strides: the fake (meta) kernels must say
    # the same, or a compiled graph plans the wrong strides for every tensor downstream. A transposed input
    # is dense, so empty_like would keep its strides; a sliced one is not, so empty_like would not
    inputs = [non_contiguous(t.detach(), layout) for t in make_inputs((4,), 8, 4, device=device)]
    assert not inputs[0].is_contiguous() and not inputs[3].is_contiguous() and not inputs[4].is_contiguous()
    if op == "forward":
        torch.library.opcheck(
            torch.ops.nag.fused_branch.default, (*[t.requires_grad_() for t in inputs], None, 1e-6, "measured")
        )
        return
    gen = torch.Generator().manual_seed(2)
    grads = [non_contiguous(torch.randn(t.shape, generator=gen).to(device), layout) for t in (inputs[0], inputs[1])]
    res_dir, _, branch_out, mod_logits, coef, beta_raw, alpha = inputs
    # the backward op has no autograd formula of its own (no double backward), so the autograd check,
    # which needs inputs that require grad, does not apply
    torch.library.opcheck(
        torch.ops.nag.fused_branch_backward.default,
        (*grads, res_dir, branch_out, mod_logits, coef, beta_raw, alpha, None, 1e-6, "predicted"),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


@pytest.mark.parametrize("device", DEVICES)
def test_compiles_without_graph_break(device):
    def step(res_dir, log_norm, branch_out, mod_logits, coef, beta_raw, alpha):
        new_dir, new_log_norm = fused_nag_branch(
            res_dir * 1.0, log_norm, branch_out * 2.0, mod_logits, coef, beta_raw, alpha, 1e-6
        )
        return new_dir.float().sin().sum() + new_log_norm.sum()

    inputs = make_inputs((2, 3), 96, 32, device=device)
    explanation = torch._dynamo.explain(step)(*inputs)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0
    torch._dynamo.reset()
    # aot_eager runs dynamo, fake tensors and AOT autograd, like Inductor, without compiling C++
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    loss = compiled(*inputs)
    grads = torch.autograd.grad(loss, inputs)
    ref_inputs = fresh(inputs)
    ref_loss = step(*ref_inputs)
    ref_grads = torch.autograd.grad(ref_loss, ref_inputs)
    torch.testing.assert_close(loss, ref_loss)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_whole_model_compiles_as_one_graph(device):
    from nag.model import NAGGPT
    from nanochat.gpt import GPTConfig

    config = GPTConfig(sequence_len=32, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=64)
    model = NAGGPT(config, impl="fused", device=device)
    model.init_weights()
    idx = torch.randint(0, 64, (2, 32), device=device)
    explanation = torch._dynamo.explain(model)(idx, idx)
    torch._dynamo.reset()
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0, explanation.break_reasons
    # each sub-layer's update is the fused op, one opaque node (not traced through, nor the reference's ops)
    calls = [n.target for g in explanation.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert calls.count(torch.ops.nag.fused_branch.default) == 2 * config.n_layer


@pytest.mark.parametrize("device", DEVICES[:1])  # the CPU alone: the figure does not depend on the device
def test_compiled_model_activations_within_target(device):
    # the memory target (NAG-fused ≤ 1.05× GPT) in its device-independent part: what a compiled
    # model keeps for backward per token per layer at the real width, D = 640
    from scripts.bench.nag import activations_per_layer

    # the bench's depths are 1 and 3, its sequence 199 tokens; 13 (prime too, equal to no width) gives the same bytes
    # per token per layer, and the interpreted fused kernel runs on 13 rows instead of 199
    def per_layer(variant):
        return activations_per_layer(variant, 640, 256, device, compiled=True, seq_len=13, depths=(1, 2))

    gpt = per_layer("gpt")
    assert per_layer("nag:fused") <= 1.05 * gpt
    assert per_layer("nag:reference") > 1.1 * gpt  # the unfused update costs activations: the measure sees it


def test_kernels_build_for_hopper():
    # What the interpreter cannot show: that the kernels compile for sm_90 (H100/H200) at the real
    # widths, keep every row quantity in registers (no spills), and move the rows in 128-bit accesses, the least bytes
    # a row can, with enough of them in flight
    from scripts.bench.nag import branch_op_bytes

    try:
        assert triton.knobs.nvidia.cuobjdump.path
    except RuntimeError:
        pytest.skip("this Triton build ships no cuobjdump")
    # D = 640 alone: 768 builds alike (the report shows both)
    code = "import json; from scripts.bench.kernel_report import report; print(json.dumps(report((640,))))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    builds = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(builds) == 9 and builds[-1]["kernel"] == "_nag_gate_grad_kernel" and builds[-1]["local"] == 0
    rows_read = {"_nag_forward_kernel": 2, "_nag_backward_kernel": 3}  # res, branch_out (+ grad of new_res)
    rows_written = {"_nag_forward_kernel": 1, "_nag_backward_kernel": 2}  # new_res (grads of res and branch_out)
    per_thread = {"_nag_forward_kernel": 16, "_nag_backward_kernel": 8}  # elements of a row vector a thread holds
    for b in builds[:-1]:
        assert b["local"] == 0, b
        # a row vector's elements a thread holds, 16 bytes an access (cp.async's, "128a", count as loads)
        per_row = per_thread[b["kernel"]] * (2 if b["dtype"] == "bf16" else 4) // 16
        assert b["loads"].get("128", 0) + b["loads"].get("128a", 0) >= rows_read[b["kernel"]] * per_row, b
        assert b["stores"].get("128", 0) >= rows_written[b["kernel"]] * per_row, b
        # the build moves the least bytes a row can (padded columns masked off), and an SM holds enough of them
        # in flight to cover an H200's memory latency (some 36 KB: 4.8 TB/s × ~1 µs over 132 SMs)
        forward, backward = branch_op_bytes(b["dim"], 32, 2 if b["dtype"] == "bf16" else 4)
        least = forward if b["kernel"] == "_nag_forward_kernel" else backward
        assert b["row_bytes"]["loads"] + b["row_bytes"]["stores"] == least, b
        assert b["blocks_per_sm"] >= 2 and b["in_flight_per_sm"] >= 36 * 1024, b


@requires_cuda
@pytest.mark.parametrize("renorm", ["measured", "predicted"])
def test_matches_reference_cuda_large(renorm, monkeypatch):
    # the backward's programs take a full micro-batch's 16 rows each (8 pipelined tiles of 2), as at 32,768 rows
    from nag import kernels

    monkeypatch.setattr("nag.kernels._rows_per_program", lambda n: kernels.BACKWARD_ROWS_PER_PROGRAM)
    inputs = make_inputs((4, 1024), 640, 32, dtype=torch.bfloat16, device="cuda")
    fused_out, fused_grads = run(fused_nag_branch, inputs, 1e-6, renorm)
    ref_out, ref_grads = run(nag_branch, fresh(inputs), 1e-6, renorm)
    assert_matches(fused_out, ref_out, 3e-2)
    assert_matches(fused_grads, ref_grads, 3e-2)


@requires_cuda
def test_inductor_compile_cuda():
    def step(*inputs):
        new_dir, new_log_norm = fused_nag_branch(*inputs, 1e-6)
        return new_dir.float().square().mean() + new_log_norm.mean()

    inputs = make_inputs((2, 64), 768, 32, dtype=torch.bfloat16, device="cuda")
    compiled = torch.compile(step, fullgraph=True)
    grads = torch.autograd.grad(compiled(*inputs), inputs)
    ref_inputs = fresh(inputs)
    ref_grads = torch.autograd.grad(step(*ref_inputs), ref_inputs)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)
