"""
Train the BPE tokenizer on the train split and save it to <base_dir>/tokenizer/.

    python -m scripts.tok_train --vocab-size 4096 --max-chars 20000000        # the CPU demo's tokenizer
    python -m scripts.tok_train --vocab-size 32768 --max-chars 2000000000    # the published one, on ClimbMix shards (network)
"""

import argparse
import time

from nanochat.common import exit_on_user_error
from nanochat.dataset import parquets_iter_batched
from nanochat.tokenizer import get_tokenizer_dir, train_tokenizer


def main(argv=None):
    parser = argparse.ArgumentParser(description="Train the BPE tokenizer.")
    parser.add_argument("--max-chars", type=int, default=2_000_000_000, help="train on at most this many characters")
    parser.add_argument("--doc-cap", type=int, default=10_000, help="use at most this many characters of each document")
    parser.add_argument("--vocab-size", type=int, default=32768, help="vocabulary size, special tokens included")
    args = parser.parse_args(argv)
    with exit_on_user_error():
        t0 = time.time()
        tokenizer = train_tokenizer(args.vocab_size, args.max_chars, args.doc_cap)
        train_time = time.time() - t0
        out_dir = get_tokenizer_dir()
        print(f"trained a {tokenizer.get_vocab_size():,}-token vocabulary in {train_time:.1f}s, saved to {out_dir}")

        # sanity: the round trip is exact, and compression is that of a BPE (well above 1 byte per token)
        sample = "The quick brown fox jumps over the lazy dog. Numbers: 12345, unicode: café, 東京, 🙂.\n"
        assert tokenizer.decode(tokenizer.encode(sample)) == sample, "tokenizer round trip failed"
        val_texts = next(parquets_iter_batched("val"))
        num_bytes = sum(len(t.encode("utf-8")) for t in val_texts)
        num_tokens = sum(len(ids) for ids in tokenizer.encode(val_texts))
        print(
            f"compression on {num_bytes:,} bytes of validation text: {num_bytes / max(num_tokens, 1):.2f} bytes/token"
        )


if __name__ == "__main__":
    main()
