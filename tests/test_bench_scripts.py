"""The benchmark scripts still run (tiny shapes): they print figures, so nothing else would notice them rot."""

import os
import sys
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args):
    out = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


def test_bench_train_prints_ratios():
    out = run("scripts.bench_train", "--depth", "1", "--model-dim", "64", "--head-dim", "32", "--max-seq-len", "32",
              "--vocab-size", "128", "--device-batch-size", "2", "--steps", "1", "--warmup", "1", "--arch", "gpt,nag:reference")
    assert "tok/s" in out and "nag:reference / gpt (eager): step time" in out


def test_bench_nag_op():
    out = run("scripts.bench_nag", "--sections", "op,activations", "--op-rows", "64", "--op-dim", "96", "--impls", "reference")
    assert "branch op: 64 rows × D=96" in out and "reference forward" in out and "% of copy" in out
    assert "activations saved for backward" in out and "nag:reference" in out and "× gpt" in out
