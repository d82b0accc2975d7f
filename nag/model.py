"""
The NAG model: the GPT baseline with the additive residual replaced by a direction and a log-norm.

docs/design.md §4: the baseline's attention and MLP, with the additive residual stream
replaced by a direction R̄ (RMS 1) and a carried log-norm s (fp32).

Each sub-layer output x = f(R̄) rotates R̄ towards N_out(x) by angle arctan(g), with
g = α · warmup(t) · m(R̄), and adds ½·log1p(g²) to s. Decoding reads the cosine
between R̄ and each centred, RMS-normalised lm_head row, scaled by exp(s): the
carried norm acts as an inverse temperature.
"""

import math
import re
from dataclasses import dataclass, asdict

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat import step_timer
from nanochat.gpt import GPT
from nanochat.optim import ROW_CONSTRAINTS
from nanochat.common import positive_int, positive_float, non_negative
from nag.functional import nag_branch, modulator
from nag import mod as mod_lib
from nag.mod import ModConfig, Thresholds, mod_config_from_args, rotation_score, run_executed, flops_with_skips

BETA_RAW_INIT = 0.5413  # softplus⁻¹(1): the modulator starts linear in u
DEAD_GAIN = 1e-3  # a branch whose mean |g| falls below this counts as dead in telemetry
# the two dead counts of docs/design.md §5: the walkthrough's (mean α·m below 0.05; at init it already marks every
# update past l = 100) and the relative one (mean m below 0.1 of the branch's own ceiling α), which means "shut"
WALKTHROUGH_DEAD_GAIN = 0.05
DEAD_MODULATOR = 0.1


# AdamW LRs of the gates (α, β, coef, m_down) and of log G_encode, before the batch LR scale: the published pair's
GATE_LR, TEMP_GAIN_LR = 1e-3, 0.005
# the rows of the embedding and of lm_head keep a constraint of nanochat.optim.ROW_CONSTRAINTS (keyed by the name of
# the module and of its optimizer group alike): imposed at init, then by the optimizer as part of every update
ROW_CONSTRAINED = {"wte": "centred", "lm_head": "centred_unit_rms"}


@dataclass
class NAGConfig:
    directions: int = 32  # C, preferred directions of the modulator
    alpha_init_power: float = 0.5  # α_l = l^(−p)
    mod_floor: float = 1e-6  # 0 reproduces failure 1 (NaN from u^(β−1) at u = 0)
    renorm: str = "measured"  # or "predicted" (paper eq. 17)
    alpha_warmup_tokens: int = 314_572_800  # 0 disables the warm-up


def add_nag_args(parser):
    g = parser.add_argument_group("NAG (used with --arch nag)")
    # an LR of 0 would freeze the gates, a negative one climb the loss:
    # positive, as --matrix-lr (nanochat/common.py's rule)
    g.add_argument(
        "--nag-gate-lr", type=positive_float, default=GATE_LR, help="AdamW LR of α, β, coef, m_down (× batch LR scale)"
    )
    g.add_argument(
        "--nag-temp-gain-lr",
        type=positive_float,
        default=TEMP_GAIN_LR,
        help="AdamW LR of log G_encode (× batch LR scale)",
    )
    g.add_argument(
        "--nag-alpha-warmup-tokens",
        type=non_negative(int, "no α warm-up"),
        default=NAGConfig.alpha_warmup_tokens,
        help="0 disables the α warm-up",
    )
    g.add_argument(
        "--nag-mod-floor",
        type=non_negative(float, "no floor, failure 1"),
        default=NAGConfig.mod_floor,
        help="floor of u before the power; 0 reproduces failure 1",
    )
    g.add_argument("--nag-renorm", type=str, default=NAGConfig.renorm, choices=["measured", "predicted"])
    g.add_argument("--nag-directions", type=positive_int, default=NAGConfig.directions)
    g.add_argument(
        "--nag-gate-log-every",
        type=non_negative(int, "never"),
        default=100,
        help="gate telemetry every N steps (0 = never)",
    )
    g.add_argument(
        "--nag-impl",
        type=str,
        default="",
        choices=["", "reference", "compiled", "fused"],
        help="branch implementation (default: fused on cuda, reference elsewhere)",
    )


