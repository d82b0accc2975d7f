"""Shared fixtures: a tiny offline corpus and tokenizer, built once per test session."""

import os
import json
import random

import pytest
import torch

import nag  # noqa: F401  (sets TRITON_INTERPRET before anything imports triton)

torch.set_num_threads(1)  # one per xdist worker (runs/test.sh runs two): more only add contention for tiny models

# runs/test.sh runs two pytest-xdist workers; a test that starts a process group of its own (torchrun, gloo ranks)
# carries this mark, and the marked tests run one after another on one worker: never two groups competing for the
# cores, the ports or the timeouts at once
PROCESSES = pytest.mark.xdist_group("processes")


# --require-cuda: the GPU preflight (speedrun.sh, runs/gpu_checks.sh). A CUDA test skipped for want of a GPU
# passes in an ordinary run; here it must not, or a preflight on a machine where torch sees no GPU says "ok".
def pytest_addoption(parser):
    parser.addoption(
        "--require-cuda", action="store_true", help="fail unless at least one CUDA test passed and none was skipped"
    )


CUDA_TESTS = {"passed": 0, "skipped": 0}


def pytest_runtest_logreport(report):
    if "cuda" in report.nodeid.lower():
        if report.passed and report.when == "call":
            CUDA_TESTS["passed"] += 1
        elif report.skipped:
            CUDA_TESTS["skipped"] += 1


def pytest_sessionfinish(session, exitstatus):
    if session.config.getoption("--require-cuda") and (not CUDA_TESTS["passed"] or CUDA_TESTS["skipped"]):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter:
            reporter.write_line(
                f"error: --require-cuda: {CUDA_TESTS['passed']} CUDA test(s) passed, {CUDA_TESTS['skipped']} skipped "
                f"(torch CUDA available: {torch.cuda.is_available()}); the preflight did not test the GPU"
            )
        session.exitstatus = 1


WORDS = (
    "the of and to in is was that for on with as by at from it an be this which or are have not but had "
    "model data token train loss layer weight gradient norm residual attention head vector matrix batch "
    "python module function class value return string number list file error default object method "
    "café naïve résumé über straße 東京 данные 🙂"
).split()


def tiny_documents(num_docs=300, seed=0):
    """Deterministic pseudo-English documents of varied length, a few long enough to need cropping."""
    rng = random.Random(seed)
    docs = []
    for i in range(num_docs):
        num_sentences = rng.choice([1, 2, 3, 5, 8, 13]) if i % 25 else 60
        sentences = []
        for _ in range(num_sentences):
            words = [rng.choice(WORDS) for _ in range(rng.randint(3, 14))]
            if rng.random() < 0.2:
                words.append(str(rng.randint(0, 99999)))
            sentences.append(" ".join(words).capitalize() + rng.choice([".", ".", "?", "!"]))
        docs.append(f"Document {i}.\n" + " ".join(sentences) + "\n")
    return docs


@pytest.fixture(scope="session")
def tiny_base_dir(tmp_path_factory):
    """A NANOCHAT_BASE_DIR with an offline corpus (~300 docs: 4 train shards + 1 val shard) and a vocab-512
    tokenizer."""
    from nanochat.dataset import build_offline_corpus, parquets_iter_batched
    from nanochat.tokenizer import Tokenizer

    base = tmp_path_factory.mktemp("nanochat_base")
    txt_dir = base / "txt"
    txt_dir.mkdir()
    for i, doc in enumerate(tiny_documents()):
        (txt_dir / f"doc_{i:04d}.txt").write_text(doc, encoding="utf-8")
    data_dir = os.path.join(base, "base_data")
    build_offline_corpus(
        data_dir=data_dir, txt_dir=str(txt_dir), num_train_shards=4, docs_per_row_group=8, max_doc_chars=8000
    )
    train_texts = (t for batch in parquets_iter_batched("train", data_dir=data_dir) for t in batch)
    Tokenizer.train_from_iterator(train_texts, 512).save(os.path.join(base, "tokenizer"))
    return str(base)


# base_train flags of every tiny test run: 2 layers × 64, 256 tokens per step, LRs raised against the
# muP batch rule (√(256 / 2^19) ≈ 0.022 at this batch); add --arch, --run and a horizon.
# fmt: off
TINY_TRAIN = [
    "--depth", "2", "--model-dim", "64", "--head-dim", "32", "--max-seq-len", "64", "--device-batch-size", "4",
    "--total-batch-size", "256", "--eval-tokens", "512", "--warmup-steps", "2", "--nag-alpha-warmup-tokens", "1024",
    "--matrix-lr", "0.5", "--embedding-lr", "2.0", "--unembedding-lr", "0.1", "--device-type", "cpu",
]
# fmt: on


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of tiny models: they gain nothing from a second thread and lose ~100x when the cores are
    contended."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def no_heap_freeze(monkeypatch):
    """In-process training runs skip base_train's collect-and-freeze after the first step: a full collection would
    walk the whole test session's heap each time (seconds over the suite). Runs started as commands still do it."""
    import scripts.base_train

    monkeypatch.setattr(scripts.base_train, "freeze_heap", lambda: None)


