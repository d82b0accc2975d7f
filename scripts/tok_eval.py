"""
Report the tokenizer's compression: bytes per token on validation text and on a train sample.

    python -m scripts.tok_eval
"""

import argparse

from nanochat.common import exit_on_user_error, parse_checked, positive_int
from nanochat.dataset import parquets_iter_batched
from nanochat.tokenizer import get_tokenizer


def take_texts(split, max_chars):
    """Documents of a split, in order, up to about max_chars characters."""
    texts, seen = [], 0
    for batch in parquets_iter_batched(split):
        for text in batch:
            texts.append(text)
            seen += len(text)
            if seen >= max_chars:
                return texts
    return texts


def compression(tokenizer, texts):
    num_bytes = sum(len(t.encode("utf-8")) for t in texts)
    num_tokens = sum(len(ids) for ids in tokenizer.encode(texts))
    return num_bytes, num_tokens


def main(argv=None):
    parser = argparse.ArgumentParser(description="Tokenizer compression on the data.")
    parser.add_argument(
        "--max-chars", type=positive_int, default=10_000_000, help="characters of text to encode per split"
    )
    args = parse_checked(parser, argv)
    with exit_on_user_error():
        tokenizer = get_tokenizer()
        print(f"vocab size: {tokenizer.get_vocab_size():,}")
        for name, split in (("val shard", "val"), ("train sample", "train")):
            num_bytes, num_tokens = compression(tokenizer, take_texts(split, args.max_chars))
            print(
                f"{name:>12}: {num_bytes:>14,} bytes  {num_tokens:>12,} "
                f"tokens  {num_bytes / max(num_tokens, 1):.3f} bytes/token"
            )


if __name__ == "__main__":
    main()