def nag_config_from_args(args):
    """NAGConfig of the parsed flags (their values were checked as they were parsed: add_nag_args)."""
    return NAGConfig(
        directions=args.nag_directions,
        mod_floor=args.nag_mod_floor,
        renorm=args.nag_renorm,
        alpha_warmup_tokens=args.nag_alpha_warmup_tokens,
    )


def pow_backward(u, beta):
    """β·u^(β−1) in fp32, the derivative of the modulator's power at u (inf where it overflows)."""
    u, beta = torch.tensor(u, dtype=torch.float32), torch.tensor(beta, dtype=torch.float32)
    return (beta * u ** (beta - 1)).item()


def branch_function(impl):
    """The NAG update implementation: all three give the same results (tests check it)."""
    if impl == "reference":
        return nag_branch
    if impl == "compiled":
        return torch.compile(nag_branch, dynamic=False)
    if impl == "fused":
        from nag.kernels import fused_nag_branch

        return fused_nag_branch
    raise ValueError(f"unknown NAG impl {impl!r} (reference, compiled, fused)")


def default_impl(device_type):
    return "fused" if device_type == "cuda" else "reference"


class BranchGates:
    """The gate of one sub-layer (update l): views of row l − 1 of each of NAGGates' stacks, m_down's weight (C, d) and
    bias (C), coef (C), beta_raw (1) and alpha (1)."""

    def __init__(self, l, m_down_weight, m_down_bias, coef, beta_raw, alpha):
        self.l = l
        self.m_down_weight, self.m_down_bias = m_down_weight, m_down_bias
        self.coef, self.beta_raw, self.alpha = coef, beta_raw, alpha

    def m_down(self, x):
        """The modulator logits (..., C): as nanochat's Linear, the fp32 masters cast to the input's dtype."""
        return F.linear(x, self.m_down_weight.to(x.dtype), self.m_down_bias.to(x.dtype))


# a checkpoint of before the stacks: one module per sub-layer, gates.{block}.{attn,mlp}_branch.{parameter}
PER_BRANCH_KEY = re.compile(r"(\d+)\.(attn|mlp)_branch\.(m_down\.weight|m_down\.bias|coef|beta_raw|alpha)")


def stack_per_branch_gates(module, state_dict, prefix, *_):
    """load_state_dict pre-hook of NAGGates: a checkpoint's per-branch gate tensors, stacked in update order."""
    rows = {}
    for key in [k for k in state_dict if k.startswith(prefix)]:
        if found := PER_BRANCH_KEY.fullmatch(key[len(prefix) :]):
            block, kind, name = found.groups()
            rows.setdefault(name.replace(".", "_"), {})[(int(block), kind == "mlp")] = state_dict.pop(key)
    for name, by_branch in rows.items():  # a missing branch leaves a stack of the wrong size: load names it
        state_dict[prefix + name] = torch.stack([by_branch[k] for k in sorted(by_branch)])


class NAGGates(nn.Module):
    """The gates of all 2L sub-layers, one tensor per kind, row l − 1 for update l (attn of block 0, its MLP, attn of
    block 1, ...): m_down's weight (2L, C, d) and bias (2L, C), coef (2L, C), beta_raw (2L, 1), alpha (2L, 1). Five
    tensors for the optimizer at any depth, not five per sub-layer."""

    names = ("m_down_weight", "m_down_bias", "coef", "beta_raw", "alpha")

    def __init__(self, branches, dim, directions, device=None):
        super().__init__()
        self.m_down_weight = nn.Parameter(torch.empty(branches, directions, dim, device=device))
        self.m_down_bias = nn.Parameter(torch.empty(branches, directions, device=device))
        self.coef = nn.Parameter(torch.empty(branches, directions, device=device))
        self.beta_raw = nn.Parameter(torch.empty(branches, 1, device=device))
        self.alpha = nn.Parameter(torch.empty(branches, 1, device=device))
        self.register_load_state_dict_pre_hook(stack_per_branch_gates)

    def branch(self, l):
        """Update l's gate as views that take in-place edits (telemetry, analysis, tests)."""
        return BranchGates(l, *(getattr(self, n)[l - 1] for n in self.names))

    def unbound(self):
        """Every update's gate, for the forward: one unbind per stack, whose backward stacks the 2L gradients in one
        op (a view per row would add 2L zero-padded copies of the whole stack)."""
        views = zip(*(getattr(self, n).unbind(0) for n in self.names))
        return [BranchGates(l, *v) for l, v in enumerate(views, start=1)]


