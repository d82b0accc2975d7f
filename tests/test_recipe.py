"""nanochat's recipe on the GPT baseline (gpt-recipe) and on NAG (nag-recipe).

nanochat/recipe.py and nag/recipe.py: each part
against a plain restatement of nanochat's formula, every part off = the base arch bit for bit, NAG's decisions, the FLOP
count at nanochat's d24 against its estimate_flops, the KV cache and packed rows, the run6 preset's plan, train +
resume."""

import json
import math
import os
from dataclasses import asdict, replace

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY_TRAIN, random_model
from nanochat.core_eval import forward_scores, packed_row, packed_scores
from nanochat.engine import KVCache, generate
from nanochat.gpt import GPT, GPTConfig
from nanochat.recipe import PARTS, RecipeConfig, RecipeGPT, quarter_window
from nag import archs
from nag.model import NAGGPT, NAGConfig
from nag.recipe import NAGRecipeGPT
from scripts import base_train

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CFG = GPTConfig(sequence_len=64, vocab_size=512, n_layer=4, n_head=4, n_kv_head=2, n_embd=64)
OFF = RecipeConfig(**{p: False for p in PARTS})
NAG = {"nag": NAGConfig(alpha_warmup_tokens=0)}


def only(*parts):
    return RecipeConfig(**{p: p in parts for p in PARTS})


