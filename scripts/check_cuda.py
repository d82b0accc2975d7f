"""
Does torch see the GPUs this machine has? One line either way, before anything costs GPU time.

    python -m scripts.check_cuda            # (GPU) every GPU that nvidia-smi lists must be visible to torch
    python -m scripts.check_cuda --gpus 8   # (GPU) at least 8

runs/setup_env.sh runs it on any machine where nvidia-smi lists a GPU, and speedrun.py calls
`cuda_problem` before any stage: a CPU build of torch on a GPU node (or a CUDA build newer than the
driver) would otherwise train on the CPU without a word.
"""

import argparse
import re
import subprocess
import sys


def nvidia_smi():
    """(GPUs listed, driver version, the CUDA version the driver supports); (0, None, None) without nvidia-smi."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        header = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0, None, None
    count = sum(line.startswith("GPU") for line in listed.splitlines())
    driver = re.search(r"Driver Version:\s*([\d.]+)", header)
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", header)
    return count, driver and driver.group(1), cuda and cuda.group(1)


def cuda_problem(need=None):
    """None when torch sees at least `need` CUDA devices (default: every GPU nvidia-smi lists, at least one);
    else one line saying what torch and the driver report and what to do."""
    import torch
    listed, driver, driver_cuda = nvidia_smi()
    need = need or max(listed, 1)
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if seen >= need:
        return None
    build = f"torch {torch.__version__} (" + (f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build, no CUDA") + ")"
    smi = (f"nvidia-smi lists {listed} GPU(s), driver {driver or '?'} (CUDA {driver_cuda or '?'})" if listed
           else "nvidia-smi lists no GPU")
    if not torch.version.cuda:
        fix = "remove .venv and run `source runs/setup_env.sh` on this node to install the CUDA build"
    elif listed:
        fix = f"the driver must support CUDA {torch.version.cuda}: upgrade the driver, or set NANOCHAT_TORCH_INDEX (README) and rebuild .venv"
    else:
        fix = "check that the GPUs are visible here (CUDA_VISIBLE_DEVICES, the container's --gpus)"
    return f"torch sees {seen} CUDA device(s), {need} needed: {build}; {smi}; {fix}"


def main(argv=None):
    p = argparse.ArgumentParser(description="Check that torch sees the GPUs (one line, exit 1 if not).")
    p.add_argument("--gpus", type=int, default=None, help="GPUs needed (default: every one nvidia-smi lists)")
    args = p.parse_args(argv)
    problem = cuda_problem(args.gpus)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(1)
    import torch
    print(f"CUDA ok: torch {torch.__version__} sees {torch.cuda.device_count()} × {torch.cuda.get_device_name()}")


if __name__ == "__main__":
    main()
