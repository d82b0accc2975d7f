"""
Sample from a checkpoint of any arch with a KV cache, printing the text as it comes.

Any arch: gpt, nag, a NAG-MoD or router-MoD one (docs/design.md §9).

    python -m scripts.sample --run nag-tiny --prompt "The capital of France is"
    python -m scripts.sample --run nag-tiny --prompt "The" --prompt "Once" --temperature 0.8 --top-k 50 --num-samples 2
    echo "The opposite of hot is" | python -m scripts.sample --run gpt-tiny --prompt - --temperature 0
    python -m scripts.sample --run nag-tiny --prompt-file prompts.txt      # prompts separated by blank lines
    python -m scripts.sample --run nag-tiny --prompt "The" --mod-rate 0.2  # NAG-MoD at a 20% skip rate

Prompts: every --prompt (`-` reads the whole of stdin as one prompt), then the prompts of --prompt-file (`-`: stdin),
which are separated by blank lines (a prompt may span lines; its newlines are kept, the whitespace around it is not).
Each prompt starts a document (<|bos|> first). The samples of a prompt use seeds --seed, --seed + 1, ...: the same seed
gives the same sample. A sample ends after --max-tokens tokens, at <|bos|> (the model starts a new document; not
printed), or when the context (the model's sequence length, prompt included) is full: decoding never goes past the
positions the model was trained on, and a note says when a prompt leaves less room than --max-tokens.

--mod-rate R samples a NAG checkpoint (or a router-MoD GPT one) at a skip rate: its thresholds are calibrated on
--mod-calib-tokens train-split tokens as in base_eval, then fixed, so every token's skips depend on its own prefix
only and the cache stays exact. A checkpoint trained with MoD samples at its own rate and thresholds without it.
"""

import sys
import time
import argparse

import torch

from nanochat.common import (
    UserError,
    exit_on_user_error,
    script_argv,
    autodetect_device_type,
    compute_dtype_for,
    parse_checked,
    positive_int,
    non_negative,
    STEP,
)
from nanochat.tokenizer import get_tokenizer
from nanochat.dataloader import data_loader
from nanochat.engine import generate, context_room, Utf8Stream
from nanochat import checkpoint_manager as ckpt
from nanochat.run_dir import resolve_run_dir
from nag.archs import load_model
from nag.mod import ModConfig, BLOCKS, check_rate, calibrate, skip_summary

DEVICE_TYPES = ("cuda", "cpu", "mps")


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--run", type=str, required=True, help="run name under $NANOCHAT_BASE_DIR/runs, or a path to a run directory"
    )
    p.add_argument("--step", type=STEP, default=-1, help="checkpoint step (-1: the latest)")
    p.add_argument(
        "--prompt", type=str, action="append", default=[], help="a prompt (repeatable); - reads one from stdin"
    )
    p.add_argument(
        "--prompt-file", type=str, default="", help="prompts separated by blank lines; - reads them from stdin"
    )
    p.add_argument("--max-tokens", type=positive_int, default=64, help="tokens sampled per sample at most")
    p.add_argument("--temperature", type=non_negative(float, "greedy"), default=0.8, help="0 = greedy (argmax)")
    p.add_argument(
        "--top-k", type=positive_int, default=None, help="sample among the k most likely tokens only (default: all)"
    )
    p.add_argument("--seed", type=int, default=42, help="the samples of each prompt use seeds seed, seed + 1, ...")
    p.add_argument("--num-samples", type=positive_int, default=1, help="samples per prompt")
    p.add_argument(
        "--device-type", type=str, default="", choices=("",) + DEVICE_TYPES, help="default: cuda if available, else cpu"
    )
    p.add_argument(
        "--no-cache",
        action="store_true",
        help="recompute the whole sequence for every token (slow: the cache's reference)",
    )
    p.add_argument(
        "--mod-rate", type=float, default=None, help="MoD: target share of skipped token-sublayers, in [0, 0.95)"
    )
    p.add_argument(
        "--mod-blocks",
        type=str,
        default=None,
        choices=BLOCKS,
        help="sub-layers skipped with --mod-rate (default: the checkpoint's own MoD blocks, else both)",
    )
    p.add_argument(
        "--mod-calib-tokens",
        type=positive_int,
        default=2**16,
        help="train-split tokens that calibrate the --mod-rate thresholds",
    )
    p.add_argument(
        "--device-batch-size", type=positive_int, default=4, help="rows per calibration forward (--mod-rate)"
    )
    return p


