"""
Export a checkpoint of any arch to the Hugging Face format.

The archs: gpt, nag, NAG-MoD, router-MoD GPT, gpt-recipe, nag-recipe. The export is for transformers and
lm-evaluation-harness (docs/interop.md). Needs the [hf] extra: pip install -e '.[hf]'.

    python -m scripts.export_hf --run nag-tiny --out /tmp/nag-chat-hf-nag-tiny

--step N exports another checkpoint than the latest (default); --force writes into a folder that is not empty.
The folder (DIR) then holds model.safetensors (fp32, the native weight names), config.json, generation_config.json,
the modeling code (configuration_nagchat.py, modeling_nagchat.py, loaded with trust_remote_code=True), the tokenizer
(tokenizer.json: a byte-level BPE with the tiktoken ids, checked on sample strings) and README.md, a model card with
the run's config, fingerprints, evaluation results and this command, and inputs.json, the manifest (the checkpoint
exported, every file written and its sha256: with --force over an earlier export, a file of it changed since, say an
edited README.md, moves to DIR/replaced/<time>/ with a note instead of being overwritten). The export then loads DIR
with transformers and prints the largest logit difference against the native model (--no-verify skips that).

    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)  # the config is remote code; the tokenizer is not
    model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)
    print(tok.decode(model.generate(**tok("The capital of France is", return_tensors="pt"), max_new_tokens=16)[0]))

A MoD checkpoint is exported with its evaluation thresholds, fixed: every token runs a sub-layer exactly when its own
score is above the threshold, as in scripts.sample without --mod-rate.
"""

import os
import json
import shlex
import shutil
import tempfile
import argparse

import torch

from nanochat.common import (
    UserError,
    exit_on_user_error,
    script_argv,
    FILE_MODE,
    parse_checked,
    STEP,
    atomic_write_bytes,
    atomic_write_json,
)
from nanochat.tokenizer import get_tokenizer
from nanochat import checkpoint_manager as ckpt
from nanochat.run_dir import (
    CONFIG,
    MANIFEST,
    read_manifest,
    changed_files,
    file_sha256,
    set_aside,
    read_record,
    step_files,
    resolve_run_dir,
)
from nag.hf.tokenizer import PAD
from nag.archs import ARCHS, load_model  # every registered arch has modeling code in nag/hf/ (tests/test_export_hf.py)

HF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nag", "hf")
CODE_FILES = ("configuration_nagchat.py", "modeling_nagchat.py")
AUTO_MAP = {
    "AutoConfig": "configuration_nagchat.NagChatConfig",
    "AutoModelForCausalLM": "modeling_nagchat.NagChatForCausalLM",
}
VERIFY_TOKENS = 256  # tokens of the verification forward (at most the context)
VERIFY_LIMIT = 1e-4  # largest logit difference accepted; fp32 on a CPU gives ~1e-6
HF_EXTRA = "pip install -e '.[hf]'"
# the manifest's tool (inputs.json: the checkpoint exported, the files written and their sha256)
TOOL = "scripts.export_hf"
CARD = "README.md"  # written last, once the export is verified


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--run", type=str, required=True, help="run name under $NANOCHAT_BASE_DIR/runs, or a path to a run directory"
    )
    p.add_argument("--step", type=STEP, default=-1, help="checkpoint step (-1: the latest)")
    p.add_argument("--out", type=str, required=True, help="the export folder (created; must be empty unless --force)")
    p.add_argument(
        "--force",
        action="store_true",
        help="write into a folder that is not empty (its files of the same names are replaced)",
    )
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip loading the export back and comparing its logits with the native model's",
    )
    return p


def require_hf():
    """Import what the export needs, or stop with one line naming the extra."""
    for name in ("transformers", "safetensors", "tokenizers"):
        try:
            __import__(name)
        except ImportError:
            raise UserError(f"exporting needs the {name} package: {HF_EXTRA}") from None


# ----- weights and config -----


def hf_state_dict(model):
    """The native state dict under the exported names: MoD keeps its evaluation thresholds (thresholds.values, as
    mod_thresholds) and drops the training-only estimates; every tensor contiguous, on the CPU."""
    out = {}
    for name, t in model.state_dict().items():
        if name.startswith("thresholds."):
            if name != "thresholds.values":
                continue
            name = "mod_thresholds"
        out[name] = t.detach().to("cpu").contiguous()
    return out


def alpha_warmup(meta):
    """NAG's α warm-up factor at the checkpoint, as sampling and evaluation use it (set_tokens_seen; a checkpoint that
    does not record its tokens keeps the factor 1, as there)."""
    warm = meta["nag_config"].get("alpha_warmup_tokens", 0)
    return 1.0 if warm <= 0 or "tokens" not in meta else min(1.0, meta["tokens"] / warm)


