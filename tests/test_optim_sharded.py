"""MuonAdamW sharded over ranks: same weights as one process, and state reloads on other rank counts.

Two gloo processes give one process's weights over 20 steps (GPT and NAG), and
the per-rank state dicts reload on another number of ranks (2 → 1, 1 → 2, a checkpoint from before sharding)."""

import os
import sys
import copy
import json
import socket
import subprocess

import pytest
import torch

from conftest import PROCESSES
from nanochat.optim import MuonAdamW, shard_rows

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, SAVE_AT = 20, 10
# the tiny preset at depth 3: stacks of 12 and 3 matrices, so on two ranks a chunk is padded
FLAGS = ["--preset", "tiny", "--depth", "3"]


def tiny_model(arch):
    """A tiny model with the same seeded weights in every process, and its optimizer groups as base_train makes them."""
    from scripts import base_train
    from nag.archs import plan_for

    args = base_train.parse_args(FLAGS + ["--arch", arch])
    plan = plan_for(args, 512, 1)  # the groups do not depend on the process count
    plan.model.to_empty(device="cpu")
    with torch.no_grad():
        for i, p in enumerate(plan.model.parameters()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 + i)) * 0.05)
    return plan.model, plan.optimizer_groups(args)


def train(model, opt, steps):
    """Seeded gradients (the same on every rank, as after DDP's all-reduce) and base_train-like schedules; at step 7
    every fifth parameter has no gradient (a MoD sub-layer that ran no token): Muon matrices and AdamW gates alike."""
    params = list(model.parameters())
    for step in steps:
        g = torch.Generator().manual_seed(step)
        for i, p in enumerate(params):
            grad = torch.randn(p.shape, generator=g)
            p.grad = None if step == 7 and i % 5 == 2 else grad
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * (1 - step / (2 * STEPS))
            if group["kind"] == "muon":
                group["momentum"] = 0.85 + 0.005 * step
                group["weight_decay"] = group["initial_weight_decay"] * (1 - step / STEPS)
        opt.step()


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def load_weights(model, ws):
    with torch.no_grad():
        for p, w in zip(model.parameters(), ws):
            p.copy_(w)


