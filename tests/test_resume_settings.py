"""What a resume may change (nanochat/resume.py's table), and what it refuses.

A new LR or weight decay, given with --change-settings, is
what the optimizer steps with from the resumed step on (only the moments and buffers come from the checkpoint); a flag
that changes the model's parameters or shapes, the batch or the init is refused in one line before anything loads."""

import json
import os
import shutil

import pytest
import torch

from conftest import TINY_TRAIN, linked_base
from nanochat import resume
from nanochat.optim import MuonAdamW
from scripts import base_train

COMMON = ["--num-iterations", "4", "--save-every", "2", "--eval-every", "-1"]
RECIPE = ["--arch", "gpt-recipe", "--run", "recipe", "--num-iterations", "1", "--eval-every", "-1"]
SETTINGS = ("lr", "initial_lr", "weight_decay", "initial_weight_decay", "betas", "eps", "momentum")


def main(argv):
    return base_train.main(TINY_TRAIN + list(argv))


@pytest.fixture(scope="module")
def base(tiny_base_dir, tmp_path_factory, one_torch_thread):
    """A base dir with run "full": the tiny gpt for 4 steps, checkpoints at 2 and 4 (copied by every test that
    writes)."""
    base = linked_base(tiny_base_dir, tmp_path_factory.mktemp("resume_settings") / "base")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(base))
        mp.setattr(base_train, "freeze_heap", lambda: None)
        main(COMMON + ["--run", "full"])
    return str(base)


