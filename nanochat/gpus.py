"""
The training GPUs people own: dense bf16 peak and memory, for MFU and plans (--gpu NAME).

Peaks are dense (no 2:4 sparsity) bf16 tensor-core FLOP/s with fp32 accumulation, what a PyTorch bf16 matmul can
approach: the data-center datasheets print twice these "with sparsity"; the GeForce whitepapers print the fp16
accumulate rate beside it, twice the bf16 one. Memory is what torch.cuda.get_device_properties().total_memory reports,
GiB, where a report of it was found, else the marketed size less the same ~1 % (marked "est.").
"""

from dataclasses import dataclass

import torch

from nanochat.common import UserError


@dataclass(frozen=True)
class GPU:
    name: str  # --gpu's word
    label: str  # what a plan calls it
    words: tuple  # the words of torch.cuda.get_device_name() that identify it (lower case)
    peak_flops: float
    memory_gib: float


# Most specific first: an SXM part names no form factor ("NVIDIA H100 80GB HBM3"); a PCIe or NVL part says so.
# Sources: NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100: bf16 1,979 / 1,513 / 1,671 TFLOPS with
# sparsity for SXM / PCIe / NVL) and NVIDIA/exemplar-performance's non-sparse table (H100 989); H200 page
# (nvidia.com/en-us/data-center/h200: the H100 SXM's compute, 141 GB); A100 datasheet (312 dense, 40 / 80 GB);
# L40S datasheet (362 dense, 48 GB); the Ada (RTX 4090: 165.2), Blackwell (RTX 5090: 209.5) and Ampere GA102
# (RTX 3090: 71) whitepapers' "bf16 with fp32 accumulate"; HGX B200 (4.5 PFLOPS bf16 with sparsity per GPU).
# total_memory as reported by torch on each part (public bug reports and logs): H100 SXM 81,090 MiB, PCIe 81,008,
# NVL 99,456,909,312 B, H200 143,156 MiB, A100 40 GB 40,536 MiB, L40S 45,589, RTX 4090 24,563, RTX 3090 24,575,
# B200 182,642; nvidia-smi's 32,607 MiB for the RTX 5090.
# fmt: off
GPUS = (
    GPU("h100-nvl", "H100 NVL", ("h100", "nvl"), 835e12, 92.6),
    GPU("h100-pcie", "H100 PCIe", ("h100", "pcie"), 756e12, 79.1),
    GPU("h100", "H100", ("h100",), 989e12, 79.2),
    GPU("h200-nvl", "H200 NVL", ("h200", "nvl"), 836e12, 139.8),  # est.: the SXM part's memory
    GPU("h200", "H200", ("h200",), 989e12, 139.8),
    GPU("h800-pcie", "H800 PCIe", ("h800", "pcie"), 756e12, 79.1),  # est.: the H100 PCIe's
    GPU("h800", "H800", ("h800",), 989e12, 79.2),  # est.: the H100 SXM's
    GPU("a100-40gb", "A100 40GB", ("a100", "40gb"), 312e12, 39.6),
    GPU("a100", "A100 80GB", ("a100",), 312e12, 79.2),  # the 80 GB part; est.: the H100 SXM's
    GPU("l40s", "L40S", ("l40s",), 362e12, 44.5),
    GPU("rtx5090", "RTX 5090", ("rtx 5090",), 209.5e12, 31.8),
    GPU("rtx4090", "RTX 4090", ("rtx 4090",), 165.2e12, 24.0),
    GPU("rtx3090", "RTX 3090", ("rtx 3090",), 71e12, 24.0),
    GPU("b200", "B200", ("b200",), 2250e12, 178.4),
)
# fmt: on
BY_NAME = {g.name: g for g in GPUS}
PLANNED = BY_NAME["h100"]  # plans without a GPU here and no --gpu: the 8 × H100 SXM node of the published runs


def gpu_of(device_name):
    """The table's GPU of a torch.cuda.get_device_name() string, or None for one the table lacks."""
    name = device_name.lower()
    return next((g for g in GPUS if all(w in name for w in g.words)), None)


def gpu_named(name):
    """--gpu's GPU by its table name."""
    if name not in BY_NAME:
        raise UserError(f"unknown GPU {name!r} (--gpu takes one of: {', '.join(BY_NAME)})")
    return BY_NAME[name]


def gpu_here():
    """(torch's name, memory GiB) of this process's current GPU, or None without one."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return props.name, props.total_memory / 2**30


def peak_flops_of(device_name):
    """The peak of a GPU by its name, or None for one the table lacks: its MFU is unknown, never a guess."""
    gpu = gpu_of(device_name)
    return gpu.peak_flops if gpu else None


def peak_flops(device_type):
    """This process's GPU's peak (peak_flops_of), or None: not a GPU, or one the table lacks (no MFU is shown)."""
    return peak_flops_of(torch.cuda.get_device_name()) if device_type == "cuda" else None
