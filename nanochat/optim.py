"""
Muon + AdamW in one optimizer, chosen per parameter group by its "kind".

The update math lives in two plain functions (`adamw_update`, `muon_update`) that act on tensors; the optimizer
compiles them where the parameters are on CUDA and, on several ranks, shards Muon (docs/optimizer.md):

    opt = MuonAdamW(groups)                        # one process, every matrix; compile=False: the eager optimizer,
                                                   # bit for bit
    opt = MuonAdamW(groups, rank=r, world_size=W)  # under DDP: each rank updates its chunk of every Muon stack,
                                                   # then all-gather
    opt.step()                                     # after DDP averaged the gradients: every rank holds all of them
    sd = opt.state_dict()                          # saved by every rank: its Muon rows, and on rank 0 the AdamW state
    opt.ranks_to_load(saved_world_size)            # which saved ranks' state dicts this rank needs
    opt.load_state_dicts([sd_0, sd_1, ...])        # those saved by a run on any number of ranks (None for one not read)
    opt.load_state_dict(sd)                        # one full state dict: saved on one rank, or by rank 0 before
                                                   # sharding

Sharding: a stack of n same-shape matrices is cut into contiguous chunks of ceil(n / W) (`shard_rows`); rank r keeps
momentum and variance for its chunk only, updates only those matrices, and one all-gather per stack (padded to W
chunks) gives every rank every updated matrix. AdamW (embeddings, lm_head, small gate tensors) stays replicated: a few
tensors, ~12% of the parameters at the published shape, one elementwise pass (scripts/bench/optim.py counts it).
"""

import torch
import torch.distributed as dist

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
# compiled AdamW: a tensor this large gets its own fused update; smaller ones (a model may have hundreds of
# small gate tensors) stay in eager foreach kernels, since one graph over hundreds of tensors takes minutes
# to compile and a call per tensor would cost more launches than the fusion saves. commit draws the same line
# (a select each for the large tensors, one over many small ones)
FUSE_MIN_NUMEL = 1 << 16


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


def commit(gate, targets, values):
    """Write `values` into `targets` (lists of tensors), in place. gate: None, or a 0-d bool tensor on their device:
    where it is False every target keeps its value. A select, not a product: a non-finite value times 0 is still NaN.
    It lets the training loop veto a non-finite step on the device, without waiting to read the flag
    (docs/optimizer.md)."""
    if gate is not None:
        # more than three small tensors share one select over them flattened together: two cats and the select, three
        # launches, not one per tensor (a model may have hundreds); the others get a select each, the large ones
        # always (copying them into a flat tensor would add their traffic)
        small = [i for i, t in enumerate(targets) if t.numel() < FUSE_MIN_NUMEL]
        shared = set(small) if len(small) > 3 else set()
        values = [v if i in shared else torch.where(gate, v, t) for i, (t, v) in enumerate(zip(targets, values))]
        if shared:
            chosen = torch.where(gate, flattened([values[i] for i in small]), flattened([targets[i] for i in small]))
            for i, v in zip(small, chosen.split([targets[i].numel() for i in small])):
                values[i] = v.view_as(targets[i])
    torch._foreach_copy_(targets, values)


