"""
Train the BPE tokenizer on the train split and save it to <base_dir>/tokenizer/.

    python -m scripts.tok_train --vocab-size 4096 --max-chars 20000000        # the CPU demo's tokenizer
    python -m scripts.tok_train --vocab-size 32768 --max-chars 2000000000    # the published one, on ClimbMix shards (network)

A tokenizer already in the base dir that runs under <base_dir>/runs/ were trained with is replaced only with
--replace: their checkpoints read only the tokenizer they were trained with. A replaced tokenizer moves to
<base_dir>/replaced/<time>/tokenizer/, never deleted; moving it back to tokenizer/ serves those runs again.
"""

import argparse
import os
import time

from nanochat.common import UserError, exit_on_user_error, get_base_dir, parse_checked, positive_int
from nanochat.dataset import parquets_iter_batched
from nanochat.run_dir import CONFIG, read_record
from nanochat.tokenizer import get_tokenizer, get_tokenizer_dir, has_tokenizer, train_tokenizer


def named(names, shown=3):
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def runs_trained_with(tokenizer):
    """The runs under <base_dir>/runs/ whose config.json records this tokenizer's fingerprint: the ones whose
    checkpoints it serves (nanochat/checkpoint_manager.py check_vocab reads them with no other)."""
    runs_dir = os.path.join(get_base_dir(), "runs")
    names = sorted(os.listdir(runs_dir)) if os.path.isdir(runs_dir) else []
    fingerprint = tokenizer.fingerprint()
    out = []
    for name in names:
        config = read_record(os.path.join(runs_dir, name, CONFIG)) or {}
        recorded = config.get("fingerprints")
        if isinstance(recorded, dict) and recorded.get("tokenizer") == fingerprint:
            out.append(name)
    return out


def tokenizer_in_place():
    """(the base dir's tokenizer, the runs trained with it), or (None, []) where there is none or it does not load
    (then no run can use it either)."""
    if not has_tokenizer():
        return None, []
    try:
        tokenizer = get_tokenizer()
    except UserError:
        return None, []
    return tokenizer, runs_trained_with(tokenizer)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Train the BPE tokenizer.")
    parser.add_argument(
        "--max-chars", type=positive_int, default=2_000_000_000, help="train on at most this many characters"
    )
    parser.add_argument(
        "--doc-cap", type=positive_int, default=10_000, help="use at most this many characters of each document"
    )
    parser.add_argument(
        "--vocab-size", type=positive_int, default=32768, help="vocabulary size, special tokens included"
    )
    parser.add_argument(
        "--replace",
        action="store_true",
        help="replace a tokenizer that runs were trained with (it moves to <base_dir>/replaced/<time>/)",
    )
    args = parse_checked(parser, argv)
    with exit_on_user_error():
        out_dir = get_tokenizer_dir()
        old, users = tokenizer_in_place()
        if users and not args.replace:  # checked before minutes of training
            raise UserError(
                f"the tokenizer in {out_dir} ({old.get_vocab_size():,} tokens) is the one {len(users)} run(s) under "
                f"{os.path.join(get_base_dir(), 'runs')} were trained with ({named(users)}); a new one would leave "
                "them unreadable. Train it under another NANOCHAT_BASE_DIR, or add --replace (the old one is kept "
                "in replaced/)"
            )
        t0 = time.time()
        tokenizer, moved_to = train_tokenizer(args.vocab_size, args.max_chars, args.doc_cap)
        train_time = time.time() - t0
        print(f"trained a {tokenizer.get_vocab_size():,}-token vocabulary in {train_time:.1f}s, saved to {out_dir}")
        if moved_to:
            used = f"the one {named(users)} were trained with" if users else "no run under runs/ was trained with it"
            size = f"{old.get_vocab_size():,} tokens, " if old else ""
            print(
                f"note: it replaced the earlier tokenizer ({size}{used}), kept in {moved_to}"
                + (f"; move it back to {out_dir} to evaluate or resume those runs" if users else "")
            )

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
