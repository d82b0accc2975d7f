"""
Does torch see the GPUs this machine has? One line either way, before anything costs GPU time.

    python -m scripts.check_cuda            # (GPU) every GPU that nvidia-smi lists must be visible to torch
    python -m scripts.check_cuda --gpus 8   # (GPU) at least 8

runs/setup_env.sh runs it on any machine where nvidia-smi lists a GPU, and speedrun.py calls the same check
(nanochat.common.cuda_problem) before any stage: a CPU build of torch on a GPU node (or a CUDA build newer than the
driver) would otherwise train on the CPU without a word.
"""

import argparse
import sys

from nanochat.common import cuda_problem, parse_checked, positive_int


def main(argv=None):
    p = argparse.ArgumentParser(description="Check that torch sees the GPUs (one line, exit 1 if not).")
    p.add_argument(
        "--gpus", type=positive_int, default=None, help="GPUs needed (default: every one nvidia-smi lists)"
    )
    args = parse_checked(p, argv)
    problem = cuda_problem(args.gpus)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(1)
    import torch

    print(f"CUDA ok: torch {torch.__version__} sees {torch.cuda.device_count()} × {torch.cuda.get_device_name()}")


if __name__ == "__main__":
    main()