@pytest.fixture
def runs(base, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", base)
    return os.path.join(base, "runs")


def copy_run(runs, src, name):
    shutil.copytree(os.path.join(runs, src), os.path.join(runs, name), ignore=shutil.ignore_patterns(".lock"))
    return os.path.join(runs, name)


def resumed(base, name, *extra):
    """Run "full" copied to `name` and resumed from step 2 with `extra` flags. Returns each step's group settings
    ({group name: {setting: value}}), the first resumed step's update of every group (flat) and the run dir."""
    copy_run(os.path.join(base, "runs"), "full", name)
    steps, update = [], {}
    real = MuonAdamW.step

    def step(self, gate=None):
        groups = {g["name"]: g for g in self.param_groups}
        first = not steps
        before = {n: [p.detach().clone() for p in g["params"]] for n, g in groups.items()} if first else None
        steps.append({n: {k: g[k] for k in SETTINGS} for n, g in groups.items()})
        real(self, gate)
        if first:
            update.update(
                {
                    n: torch.cat([(p.detach() - b).flatten() for p, b in zip(groups[n]["params"], bs)])
                    for n, bs in before.items()
                }
            )

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", base)
        mp.setattr(base_train, "freeze_heap", lambda: None)
        mp.setattr(MuonAdamW, "step", step)
        run_dir = main(COMMON + ["--run", name, "--resume", "2", *extra])
    return steps, update, run_dir


@pytest.fixture(scope="module")
def unchanged(base):
    return resumed(base, "unchanged")


def losses(run_dir):
    return {r["step"]: r["train_loss"] for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl")))}


def weights(run_dir, step=4):
    return torch.load(os.path.join(run_dir, f"model_{step:06d}.pt"), weights_only=False)["model"]


def mtimes(run_dir):
    return {f: os.stat(os.path.join(run_dir, f)).st_mtime_ns for f in os.listdir(run_dir) if f != ".lock"}


@pytest.mark.parametrize(
    "flag, value, kind, setting",
    [
        ("--matrix-lr", "0.25", "muon", "lr"),  # TINY_TRAIN's 0.5 halved
        ("--weight-decay", "0.14", "muon", "weight_decay"),  # the default 0.28 halved
        ("--embedding-lr", "1.0", "wte", "lr"),  # TINY_TRAIN's 2.0 halved: an AdamW group's
    ],
)
def test_a_changed_setting_is_what_the_resumed_steps_use(base, unchanged, flag, value, kind, setting):
    ref_steps, ref_update, ref_dir = unchanged
    full_dir = os.path.join(base, "runs", "full")
    # the unchanged resume is the uninterrupted run, bit for bit
    assert losses(ref_dir) == losses(full_dir)
    a, b = weights(ref_dir), weights(full_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    steps, update, run_dir = resumed(base, flag.strip("-"), flag, value, "--change-settings")
    assert len(steps) == len(ref_steps) == 2  # steps 3 and 4
    changed = {n for n in steps[0] if (n.startswith("matrices") if kind == "muon" else n == kind)}
    assert changed
    for n, settings in steps[0].items():
        if n in changed:  # the new value, where the schedule scales it from: half the unchanged resume's
            assert settings[setting] == pytest.approx(ref_steps[0][n][setting] / 2, rel=1e-12), (
                n,
                settings,
                ref_steps[0][n],
            )
            assert settings[f"initial_{setting}"] == pytest.approx(ref_steps[0][n][f"initial_{setting}"] / 2, rel=1e-12)
            assert not torch.equal(update[n], ref_update[n]), n
            if setting == "lr" and kind == "muon":  # Muon's update is the LR times a step that does not depend on it
                assert torch.allclose(update[n], ref_update[n] / 2, rtol=1e-3, atol=1e-7), n
        else:  # every other group steps exactly as in the unchanged resume
            assert settings == ref_steps[0][n], n
            assert torch.equal(update[n], ref_update[n]), n
    # step 3 trained from the same weights; step 4 from weights the new setting updated (a halved decay of these
    # tiny weights moves the loss by less than its float32 resolution: its update and weights differ, above and below)
    got, ref = losses(run_dir), losses(ref_dir)
    assert got[3] == ref[3] and (got[4] != ref[4] or setting == "weight_decay")
    a, b = weights(run_dir), weights(ref_dir)
    assert any(not torch.equal(a[k], b[k]) for k in a)
    segment = json.load(open(os.path.join(run_dir, "config.json")))["segments"][-1]
    assert segment["start_step"] == 2 and set(segment["changes"]) == {flag}


@pytest.mark.parametrize(
    "extra, named",
    [
        (["--seed", "7"], "--seed 42 → 7"),  # the init, which the checkpoint replaces
        (["--seed", "7", "--change-settings"], "--seed 42 → 7"),
        (["--depth", "3", "--change-settings"], "--depth 2 → 3"),
        (
            ["--max-seq-len", "32"],
            "--max-seq-len 64 → 32",
        ),  # not "keep --device-batch-size": the shards changed with it
    ],
)
def test_what_no_resume_can_change_is_refused_in_one_line(runs, script_error, extra, named):
    name = "refused" + "".join(extra)
    run_dir = copy_run(runs, "full", name)
    before = mtimes(run_dir)
    err = script_error(main, *COMMON, "--run", name, "--resume", "2", *extra)
    assert "cannot resume" in err and named in err and "another --run" in err and "add --change-settings" not in err, (
        err
    )
    assert mtimes(run_dir) == before


def test_a_recipe_part_that_adds_parameters_is_refused_before_anything_loads(runs, script_error, monkeypatch):
    run_dir = main(RECIPE)
    before = mtimes(run_dir)
    with monkeypatch.context() as mp:
        mp.setattr(base_train.ckpt, "load_model_file", lambda *a, **k: pytest.fail("loaded the checkpoint"))
        for extra in (["--change-settings"], []):
            err = script_error(main, *RECIPE, "--resume", "1", "--no-smear", *extra)
            assert "cannot resume" in err and "--no-smear False → True" in err and "smear_lambda" in err, err
            assert "add --change-settings" not in err
    assert mtimes(run_dir) == before
    # a part that adds no parameter (the short windows) is a setting like any other
    main([*RECIPE, "--resume", "1", "--no-quarter-windows", "--change-settings"])
    assert json.load(open(os.path.join(run_dir, "config.json")))["segments"][-1]["changes"] == {
        "--no-quarter-windows": {"then": False, "now": True}
    }


def test_loaded_optimizer_keeps_its_own_settings_and_the_saved_state():
    g = torch.Generator().manual_seed(0)
    ms = [torch.randn(8, 6, generator=g).requires_grad_() for _ in range(3)]
    vec = [torch.randn(5, generator=g).requires_grad_()]

    def groups(lr, wd, betas):
        return [
            dict(kind="muon", name="m", lr=lr, weight_decay=wd, params=ms),
            dict(kind="adamw", name="v", lr=lr, weight_decay=wd, betas=betas, eps=1e-8, params=vec),
        ]

    saved = MuonAdamW(groups(0.02, 0.1, (0.8, 0.95)))
    for _ in range(2):
        for p in ms + vec:
            p.grad = torch.randn(p.shape, generator=g)
        saved.step()
    fresh = MuonAdamW(groups(0.01, 0.3, (0.9, 0.99)))
    settings = [{k: v for k, v in grp.items() if k != "params"} for grp in fresh.param_groups]
    fresh.load_state_dict(saved.state_dict())
    assert [{k: v for k, v in grp.items() if k != "params"} for grp in fresh.param_groups] == settings
    sd, again = saved.state_dict()["state"], fresh.state_dict()["state"]
    assert sd.keys() == again.keys()
    for i, st in sd.items():
        for k, v in st.items():
            assert torch.equal(again[i][k], v) if torch.is_tensor(v) else again[i][k] == v


def test_the_table_names_every_baseline_flag_once():
    import argparse
    from nag.archs import add_arch_args
    from nanochat import resume

    arch_parser = argparse.ArgumentParser()
    add_arch_args(arch_parser)
    arch_flags = {a.dest for a in arch_parser._actions} - {"help"}
    baseline = {a.dest for a in base_train.build_parser()._actions} - {"help"} - arch_flags
    listed = [f for _, flags, _ in resume.RESUME_TABLE for f in flags]
    assert len(listed) == len(set(listed)) and set(listed) == baseline
    kinds = {f: kind for kind, flags, _ in resume.RESUME_TABLE for f in flags}
    assert resume.NOT_SETTINGS == {f for f, k in kinds.items() if k == resume.FREE} | resume.HORIZON
    assert set(resume.REFUSED) == {f for f, k in kinds.items() if k == resume.REFUSED_KIND}


# ---------------------------------------------------------------------------
# what a resume compares with: the run at its checkpoint, never argparse's defaults


def config_of(run_dir):
    return json.load(open(os.path.join(run_dir, "config.json")))


def test_without_config_json_a_resume_compares_with_the_checkpoint(runs, script_error, capsys):
    """config.json moved away, as its damaged-file message advises: the checkpoint's own record is the run (it was
    "--depth 20 → 2", the parser's defaults against the tiny run's flags)."""
    run_dir = copy_run(runs, "full", "no_config")
    os.rename(os.path.join(run_dir, "config.json"), os.path.join(run_dir, "config.json.moved"))
    err = script_error(main, *COMMON, "--run", "no_config", "--resume", "2", "--depth", "3")
    assert "--depth 2 → 3" in err and "--depth 20" not in err, err  # (the path may hold "20": pytest-320)
    assert not os.path.exists(os.path.join(run_dir, "config.json"))
    capsys.readouterr()
    main(COMMON + ["--run", "no_config", "--resume", "2"])
    assert "resumed from step 2 of" in capsys.readouterr().out
    assert losses(run_dir) == losses(os.path.join(runs, "full"))
    cfg = config_of(run_dir)
    assert cfg["args"]["depth"] == 2 and [s["start_step"] for s in cfg["segments"]] == [0, 2]
    assert cfg["segments"][0]["command"] is None  # the history before step 2 went with the old config.json


def test_a_checkpoint_that_records_no_flags_is_compared_by_its_model(runs, script_error, capsys):
    """A checkpoint of earlier code holds no flags: without config.json, its model is what a resume is checked
    against, and a line says that the settings were not compared."""
    run_dir = copy_run(runs, "full", "old_meta")
    os.remove(os.path.join(run_dir, "config.json"))
    meta_file = os.path.join(run_dir, "meta_000002.json")
    meta = json.load(open(meta_file))
    for key in ("args", "num_iterations", "total_batch_size", "grad_accum_steps"):
        meta.pop(key, None)
    json.dump(meta, open(meta_file, "w"))
    err = script_error(base_train.main, *COMMON, "--run", "old_meta", "--resume", "2", "--device-type", "cpu")
    assert "n_layer 2 → 20" in err and "--depth" not in err, err  # the checkpoint's model against the command's
    capsys.readouterr()
    main(COMMON + ["--run", "old_meta", "--resume", "2"])
    out = capsys.readouterr().out
    assert "resumed from step 2 of" in out and "records no settings" in out, out
    assert losses(run_dir) == losses(os.path.join(runs, "full"))


def test_a_resume_carries_on_earlier_changes_and_names_what_it_changes(runs, script_error, capsys):
    """The settings in force at the checkpoint go on unless the command line states another value: a change
    accepted with --change-settings is no longer undone by a later resume that does not restate it."""
    run_dir = copy_run(runs, "full", "carried")
    capsys.readouterr()
    main(COMMON + ["--run", "carried", "--resume", "2", "--matrix-lr", "0.25", "--change-settings"])
    assert "resumed from step 2 of" in (out := capsys.readouterr().out) and "changes --matrix-lr 0.5 → 0.25" in out
    # a longer horizon, the LR not restated: it stays 0.25, and the line says so
    bare = ["--run", "carried", "--device-type", "cpu", "--eval-every", "-1"]  # no flag of TINY_TRAIN's
    base_train.main(bare + ["--resume", "latest", "--num-iterations", "6", "--change-settings"])
    out = capsys.readouterr().out
    assert "changes the horizon 4 → 6 steps" in out and "carries on --matrix-lr 0.5 → 0.25 (since step 2)" in out, out
    cfg = config_of(run_dir)
    assert cfg["args"]["matrix_lr"] == 0.25 and cfg["num_iterations"] == 6
    assert [(s["start_step"], set(s.get("changes", {}))) for s in cfg["segments"]] == [
        (0, set()),
        (2, {"--matrix-lr"}),
        (4, {"num_iterations"}),
    ]
    # the finished run, asked again with no flag: nothing to do; stating the old LR is a change
    base_train.main(bare + ["--resume", "latest"])
    assert "already finished its 6 steps" in capsys.readouterr().out
    err = script_error(base_train.main, *bare, "--resume", "4", "--matrix-lr", "0.5")
    assert "--matrix-lr 0.25 → 0.5" in err and "--change-settings" in err, err
    # checkpoints of earlier code record no flags: config.json's, with the changes from the resumed step on undone
    for step in (2, 4, 6):
        meta_file = os.path.join(run_dir, f"meta_{step:06d}.json")
        meta = json.load(open(meta_file))
        json.dump({k: v for k, v in meta.items() if k not in resume.RUN_KEYS}, open(meta_file, "w"))
    base_train.main(bare + ["--resume", "2"])
    cfg = config_of(run_dir)
    assert cfg["args"]["matrix_lr"] == 0.5 and cfg["num_iterations"] == 4 and len(cfg["segments"]) == 1
    assert losses(run_dir) == losses(os.path.join(runs, "full"))


def test_resuming_from_an_earlier_step_drops_the_later_history(runs, capsys):
    """The history describes the run that exists: a start at step 2 replaces every segment from step 2 on."""
    run_dir = copy_run(runs, "full", "again")
    main(COMMON[:1] + ["6"] + COMMON[2:] + ["--run", "again", "--resume", "latest", "--change-settings"])
    assert [s["start_step"] for s in config_of(run_dir)["segments"]] == [0, 4]
    capsys.readouterr()
    main(COMMON + ["--run", "again", "--resume", "2", "--change-settings"])
    out = capsys.readouterr().out
    assert "resumed from step 2 of" in out and "changes no setting" in out, out
    cfg = config_of(run_dir)
    assert cfg["num_iterations"] == 4 and [s["start_step"] for s in cfg["segments"]] == [0]
    assert losses(run_dir) == losses(os.path.join(runs, "full"))