def tokens(B=2, T=64, seed=3):
    return torch.randint(0, CFG.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


# ----- nanochat's forward, restated (karpathy/nanochat nanochat/gpt.py: GPT.forward, CausalSelfAttention.forward) -----


def rotate(x, T, hd):
    inv = 1.0 / (100000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    f = torch.outer(torch.arange(T, dtype=torch.float32), inv)[None, :, None, :]
    cos, sin = f.cos(), f.sin()
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return torch.cat([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos], dim=-1)


def nanochat_logits(model, idx, parts):
    W = dict(model.named_parameters())
    c = model.config
    d, L, H, KV = c.n_embd, c.n_layer, c.n_head, c.n_kv_head
    hd = d // H
    B, T = idx.shape
    rms = lambda x: F.rms_norm(x, (x.size(-1),))
    x = rms(F.embedding(idx, W["wte.weight"]))
    if parts.smear:
        gate = W["smear_lambda"] * torch.sigmoid(x[:, 1:, :24] @ W["smear_gate.weight"].T)
        x = torch.cat([x[:, :1], x[:, 1:] + gate * x[:, :-1]], dim=1)
    x0, mid = x, None
    for i in range(L):
        r = W["resid_lambdas"][i] if parts.resid_lambdas else 1.0
        c0 = W["x0_lambdas"][i] if parts.x0_lambdas else 0.0
        x = r * x + c0 * x0
        p = f"blocks.{i}."
        h = rms(x)
        q = (h @ W[p + "attn.c_q.weight"].T).view(B, T, H, hd)
        k = (h @ W[p + "attn.c_k.weight"].T).view(B, T, KV, hd)
        v = (h @ W[p + "attn.c_v.weight"].T).view(B, T, KV, hd)
        if parts.value_embeds and i % 2 == (L - 1) % 2:  # has_ve
            ve = F.embedding(idx, W[f"value_embeds.{i}.weight"]).view(B, T, KV, hd)
            v = v + (3 * torch.sigmoid(h[..., :12] @ W[p + "attn.ve_gate.weight"].T)).unsqueeze(-1) * ve
        q, k = rms(rotate(q, T, hd)) * 1.2, rms(rotate(k, T, hd)) * 1.2
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        x = x + y.transpose(1, 2).reshape(B, T, d) @ W[p + "attn.c_proj.weight"].T
        x = x + F.relu(rms(x) @ W[p + "mlp.c_fc.weight"].T).square() @ W[p + "mlp.c_proj.weight"].T
        if i == L // 2:
            mid = x
    if parts.backout:
        x = x - W["backout_lambda"] * mid
    logits = rms(x) @ W["lm_head.weight"].T
    return 15 * torch.tanh(logits / 15)


@pytest.mark.parametrize(
    "parts",
    [RecipeConfig()] + [replace(RecipeConfig(), **{p: False}) for p in PARTS[:5]] + [only(p) for p in PARTS[:5]],
    ids=lambda r: ",".join(p for p in PARTS if getattr(r, p)) or "none",
)
def test_each_part_is_nanochats_formula(parts):
    model = random_model(RecipeGPT, CFG, 512, recipe=parts)
    idx = tokens()
    with torch.no_grad():
        assert (model(idx) - nanochat_logits(model, idx, parts)).abs().max().item() < 1e-5
    names = {part for n, _ in model.named_parameters() for part in n.split(".")}
    for part, param in (
        ("value_embeds", "value_embeds"),
        ("value_embeds", "ve_gate"),
        ("smear", "smear_gate"),
        ("backout", "backout_lambda"),
        ("resid_lambdas", "resid_lambdas"),
        ("x0_lambdas", "x0_lambdas"),
    ):
        assert (param in names) == getattr(parts, part), (part, param)  # a part off leaves no parameter behind


def test_nanochats_inits():
    torch.manual_seed(0)
    m = RecipeGPT.initialised(CFG)
    L, d = CFG.n_layer, CFG.n_embd
    depth = torch.arange(L) / (L - 1)
    assert torch.allclose(m.resid_lambdas, 1.15 - 0.10 * depth) and m.resid_lambdas[0] == 1.15
    assert torch.allclose(m.x0_lambdas, 0.20 - 0.15 * depth) and torch.isclose(m.x0_lambdas[-1], torch.tensor(0.05))
    assert m.smear_lambda.item() == 0 and m.backout_lambda.item() == pytest.approx(0.2)
    assert (
        sorted(m.value_embeds) == ["1", "3"]
        and m.blocks[0].attn.ve_gate is None
        and m.blocks[3].attn.ve_gate is not None
    )
    for w in (m.smear_gate.weight, m.blocks[1].attn.ve_gate.weight):
        assert 0 <= w.min() and w.max() <= 0.02
    ve = m.value_embeds["1"].weight
    assert ve.abs().max() <= math.sqrt(3 / d) and abs(ve.std().item() - d**-0.5) < 0.01
    with torch.no_grad():  # smear λ = 0 at init: the smear changes nothing yet
        assert torch.equal(m.smear(torch.ones(1, 3, d)), torch.ones(1, 3, d))


@pytest.mark.cpu_kind
@pytest.mark.parametrize(
    "base,recipe_cls,kwargs", [(GPT, RecipeGPT, {}), (NAGGPT, NAGRecipeGPT, NAG)], ids=["gpt", "nag"]
)
def test_every_part_off_is_the_base_arch_bit_for_bit(base, recipe_cls, kwargs):
    cfg = replace(CFG, window_pattern="SL")  # S layers too: the quarter-window part off gives back the baseline's half
    torch.manual_seed(0)
    a = base.initialised(cfg, **kwargs)
    torch.manual_seed(0)
    b = recipe_cls.initialised(cfg, recipe=OFF, **kwargs)
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a.windows == b.windows == [32, 64, 32, 64]
    idx = tokens()
    with torch.no_grad():
        assert torch.equal(a(idx), b(idx))
    assert a.estimate_flops() == b.estimate_flops() and a.num_scaling_params() == b.num_scaling_params()
    # the parts draw after the baseline: with them on, the baseline's weights are still the same
    torch.manual_seed(0)
    c = recipe_cls.initialised(cfg, **kwargs).state_dict()
    assert all(torch.equal(sa[k], c[k]) for k in sa)


def test_quarter_windows():
    # nanochat's -(-T // 4 // 128) * 128: 512 at 2048
    # (its comment says 768; the code gives a quarter, rounded up to 128)
    assert [quarter_window(t) for t in (2048, 1024, 256, 64)] == [512, 256, 128, 64]
    m = RecipeGPT(replace(CFG, sequence_len=512, window_pattern="SSSL"), device="meta")
    assert m.windows == [128, 128, 128, 512] and [b.attn.window for b in m.blocks] == m.windows


# ----- the FLOP count and S at nanochat's d24 -----
# (scripts/base_train.py build_model_meta; gpt.py estimate_flops, num_scaling_params)


def nanochat_d24(depth=24, aspect=64, head_dim=128, seq=2048, vocab=32768, pattern="SSSL"):
    """nanochat's estimate_flops (6 × every Linear weight: blocks, ve gates, smear gate, lm_head; value embeddings are
    lookups) + 12·h·q·min(window, T) per layer, and its S (transformer matrices + lm_head), in plain Python."""
    d = -(-depth * aspect // head_dim) * head_dim
    h = d // head_dim
    ve_layers = sum(i % 2 == (depth - 1) % 2 for i in range(depth))
    matrices = depth * 12 * d * d + ve_layers * 12 * h  # attention 4d², MLP 8d²; ve_gate 12 → n_kv_head
    short = -(-seq // 4 // 128) * 128
    windows = [seq if pattern[i % len(pattern)] == "L" else short for i in range(depth - 1)] + [seq]
    flops = 6 * (matrices + 24 + vocab * d) + sum(12 * h * head_dim * min(w, seq) for w in windows)
    return flops, matrices + vocab * d


def test_flops_and_scaling_params_are_nanochats_at_d24():
    flops, S = nanochat_d24()
    assert flops == 4_775_225_616  # nanochat's figure for its d24 (dim 1536, 12 heads, SSSL at 2048)
    cfg = GPTConfig(
        sequence_len=2048, vocab_size=32768, n_layer=24, n_head=12, n_kv_head=12, n_embd=1536, window_pattern="SSSL"
    )
    m = RecipeGPT(cfg, device="meta")
    assert m.estimate_flops() == flops and m.num_scaling_params() == S
    # every part off: the baseline's count at that shape (its S windows are half the context, 1024)
    base = GPT(cfg, device="meta")
    assert RecipeGPT(cfg, recipe=OFF, device="meta").estimate_flops() == base.estimate_flops() != flops
    # NAG on the recipe: NAG's gates on top, the smear gate in the FLOPs but not in S, as for the baseline
    n, nag = NAGRecipeGPT(cfg, device="meta"), NAGGPT(cfg, device="meta")
    # the m_down matrices
    assert n.estimate_flops() - flops == nag.estimate_flops() - base.estimate_flops() == 6 * 48 * 1536 * 32
    assert n.num_scaling_params() - S == nag.num_scaling_params() - base.num_scaling_params()


# ----- NAG's decisions (docs/design.md §10) -----


def silenced(model):
    """Every sub-layer's gain set to 0 (α = 0): the sub-layers write nothing, only the recipe's writes act."""
    with torch.no_grad():
        for _, br in model.branches():
            br.alpha.zero_()
    return model


def test_nag_leaves_resid_lambdas_out():
    m = NAGRecipeGPT(CFG, recipe=RecipeConfig(), device="meta")
    assert (
        not m.recipe.resid_lambdas
        and not hasattr(m, "resid_lambdas")
        and m.extra_meta()["recipe_config"]["resid_lambdas"] is False
    )
    assert m.recipe.x0_lambdas and m.recipe.smear and m.recipe.backout and m.recipe.value_embeds


def start(model, idx):
    e = model.wte(idx)
    rho = e.square().mean(-1, keepdim=True).sqrt()
    return e / rho, torch.log(rho) + model.log_gain_encode


def decode(model, res_dir, log_norm):
    return model.lm_head(res_dir) / model.config.n_embd * log_norm.exp()


@pytest.mark.parametrize("part", ["x0_lambdas", "backout"])
def test_nag_parallel_writes_move_only_the_log_norm(part):
    """x0 and backout as eq. 7 writes: with the sub-layers silenced R̄ stays R̄₀, so writing c·R̄₀ (x0) or
    −λ·R̄_mid (backout) leaves the direction and adds log(1 + c) or log(1 − λ) to s (eqs. 16-17)."""
    m = silenced(random_model(NAGRecipeGPT, CFG, 512, recipe=only(part), **NAG))
    idx = tokens()
    with torch.no_grad():
        res_dir, log_norm = start(m, idx)
        shift = torch.log1p(m.x0_lambdas).sum() if part == "x0_lambdas" else torch.log1p(-m.backout_lambda)
        assert (m(idx) - decode(m, res_dir, log_norm + shift)).abs().max().item() < 1e-4


def test_nag_smear_renormalises_and_carries_the_gain():
    m = silenced(random_model(NAGRecipeGPT, CFG, 512, recipe=only("smear"), **NAG))
    idx = tokens()
    with torch.no_grad():
        res_dir, log_norm = start(m, idx)
        gate = m.smear_lambda * torch.sigmoid(res_dir[:, 1:, :24] @ m.smear_gate.weight.T)
        y = torch.cat([res_dir[:, :1], res_dir[:, 1:] + gate * res_dir[:, :-1]], dim=1)
        rms = y.square().mean(-1, keepdim=True).sqrt()
        assert (m(idx) - decode(m, y / rms, log_norm + torch.log(rms))).abs().max().item() < 1e-4


def test_nag_value_embeds_are_the_baselines():
    """Value embeddings carried over: the attention of NAG on the recipe is NAGGPT's, given the gated value
    embeddings."""
    m = random_model(NAGRecipeGPT, CFG, 512, recipe=only("value_embeds"), **NAG)
    plain = NAGGPT.initialised(CFG, **NAG)
    plain.load_state_dict({k: v for k, v in m.state_dict().items() if "value_embeds" not in k and "ve_gate" not in k})
    idx = tokens()
    for i in (1, 3):
        attn, gate = plain.blocks[i].attn, m.blocks[i].attn.ve_gate
        table = m.value_embeds[str(i)].weight
        attn.ve_gate = gate
        attn.forward = lambda x, cos_sin, mask, kv=None, ve=None, a=attn, t=table: type(a).forward(
            a, x, cos_sin, mask, kv, F.embedding(idx, t)
        )
    with torch.no_grad():
        assert (m(idx) - plain(idx)).abs().max().item() < 1e-6


def test_nag_writes_are_norm_agnostic():
    """Eq. 7: a write's direction depends on directions only. Scaling every embedding by c scales ρ (each s by log c)
    and nothing else: the logits (cosine × e^s) scale by c exactly, every recipe part on."""
    m = random_model(NAGRecipeGPT, CFG, 512, **NAG)
    idx = tokens()
    with torch.no_grad():
        want = 3 * m(idx)
        m.wte.weight.mul_(3)
        assert ((m(idx) - want).abs().max() / want.abs().max()).item() < 1e-5


# ----- the KV cache, packed rows, sampling -----


@pytest.mark.parametrize("cls,kwargs", [(RecipeGPT, {}), (NAGRecipeGPT, NAG)], ids=["gpt-recipe", "nag-recipe"])
def test_cache_and_packed_rows_equal_the_full_forward(cls, kwargs):
    m = random_model(
        cls,
        replace(CFG, window_pattern="SL", sequence_len=256),
        512,
        recipe=replace(RecipeConfig(), quarter_windows=True),
        **kwargs,
    )
    assert m.windows == [128, 256, 128, 256]
    seq = tokens(1, 200, seed=5)
    with torch.no_grad():
        full = m(seq)
        cache = KVCache.for_model(m)
        steps = [m(seq[:, :150], cache=cache)] + [m(seq[:, t : t + 1], cache=cache) for t in range(150, 200)]
    assert (torch.cat(steps, dim=1) - full).abs().max().item() < 1e-5  # past the 128-token window
    prompt = seq[0, :10].tolist()
    assert list(generate(m, prompt, 60, temperature=0)) == list(generate(m, prompt, 60, temperature=0, use_cache=False))
    # CORE's packed rows: a shared prefix, then each continuation; the smear follows each sequence's own previous token
    base = seq[0, :20].tolist()
    seqs = [base + seq[0, 20 + 7 * j : 27 + 7 * j].tolist() for j in range(3)]
    spans = [(20, 27)] * 3
    packed = packed_scores(m, [packed_row(seqs, spans)], 0, "cpu", True)[0]
    plain = forward_scores(m, seqs, spans, 0, "cpu")
    assert len(packed) == len(plain) == 3
    for (loss_a, _, _), (loss_b, _, _) in zip(packed, plain):  # per sequence: the scored tokens' losses
        assert max(abs(x - y) for x, y in zip(loss_a, loss_b)) < 1e-5


# ----- the command line, the run6 preset, training -----


def test_flags_switch_parts_off_and_mod_is_refused(script_error):
    args = base_train.parse_args(["--arch", "gpt-recipe", "--no-smear", "--no-x0-lambdas"])
    kw = archs.arch_spec("gpt-recipe").init_kwargs(args)
    assert asdict(kw["recipe"]) == {**asdict(RecipeConfig()), "smear": False, "x0_lambdas": False}
    assert archs.is_nag_arch("nag-recipe") and not archs.is_nag_arch("gpt-recipe")
    for arch in ("gpt-recipe", "nag-recipe"):
        assert "has no Mixture-of-Depths" in script_error(
            base_train.main, "--arch", arch, "--mod-rate", "0.2", "--dry-run", "1"
        )


def plan_record(arch):
    args = base_train.parse_args(["--preset", "run6", "--arch", arch])
    return archs.plan_for(args, 32768, 8).record(args)


def test_run6_preset_is_nanochats_run():
    gpt, nag = plan_record("gpt-recipe"), plan_record("nag-recipe")
    flops, S = nanochat_d24()
    # nanochat: tokens = 8·S, batch 2^round(log2(2^19·(S/S_d12)^0.383)) with S_d12 of its 768-wide d12,
    # horizon tokens // batch
    S12 = nanochat_d24(depth=12)[1]
    batch = 2 ** round(math.log2(2**19 * (S / S12) ** 0.383))
    assert gpt["total_batch_size"] == batch == 2**20 and gpt["num_iterations"] == 8 * S // batch == 5568
    assert gpt["flops_per_token"] == flops and gpt["model_config"]["window_pattern"] == "SSSL"
    decay = 0.28 * math.sqrt(batch / 2**19) * S12 / S  # nanochat's weight-decay rule, from its d12
    assert gpt["weight_decay_effective"] == pytest.approx(decay, rel=1e-6)
    groups = {g["name"]: g for g in gpt["optimizer"]["groups"]}
    scale, dim = math.sqrt(batch / 2**19), (1536 / 768) ** -0.5
    assert groups["value_embeds"]["lr"] == pytest.approx(0.5 * 0.3 * dim * scale) and groups["x0_lambdas"]["betas"] == [
        0.96,
        0.95,
    ]
    assert groups["resid_lambdas"]["lr"] == pytest.approx(0.005 * scale) and groups["smear_backout"]["lr"] == 0.2
    assert groups["lm_head"]["lr"] == pytest.approx(0.008 * dim * scale)
    assert base_train.parse_args(["--preset", "run6"]).fp8
    # the NAG twin: the baseline's planned FLOPs, so fewer steps of the same batch
    assert base_train.parse_args(["--preset", "run6", "--arch", "nag-recipe"]).target_flops == gpt["total_flops"]
    assert (
        nag["num_iterations"] < gpt["num_iterations"]
        and abs(nag["total_flops"] - gpt["total_flops"]) < nag["flops_per_token"] * batch
    )


@pytest.mark.parametrize("arch", ["gpt-recipe", "nag-recipe"])
def test_tiny_run_trains_and_resumes_exactly(run_base, arch):
    common = TINY_TRAIN + [
        "--arch",
        arch,
        "--run",
        "r",
        "--num-iterations",
        "8",
        "--eval-every",
        "4",
        "--save-every",
        "4",
        "--nag-gate-log-every",
        "4",
    ]
    run_dir = base_train.main(common)
    read = lambda: [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
    full = read()
    losses = [r["train_loss"] for r in full[1:]]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    cfg = json.load(open(f"{run_dir}/config.json"))
    assert (
        cfg["arch"] == arch
        and cfg["recipe_config"]["smear"]
        and cfg["recipe_config"]["resid_lambdas"] == (arch == "gpt-recipe")
    )
    base_train.main(common + ["--resume", "4"])
    resumed = read()
    assert [r["train_loss"] for r in resumed[1:]] == losses and resumed[-1]["val_bpb"] == full[-1]["val_bpb"]
    model, meta = archs.load_model(run_dir)
    assert type(model).arch == arch and meta["recipe_config"] == cfg["recipe_config"]


@pytest.mark.parametrize("arch", ["gpt-recipe", "nag-recipe"])
def test_the_residual_geometry_analysis_observes_the_recipe_archs(arch):
    """analysis/capture.py reads NAG's states where the model makes its updates; nag-recipe makes them in
    recipe_sublayer (it recorded none, and the analysis failed on a missing attribute)."""
    from analysis.capture import capture
    from conftest import TINY_TRAIN
    from scripts import base_train

    args = base_train.parse_args(TINY_TRAIN + ["--arch", arch, "--num-iterations", "2"])
    model = archs.plan_for(args, 512, 1).model
    model.to_empty(device="cpu")
    model.init_weights()
    model.eval()
    g = torch.Generator().manual_seed(0)
    batches = iter(
        [(torch.randint(0, 512, (2, 64), generator=g), torch.randint(0, 512, (2, 64), generator=g)) for _ in range(2)]
    )
    acc = capture(model, batches, 2, 0)
    assert (
        acc.is_nag == (arch == "nag-recipe") and torch.isfinite(acc.last_norms).all() and acc.last_norms.numel() == 128
    )
    assert "sublayer" not in vars(model) and "recipe_sublayer" not in vars(model)  # the hooks are gone


def test_the_recipe_pair_trains_and_compares(run_base):
    """runs/recipe_cpu.sh's pair at the tests' size: both archs on one FLOP budget, compared in one report showing
    both arms (the demo itself, 1e13 FLOPs and CORE, runs for minutes: docs/design.md §10 has its figures)."""
    from scripts import compare

    for arch in ("gpt-recipe", "nag-recipe"):
        base_train.main(
            TINY_TRAIN + ["--arch", arch, "--run", f"t-{arch}", "--target-flops", "2e9", "--eval-every", "-1"]
        )
    report = open(compare.main(["t-gpt-recipe", "t-nag-recipe"])).read()
    assert "`t-gpt-recipe` (gpt-recipe)" in report and "`t-nag-recipe` (nag-recipe)" in report
    cfgs = [
        json.load(open(os.path.join(run_base, "runs", f"t-{a}", "config.json"))) for a in ("gpt-recipe", "nag-recipe")
    ]
    assert abs(cfgs[0]["total_flops"] - cfgs[1]["total_flops"]) <= max(
        c["flops_per_token"] * c["total_batch_size"] for c in cfgs
    )
