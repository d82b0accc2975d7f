"""routed_attention (nanochat/flash_attention.py): queries gathered at given positions, on the CPU.

The CPU path (SDPA with a mask from the positions) forward and backward, CUDA's path (flex_attention with a block mask
built from the positions) as its CPU twin: the compiled forward, the eager forward and backward with flex_attention's
CPU autograd refusal lifted, and the blocks the mask visits; both against SDPA in fp32 with the dense mask. Both trace
without a graph break, compile once for every batch of positions, and read nothing on the host."""

import contextlib
import functools

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F

from nanochat import flash_attention as fa

B, H, KV, HD = 2, 4, 2, 16  # two rows, GQA 2:1


def inputs(Tq, Tk, seed=0):
    """q, k, v and each row's Tq positions of Tk, drawn apart per row (ascending, distinct), and an output grad."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.stack([torch.randperm(Tk, generator=g)[:Tq].sort().values for _ in range(B)])
    q, dy = (torch.randn(B, H, Tq, HD, generator=g) for _ in range(2))
    k, v = (torch.randn(B, KV, Tk, HD, generator=g) for _ in range(2))
    return q, k, v, positions, dy


def reference(q, k, v, positions, window):
    """SDPA in fp32 with the dense (B, 1, Tq, Tk) mask: the rows of the plain row's window mask at the positions."""
    allowed = fa.window_mask(k.size(2), window, q.device)[positions][:, None]
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=allowed, enable_gqa=True)


def forward_backward(fn, q, k, v, positions, dy, window):
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    y = fn(*xs, positions, window)
    y.backward(dy)
    return [y.detach()] + [x.grad for x in xs]


def assert_close(got, want):
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


@pytest.fixture
def flex_on_cpu(monkeypatch):
    """CUDA's path on the CPU: routed_attention takes flex_attention's branch."""
    monkeypatch.setattr(fa, "flex_windows", lambda device: True)


@pytest.fixture
def flex_eager(flex_on_cpu, monkeypatch):
    """CUDA's path on the CPU with flex_attention eager, its CPU autograd refusal lifted, and block masks of 16, so
    that short rows span several blocks."""
    from torch.nn.attention import flex_attention as fx

    monkeypatch.setattr(fx, "_validate_device", lambda *a: None)
    monkeypatch.setattr(fa, "flex", lambda: fx.flex_attention)
    build = functools.partial(fa.routed_block_mask, block=16)
    monkeypatch.setattr(fa, "routed_block_mask_builder", lambda q_positions: build)


@contextlib.contextmanager
def refusing_host_reads():
    """Tensor.item and Tensor.tolist raise (a compiler may read its constants: compile before, run inside)."""

    def refuse(self, *a, **kw):
        raise AssertionError("a host read")

    with pytest.MonkeyPatch.context() as m:
        for name in ("item", "tolist"):
            m.setattr(torch.Tensor, name, refuse)
        yield


@pytest.fixture
def no_host_reads():
    with refusing_host_reads():
        yield


@pytest.mark.parametrize("window", [48, 20])  # the whole row (plain causal), and a window shorter than it
def test_the_cpu_path_equals_the_dense_mask_reference(window, no_host_reads):
    """Tq 26 of Tk 48: no multiple of a block; forward and the grads of q, k and v."""
    q, k, v, positions, dy = inputs(26, 48)
    got = forward_backward(fa.routed_attention, q, k, v, positions, dy, window)
    assert_close(got, forward_backward(reference, q, k, v, positions, dy, window))
    assert got[0].dtype == q.dtype


@pytest.mark.parametrize("window", [48, 20])
def test_the_flex_path_forward_and_backward_equals_the_reference(flex_eager, window, no_host_reads):
    """The mask_mod that indexes the positions, forward and backward (flex_attention's eager path)."""
    q, k, v, positions, dy = inputs(26, 48)
    got = forward_backward(fa.routed_attention, q, k, v, positions, dy, window)
    assert_close(got, forward_backward(reference, q, k, v, positions, dy, window))


def test_the_flex_path_compiled_forward_equals_the_reference(flex_on_cpu):
    """The kernel walks the block mask, built by the compiled builder (CPU: forward only, as flex_attention allows):
    Tq 208 of 256, a query block of 128 and a part one, full causal and a window of 64. Two batches of positions,
    each window compiled once (one builder graph per window, whatever the positions)."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    real = torch.compile

    def counted(fn, **kw):
        return real(fn, backend=counter, **kw) if fn is fa.routed_block_mask else real(fn, **kw)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(fa, "_routed_block_mask_compiled", None)
        m.setattr(torch, "compile", counted)
        with torch.no_grad():
            for seed, reads in ((0, contextlib.nullcontext), (1, refusing_host_reads)):  # compiles, then runs
                for window in (256, 64):
                    q, k, v, positions, _ = inputs(208, 256, seed)
                    with reads():
                        got = fa.routed_attention(q, k, v, positions, window)
                    assert torch.allclose(got, reference(q, k, v, positions, window), atol=1e-5)
    assert counter.frame_count == 2


def test_the_block_mask_visits_exactly_the_blocks_some_query_sees():
    Tq, Tk, w, block = 40, 64, 12, 16
    _, _, _, positions, _ = inputs(Tq, Tk)
    visited = fa.routed_block_mask(positions, Tk, w, block).to_dense()[:, 0].bool()  # (B, query blocks, key blocks)
    seen = fa.window_mask(Tk, w, "cpu")[positions]  # (B, Tq, Tk)
    padded = F.pad(seen, (0, 0, 0, -Tq % block)).view(B, -(-Tq // block), block, Tk // block, block)
    assert torch.equal(visited, padded.any(4).any(2))
    assert not visited.all()  # a window this short skips blocks


@pytest.mark.parametrize("path", ["cpu", "flex"])
def test_it_traces_without_a_graph_break_or_a_host_read(path, monkeypatch):
    """What torch.compile of a model meets: one graph, no host read in it; a second batch of positions traces no
    other graph."""
    if path == "flex":
        monkeypatch.setattr(fa, "flex_windows", lambda device: True)

    def layer(q, k, v, positions):
        return fa.routed_attention(q * 2, k, v, positions, 20) + 1

    q, k, v, positions, _ = inputs(26, 48)
    with torch.no_grad(), refusing_host_reads():
        explained = torch._dynamo.explain(layer)(q, k, v, positions)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=False)
    with torch.no_grad():
        for seed in (0, 1):
            q, k, v, positions, _ = inputs(26, 48, seed)
            want = layer(q, k, v, positions)
            with refusing_host_reads():
                got = compiled(q, k, v, positions)
            assert torch.allclose(got, want, atol=1e-5)
    assert counter.frame_count == 1
