"""Failure cases of NAG (docs/failures.md): the guard names the origin of a NaN; the gate-collapse verdict."""

import json
import os

import pytest
import torch

from conftest import TINY_TRAIN
from scripts import base_train
from nag.model import NAGGPT


def tiny_main(argv):
    return base_train.main(TINY_TRAIN + list(argv))


def force_u_zero(monkeypatch, block, kind):
    """Every σ of one branch underflows to exactly 0 (logits ≈ −200), so u = 0 for every token from step 1."""
    original_init = NAGGPT.init_weights

    def init_shut(self):
        original_init(self)
        with torch.no_grad():
            getattr(self.gates[block], f"{kind}_branch").m_down.bias.fill_(-200.0)
    monkeypatch.setattr(NAGGPT, "init_weights", init_shut)


def test_guard_names_the_origin_of_a_nan(run_base, script_error, monkeypatch):
    force_u_zero(monkeypatch, 0, "mlp")  # update 2 of 4: branches before it get NaN gradients, those after do not
    common = ["--arch", "nag", "--num-iterations", "3", "--eval-every", "100", "--nag-gate-log-every", "0"]
    err = script_error(tiny_main, *common, "--run", "f0", "--nag-mod-floor", "0")
    # the NaN spreads backwards to the embedding and every earlier branch, so the parameter list alone misleads
    assert "step 1" in err and "wte.weight" in err and "gates.0.attn_branch.coef" in err
    assert "origin: branch 0.mlp (update 2): u reached 0, min u 0, β 0.99998" in err, err
    # the fixed twin: the same shut branch with the floor stays finite
    run_dir = tiny_main(common + ["--run", "f1", "--nag-mod-floor", "1e-6"])
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert len(rows) == 4 and all(r["train_loss"] is None or r["train_loss"] == r["train_loss"] for r in rows)