def hf_config(meta, bos, pad):
    from nag.hf.configuration_nagchat import NagChatConfig

    arch = meta["arch"]
    nag = meta.get("nag_config")
    mod = meta.get("mod_config")
    cfg = NagChatConfig(
        arch=arch,
        **meta["model_config"],
        nag={k: nag[k] for k in ("directions", "mod_floor", "renorm")} if nag else None,
        alpha_warmup=alpha_warmup(meta) if nag else 1.0,
        mod={k: mod[k] for k in ("blocks", "rate")} if mod else None,
        recipe=meta.get("recipe_config"),
        bos_token_id=bos,
        eos_token_id=bos,
        pad_token_id=pad,
    )
    cfg.architectures = ["NagChatForCausalLM"]
    cfg.auto_map = dict(AUTO_MAP)
    return cfg


def write_model(out, model, meta, bos, pad):
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    path = os.path.join(out, "model.safetensors")
    save_file(hf_state_dict(model), path, metadata={"format": "pt"})
    os.chmod(path, FILE_MODE)  # safetensors writes 0600; the other files get the umask's mode
    hf_config(meta, bos, pad).save_pretrained(out)
    GenerationConfig(bos_token_id=bos, eos_token_id=bos, pad_token_id=pad).save_pretrained(out)
    for name in CODE_FILES:
        shutil.copyfile(os.path.join(HF_DIR, name), os.path.join(out, name))


def write_tokenizer(out, tokenizer, sequence_len):
    from nag.hf.tokenizer import hf_tokenizer, id_mismatches  # these import tokenizers and transformers

    tok = hf_tokenizer(tokenizer.enc, sequence_len)
    bad = id_mismatches(tokenizer.enc, tok)
    if bad:
        text, want, got = bad[0]
        raise UserError(
            f"the converted tokenizer gives other ids than tiktoken on {text[:40]!r} ({want[:8]}... vs {got[:8]}...); "
            "nothing usable was exported"
        )
    tok.save_pretrained(out)


# ----- verification -----


