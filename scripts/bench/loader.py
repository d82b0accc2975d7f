"""
Tokens per second of the train loader in one process, against what a training rank consumes.

    python -m scripts.bench.loader                                  # B × T = 16 × 2048 (published) and 16 × 256 (CPU demo)
    python -m scripts.bench.loader --shapes 16x2048 --batches 200 --tokenizer-threads 1

The loader (nanochat/dataloader.py) reads parquet row groups, tokenizes them and packs rows by best fit, all on
the host. What one rank of the published run needs: 2^20 tokens per step at ~1.1 s per step (8 × H100), shared by
8 ranks, so 2^20 / 1.1 / 8 ≈ 119K tokens/s per rank. Training fetches the next micro-batch while the device works
on the current one (scripts/base_train.py), so a loader well above that rate costs the step nothing.

The first batch fills the loader's document buffer (up to 1,000 documents tokenized at once) and is timed apart:
a run pays it once per start. The rate is over the batches after it, at the steady state the run sees.
"""

import time
import argparse

from nanochat.common import exit_on_user_error
from nanochat.dataloader import data_loader
from nanochat.tokenizer import get_tokenizer

PUBLISHED = {"tokens_per_step": 2**20, "seconds_per_step": 1.1, "ranks": 8}  # docs/reproduce.md: the published run
# ≈ 119,156 tokens/s
NEED_PER_RANK = PUBLISHED["tokens_per_step"] / PUBLISHED["seconds_per_step"] / PUBLISHED["ranks"]


def parse_shape(text):
    try:
        B, T = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is BxT, like 16x2048 (got {text!r})") from None
    return B, T


def bench(tokenizer, B, T, batches, tokenizer_threads, device):
    """(seconds of the first batch, tokens/s over the next `batches`) of one train loader."""
    loader = data_loader(tokenizer, B, T, "train", device=device, tokenizer_threads=tokenizer_threads)
    t0 = time.perf_counter()
    next(loader)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(batches):
        next(loader)
    return first, batches * B * T / (time.perf_counter() - t0)


def main(argv=None):
    p = argparse.ArgumentParser(description="Train-loader tokens/s per process against what a training rank needs.")
    p.add_argument(
        "--shapes",
        type=lambda s: [parse_shape(x) for x in s.split(",")],
        default=[(16, 2048), (16, 256)],
        help="comma list of BxT (device batch × sequence length)",
    )
    p.add_argument("--batches", type=int, default=100, help="timed batches per shape, after the first")
    p.add_argument(
        "--tokenizer-threads", type=int, default=4, help="threads of the tokenizer (the loader's default: 4)"
    )
    p.add_argument(
        "--device", type=str, default="cpu", help="where batches go (cuda: pinned memory, non-blocking copies)"
    )
    args = p.parse_args(argv)
    with exit_on_user_error():
        tokenizer = get_tokenizer()
        print(
            f"need per rank (published run): 2^20 tokens / {PUBLISHED['seconds_per_step']} s per step / "
            f"{PUBLISHED['ranks']} ranks = {NEED_PER_RANK:,.0f} tokens/s"
        )
        results = []
        for B, T in args.shapes:
            first, rate = bench(tokenizer, B, T, args.batches, args.tokenizer_threads, args.device)
            results.append(
                {"B": B, "T": T, "first_batch_s": first, "tokens_per_s": rate, "x_need": rate / NEED_PER_RANK}
            )
            print(
                f"B × T = {B} × {T}: {rate:,.0f} tokens/s ({rate / NEED_PER_RANK:.1f}× the need; "
                f"{1e3 * B * T / rate:.1f} ms per batch) | first batch {first:.2f} s (fills the buffer)"
            )
        return results


if __name__ == "__main__":
    main()