@pytest.fixture
def run_base(tiny_base_dir, tmp_path, monkeypatch):
    """A private NANOCHAT_BASE_DIR sharing the session's corpus and tokenizer, with an empty runs/; one torch thread
    for the test: its runs are tiny models trained in this process, where a second thread only contends with the
    other worker's (tests/test_depth_sweep.py's tiny sweep: 4x the CPU time with two on a busy box)."""
    base = linked_base(tiny_base_dir, tmp_path / "base")
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield base
    torch.set_num_threads(before)


def unwritable_reports(base, how):
    """Make base/reports take no new folder: a regular file in its place (works as root too), or a read-only
    directory (skips the test where the mode stops nothing: as root)."""
    reports = os.path.join(base, "reports")
    if how == "file in the way":
        open(reports, "w").close()
        return
    os.makedirs(reports)
    os.chmod(reports, 0o555)
    if os.access(reports, os.W_OK):
        os.chmod(reports, 0o755)
        pytest.skip("running as root: a read-only mode does not stop writes")


def linked_base(tiny_base_dir, base):
    """base (a new directory) sharing the session's corpus and tokenizer, with an empty runs/."""
    os.makedirs(base, exist_ok=True)
    for name in ("base_data", "tokenizer"):
        os.symlink(os.path.join(tiny_base_dir, name), os.path.join(base, name))
    return base


def train_tiny_pair(base, *extra):
    """A 6-step gpt run and nag run on the same budget in base (checkpoints at 3 and 6, val bpb at 0, 3, 6,
    gate telemetry every 2 steps); returns {arch: run_dir}."""
    from scripts import base_train

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(base))
        return {
            arch: base_train.main(
                TINY_TRAIN
                + [
                    "--num-iterations",
                    "6",
                    "--eval-every",
                    "3",
                    "--save-every",
                    "3",
                    "--nag-gate-log-every",
                    "2",
                    *extra,
                    "--arch",
                    arch,
                    "--run",
                    arch,
                ]
            )
            for arch in ("gpt", "nag")
        }


@pytest.fixture
def script_error(capsys):
    """script_error(main, *argv): main(argv) must exit 1 with one `error: ...` line on stderr; returns that line."""

    def run(main, *argv):
        with pytest.raises(SystemExit) as e:
            main(list(argv))
        assert e.value.code == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
        return err[0]

    return run


# ---------------------------------------------------------------------------
# CORE eval bundles written by tests (core.yaml, eval_meta_data.csv, eval_data/tiny/<label>.jsonl)


def _write_eval_bundle(root, tasks, extra_baselines=None):
    """tasks: (label, task type, num_fewshot, random baseline in % or None for no row, items or None for an
    absent file[, continuation_delimiter]). extra_baselines: {label: %} rows of tasks core.yaml does not list."""
    root = str(root)
    os.makedirs(os.path.join(root, "eval_data", "tiny"), exist_ok=True)
    yaml_lines = ["# test bundle", "icl_tasks:"]
    meta = ["Eval Task,Task Category,Random baseline,Description"]
    for label, kind, shots, baseline, items, *delimiter in tasks:
        yaml_lines += [
            "-",
            f"  label: {label}",
            f"  dataset_uri: tiny/{label}.jsonl",
            f"  num_fewshot: [{shots}]",
            f"  icl_task_type: {kind}",
        ]
        if delimiter:
            # a JSON string is a YAML double-quoted one
            yaml_lines.append(f"  continuation_delimiter: {json.dumps(delimiter[0])}")
        if baseline is not None:
            meta.append(f'{label},tiny,{baseline},"a, quoted description"')
        if items is not None:
            with open(os.path.join(root, "eval_data", "tiny", f"{label}.jsonl"), "w") as f:
                f.writelines(json.dumps(it) + "\n" for it in items)
    meta += [f"{label},tiny,{b}," for label, b in (extra_baselines or {}).items()]
    with open(os.path.join(root, "core.yaml"), "w") as f:
        f.write("\n".join(yaml_lines) + "\n")
    with open(os.path.join(root, "eval_meta_data.csv"), "w") as f:
        f.write("\n".join(meta) + "\n")
    return root


@pytest.fixture(scope="session")
def write_eval_bundle():
    """write_eval_bundle(root, tasks, extra_baselines=None) -> root: see _write_eval_bundle."""
    return _write_eval_bundle


def random_model(cls, config, vocab_size, **kwargs):
    """A model with random weights (init_weights, then noise on every parameter, so the zero-initialised projections
    are awake), MoD thresholds calibrated on random tokens, in eval mode: for tests that compare two paths through
    it."""
    from nag.mod import calibrate
    from scripts.bench import models

    model = models.build(cls, config, "cpu", **kwargs)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    if getattr(model, "thresholds", None) is not None:
        batches = [
            (torch.randint(0, vocab_size, (4, 64), generator=torch.Generator().manual_seed(s)),) for s in range(3)
        ]
        calibrate(model, iter(batches), 3)
    model.eval()
    return model