def verify(out, model, tokenizer):
    """Load DIR with transformers (trust_remote_code) and return the largest |logit difference| with the native model
    over one row of text, <|bos|> first, up to VERIFY_TOKENS tokens."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging
    from nag.hf.tokenizer import CHECK_TEXTS

    logging.disable_progress_bar()
    hf, info = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, output_loading_info=True)
    wrong = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if wrong:
        raise UserError(f"transformers loaded {out} with {wrong}: the modeling code and the weights disagree")
    n = min(VERIFY_TOKENS, model.config.sequence_len)
    text = " ".join(t for t in CHECK_TEXTS if "<|" not in t)
    ids = tokenizer.encode(text, prepend=tokenizer.get_bos_token_id())
    ids = (ids * (n // len(ids) + 1))[:n]
    x = torch.tensor([ids])
    with torch.no_grad():
        want = model(x)
        got = hf(x).logits
    return (want - got).abs().max().item()


# ----- the model card -----


def eval_record(run_dir, step):
    """The evaluation of this step (its eval/step_N.json), or None: none, or unreadable."""
    return read_record(os.path.join(run_dir, step_files(step)["json"]))


def fmt(v):
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return json.dumps(v) if isinstance(v, (dict, list)) else str(v)


def eval_lines(rec):
    if rec is None:
        return ["No evaluation of this step in the run directory (`python -m scripts.base_eval --run RUN --step N`)."]
    lines = []
    for key in ("val_bpb", "train_bpb"):
        if rec.get(key) is not None:
            lines.append(f"- {key.replace('_', ' ')}: {rec[key]:.4f}")
    if rec.get("core_metric") is not None:
        lines.append(
            f"- CORE: {rec['core_metric']:.4f} ({rec.get('num_tasks_scored')} "
            f"tasks, max per task {rec.get('max_per_task')})"
        )
    elif rec.get("partial_core") is not None:
        lines.append(
            f"- {rec.get('partial_label') or 'partial CORE'}: {rec['partial_core']:.4f} (not CORE: fewer than 22 tasks)"
        )
    tasks = rec.get("tasks") or {}
    if tasks:
        lines += ["", "| task | accuracy | centred |", "|---|---:|---:|"]
        lines += [f"| {label} | {r['accuracy']:.4f} | {r['centered']:+.4f} |" for label, r in tasks.items()]
    return lines or ["The run's eval.json for this step holds no bpb or CORE result."]


def model_card(run_dir, meta, config_record, rec, command, max_diff):
    arch = meta["arch"]
    mc = meta["model_config"]
    fingerprints = {**(config_record or {}).get("fingerprints", {}), **meta.get("fingerprints", {})}
    name = os.path.basename(run_dir.rstrip(os.sep))
    what = ARCHS[arch].title
    if meta.get("mod_config"):
        what += f", Mixture-of-Depths {meta['mod_config']['blocks']} at rate {meta['mod_config']['rate']:g}"
    num_params = (config_record or {}).get("num_params")
    lines = [
        "---",
        "library_name: transformers",
        f"tags: [nag-chat, {arch}, custom_code]",
        "---",
        "",
        f"# {name}, step {meta['step']}: {what}",
        "",
        f"Exported from the nag-chat run `{name}` at step {meta['step']} ({fmt(meta.get('tokens', 0))} tokens) by:",
        "",
        "```bash",
        command,
        "```",
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "tok = AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)  # adds <|bos|> in front, as in training",
        "model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)",
        "out = model.generate(**tok(\"The capital of France is\", "
        "return_tensors=\"pt\"), max_new_tokens=16, do_sample=False)",
        "print(tok.decode(out[0], skip_special_tokens=True))",
        "```",
        "",
        "lm-evaluation-harness: `lm_eval --model hf --model_args "
        "pretrained=DIR,trust_remote_code=True,add_bos_token=True --tasks TASKS`.",
        "",
        "## Model",
        "",
        "| setting | value |",
        "|---|---|",
        f"| arch | {arch} |",
    ]
    lines += [f"| {k} | {fmt(v)} |" for k, v in mc.items()]
    if num_params:
        lines.append(f"| parameters | {fmt(num_params)} |")
    for key in ("nag_config", "mod_config", "recipe_config"):
        if meta.get(key):
            lines.append(f"| {key} | `{json.dumps(meta[key])}` |")
    if meta.get("nag_config"):
        lines.append(f"| α warm-up factor at this step | {alpha_warmup(meta):.6g} |")
    lines += ["", "## Training", ""]
    if config_record:
        for key in (
            "command",
            "git_commit",
            "num_iterations",
            "total_batch_size",
            "total_tokens",
            "device_type",
            "compute_dtype",
        ):
            if config_record.get(key) is not None:
                v = config_record[key]
                lines.append(
                    f"- {key.replace('_', ' ')}: " + (f"`{v}`" if key in ("command", "git_commit") else fmt(v))
                )
        args = config_record.get("args")
        if args:
            lines += [
                "",
                "<details><summary>every training argument</summary>",
                "",
                "```json",
                json.dumps(args, indent=1, sort_keys=True),
                "```",
                "",
                "</details>",
            ]
    else:
        lines.append("The run directory has no config.json.")
    lines += [
        "",
        "## Fingerprints",
        "",
        "What the numbers depend on besides the weights (nanochat/tokenizer.py, nanochat/dataset.py):",
        "",
    ]
    lines += [f"- {k}: `{v}`" for k, v in sorted(fingerprints.items())]
    lines += ["", "## Evaluation (scripts.base_eval, this step)", ""] + eval_lines(rec)
    lines += [
        "",
        "## Export",
        "",
        "- weights: model.safetensors, fp32, the native parameter names; "
        "MoD thresholds as `mod_thresholds` (fixed, evaluation rule)",
        "- tokenizer: tokenizer.json, a byte-level BPE built from the tiktoken ranks, with the same ids (checked on "
        "sample strings at export); `<|bos|>` is bos and eos (added in front of every text), `<|output_end|>` pads",
        "- code: configuration_nagchat.py, modeling_nagchat.py (trust_remote_code); generate() uses a KV cache",
        "- largest |logit difference| against the native model at export: "
        f"{fmt(max_diff) if max_diff is not None else 'not checked (--no-verify)'}",
        "",
    ]
    return "\n".join(lines)


# ----- the command -----


def prepare_out(out, force):
    """A new, empty staging folder beside `out`, where the export is written: it takes out's place only once every file
    is there, so a full disk or a Ctrl-C never leaves a half-made export."""
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise UserError(f"{out} is not empty; choose another --out, or add --force to replace the export's files there")
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"{out} is a file; choose another --out")
    try:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        return tempfile.mkdtemp(dir=os.path.dirname(out), prefix=f".tmp-{os.path.basename(out)}-")
    except OSError as e:
        raise UserError(f"cannot create {out} ({e.strerror or e})") from None


def edited_files(out, names):
    """Those of names that an earlier export wrote into out (its manifest lists them) and that changed since (their
    sha256 no longer the manifest's: a user's edit of README.md, say): --force moves them to replaced/, never over
    them."""
    m = read_manifest(out)
    if m is None or m["tool"] != TOOL:
        return []
    listed = [n for n in names if n in (m["files"] or []) and os.path.isfile(os.path.join(out, n))]
    return changed_files(out, listed, m.get("sha256"))


def write_export(out, staging, write):
    """write(staging), then its files moved into `out` (created; with --force, files of the same names replaced, but
    an earlier export's file changed since it was written first moves to replaced/<time>/ with a line saying so).
    Whatever stops the writing, the staging folder goes and `out` is as it was: one line for a disk error."""
    try:
        write(staging)
        os.makedirs(out, exist_ok=True)
        if edited := edited_files(out, sorted(os.listdir(staging)) + [CARD]):
            dest = set_aside(out, edited)
            print(
                f"note: {', '.join(edited)} in {out} changed since `python -m {TOOL}` wrote "
                f"{'it' if len(edited) == 1 else 'them'} (an edit is never overwritten); kept in {dest}/"
            )
        written = sorted(os.listdir(staging))
        for name in written:
            os.replace(os.path.join(staging, name), os.path.join(out, name))
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(e, OSError) or type(e).__name__ == "SafetensorError":  # safetensors' own type for its I/O errors
            detail = getattr(e, "strerror", None) or " ".join(str(e).split())[:200]
            raise UserError(
                f"cannot write the export to {out} ({detail}): nothing "
                "of it was kept; free space and run the command again"
            ) from None
        raise
    os.rmdir(staging)
    return written


def write_card(out, card, written, inputs):
    """The model card, then the manifest (inputs.json: the checkpoint, every file written with its sha256, so that a
    later --force knows an edit from its own output). A disk error is one line: the verified export is in place."""
    try:
        atomic_write_bytes(os.path.join(out, CARD), card.encode())
        files = sorted(set(written) | {CARD})
        atomic_write_json(
            os.path.join(out, MANIFEST),
            {
                "tool": TOOL,
                "inputs": inputs,
                "files": files,
                "sha256": {n: file_sha256(os.path.join(out, n)) for n in files},
            },
        )
    except OSError as e:
        raise UserError(
            f"cannot write {os.path.join(out, CARD)} ({e.strerror or e}): the verified weights, code and tokenizer are "
            f"in {out}, the model card is not; free space and run the command again with --force"
        ) from None


def export(args, command):
    require_hf()
    run_dir = resolve_run_dir(args.run)
    model, meta = load_model(run_dir, None if args.step < 0 else args.step, "cpu")
    if meta["arch"] not in ARCHS:
        raise UserError(f"arch {meta['arch']!r} has no exported modeling code (exported: {', '.join(ARCHS)})")
    tokenizer = get_tokenizer()
    ckpt.check_vocab(meta, tokenizer)
    if "tokens" in meta:  # NAG's α warm-up at the checkpoint, as base_eval and scripts.sample use it
        model.set_tokens_seen(meta["tokens"])
    out = os.path.abspath(args.out)
    staging = prepare_out(out, args.force)

    def write(folder):
        write_model(folder, model, meta, tokenizer.get_bos_token_id(), tokenizer.encode_special(PAD))
        write_tokenizer(folder, tokenizer, model.config.sequence_len)

    written = write_export(out, staging, write)
    max_diff = None if args.no_verify else verify(out, model, tokenizer)
    if max_diff is not None and not max_diff <= VERIFY_LIMIT:
        raise UserError(
            f"the export's logits differ from the native model's by up to {max_diff:.3g} (limit {VERIFY_LIMIT:g}); "
            f"{out} is not a faithful copy"
        )
    config = read_record(os.path.join(run_dir, CONFIG))  # None (no config.json, or unreadable): the card says so
    card = model_card(run_dir, meta, config, eval_record(run_dir, meta["step"]), command, max_diff)
    write_card(out, card, written, {"run": os.path.realpath(run_dir), "step": meta["step"]})
    check = (
        f"largest |logit difference| against the native model {max_diff:.3g}"
        if max_diff is not None
        else "not verified"
    )
    print(f"exported {run_dir} step {meta['step']} ({meta['arch']}) to {out}: {check}")
    return out, max_diff


def main(argv=None):
    args = parse_checked(build_parser(), script_argv(argv))
    command = "python -m scripts.export_hf " + shlex.join(script_argv(argv))
    with exit_on_user_error(
        interrupted="interrupted: an export cut short while writing leaves nothing; "
        "one cut short while verifying is in place but unchecked: run the command again with --force"
    ):
        return export(args, command)


if __name__ == "__main__":
    main()