def flattened(tensors):
    """The tensors' elements in one 1-D tensor (a single cat: contiguous tensors reshape as views)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def centre_rows(w):
    """Each row of the matrix w minus its mean, in place."""
    w.sub_(w.mean(dim=1, keepdim=True))


def centre_rows_unit_rms(w):
    """Each row of the matrix w centred, then scaled to unit RMS, in place."""
    centre_rows(w)
    w.mul_(torch.rsqrt(w.square().mean(dim=1, keepdim=True).clamp_min(1e-30)))


# the row constraints an AdamW group may ask for by name (its "constrain"): imposed on the group's updated weights
# inside the update itself, so that a compiled update fuses them. A name, not a function, so that a group's settings
# stay plain data in a checkpoint.
ROW_CONSTRAINTS = {"centred": centre_rows, "centred_unit_rms": centre_rows_unit_rms}


@torch.no_grad()
def muon_update(
    params,
    grads,
    momentum_buf,
    variance_buf,
    lr,
    momentum,
    weight_decay,
    beta2=NORMUON_BETA2,
    ortho_dtype=torch.float32,
    gate=None,
):
    """One Muon step on a stack of same-shape matrices, in place. params/grads/momentum_buf: (n, r, c).
    lr, momentum, weight_decay: numbers, or 0-d tensors when compiled (then one graph serves every value).
    gate: None, or a 0-d bool tensor: False leaves the weights and both buffers as they were (commit)."""
    # Nesterov momentum
    new_momentum = momentum_buf.lerp(grads, 1 - momentum)
    g = grads.lerp(new_momentum, momentum)
    g = orthogonalize(g, ortho_dtype).float()
    # NorMuon: normalise each row (or column) by a running second moment, keeping the update's total norm
    red_dim = -1 if g.size(-2) >= g.size(-1) else -2
    v_mean = g.square().mean(dim=red_dim, keepdim=True)
    n_red = g.size(red_dim)
    norm_before = (v_mean.sum(dim=(-2, -1), keepdim=True) * n_red).sqrt()
    new_variance = variance_buf.lerp(v_mean, 1 - beta2)
    step_size = new_variance.clamp_min(1e-10).rsqrt()
    norm_after = ((v_mean * n_red) * step_size.square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    g = g * step_size * (norm_before / norm_after.clamp_min(1e-10))
    lr = lr * max(1.0, params.size(-2) / params.size(-1)) ** 0.5
    # cautious weight decay: only where the update and the weight agree in sign (at 0 it subtracts exact zeros:
    # no branch on the value, which a compiled graph could not take)
    mask = (g * params) >= 0
    new_params = params - lr * weight_decay * params * mask
    new_params = new_params - lr * g.to(params.dtype)
    commit(gate, [momentum_buf, variance_buf, params], [new_momentum, new_variance, new_params])


@torch.no_grad()
def adamw_update(
    params, grads, exp_avgs, exp_avg_sqs, lr, weight_decay, bias1, bias2, beta1, beta2, eps, gate=None, constrain=None
):
    """One AdamW step on lists of fp32 tensors that share a step count (bias1 = 1 - beta1^step, bias2 the same with
    beta2), in place, with foreach kernels (a model may have hundreds of small gate tensors: one launch each would add
    up). lr, weight_decay, bias1, bias2: numbers, or 0-d tensors when compiled. gate: as muon_update's. constrain: None,
    or a name in ROW_CONSTRAINTS, imposed on each updated weight before the commit (a vetoed step changes nothing)."""
    new_params = torch._foreach_mul(params, 1 - lr * weight_decay)  # at 0 a product with exactly 1
    new_avgs = torch._foreach_lerp(exp_avgs, grads, 1 - beta1)
    new_sqs = torch._foreach_mul(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(new_sqs, grads, grads, value=1 - beta2)
    denom = torch._foreach_div(new_sqs, bias2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    if isinstance(lr, torch.Tensor):  # addcdiv takes its factor as a number only
        torch._foreach_sub_(new_params, torch._foreach_mul(torch._foreach_div(new_avgs, denom), lr / bias1))
    else:
        torch._foreach_addcdiv_(new_params, new_avgs, denom, value=-lr / bias1)
    if constrain is not None:
        for w in new_params:  # a constrained group holds one matrix or a few (wte, lm_head)
            ROW_CONSTRAINTS[constrain](w)
    commit(gate, [*params, *exp_avgs, *exp_avg_sqs], [*new_params, *new_avgs, *new_sqs])


COMPILED = {}


def compiled(fn):
    """fn compiled once per process: one graph per input shape, hyperparameters passed as 0-d tensors. Not fullgraph:
    past dynamo's recompile limit (8 shapes) a call runs eager instead of failing (tests/test_optim.py counts
    graphs)."""
    if fn not in COMPILED:
        COMPILED[fn] = torch.compile(fn, dynamic=False)
    return COMPILED[fn]


def scalars(device, *values):
    """0-d fp32 tensors on the parameters' device (a fill kernel each: no host sync, no cross-device operand)."""
    return [torch.full((), v, dtype=torch.float32, device=device) for v in values]