def check_args(args):
    """What the flags' types (nanochat/common.py's rule for numbers) cannot check alone."""
    if args.mod_rate is not None:
        check_rate(args.mod_rate)
    elif args.mod_blocks:
        raise UserError("--mod-blocks needs --mod-rate (the target share of skipped token-sublayers)")


def split_prompts(text):
    """Prompts separated by blank lines; each one's own newlines kept, the whitespace around it dropped."""
    prompts, lines = [], []
    for line in text.splitlines() + [""]:
        if line.strip():
            lines.append(line)
        elif lines:
            prompts.append("\n".join(lines).strip())
            lines = []
    return prompts


def read_prompts(args, stdin):
    """Every prompt, in order: the --prompt ones, then --prompt-file's. stdin is read at most once."""
    if not args.prompt and not args.prompt_file:
        raise UserError("no prompt: give --prompt TEXT, --prompt - (stdin) or --prompt-file FILE")
    if args.prompt.count("-") + (args.prompt_file == "-") > 1:
        raise UserError("stdin can be read once: give --prompt - or --prompt-file - once")
    prompts = []
    for i, p in enumerate(args.prompt):
        text = stdin.read().rstrip("\n") if p == "-" else p
        if not text.strip():
            raise UserError(f"prompt {i + 1} is empty{' (stdin)' if p == '-' else ''}")
        prompts.append(text)
    if args.prompt_file:
        if args.prompt_file == "-":
            text = stdin.read()
        else:
            try:
                with open(args.prompt_file, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise UserError(
                    f"cannot read --prompt-file {args.prompt_file} ({getattr(e, 'strerror', None) or e})"
                ) from None
        found = split_prompts(text)
        if not found:
            raise UserError(f"--prompt-file {args.prompt_file} holds no prompt")
        prompts += found
    return prompts


def encode_prompts(prompts, tokenizer, model):
    """Token ids of every prompt, <|bos|> first; a prompt longer than the context is refused."""
    bos, seq = tokenizer.get_bos_token_id(), model.config.sequence_len
    out = []
    for i, text in enumerate(prompts):
        ids = tokenizer.encode(text, prepend=bos)
        if len(ids) > seq:
            raise UserError(
                f"prompt {i + 1} is {len(ids)} tokens long (with <|bos|>), more than the model's context of {seq}"
            )
        out.append(ids)
    return out


def configure_mod(model, meta, args, tokenizer, device):
    """The MoD to sample with, as a header phrase (None: no MoD). --mod-rate recalibrates the thresholds as base_eval
    does; without it a MoD checkpoint keeps the thresholds it was trained with."""
    if args.mod_rate is None:
        if getattr(model, "mod", None) is None:
            return None
        calibrated = model.thresholds.calibrated() or not (model.mod.skips("attn") or model.mod.skips("mlp"))
        return f"MoD {model.mod.blocks} at rate {model.mod.rate:g}, thresholds from training" + (
            "" if calibrated else " (not estimated yet: almost every token runs)"
        )
    if not hasattr(model, "configure_mod"):
        raise UserError(
            f"--mod-rate: the checkpoint is a {meta['arch']!r} model, which has no score to skip tokens by "
            "(a NAG checkpoint, or a router-MoD GPT one trained with --arch gpt-router)"
        )
    own = getattr(model, "mod", None)
    blocks = args.mod_blocks or (own.blocks if own is not None else "both")
    model.configure_mod(ModConfig(blocks=blocks, rate=args.mod_rate))
    if args.mod_rate == 0:
        model.eval()
        return f"MoD {blocks} at rate 0 (nothing skipped)"
    B, T = args.device_batch_size, model.config.sequence_len
    steps = max(1, args.mod_calib_tokens // (B * T))
    calibrate(model, data_loader(tokenizer, B, T, "train", device=device), steps)  # ends in eval mode: thresholds fixed
    return f"MoD {blocks} at rate {args.mod_rate:g}, thresholds calibrated on {steps * B * T:,} train tokens"


def sample_one(model, tokenizer, ids, args, seed, out):
    """Stream one sample to out; returns (its text, its token count, why it ended)."""
    bos = tokenizer.get_bos_token_id()
    stream = Utf8Stream(tokenizer.enc.decode_single_token_bytes)
    pieces, n, end = [], 0, "max tokens"
    room = context_room(model, len(ids))
    for tok in generate(
        model,
        ids,
        args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=seed,
        use_cache=not args.no_cache,
    ):
        if tok == bos:  # the model started a new document: the completion is over
            end = "<|bos|>"
            break
        n += 1
        piece = stream.push(tok)
        if piece:
            pieces.append(piece)
            out.write(piece)
            out.flush()
    else:
        if n == room < args.max_tokens:
            end = "context full"
    tail = stream.finish()
    if tail:
        pieces.append(tail)
        out.write(tail)
    out.write("\n")
    out.flush()
    return "".join(pieces), n, end


def sample(args, stdin=None, out=None):
    stdin, out = stdin or sys.stdin, out or sys.stdout
    check_args(args)
    prompts = read_prompts(args, stdin)
    device_type = args.device_type or autodetect_device_type()
    if device_type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device-type cuda, but torch sees no CUDA device")
    device = torch.device(device_type)
    run_dir = resolve_run_dir(args.run)
    model, meta = load_model(run_dir, None if args.step < 0 else args.step, device)
    tokenizer = get_tokenizer()
    ckpt.check_vocab(meta, tokenizer)
    encoded = encode_prompts(prompts, tokenizer, model)
    model.set_compute_dtype(compute_dtype_for(device_type))
    if "tokens" in meta:  # NAG's α warm-up is a function of tokens seen: sample the model as it was trained
        model.set_tokens_seen(meta["tokens"])
    mod = configure_mod(model, meta, args, tokenizer, device)
    top_k = f"top-k {args.top_k}" if args.top_k else "all tokens"
    print(
        f"sampling {run_dir} step {meta['step']} ({meta['arch']}) on "
        f"{device_type}: temperature {args.temperature:g}, {top_k}, "
        f"up to {args.max_tokens} tokens, {'no cache' if args.no_cache else 'KV cache'}" + (f" | {mod}" if mod else ""),
        file=out,
    )
    results = []
    for i, (text, ids) in enumerate(zip(prompts, encoded)):
        room = context_room(model, len(ids))
        if room < args.max_tokens:
            print(
                f"note: prompt {i + 1} is {len(ids)} tokens: the context of {model.config.sequence_len} leaves room "
                f"for {room} more",
                file=out,
            )
        for j in range(args.num_samples):
            seed = args.seed + j
            print(f"--- prompt {i + 1}/{len(prompts)}, sample {j + 1}/{args.num_samples}, seed {seed}", file=out)
            out.write(text)
            out.flush()
            t0 = time.perf_counter()
            completion, n, end = sample_one(model, tokenizer, ids, args, seed, out)
            dt = time.perf_counter() - t0
            print(f"--- {n} tokens in {dt:.2f} s ({n / dt:.1f} tokens/s), ended by {end}", file=out)
            results.append(
                {"prompt": text, "sample": j, "seed": seed, "completion": completion, "tokens": n, "end": end}
            )
    if mod and getattr(model, "thresholds", None) is not None:
        s = skip_summary(model.thresholds.pop_rates("eval"))
        if "skip_attn" in s or "skip_mlp" in s:
            print(
                f"MoD: skipped {', '.join(f'{k[5:]} {100 * s[k]:.1f}%' for k in ('skip_attn', 'skip_mlp') if k in s)} "
                "(the mean over forwards of the share of their tokens)",
                file=out,
            )
    return results


def main(argv=None, stdin=None, out=None):
    args = parse_checked(build_parser(), script_argv(argv))
    with exit_on_user_error(interrupted="interrupted"):
        return sample(args, stdin, out)


if __name__ == "__main__":
    main()
