"""The GPT baseline: shapes, init, FLOP accounting, optimizer."""

import math

import pytest
import torch

from nanochat.gpt import GPT, GPTConfig, layer_windows
from nanochat.optim import orthogonalize


def tiny_model(seed=0, **kw):
    cfg = dict(sequence_len=32, vocab_size=100, n_layer=2, n_head=2, n_kv_head=1, n_embd=32, window_pattern="SL")
    cfg.update(kw)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = GPT(GPTConfig(**cfg))
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def test_flops_match_hand_count():
    model = tiny_model()
    # per layer: q 32·32 + k 32·16 + v 32·16 + proj 32·32 + mlp 2·32·128 = 11264; lm_head 32·100
    matmul = 2 * 11264 + 3200
    assert model.num_scaling_params() == matmul
    # windows: S = 16 tokens, last layer L = 32; 12·h·q·T_eff with h=2, q=16
    attn = 12 * 2 * 16 * 16 + 12 * 2 * 16 * 32
    assert model.estimate_flops() == 6 * matmul + attn == 172800


def test_windows_pattern():
    cfg = GPTConfig(sequence_len=64, n_layer=5, window_pattern="SSL")
    assert layer_windows(cfg) == [32, 32, 64, 32, 64]
    with pytest.raises(ValueError):
        layer_windows(GPTConfig(window_pattern="SX"))


def test_loss_at_init_near_ln_vocab():
    model = tiny_model()
    x = torch.randint(0, 100, (4, 32))
    loss = model(x, torch.roll(x, -1, 1)).item()
    assert abs(loss - math.log(100)) < 0.05


def test_logits_and_reductions():
    model = tiny_model()
    x = torch.randint(0, 100, (3, 20))
    y = torch.roll(x, -1, 1)
    assert model(x).shape == (3, 20, 100)
    per_token = model(x, y, loss_reduction="none")
    assert per_token.shape == (60,)
    assert torch.allclose(per_token.mean(), model(x, y))
    y[0, :5] = -1  # ignored targets
    assert model(x, y, loss_reduction="none")[:5].abs().sum() == 0


def test_causality_and_softcap():
    model = tiny_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    x = torch.randint(0, 100, (1, 32))
    x2 = x.clone()
    x2[0, 20:] = (x2[0, 20:] + 1) % 100
    a, b = model(x), model(x2)
    assert torch.allclose(a[0, :20], b[0, :20], atol=1e-5)
    assert not torch.allclose(a[0, 20:], b[0, 20:])
    assert a.abs().max() <= 15.0


def test_orthogonalize_gives_near_orthogonal():
    torch.manual_seed(0)
    G = torch.randn(3, 16, 8)
    X = orthogonalize(G, torch.float32)
    s = torch.linalg.svdvals(X)
    assert s.min() > 0.6 and s.max() < 1.3  # Polar Express lands singular values near 1


def test_optimizer_lowers_loss_and_uses_every_param():
    model = tiny_model()
    opt = model.setup_optimizer()
    kinds = {g["kind"] for g in opt.param_groups}
    assert kinds == {"adamw", "muon"}
    n_opt = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert n_opt == sum(p.numel() for p in model.parameters())
    x = torch.randint(0, 100, (8, 32))
    y = torch.roll(x, -1, 1)
    first = model(x, y).item()
    for _ in range(20):
        model(x, y).backward()
        opt.step()
        model.zero_grad(set_to_none=True)
    assert model(x, y).item() < first - 1.0


def test_generate_greedy_follows_argmax_and_sampling_follows_seed():
    model = tiny_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    prompt = [1, 2, 3]
    greedy = list(model.generate(prompt, 4, temperature=0))
    expected = []
    for _ in range(4):  # greedy decoding by hand, one full forward per token
        expected.append(model(torch.tensor([prompt + expected]))[0, -1].argmax().item())
    assert greedy == expected
    a = list(model.generate(prompt, 8, temperature=1.0, seed=7))
    assert a == list(model.generate(prompt, 8, temperature=1.0, seed=7))
    assert a != list(model.generate(prompt, 8, temperature=1.0, seed=8))