def shard_rows(n, rank, world_size):
    """The matrices [start, stop) of an n-matrix stack that `rank` updates: contiguous chunks of ceil(n / world_size),
    so the gathered chunks are the stack in order (the last ranks may hold fewer, or none)."""
    chunk = -(-n // world_size)
    return min(n, rank * chunk), min(n, (rank + 1) * chunk)


def shard_of(sd):
    """The "shard" record of a saved state dict; one without it (saved before sharding) holds every row."""
    return sd.get("shard") or {"rank": 0, "world_size": 1, "rows": None}


def param_groups(groups):
    """The param groups MuonAdamW holds for `groups`: Muon groups split by parameter shape, every setting filled in.
    A plan reads them without building an optimizer (torch imports torch._dynamo for the first one: ~1.5 s)."""
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
        if g.get("constrain") is not None and (g["kind"] != "adamw" or g["constrain"] not in ROW_CONSTRAINTS):
            raise ValueError(
                f"group {g.get('name', g['kind'])!r}: constrain={g['constrain']!r}, but only an AdamW group takes one, "
                f"one of {list(ROW_CONSTRAINTS)}"
            )
        g.setdefault("weight_decay", 0.0)
        g.setdefault("betas", (0.8, 0.95))
        g.setdefault("eps", 1e-10)
        g.setdefault("momentum", 0.95)  # Muon: base_train sets it every step (muon_momentum)
        g.setdefault("beta2", NORMUON_BETA2)
        g["initial_lr"] = g["lr"]
        g["initial_weight_decay"] = g["weight_decay"]
    return flat


class MuonAdamW(torch.optim.Optimizer):
    """
    groups: dicts with kind="adamw" (lr, betas, eps, weight_decay; constrain: a ROW_CONSTRAINTS name) or kind="muon"
    (lr, momentum, weight_decay, beta2 of NorMuon). Muon groups are split by parameter shape so each
    sub-group's matrices are updated as one stack. Each group keeps its
    "initial_lr" / "initial_weight_decay" so schedules can scale them.
    rank, world_size, process_group: shard Muon over the ranks of process_group (default: the world); compile:
    compile the update math (default: where the parameters are on CUDA).
    """

    def __init__(self, groups, rank=0, world_size=1, process_group=None, compile=None):
        assert 0 <= rank < world_size, (rank, world_size)
        if world_size > 1 and dist.is_initialized():
            assert (dist.get_rank(process_group), dist.get_world_size(process_group)) == (rank, world_size), (
                "rank and world_size must be this process's place in process_group"
            )
        super().__init__(param_groups(groups), defaults={})
        self.rank, self.world_size, self.process_group, self.compile = rank, world_size, process_group, compile

    def compiles(self, tensor):
        return self.compile if self.compile is not None else tensor.is_cuda

    def ortho_dtype(self, tensor):
        """Polar Express in bf16 on CUDA (tensor cores), fp32 elsewhere."""
        return torch.bfloat16 if tensor.is_cuda else torch.float32

    def rows(self, group):
        """The matrices [start, stop) of a Muon group that this rank updates and keeps state for."""
        return shard_rows(len(group["params"]), self.rank, self.world_size)

    @torch.no_grad()
    def step(self, gate=None):
        """gate: None, or a 0-d bool tensor on the parameters' device; where it is False the step changes no weight
        and no buffer (AdamW's step counts still advance), decided on the device: nothing waits to read it."""
        for group in self.param_groups:
            if group["kind"] not in ("adamw", "muon"):
                raise ValueError(f"unknown optimizer group kind {group['kind']!r}")
        # Muon first: its all-gathers run while the AdamW groups update
        gathers = [self.step_muon(g, gate) for g in self.param_groups if g["kind"] == "muon"]
        for group in self.param_groups:
            if group["kind"] == "adamw":
                self.step_adamw(group, gate)
        for finish in gathers:
            if finish:
                finish()

    def step_adamw(self, group, gate=None):
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
        constrain = group.get("constrain")
        for step, ps in by_step.items():
            bias1, bias2 = 1 - beta1**step, 1 - beta2**step
            fuse = [self.compiles(p) and p.numel() >= FUSE_MIN_NUMEL for p in ps]
            if any(fuse):  # the hyperparameters as 0-d tensors, filled once for every large tensor of the group
                hyper = scalars(ps[0].device, group["lr"], group["weight_decay"], bias1, bias2)
            for p in (p for p, f in zip(ps, fuse) if f):  # one compiled kernel per large tensor (wte, lm_head)
                compiled(adamw_update)(
                    [p],
                    [p.grad.float()],  # .float() of an fp32 gradient is the gradient itself: no copy, no launch
                    [self.state[p]["exp_avg"]],
                    [self.state[p]["exp_avg_sq"]],
                    *hyper,
                    beta1,
                    beta2,
                    group["eps"],
                    gate,
                    constrain,
                )
            ps = [p for p, f in zip(ps, fuse) if not f]
            if ps:
                adamw_update(
                    ps,
                    [p.grad.float() for p in ps],
                    [self.state[p]["exp_avg"] for p in ps],
                    [self.state[p]["exp_avg_sq"] for p in ps],
                    group["lr"],
                    group["weight_decay"],
                    bias1,
                    bias2,
                    beta1,
                    beta2,
                    group["eps"],
                    gate,
                    constrain,
                )

    def step_muon(self, group, gate=None):
        """Update this rank's matrices of the group; on several ranks, start the all-gather of every rank's and return
        the function that finishes it."""
        params = group["params"]
        if all(p.grad is None for p in params):  # the same on every rank: DDP gives each rank every gradient
            return None
        start, stop = self.rows(group)
        self.update_matrices(group, params[start:stop], gate)
        return self.gather(params, start, stop) if self.world_size > 1 else None

    def update_matrices(self, group, params, gate=None):
        """One Muon step on `params`, this rank's matrices of the group, whose momentum and variance rows are the
        group's state (keyed by the group's first matrix)."""
        state = self.state[group["params"][0]]
        if not state:
            r, c = group["params"][0].shape
            var_shape = (len(params), r, 1) if r >= c else (len(params), 1, c)
            state["momentum_buffer"] = torch.zeros(
                (len(params), r, c), dtype=torch.float32, device=group["params"][0].device
            )
            state["variance_buffer"] = torch.zeros(var_shape, dtype=torch.float32, device=group["params"][0].device)
        live = [i for i, p in enumerate(params) if p.grad is not None]
        if not live:
            return
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
        ortho_dtype = self.ortho_dtype(stacked_p)
        update, hyper = muon_update, [group["lr"], group["momentum"], group["weight_decay"]]
        # a skipped matrix (rare) would need a graph for another stack size
        if self.compiles(stacked_p) and not partial:
            update, hyper = compiled(muon_update), scalars(stacked_p.device, *hyper)
        update(
            stacked_p,
            stacked_g,
            momentum_buf,
            variance_buf,
            *hyper,
            beta2=group["beta2"],
            ortho_dtype=ortho_dtype,
            gate=gate,
        )
        torch._foreach_copy_(params, list(stacked_p.unbind(0)))
        if partial:  # the rows were gathered copies: write the updated ones back
            state["momentum_buffer"].index_copy_(0, rows, momentum_buf)
            state["variance_buffer"].index_copy_(0, rows, variance_buf)

    def gather(self, params, start, stop):
        """Start the all-gather of every rank's chunk of the stack (padded to equal chunks); returns the function that
        waits for it and copies the other ranks' matrices into this rank's weights."""
        chunk, p0 = -(-len(params) // self.world_size), params[0]
        send = torch.empty((chunk, *p0.shape), dtype=p0.dtype, device=p0.device)  # rows past `stop`: padding, dropped
        if stop > start:
            torch.stack(params[start:stop], out=send[: stop - start])
        recv = torch.empty((chunk * self.world_size, *p0.shape), dtype=p0.dtype, device=p0.device)
        work = self.all_gather(recv, send)

        def finish():
            work.wait()
            others = [i for i in range(len(params)) if not start <= i < stop]
            if others:
                torch._foreach_copy_([params[i] for i in others], [recv[i] for i in others])

        return finish

    def all_gather(self, out, inp):
        # all_gather_into_tensor, not all_gather_single: torch 2.11 (the floor) lacks the latter
        return dist.all_gather_into_tensor(out, inp, group=self.process_group, async_op=True)

    # ----- checkpoints: per rank, reloadable on any number of ranks -----

    def state_dict(self):
        """torch's format (state by parameter index, the group settings) holding this rank's Muon rows only, the
        AdamW state on rank 0 only (replicated: saved once), and "shard": which rows of each Muon group it holds."""
        sd = super().state_dict()
        if self.rank > 0:
            for g in sd["param_groups"]:
                if g["kind"] == "adamw":
                    for i in g["params"]:
                        sd["state"].pop(i, None)
        sd["shard"] = {
            "rank": self.rank,
            "world_size": self.world_size,
            "rows": [list(self.rows(g)) if g["kind"] == "muon" else None for g in self.param_groups],
        }
        return sd

    def load_state_dict(self, state_dict):
        self.load_state_dicts([state_dict])

    def ranks_to_load(self, saved_world_size):
        """The saved ranks whose state dicts this rank's load_state_dicts needs: 0 (the AdamW state) and the owners of
        this rank's Muon rows. A checkpoint saved before sharding has everything on rank 0 (the others saved None)."""
        need = {0}
        for g in self.param_groups:
            if g["kind"] == "muon":
                start, stop = self.rows(g)
                for r in range(saved_world_size):
                    a, b = shard_rows(len(g["params"]), r, saved_world_size)
                    if max(a, start) < min(b, stop):
                        need.add(r)
        return sorted(need)

    def load_state_dicts(self, state_dicts):
        """This rank's state from the state dicts saved by the ranks of a run on any number of ranks (a list in any
        order, None for a rank not read, or {saved rank: state dict}): the AdamW state from rank 0's, this rank's Muon
        rows from whichever hold them. The groups keep this optimizer's settings, not the saved ones (below)."""
        if isinstance(state_dicts, dict):
            state_dicts = [state_dicts] if "param_groups" in state_dicts else state_dicts.values()
        saved = [sd for sd in state_dicts if sd is not None]
        full = [sd for sd in saved if shard_of(sd)["rank"] == 0]
        if not full:
            raise ValueError("load_state_dicts needs the state dict of saved rank 0 (it holds the AdamW state)")
        saved_groups = full[0]["param_groups"]
        if [(g["kind"], len(g["params"])) for g in saved_groups] != [
            (g["kind"], len(g["params"])) for g in self.param_groups
        ]:
            raise ValueError(
                "the saved optimizer state has other parameter groups than this optimizer (another model?)"
            )
        state = {}
        for k, (group, saved_group) in enumerate(zip(self.param_groups, saved_groups)):
            # The group's settings (lr, initial_lr, weight decay, betas, eps, momentum, beta2) stay those this optimizer
            # was built with: a resume may change them (--change-settings), and the schedules scale initial_lr and
            # initial_weight_decay as on a fresh run. No saved group key is state: AdamW's step counts live per
            # parameter in its state, loaded below with the moments, and Muon keeps none.
            ids = saved_group["params"]  # the saved indices of the group's parameters
            if group["kind"] == "adamw":
                for p, i in zip(group["params"], ids):
                    if i in full[0]["state"]:
                        state[p] = {
                            key: v.to(p.device, copy=True) if torch.is_tensor(v) else v
                            for key, v in full[0]["state"][i].items()
                        }
            elif rows := self.load_rows(k, group, ids[0], saved):
                state[group["params"][0]] = rows
        self.state.clear()
        self.state.update(state)

    def load_rows(self, k, group, key, saved):
        """This rank's momentum and variance rows of Muon group k, cut from the saved ranks' rows (key: the saved index
        of the group's first matrix, which keys its state). None if the group had no state (it never stepped)."""
        start, stop = self.rows(group)
        p0, n = group["params"][0], len(group["params"])
        pieces = []
        for sd in saved:
            rows = shard_of(sd)["rows"]
            a, b = rows[k] if rows else (0, n)
            if key in sd["state"]:
                pieces.append((a, b, sd["state"][key]))
        if not pieces:
            return None
        rows = {}
        for name in ("momentum_buffer", "variance_buffer"):
            shape = pieces[0][2][name].shape[1:]
            rows[name] = torch.zeros((stop - start, *shape), dtype=torch.float32, device=p0.device)
        covered = set()
        for a, b, st in pieces:
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                for name, buf in rows.items():
                    buf[lo - start : hi - start] = st[name][lo - a : hi - a]
                covered.update(range(lo, hi))
        if len(covered) < stop - start:
            raise ValueError(
                f"the saved state dicts lack matrices {sorted(set(range(start, stop)) - covered)} of "
                f"{group['name']}: pass those of every saved rank in ranks_to_load"
            )
        return rows
