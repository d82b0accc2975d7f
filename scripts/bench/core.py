"""
Time CORE scoring batched vs one example at a time, and check both give the same verdicts.

Time CORE scoring batched vs one example at a time, on a tiny random GPT, and check that every
per-example verdict (correct, predicted choice) is the same both ways.

python -m scripts.bench.core                        # the CORE bundle is downloaded once (network)
python -m scripts.bench.core --tokenizer trained    # the base dir's BPE tokenizer: real sequence lengths and vocab (network)

On a CPU the forward is compute-bound, so the batched path gains mostly by doing less work: shared
prefixes packed once, logits only at scored tokens. Its gain therefore grows with the vocab (lm_head
work saved) and with few-shot prompts, and shrinks as the model body grows.
"""

import os
import sys
import time
import random
import argparse

import torch

from nanochat.common import UserError, autodetect_device_type
from nanochat.core_eval import ensure_eval_bundle, load_core_tasks, load_task_data, score_examples


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255 and BOS is 256: a tokenizer that needs no training."""

    def get_bos_token_id(self):
        return 256

    def get_vocab_size(self):
        return 257

    def __call__(self, texts, prepend=None):
        first = [] if prepend is None else [prepend]
        if isinstance(texts, str):
            return first + list(texts.encode("utf-8"))
        return [first + list(t.encode("utf-8")) for t in texts]


def tiny_random_gpt(vocab_size, depth, dim, seq_len, device, seed=0):
    from nanochat.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(
        GPTConfig(
            sequence_len=seq_len,
            vocab_size=vocab_size,
            n_layer=depth,
            n_head=max(1, dim // 64),
            n_kv_head=max(1, dim // 64),
            n_embd=dim,
        ),
        device=device,
    )
    model.init_weights()
    with torch.no_grad():  # the output projections start at zero and lm_head near it: give the logits some shape
        for name, p in model.named_parameters():
            if name.endswith("c_proj.weight"):
                p.normal_(std=0.02)
        model.lm_head.weight.normal_(std=0.05)
    return model.eval()


def main():
    parser = argparse.ArgumentParser(description="CORE scoring: batched vs one at a time")
    parser.add_argument(
        "--eval-bundle", default=None, help="eval bundle directory (default: <base_dir>/eval_bundle, downloaded once)"
    )
    parser.add_argument("--tasks", default="copa,piqa,winograd,lambada_openai", help="comma-separated task labels")
    parser.add_argument("--max-per-task", type=int, default=100, help="items per task (after the 1337 shuffle)")
    parser.add_argument(
        "--tokenizer",
        choices=["byte", "trained"],
        default="byte",
        help="byte-level, or the trained tokenizer of the base dir",
    )
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512, help="model context; longer prompts are left-cropped")
    parser.add_argument("--batch-size", type=int, default=32, help="rows per batched forward")
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="padded tokens per batched forward (default: by device)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1: steadier timings on a shared machine; 0: torch default)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each path; the best is reported")
    parser.add_argument("--device-type", default="", help="cuda|cpu|mps (empty = autodetect)")
    args = parser.parse_args()

    device = torch.device(args.device_type or autodetect_device_type())
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.tokenizer == "byte":
        tokenizer = ByteTokenizer()
    else:
        from nanochat.tokenizer import get_tokenizer

        tokenizer = get_tokenizer()
    model = tiny_random_gpt(tokenizer.get_vocab_size(), args.depth, args.dim, args.seq_len, device)
    args.eval_bundle = ensure_eval_bundle(args.eval_bundle)
    tasks = {t["label"]: t for t in load_core_tasks(args.eval_bundle)}
    print(
        f"device {device}, torch threads {torch.get_num_threads()}, tokenizer {args.tokenizer}, "
        f"GPT depth {args.depth} dim {args.dim} seq_len {args.seq_len}, batch {args.batch_size} rows / "
        f"{args.max_tokens or 'default'} tokens"
    )

    # warm-up: first calls pay for allocations and kernel choice
    score_examples(
        model,
        tokenizer,
        [{"query": "warm up", "choices": ["a", "b"], "gold": 0}],
        device,
        {"task_type": "multiple_choice", "num_fewshot": 0, "continuation_delimiter": " "},
    )

    print(f"{'task':<16} {'n':>4} {'batched s':>10} {'one-by-one s':>13} {'speed-up':>9} {'rescored':>9}  verdicts")
    total_b = total_o = 0.0
    all_same = True
    for label in [s.strip() for s in args.tasks.split(",") if s.strip()]:
        if label not in tasks:
            raise UserError(f"no task {label} in {args.eval_bundle}/core.yaml")
        task = tasks[label]
        path = os.path.join(args.eval_bundle, "eval_data", task["dataset_uri"])
        if not os.path.isfile(path):
            print(f"{label:<16} missing ({path})")
            continue
        data = load_task_data(path, task["task_type"])
        random.Random(1337).shuffle(data)
        data = data[: args.max_per_task] if args.max_per_task > 0 else data
        meta = {k: task[k] for k in ("task_type", "num_fewshot", "continuation_delimiter")}
        tb = to = float("inf")
        for _ in range(args.repeats):  # interleaved, best of N: other load on the machine only adds time
            t0 = time.perf_counter()
            batched = score_examples(
                model,
                tokenizer,
                data,
                device,
                meta,
                batched=True,
                batch_size=args.batch_size,
                max_tokens=args.max_tokens,
            )
            t1 = time.perf_counter()
            single = score_examples(model, tokenizer, data, device, meta, batched=False)
            t2 = time.perf_counter()
            tb, to = min(tb, t1 - t0), min(to, t2 - t1)
        same = all((a["correct"], a["pred"]) == (b["correct"], b["pred"]) for a, b in zip(batched, single))
        all_same &= same
        total_b, total_o = total_b + tb, total_o + to
        rescored = sum(v["rescored"] for v in batched)
        print(
            f"{label:<16} {len(data):>4} {tb:>10.2f} {to:>13.2f} {to / tb:>8.1f}x {rescored:>9}  "
            f"{'identical' if same else 'DIFFERENT'} (acc {sum(v['correct'] for v in batched) / len(data):.3f})"
        )
    if total_b > 0:
        print(
            f"{'all':<16} {'':>4} {total_b:>10.2f} {total_o:>13.2f} {total_o / total_b:>8.1f}x {'':>9}  "
            f"{'all identical' if all_same else 'SOME DIFFERENT'}"
        )
    return 0 if all_same else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