class NAGGPT(GPT):
    arch = "nag"
    # the logits' bf16 gradient lives beside the saved logits: the carried norm's gradient, a sum over the vocab of
    # logits × their gradient, reads them too, so they are not overwritten in place as GPT's are. 2 bytes a logit:
    # one H200 measured NAG's peak 2.04 GiB above GPT's at 16 × 2048 tokens and a 32,768 vocab (2.0 GiB of
    # logits), where their saved activations differ by 0.03 GiB (docs/memory.md)
    compiled_readout_grad_bytes = 2

    @classmethod
    def kwargs_on(cls, device_type, init_kwargs):
        return {**init_kwargs, "impl": init_kwargs.get("impl") or default_impl(device_type)}

    def __init__(self, config, nag=None, impl=None, mod=None, device=None):
        super().__init__(config, device=device)
        self.nag = nag or NAGConfig()
        self.gates = NAGGates(2 * config.n_layer, config.n_embd, self.nag.directions, device)
        self.log_gain_encode = nn.Parameter(torch.empty(1, device=device))  # log G_encode
        self.register_buffer("alpha_warmup", torch.ones(1, device=device), persistent=False)
        self.impl = impl
        self.branch_fn = None  # chosen by init_weights, once the device is known (before any torch.compile)
        self.record_telemetry = False
        self.telemetry_rows = []
        self.mod, self.mod_base, self.thresholds = None, None, None  # Mixture-of-Depths: off unless configured
        if mod is not None:
            self.configure_mod(mod, device)

    # ----- hooks (see GPT; the command-line side is nag/archs.py) -----

    @classmethod
    def extra_init_kwargs(cls, meta):
        mod = meta.get("mod_config")
        return {"nag": NAGConfig(**meta["nag_config"]), "mod": ModConfig(**mod) if mod else None}

    def extra_meta(self):
        return {"nag_config": asdict(self.nag), **({"mod_config": asdict(self.mod)} if self.mod else {})}

    def step_metrics(self):
        return {} if self.thresholds is None else mod_lib.step_metrics(self)

    # ----- Mixture-of-Depths (nag/mod.py, docs/mod.md) -----

    def configure_mod(self, mod, device=None):
        """Turn MoD on (or change its blocks / rate): X_l (zero) for every covered sub-layer that lacks one,
        and fresh thresholds, to be trained or calibrated. A model trained without MoD gets X_l = 0."""
        device = device if device is not None else self.wte.weight.device
        self.mod = mod
        if self.mod_base is None:
            self.mod_base = nn.ParameterDict()
        for i in range(self.config.n_layer):
            for kind in ("attn", "mlp"):
                if mod.covers(kind) and f"{kind}_{i}" not in self.mod_base:
                    self.mod_base[f"{kind}_{i}"] = nn.Parameter(torch.zeros(self.config.n_embd, device=device))
        self.thresholds = Thresholds(self.config.n_layer, mod, device)

    def num_scaling_params(self):
        """S of the batch, weight-decay and --target-param-data-ratio rules, counted as the published code counts it:
        every parameter under the blocks plus lm_head. Its gates live inside its blocks, ours in self.gates, so S takes
        them whole (m_down weight and bias, coef, β_raw, α), not just the m_down matrices. MoD's X_l stays out, so a
        MoD run keeps the S, and so the batch and decay, of its base model."""
        return super().num_scaling_params() + self.gate_vector_params()

    def gate_vector_params(self):
        """The gate parameters that are not matrices (m_down's bias, coef, β_raw, α): in S, but no matmul (no
        FLOPs)."""
        return sum(p.numel() for n, p in self.gates.named_parameters() if n != "m_down_weight")

    def matmul_params(self):
        """The baseline's 2-D weights, but of the gates only the m_down matrices: their (2L, C, d) stack is 3-D, and
        the other stacks are 2-D but do no matmul."""
        return self.with_gate_matrices(super().matmul_params())

    def with_gate_matrices(self, params):
        """params less the gate stacks, plus the m_down stack (nag/recipe.py applies it to its own rule)."""
        stacks = {id(p) for p in self.gates.parameters()}
        return [p for p in params if id(p) not in stacks] + [self.gates.m_down_weight]

    def estimate_flops(self, skip=None):
        """Training FLOPs per token; with MoD, less what the skips save (at the target rate unless skip gives the
        realised ones)."""
        return flops_with_skips(self, super().estimate_flops(), self.mod, skip)

    def branches(self):
        """(update index l, its BranchGates) in residual-update order: attn of block 0 is l = 1, its MLP l = 2, ..."""
        return [(l, self.gates.branch(l)) for l in range(1, 2 * self.config.n_layer + 1)]

    @torch.no_grad()
    def init_weights(self):
        super().init_weights()
        d = self.config.n_embd
        bound = math.sqrt(3) * d**-0.5
        g = self.gates
        # one draw over the stack takes the generator's numbers in the order a draw per branch did (tests check it)
        nn.init.uniform_(g.m_down_weight, -bound, bound)
        nn.init.zeros_(g.m_down_bias)
        nn.init.zeros_(g.coef)
        g.beta_raw.fill_(BETA_RAW_INIT)
        for l, br in self.branches():
            br.alpha.fill_(l**-self.nag.alpha_init_power)
        self.log_gain_encode.zero_()
        self.alpha_warmup.fill_(1.0)
        if self.mod is not None:
            for x in self.mod_base.values():
                x.zero_()
            self.thresholds.reset()
        for name, rule in ROW_CONSTRAINED.items():
            ROW_CONSTRAINTS[rule](self.get_submodule(name).weight)
        self.branch_fn = branch_function(self.impl or default_impl(self.wte.weight.device.type))

    def after_optimizer_step(self):
        """Nothing left to do: the optimizer imposes ROW_CONSTRAINED inside its update (optimizer_groups)."""

    def set_tokens_seen(self, tokens):
        warm = self.nag.alpha_warmup_tokens
        self.alpha_warmup.fill_(1.0 if warm <= 0 else min(1.0, tokens / warm))

    def optimizer_groups(
        self,
        embedding_lr,
        unembedding_lr,
        matrix_lr,
        weight_decay,
        lr_scale,
        gate_lr=GATE_LR,
        temp_gain_lr=TEMP_GAIN_LR,
    ):
        groups = super().optimizer_groups(embedding_lr, unembedding_lr, matrix_lr, weight_decay, lr_scale)
        for g in groups:
            if g["name"] in ROW_CONSTRAINED:
                g["constrain"] = ROW_CONSTRAINED[g["name"]]
        # X_l trains with the gates
        gates = list(self.gates.parameters()) + (list(self.mod_base.parameters()) if self.mod_base is not None else [])
        groups.append(dict(kind="adamw", name="nag_gates", params=gates, lr=gate_lr * lr_scale, betas=(0.8, 0.95)))
        groups.append(
            dict(
                kind="adamw",
                name="nag_temp_gain",
                params=[self.log_gain_encode],
                lr=temp_gain_lr * lr_scale,
                betas=(0.8, 0.95),
            )
        )
        return groups

    def forward(
        self, idx, targets=None, loss_reduction="mean", positions=None, allowed=None, logits_at=None, cache=None
    ):
        # with a KV cache (decoding) only attention reads other positions, through their cached keys and values: the
        # rest of a NAG update (R̄, s, the modulator, N_out) is per position (docs/design.md §9)
        T = idx.size(1)
        cos_sin, masks, kvs = self.attention_inputs(T, idx.device, positions, allowed, cache)
        e = self.wte(idx)  # fp32 rows, centred
        rho = e.square().mean(dim=-1, keepdim=True).sqrt().clamp_min(1e-12)  # ρ₀ = ‖e‖/√d
        res_dir = (e / rho).to(self.compute_dtype)
        log_norm = torch.log(rho) + self.log_gain_encode  # (B, T, 1) fp32
        gates = self.gates.unbound()
        capacity = mod_lib.forward_capacity(self.mod, T, self.training)
        for i, (block, mask, kv) in enumerate(zip(self.blocks, masks, kvs)):
            # analysis/capture.py wraps sublayer without kv (it never decodes)
            extra = {"capacity": capacity} if kv is None else {"kv": kv, "capacity": capacity}
            for kind, br in (("attn", gates[2 * i]), ("mlp", gates[2 * i + 1])):
                res_dir, log_norm = self.sublayer(kind, i, block, br, res_dir, log_norm, cos_sin, mask, **extra)
        if self.thresholds is not None:
            self.thresholds.finish()
        return self.end_forward((res_dir, log_norm), T, targets, loss_reduction, logits_at, cache)

    def logits_from_hidden(self, hidden, at=None):
        """hidden: (direction, log-norm). The cosine with each unit-RMS lm_head row, times the carried norm; no
        soft-cap."""
        res_dir, log_norm = hidden if at is None else (hidden[0][at], hidden[1][at])
        return self.lm_head(res_dir).float() / self.config.n_embd * log_norm.exp()

    def sublayer(self, kind, layer, block, br, res_dir, log_norm, cos_sin, mask, kv=None, capacity=None):
        """One NAG update. With MoD the sub-layer output is f̂ = f(R̄) + X_l for the tokens whose rotation
        score r = atan(α·m)/atan(α) is above the threshold (the first `capacity` of each row) and X_l alone for the
        others (which f never sees)."""
        mod_logits = br.m_down(res_dir)
        if self.record_telemetry:
            self.record_branch(mod_logits, br, br.alpha * self.alpha_warmup)
        execute = None
        capacity = capacity or res_dir.size(1)
        if self.mod is not None and self.mod.skips(kind):
            m = modulator(mod_logits.detach(), br.coef.detach(), br.beta_raw.detach(), self.nag.mod_floor)
            score = rotation_score(br.alpha * self.alpha_warmup, m)
            execute, capacity = self.thresholds.decide(kind, layer, score, capacity)
        out = run_executed(kind, block, res_dir, cos_sin, mask, execute, capacity, kv)
        if self.mod is not None and self.mod.covers(kind):
            out = out + self.mod_base[f"{kind}_{layer}"].to(out.dtype)
        return self.branch_update(br, res_dir, log_norm, out, mod_logits)

    def branch_update(self, br, res_dir, log_norm, out, mod_logits):
        """R̄ and s after the sub-layer output out: the gain, the rotation and the log-norm step
        (scripts/bench/nag.py counts the kernel launches of this part)."""
        # the warm-up factor goes in as alpha_scale: the fused op applies it in its kernels, no extra launch
        return self.branch_fn(
            res_dir,
            log_norm,
            out,
            mod_logits,
            br.coef,
            br.beta_raw,
            br.alpha,
            self.nag.mod_floor,
            self.nag.renorm,
            self.alpha_warmup,
        )

    def nonfinite_origin(self, idx):
        """Where a non-finite step started (failure 1), from a no-grad forward over idx (the last micro-batch; the
        weights are still those of the failed step). The first branch in update order whose smallest u makes the
        backward of u^β, β·u^(β−1), overflow: u = 0 with β < 1, or, as β falls towards 0, any u below ~1e-38
        (fp32 and bf16 share the range). Failing that, the deepest branch with a non-finite gate gradient: the backward
        runs from the loss, so a NaN born in a branch spreads to every earlier one."""
        t = self.gate_telemetry(idx)
        branches = t["branches"]
        grads = [p.grad.flatten(1) for p in self.gates.parameters() if p.grad is not None]
        finite_rows = torch.stack([g.isfinite().all(dim=1) for g in grads]).all(dim=0).tolist() if grads else []
        bad_grad = [i for i, finite in enumerate(finite_rows) if not finite]
        overflow = [i for i, b in enumerate(branches) if not math.isfinite(pow_backward(b["u_min"], b["beta"]))]
        if overflow:
            i, why = overflow[0], "β·u^(β−1) overflows"
        elif bad_grad:
            i, why = bad_grad[-1], "deepest non-finite gate gradient"
        else:
            return None
        b = branches[i]
        return f"branch {b['name']} (update {i + 1}): {why}, min u {b['u_min']:.3g}, β {b['beta']:.5g}"

    # ----- telemetry -----

    @torch.no_grad()
    def record_branch(self, mod_logits, br, alpha):
        floor = self.nag.mod_floor
        w = torch.softmax(br.coef.float(), dim=-1)
        u = (torch.sigmoid(mod_logits.float()) * w).sum(dim=-1)
        m = u.clamp(min=floor) ** F.softplus(br.beta_raw.float())
        gain = (alpha.float() * m).abs()
        self.telemetry_rows.append(
            torch.stack(
                [
                    u.mean(),
                    m.mean(),
                    (u <= floor).float().mean(),
                    gain.mean(),
                    alpha.float().squeeze(),
                    u.min(),
                    F.softplus(br.beta_raw.float()).squeeze(),
                ]
            )
        )

    @torch.no_grad()
    def gate_telemetry(self, idx):
        """Gate statistics of a forward pass over idx (no grad), as plain numbers for metrics.jsonl.
        In eval mode, so that MoD's fixed thresholds decide and the running estimates stay as training left them."""
        self.record_telemetry = True
        self.telemetry_rows = []
        was_training = self.training
        self.eval()
        try:
            self(idx)
        finally:
            self.record_telemetry = False
            self.train(was_training)
            if self.thresholds is not None:
                self.thresholds.pop_rates("eval")
        return self.collect_telemetry()

    def collect_telemetry(self):
        rows = step_timer.read_values(torch.stack(self.telemetry_rows))
        self.telemetry_rows = []
        names = [f"{i}.{kind}" for i in range(self.config.n_layer) for kind in ("attn", "mlp")]
        gains = [r[3] for r in rows]
        alphas = [r[4] for r in rows]
        n = len(rows)
        quartiles = [
            sum(gains[q * n // 4 : (q + 1) * n // 4]) / max(1, len(gains[q * n // 4 : (q + 1) * n // 4]))
            for q in range(4)
        ]
        return {
            # u: the mixed sigmoid; m = max(u, floor)^β: the modulator; g = α·warmup·m: the realised gain
            "branches": [
                {
                    "name": nm,
                    "u_mean": r[0],
                    "m_mean": r[1],
                    "floor_frac": r[2],
                    "gain_abs_mean": r[3],
                    "alpha": r[4],
                    "u_min": r[5],
                    "beta": r[6],
                }
                for nm, r in zip(names, rows)
            ],
            "dead_branches": sum(g < DEAD_GAIN for g in gains),
            "dead_threshold": DEAD_GAIN,
            "dead_walkthrough": sum(g < WALKTHROUGH_DEAD_GAIN for g in gains),
            "dead_walkthrough_threshold": WALKTHROUGH_DEAD_GAIN,
            "dead_relative": sum(r[1] < DEAD_MODULATOR for r in rows),
            "dead_relative_threshold": DEAD_MODULATOR,
            "num_branches": n,
            "gain_by_depth_quartile": quartiles,
            "alpha_min": min(alphas),
            "alpha_max": max(alphas),
            "floor_frac_mean": sum(r[2] for r in rows) / n,
        }

    @staticmethod
    def format_telemetry(t):
        q = " ".join(f"{v:.3f}" for v in t["gain_by_depth_quartile"])
        return (
            f"  gates | dead {t['dead_relative']}/{t['num_branches']} (mean m < {t['dead_relative_threshold']:g}), "
            f"{t['dead_walkthrough']} (mean |g| < {t['dead_walkthrough_threshold']:g}) | "
            f"|g| by depth quartile {q} | α {t['alpha_min']:.3f}..{t['alpha_max']:.3f} | at floor "
            f"{100 * t['floor_frac_mean']:.2f}%"
        )