def worker(out_path):
    """One rank of the two-process check (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for arch in ("gpt", "nag"):
        # one process, uninterrupted: the reference; its state at SAVE_AT, also as saved before sharding (no "shard")
        model, groups = tiny_model(arch)
        ref = MuonAdamW(groups)
        train(model, ref, range(SAVE_AT))
        ref_w10, ref_sd10 = weights(model), copy.deepcopy(ref.state_dict())
        train(model, ref, range(SAVE_AT, STEPS))
        ref_w = weights(model)
        legacy_sd10 = {k: v for k, v in ref_sd10.items() if k != "shard"}
        # sharded over the two ranks, uninterrupted; each rank's state dict at SAVE_AT
        model, groups = tiny_model(arch)
        opt = MuonAdamW(groups, rank=rank, world_size=world)
        train(model, opt, range(SAVE_AT))
        w10, sds10 = weights(model), [None] * world
        dist.all_gather_object(sds10, opt.state_dict())
        train(model, opt, range(SAVE_AT, STEPS))
        sharded_w = weights(model)
        everyone = [None] * world
        dist.all_gather_object(everyone, sharded_w)
        res = {
            "sharded": max_diff(sharded_w, ref_w),
            "ranks_identical": all(max_diff(w, sharded_w) == 0 for w in everyone),
            "momentum_rows": {
                g["name"]: len(opt.state[g["params"][0]]["momentum_buffer"])
                for g in opt.param_groups
                if g["kind"] == "muon"
            },
        }

        def resumed(start_w, world_size, load):  # a fresh optimizer on world_size ranks, loaded, stepped to the end
            model, groups = tiny_model(arch)
            load_weights(model, start_w)
            opt = MuonAdamW(groups, rank=rank if world_size > 1 else 0, world_size=world_size)
            load(opt)
            train(model, opt, range(SAVE_AT, STEPS))
            return max_diff(weights(model), ref_w)

        res["resume_2to1"] = resumed(w10, 1, lambda o: o.load_state_dicts(sds10))
        res["resume_2to2"] = resumed(
            w10,
            2,
            lambda o: o.load_state_dicts([sd if r in o.ranks_to_load(world) else None for r, sd in enumerate(sds10)]),
        )
        res["resume_1to2"] = resumed(ref_w10, 2, lambda o: o.load_state_dict(ref_sd10))
        res["resume_legacy_1to2"] = resumed(ref_w10, 2, lambda o: o.load_state_dicts([legacy_sd10, None]))
        results[arch] = res
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.barrier()  # both ranks done with every collective: gloo aborts an exit that tears a pair down mid-use
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@PROCESSES
def test_two_gloo_ranks_equal_one_process_and_resume_on_another_count(tmp_path):
    out = tmp_path / "result.json"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        OMP_NUM_THREADS="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE="2",
        PYTHONPATH=os.pathsep.join([REPO] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(out)],
            cwd=REPO,
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(l[-3000:] for l in logs)
    for rank, results in enumerate(json.loads(out.read_text())):
        for arch, res in results.items():
            print(rank, arch, res)
            assert res["ranks_identical"], (rank, arch)
            # each rank holds momentum for its chunk only:
            # 12 square matrices → 6, 3 MLP matrices → 2 (rank 0) / 1 (rank 1)
            assert sorted(res["momentum_rows"].values()) == ([1, 1, 6] if rank else [2, 2, 6]), res["momentum_rows"]
            for key in ("sharded", "resume_2to1", "resume_2to2", "resume_1to2", "resume_legacy_1to2"):
                assert res[key] <= 1e-6, (rank, arch, key, res[key])


# ----- in one process: the bookkeeping of rows (no collective runs without a step)


def test_shard_rows_cover_the_stack_in_order():
    for n in (1, 2, 3, 7, 12, 256):
        for world in (1, 2, 3, 8):
            rows = [shard_rows(n, r, world) for r in range(world)]
            assert rows[0][0] == 0 and rows[-1][1] == n
            assert all(a <= b and b == c for (a, b), (c, _) in zip(rows, rows[1:])), (n, world, rows)
            assert max(b - a for a, b in rows) == -(-n // world)


def matrices_and_gates(seed=0):
    g = torch.Generator().manual_seed(seed)
    ms = [torch.randn(8, 6, generator=g).requires_grad_() for _ in range(5)] + [
        torch.randn(6, 8, generator=g).requires_grad_() for _ in range(2)
    ]
    gates = [torch.randn(4, generator=g).requires_grad_() for _ in range(3)]
    groups = [
        dict(kind="adamw", name="gates", lr=0.01, weight_decay=0.1, params=gates),
        dict(kind="muon", name="m", lr=0.02, weight_decay=0.1, params=ms),
    ]
    return ms + gates, groups


def test_state_dicts_reload_on_any_number_of_ranks():
    # a full state (one rank) cut for 3 ranks (a stack of 2 leaves rank 2 without rows), then put back together
    params, groups = matrices_and_gates()
    full = MuonAdamW(groups)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        full.step()
    sd = full.state_dict()
    shards = [MuonAdamW(matrices_and_gates()[1], rank=r, world_size=3) for r in range(3)]
    for r, opt in enumerate(shards):
        assert opt.ranks_to_load(1) == [0]
        opt.load_state_dict(sd)
        for g, gf in zip(opt.param_groups, full.param_groups):
            if g["kind"] == "muon":
                a, b = shard_rows(len(g["params"]), r, 3)
                st, sf = opt.state[g["params"][0]], full.state[gf["params"][0]]
                assert torch.equal(st["momentum_buffer"], sf["momentum_buffer"][a:b])
                assert torch.equal(st["variance_buffer"], sf["variance_buffer"][a:b])
    saved = [opt.state_dict() for opt in shards]
    # the AdamW state (gates: 0..2) on rank 0 only
    assert all(not any(k in s["state"] for k in range(3)) for s in saved[1:])
    assert [s["shard"]["rows"][1] for s in saved] == [[0, 2], [2, 4], [4, 5]]
    back = MuonAdamW(matrices_and_gates()[1])
    assert back.ranks_to_load(3) == [0, 1, 2]
    back.load_state_dicts(saved[::-1])  # in any order
    again = back.state_dict()
    assert again["param_groups"] == sd["param_groups"] and again["state"].keys() == sd["state"].keys()
    for i, st in sd["state"].items():
        for k, v in st.items():
            assert torch.equal(again["state"][i][k], v) if torch.is_tensor(v) else again["state"][i][k] == v
    # rank 1 of 2 needs saved rank 0 (AdamW), and of 3 ranks' rows those holding its matrices 3, 4 of the stack of
    # 5 (saved ranks 1, 2) and 1 of the stack of 2 (saved rank 1)
    two = MuonAdamW(matrices_and_gates()[1], rank=1, world_size=2)
    assert two.ranks_to_load(3) == [0, 1, 2]
    with pytest.raises(ValueError, match="lack matrices"):
        two.load_state_dicts([saved[0], None, saved[2]])
    with pytest.raises(ValueError, match="saved rank 0"):
        two.load_state_dicts(saved[1:])


def test_bench_counts_a_share_of_muon_per_rank(capsys):
    # scripts/bench/optim.py on the tiny preset over 2 ranks: stacks of 8, 2 and 2 matrices split evenly, so each rank
    # does exactly half of Muon's FLOPs and bytes; AdamW's are the same as replicated, and only the sharded step gathers
    from scripts.bench import optim as bench_optim

    rep, sharded = bench_optim.main(["--preset", "tiny", "--arch", "gpt", "--world-size", "2"])
    muon = lambda r, key: r["by_kind"]["muon"][key]
    assert muon(rep, "flops") == 2 * muon(sharded, "flops") > 0
    assert muon(sharded, "bytes") < 0.55 * muon(rep, "bytes")
    assert rep["by_kind"]["adamw"] == sharded["by_kind"]["adamw"]
    assert "all-gather" in sharded["by_kind"] and "all-gather" not in rep["by_kind"]
    assert sharded["state_bytes"] < rep["state_bytes"]
    assert "| gpt | sharded (2) |" in capsys.readouterr().out


if __name__ == "__main__":
    worker(sys.argv[1])
