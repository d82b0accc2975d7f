"""
The attention kernel: the one place that chooses it and calls it (docs/design.md §2, "The attention kernel").

FlashAttention-3 runs on Hopper (compute capability 9.x) when its prebuilt kernel loads from the Hugging Face
hub through the optional `kernels` package (`pip install kernels`), with no build step, as nanochat loads it.
Elsewhere, and wherever attention needs a mask, PyTorch SDPA runs.

    kernel, reason = resolve_attention("auto", device)   # ("fa3", "Hopper GPU, kernel loaded") or ("sdpa", why not)
    model.set_attention(kernel)                          # once, before torch.compile

Windows count positions. A layer of window w lets a query see itself and the w - 1 positions before it (the
masks' `delta < w` in nanochat/gpt.py). FA3's window_size=(left, right) counts tokens on each side, both ends
included, so w becomes (w - 1, 0). A window that covers the whole sequence becomes (-1, 0), plain causal.
FA3 only serves plain rows (training, bpb). Packed rows with several documents (CORE), MoD's gathered queries
and the KV cache keep their explicit masks and SDPA.
"""

import os

import torch
import torch.nn.functional as F

from nanochat.common import UserError

FA3_REPO = "varunneal/flash-attention-3"  # the hub repo nanochat loads: FA3 prebuilt for sm_90
CHOICES = ("auto", "fa3", "sdpa")
FA3_DTYPES = (torch.bfloat16,)  # the prebuilt kernel's training dtype; our compute dtype on every SM80+ GPU

_fa3 = None  # the loaded kernel's interface (flash_attn_func), once per process


class FA3Unavailable(Exception):
    """Why the FA3 kernel did not load, in a few words."""


def load_fa3():
    """The FA3 interface, loaded on the first call. Raises FA3Unavailable with a short reason."""
    global _fa3
    if _fa3 is None:
        try:
            from kernels import get_kernel  # the optional extra: imported here and nowhere else
        except ImportError:
            raise FA3Unavailable("the kernels package is not installed (pip install kernels)") from None
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        try:
            _fa3 = get_kernel(FA3_REPO).flash_attn_interface
        except Exception as e:  # no network and no cached copy, a build that does not match this torch, ...
            detail = (str(e).strip().splitlines() or [""])[0][:160]
            raise FA3Unavailable(f"{FA3_REPO} did not load ({type(e).__name__}: {detail})") from None
    return _fa3


def fa3_unavailable(device, dtype=None):
    """Why FA3 cannot run on `device` in `dtype`, or None when it can (the kernel is then loaded)."""
    device = torch.device(device)
    if not torch.cuda.is_available():
        return "no CUDA"
    if device.type != "cuda":
        return f"device {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:  # the prebuilt kernel has sm_90 code only: Ampere, Ada and Blackwell cannot run it
        return f"compute capability {major}.{minor}"
    if dtype is not None and dtype not in FA3_DTYPES:
        return f"compute dtype {str(dtype).replace('torch.', '')}"
    try:
        load_fa3()
    except FA3Unavailable as e:
        return str(e)
    return None


def resolve_attention(requested, device, dtype=None):
    """(kernel, reason) for --attn auto|fa3|sdpa: "fa3" or "sdpa", and why. "auto" never raises; "fa3" where
    FA3 cannot run is a one-line UserError."""
    if requested not in CHOICES:
        raise UserError(f"--attn must be one of {', '.join(CHOICES)} (got {requested!r})")
    if requested == "sdpa":
        return "sdpa", "--attn sdpa"
    why = fa3_unavailable(device, dtype)
    if why is None:
        return "fa3", "Hopper GPU, kernel loaded"
    if requested == "fa3":
        raise UserError(f"--attn fa3: FlashAttention-3 cannot run here: {why}; --attn auto falls back to SDPA")
    return "sdpa", why


def window_mask(T, window, device):
    """(T, T) bool: query i sees key j when 0 <= i - j < window."""
    delta = torch.arange(T, device=device)[:, None] - torch.arange(T, device=device)[None]
    return (delta >= 0) & (delta < window)


def causal_attention(q, k, v, window, kernel="sdpa"):
    """Attention over a plain row: each query sees itself and the window - 1 positions before it.
    q (B, T, H, D); k, v (B, T, KV, D) with KV dividing H (GQA). Returns (B, T, H, D)."""
    T = q.size(1)
    full = window >= T
    if kernel == "fa3" and q.dtype in FA3_DTYPES:  # any other dtype falls back to SDPA: same math
        y = _fa3.flash_attn_func(q, k, v, causal=True, window_size=(-1 if full else window - 1, 0))
        return y[0] if isinstance(y, tuple) else y  # some FA3 builds also return the log-sum-exp
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    y = masked_attention(q, k, v, None if full else window_mask(T, window, q.device))
    return y.transpose(1, 2)


def masked_attention(q, k, v, mask):
    """SDPA: q (B, H, Tq, D); k, v (B, KV, Tk, D). mask: a bool mask of the keys each query sees (broadcast to
    (B, H, Tq, Tk)), or None for plain causal attention (Tq == Tk: is_causal aligns queries with the first keys)."""
    gqa = k.size(1) != q.size(1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
