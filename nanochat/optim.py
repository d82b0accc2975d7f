"""
Muon + AdamW in one optimizer, chosen per parameter group by its "kind".

The update math lives in two plain functions (`adamw_update`, `muon_update`)
that act on tensors, so a distributed version can hand each rank its own slice
of the state (Muon parameters are stacked by shape: a rank owns a range of the
stack) without touching the math.
"""

import torch

# Polar Express coefficients (Amsel et al., 2025) for the 5-iteration odd polynomial
# approximation of the matrix sign function. The input is divided by its Frobenius norm times
# POLAR_NORM_FACTOR (a safety margin: the spectral norm must end up below 1), as in the published code.
POLAR_EXPRESS_COEFFS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]
POLAR_NORM_FACTOR = 1.01
NORMUON_BETA2 = 0.9  # decay of NorMuon's running second moment


def orthogonalize(G, dtype):
    """Approximate U·Vᵀ of G = U·S·Vᵀ for a stack of matrices (n, r, c)."""
    X = G.to(dtype)
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * POLAR_NORM_FACTOR + 1e-6)
    tall = X.size(-2) > X.size(-1)
    if tall:  # iterate on the smaller Gram matrix
        X = X.mT
    for a, b, c in POLAR_EXPRESS_COEFFS:
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.mT if tall else X


@torch.no_grad()
def muon_update(params, grads, momentum_buf, variance_buf, lr, momentum, weight_decay, beta2=NORMUON_BETA2, ortho_dtype=torch.float32):
    """One Muon step on a stack of same-shape matrices, in place. params/grads/momentum_buf: (n, r, c)."""
    # Nesterov momentum
    momentum_buf.lerp_(grads, 1 - momentum)
    g = grads.lerp(momentum_buf, momentum)
    g = orthogonalize(g, ortho_dtype).float()
    # NorMuon: normalise each row (or column) by a running second moment, keeping the update's total norm
    red_dim = -1 if g.size(-2) >= g.size(-1) else -2
    v_mean = g.square().mean(dim=red_dim, keepdim=True)
    n_red = g.size(red_dim)
    norm_before = (v_mean.sum(dim=(-2, -1), keepdim=True) * n_red).sqrt()
    variance_buf.lerp_(v_mean, 1 - beta2)
    step_size = variance_buf.clamp_min(1e-10).rsqrt()
    norm_after = ((v_mean * n_red) * step_size.square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    g = g * step_size * (norm_before / norm_after.clamp_min(1e-10))
    lr = lr * max(1.0, params.size(-2) / params.size(-1)) ** 0.5
    # cautious weight decay: only where the update and the weight agree in sign
    if weight_decay:
        mask = (g * params) >= 0
        params.sub_(lr * weight_decay * params * mask)
    params.sub_(lr * g.to(params.dtype))


@torch.no_grad()
def adamw_update(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, weight_decay):
    """One AdamW step on lists of fp32 tensors that share a step count, in place, with
    foreach kernels (a NAG model has hundreds of small gate tensors: one launch each would add up)."""
    if weight_decay:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    bias1 = 1 - beta1 ** step
    bias2 = 1 - beta2 ** step
    denom = torch._foreach_div(exp_avg_sqs, bias2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-lr / bias1)


class MuonAdamW(torch.optim.Optimizer):
    """
    groups: dicts with kind="adamw" (lr, betas, eps, weight_decay) or kind="muon"
    (lr, momentum, weight_decay, beta2 of NorMuon). Muon groups are split by parameter shape so each
    sub-group's matrices are updated as one stack. Each group keeps its
    "initial_lr" / "initial_weight_decay" so schedules can scale them.
    """

    def __init__(self, groups):
        flat = []
        for g in groups:
            g = dict(g)
            if g["kind"] == "muon":
                by_shape = {}
                for p in g.pop("params"):
                    by_shape.setdefault(tuple(p.shape), []).append(p)
                for shape, ps in by_shape.items():
                    flat.append(dict(g, params=ps, name=f"{g.get('name', 'muon')}{list(shape)}"))
            else:
                flat.append(g)
        for g in flat:
            g.setdefault("weight_decay", 0.0)
            g.setdefault("betas", (0.8, 0.95))
            g.setdefault("eps", 1e-10)
            g.setdefault("momentum", 0.95)  # Muon: base_train sets it every step (muon_momentum)
            g.setdefault("beta2", NORMUON_BETA2)
            g["initial_lr"] = g["lr"]
            g["initial_weight_decay"] = g["weight_decay"]
        super().__init__(flat, defaults={})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            if group["kind"] == "adamw":
                self.step_adamw(group)
            elif group["kind"] == "muon":
                self.step_muon(group)
            else:
                raise ValueError(f"unknown optimizer group kind {group['kind']!r}")

    def step_adamw(self, group):
        beta1, beta2 = group["betas"]
        params = [p for p in group["params"] if p.grad is not None]
        # a parameter without a gradient (e.g. a MoD gate whose sub-layer ran no token) misses the step, so each
        # keeps its own step count and bias correction: one foreach update per distinct count (usually one)
        by_step = {}
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            state["step"] += 1
            by_step.setdefault(state["step"], []).append(p)
        for step, ps in by_step.items():
            adamw_update(ps, [p.grad.float() for p in ps], [self.state[p]["exp_avg"] for p in ps],
                         [self.state[p]["exp_avg_sq"] for p in ps], step,
                         group["lr"], beta1, beta2, group["eps"], group["weight_decay"])

    def step_muon(self, group):
        params = group["params"]
        live = [i for i, p in enumerate(params) if p.grad is not None]
        if not live:
            return
        state = self.state[params[0]]  # the stack's state, one row per matrix of the group
        if not state:
            r, c = params[0].shape
            var_shape = (len(params), r, 1) if r >= c else (len(params), 1, c)
            state["momentum_buffer"] = torch.zeros((len(params), r, c), dtype=torch.float32, device=params[0].device)
            state["variance_buffer"] = torch.zeros(var_shape, dtype=torch.float32, device=params[0].device)
        momentum_buf, variance_buf = state["momentum_buffer"], state["variance_buffer"]
        # A matrix without a gradient (e.g. a MoD sub-layer that ran no token) is skipped alone: the others take
        # exactly the step of a group without it (orthogonalisation and NorMuon act per matrix) and its own
        # momentum and variance rows stay as they were.
        partial = len(live) < len(params)
        if partial:
            rows = torch.tensor(live, device=momentum_buf.device)
            params = [params[i] for i in live]
            momentum_buf, variance_buf = momentum_buf[rows], variance_buf[rows]
        stacked_p = torch.stack(params)
        stacked_g = torch.stack([p.grad for p in params]).float()
        ortho_dtype = torch.bfloat16 if stacked_p.is_cuda else torch.float32
        muon_update(stacked_p, stacked_g, momentum_buf, variance_buf,
                    group["lr"], group["momentum"], group["weight_decay"], beta2=group["beta2"], ortho_dtype=ortho_dtype)
        torch._foreach_copy_(params, list(stacked_p.unbind(0)))
        if partial:  # the rows were gathered copies: write the updated ones back
            state["momentum_buffer"].index_copy_(0, rows, momentum_buf)
            state["variance_buffer"].index_copy_(0, rows, variance_buf)
