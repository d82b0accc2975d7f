"""
CORE evaluation, keeping the DCLM protocol (arXiv:2406.11794) as nanochat runs it.

Three kinds of in-context task, each item scored with BOS + k few-shot examples + the item:
- multiple_choice: one context, several continuations; pick the lowest mean loss over the continuation.
- schema: several contexts, one continuation; pick the lowest mean loss over that continuation.
- language_modeling: correct iff greedy decoding reproduces every continuation token.
CORE = mean over the 22 tasks of the centred accuracy (acc - b) / (1 - b), b the random baseline.

Two ways to score, with the same verdicts example for example:
- one at a time (evaluate_example, the reference): one forward per example over its own
  sequences, right-padded to the longest of them (this is what upstream nanochat does);
- batched (the default): rows of many examples sorted by length, right-padded, one forward per
  group. With this repo's models each example whose sequences share a long prefix (few-shot
  blocks, the question) becomes one packed row that holds the prefix once, and logits are computed
  only where tokens are scored; other models get a row per sequence. Floating point results depend
  a little on batch shape and packing, so an example whose verdict is close to a tie (decisive gap
  below `margin`) is re-scored exactly as the reference does it. "Identical" therefore means:
  same (correct, pred) for every example, as long as the batch-shape noise stays below margin/2
  (fp32 on CPU: ~1e-6 against a default margin of 1e-4).
"""

import io
import os
import sys
import csv
import json
import math
import hashlib
import time
import fcntl
import random
import shutil
import zipfile
import tempfile
import urllib.error
import urllib.request

import yaml
import torch
import pyarrow as pa
import pyarrow.parquet as pq
import torch.distributed as dist

from nanochat.common import UserError, get_base_dir, fmt_time
from nanochat.gpt import GPT

EVAL_BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
NUM_CORE_TASKS = 22
TASK_FIELDS = {
    "multiple_choice": ("query", "choices", "gold"),
    "schema": ("context_options", "continuation", "gold"),
    "language_modeling": ("context", "continuation"),
}

# -----------------------------------------------------------------------------
# The eval bundle: core.yaml, eval_meta_data.csv, eval_data/<category>/<task>.jsonl


def ensure_eval_bundle(bundle_dir=None, url=None):
    """Path of a usable eval bundle: bundle_dir if given, else <base_dir>/eval_bundle (downloaded once)."""
    if bundle_dir is not None:
        if not os.path.isfile(os.path.join(bundle_dir, "core.yaml")):
            raise UserError(f"eval bundle {bundle_dir} has no core.yaml")
        return os.path.abspath(bundle_dir)
    base = get_base_dir()
    target = os.path.join(base, "eval_bundle")
    if not os.path.isfile(os.path.join(target, "core.yaml")):
        # one process downloads; the others wait on the lock, then find the bundle in place
        with open(os.path.join(base, "eval_bundle.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if not os.path.isfile(os.path.join(target, "core.yaml")):
                    _install_bundle(url or EVAL_BUNDLE_URL, base, target)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    return target


def _install_bundle(url, base, target):
    if os.path.exists(target):
        raise UserError(f"{target} exists but has no core.yaml; remove it and retry")
    zip_path = os.path.join(base, "eval_bundle.zip")
    if not os.path.exists(zip_path):  # only a complete download is ever renamed to this name
        fd, tmp = tempfile.mkstemp(dir=base, prefix=".eval_bundle-", suffix=".zip.tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                _download(url, out)
            os.replace(tmp, zip_path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    unzip_dir = tempfile.mkdtemp(dir=base, prefix=".eval_bundle-unzip-")
    try:
        try:
            with zipfile.ZipFile(zip_path) as z:
                z.extractall(unzip_dir)
        except zipfile.BadZipFile:
            os.remove(zip_path)  # corrupt: fetch again next time
            raise UserError(f"{url} did not give a valid zip file") from None
        # the archive holds an eval_bundle/ folder; accept the files at its top level too
        src = os.path.join(unzip_dir, "eval_bundle")
        src = src if os.path.isdir(src) else unzip_dir
        if not os.path.isfile(os.path.join(src, "core.yaml")):
            raise UserError(f"the archive from {url} has no core.yaml")
        os.rename(src, target)
    finally:
        shutil.rmtree(unzip_dir, ignore_errors=True)
    os.remove(zip_path)


def _download(url, out):
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            total = int(r.headers.get("Content-Length") or 0)
            done, shown = 0, 0.0
            while chunk := r.read(1 << 20):
                out.write(chunk)
                done += len(chunk)
                if time.time() - shown > 0.5 or done == total:
                    shown = time.time()
                    size = (
                        f"{done / 2**20:.1f}/{total / 2**20:.1f} MB ({100 * done / total:.0f}%)"
                        if total
                        else f"{done / 2**20:.1f} MB"
                    )
                    print(f"\rdownloading eval bundle: {size}", end="", file=sys.stderr, flush=True)
            print(file=sys.stderr, flush=True)
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = " ".join(str(getattr(e, "reason", e)).split())
        raise UserError(
            f"cannot download the CORE eval bundle from {url} ({reason}); pass --eval-bundle DIR with a local copy"
        ) from None


def load_core_tasks(bundle_dir):
    """The task list of core.yaml, each with its random baseline (percent) from eval_meta_data.csv."""
    yaml_path = os.path.join(bundle_dir, "core.yaml")
    meta_path = os.path.join(bundle_dir, "eval_meta_data.csv")
    for path in (yaml_path, meta_path):
        if not os.path.isfile(path):
            raise UserError(f"eval bundle file missing: {path}")
    with open(yaml_path, encoding="utf-8") as f:
        try:
            doc = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise UserError(f"{yaml_path} is not valid YAML ({' '.join(str(e).split())})") from None
    raw_tasks = doc.get("icl_tasks") or [] if isinstance(doc, dict) else None
    if not isinstance(raw_tasks, list) or not all(isinstance(t, dict) for t in raw_tasks):
        raise UserError(f"{yaml_path}: expected a list of tasks under `icl_tasks:`")
    with open(meta_path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    try:
        baselines = {row["Eval Task"].strip(): float(row["Random baseline"]) for row in rows}
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{meta_path}: expected numeric 'Random baseline' values in an 'Eval Task' table") from None
    tasks = []
    for t in raw_tasks:
        label = t.get("label")
        missing = [k for k in ("label", "dataset_uri", "num_fewshot", "icl_task_type") if k not in t]
        if missing:
            raise UserError(f"{yaml_path}: task {label or len(tasks)} lacks {', '.join(missing)}")
        if t["icl_task_type"] not in TASK_FIELDS:
            raise UserError(
                f"{yaml_path}: task {label} has unknown task type "
                f"{t['icl_task_type']!r} (known: {', '.join(TASK_FIELDS)})"
            )
        if label not in baselines:
            raise UserError(f"{meta_path} has no random baseline for task {label}")
        shots = t["num_fewshot"]
        # DCLM lists the shot counts; CORE uses the first
        shots = shots[0] if isinstance(shots, list) and shots else shots
        if not isinstance(shots, int) or shots < 0:
            raise UserError(f"{yaml_path}: task {label} has an invalid num_fewshot {t['num_fewshot']!r}")
        tasks.append(
            {
                "label": label,
                "dataset_uri": t["dataset_uri"],
                "task_type": t["icl_task_type"],
                "num_fewshot": shots,
                "continuation_delimiter": t.get("continuation_delimiter", " "),
                "random_baseline": baselines[label],
            }
        )
    return tasks


def task_path(bundle_dir, task):
    """The data file of one task of core.yaml (a task whose file the bundle lacks is skipped and listed missing)."""
    return os.path.join(bundle_dir, "eval_data", task["dataset_uri"])


def scorable_tasks(bundle_dir):
    """The labels of core.yaml's tasks whose data file the bundle holds: every task a finished evaluate_core scores."""
    return [t["label"] for t in load_core_tasks(bundle_dir) if os.path.isfile(task_path(bundle_dir, t))]


def _item_problem(item, task_type):
    if not isinstance(item, dict):
        return "expected a JSON object"
    missing = [k for k in TASK_FIELDS[task_type] if k not in item]
    if missing:
        return f"missing field {', '.join(missing)} for a {task_type} item"
    options = item.get("choices", item.get("context_options"))
    if options is not None and (
        not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options)
    ):
        return "choices/context_options must be a non-empty list of strings"
    if "gold" in TASK_FIELDS[task_type]:
        gold = item["gold"]
        if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(options):
            return f"gold must be an index into the {len(options)} options, got {gold!r}"
    texts = [item[k] for k in ("query", "context", "continuation") if k in TASK_FIELDS[task_type]]
    if not all(isinstance(t, str) for t in texts):
        return "query/context/continuation must be strings"
    return None


def load_task_data(path, task_type):
    """Items of one task's jsonl file; a bad line is a UserError naming the file and the line."""
    if task_type not in TASK_FIELDS:
        raise UserError(f"unknown task type {task_type!r} (known: {', '.join(TASK_FIELDS)})")
    items = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                item = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                reason = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8"
                raise UserError(f"{path} line {lineno}: malformed JSON ({reason})") from None
            problem = _item_problem(item, task_type)
            if problem:
                raise UserError(f"{path} line {lineno}: {problem}")
            items.append(item)
    return items


# -----------------------------------------------------------------------------
# Prompts: few-shot blocks end with a blank line; the item follows; BOS is prepended at tokenization


def fewshot_indices(idx, n, num_fewshot):
    """random.Random(1234 + idx).sample of the other n - 1 items (same draw as sampling the list itself)."""
    if num_fewshot <= 0:
        return []
    if num_fewshot > n - 1:
        raise UserError(f"{num_fewshot}-shot needs at least {num_fewshot + 1} items, the task has {n}")
    # sample() picks positions from the length alone, so sampling range(n - 1) and skipping idx
    # gives the same items as sampling [i for i in range(n) if i != idx], without building that list
    return [j + (j >= idx) for j in random.Random(1234 + idx).sample(range(n - 1), num_fewshot)]


def render_prompts_mc(item, delimiter, fewshot=()):
    shots = "".join(f"{ex['query']}{delimiter}{ex['choices'][ex['gold']]}\n\n" for ex in fewshot)
    return [f"{shots}{item['query']}{delimiter}{choice}" for choice in item["choices"]]


def render_prompts_schema(item, delimiter, fewshot=()):
    shots = "".join(f"{ex['context_options'][ex['gold']]}{delimiter}{ex['continuation']}\n\n" for ex in fewshot)
    return [f"{shots}{context}{delimiter}{item['continuation']}" for context in item["context_options"]]


def render_prompts_lm(item, delimiter, fewshot=()):
    """[prompt without the continuation, prompt with it]. Contexts are stripped (some carry trailing
    whitespace), and so is the whole prompt without, so that its tokens are a clean prefix of the other's."""
    shots = "".join(f"{ex['context'].strip()}{delimiter}{ex['continuation']}\n\n" for ex in fewshot)
    prompt = f"{shots}{item['context'].strip()}{delimiter}"
    return [prompt.strip(), prompt + item["continuation"]]


RENDER = {"multiple_choice": render_prompts_mc, "schema": render_prompts_schema, "language_modeling": render_prompts_lm}

# -----------------------------------------------------------------------------
# Token sequences and the span of each that is scored


def common_length(seqs, direction):
    """Length of the prefix ('left') or suffix ('right') shared by all sequences."""
    if direction == "right":
        seqs = [s[::-1] for s in seqs]
    return len(os.path.commonprefix(seqs))  # works on any sequences, lists of ids included


def crop_to_context(seq, start, end, max_len):
    """Keep the last max_len tokens and shift the span [start, end). A span too long for the window
    (rare: only with tiny contexts) keeps its head: the window then starts one token before it."""
    if max_len is None or len(seq) <= max_len:
        return seq, start, end
    cut = len(seq) - max_len
    if start - cut < 1:  # position start - 1 predicts the first scored token, so it must stay
        cut = start - 1
        return seq[cut : cut + max_len], 1, min(end - cut, max_len)
    return seq[cut:], start - cut, end - cut


def model_context_len(model):
    """Longest input the model takes: model.config.sequence_len (or model.max_seq_len), else unlimited."""
    model = getattr(model, "module", model)  # DDP wrapper
    n = getattr(getattr(model, "config", None), "sequence_len", None) or getattr(model, "max_seq_len", None)
    return int(n) if n else None


def prepare_examples(indices, data, tokenizer, task_meta, max_len=None):
    """For each idx: its token sequences (BOS first, cropped to max_len) and the scored span of each."""
    task_type = task_meta["task_type"]
    if task_type not in RENDER:
        raise UserError(f"unknown task type {task_type!r} (known: {', '.join(RENDER)})")
    delimiter = task_meta.get("continuation_delimiter", " ")
    prompts, counts = [], []
    for idx in indices:
        shots = [data[j] for j in fewshot_indices(idx, len(data), task_meta["num_fewshot"])]
        p = RENDER[task_type](data[idx], delimiter, shots)
        prompts += p
        counts.append(len(p))
    tokens = tokenizer(prompts, prepend=tokenizer.get_bos_token_id()) if prompts else []  # one call: batched encode
    examples, at = [], 0
    for idx, k in zip(indices, counts):
        seqs, at = [list(t) for t in tokens[at : at + k]], at + k
        if task_type == "multiple_choice":  # shared context: score where the choices start to differ
            start = common_length(seqs, "left")
            spans = [(start, len(s)) for s in seqs]
        elif task_type == "schema":  # shared continuation: score the common suffix
            n = common_length(seqs, "right")
            spans = [(len(s) - n, len(s)) for s in seqs]
        else:
            without, seqs = seqs[0], seqs[1:]
            if not (len(without) < len(seqs[0]) and seqs[0][: len(without)] == without):
                raise UserError(f"item {idx}: the context's tokens are not a prefix of context + continuation")
            spans = [(len(without), len(seqs[0]))]
        spans = [(max(s, 1), e) for s, e in spans]  # BOS is never scored
        cropped = [crop_to_context(seq, s, e, max_len) for seq, (s, e) in zip(seqs, spans)]
        examples.append(
            {
                "idx": idx,
                "gold": data[idx].get("gold"),
                "seqs": [c[0] for c in cropped],
                "spans": [(c[1], c[2]) for c in cropped],
            }
        )
    return examples


# -----------------------------------------------------------------------------
# Scoring


def token_scores(z, target):
    """Per scored token, from its logits z (N, V) and the target ids (N,): the loss, the gap between the
    target's logit and the best other logit (> 0: greedy picks the target), and whether argmax == target.
    The reductions stay in fp32 (a float64 copy of z costs more than the forward on small models); only
    the final differences are taken in float64."""
    z = z.float()
    z_target = z.gather(1, target[:, None])[:, 0]
    loss = torch.logsumexp(z, dim=-1).double() - z_target.double()
    top = z.topk(2, dim=-1)
    best_other = torch.where(top.indices[:, 0] == target, top.values[:, 1], top.values[:, 0])
    match = z.argmax(dim=-1) == target  # argmax, as upstream: its tie-break is the first index
    return loss.tolist(), (z_target.double() - best_other.double()).tolist(), match.tolist()


def split_by_span(scores, spans):
    loss, gap, match = scores
    out, at = [], 0
    for s, e in spans:
        out.append((loss[at : at + e - s], gap[at : at + e - s], match[at : at + e - s]))
        at += e - s
    return out


@torch.no_grad()
def forward_scores(model, seqs, spans, pad_id, device):
    """The reference computation: one forward over right-padded seqs (a causal model: padding cannot
    reach earlier positions), full logits; token_scores over each sequence's span."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    rows, cols = [], []
    for i, (seq, (s, e)) in enumerate(zip(seqs, spans)):
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        rows += [i] * (e - s)
        cols += range(s - 1, e - 1)  # logits at t predict token t + 1
    ids = ids.to(device)
    rows = torch.tensor(rows, dtype=torch.long, device=ids.device)
    cols = torch.tensor(cols, dtype=torch.long, device=ids.device)
    return split_by_span(token_scores(model(ids)[rows, cols], ids[rows, cols + 1]), spans)


def packed_row(seqs, spans):
    """One row for sequences that share their first n tokens: those once, then the rest of each sequence.
    Returns the row's tokens, positions, branch ids (0: the shared prefix, j + 1: the rest of sequence j;
    a token sees the prefix and its own branch) and, per sequence, the row columns whose logits predict
    its scored tokens with those tokens. A single sequence packs to itself."""
    n = common_length(seqs, "left")
    tokens, positions, branch, needs = list(seqs[0][:n]), list(range(n)), [0] * n, []
    for j, (seq, (s, e)) in enumerate(zip(seqs, spans)):
        shift = len(tokens) - n  # where position p >= n of this sequence lands in the row
        tokens += seq[n:]
        positions += range(n, len(seq))
        branch += [j + 1] * (len(seq) - n)
        needs.append(([p if p < n else p + shift for p in range(s - 1, e - 1)], seq[s:e]))
    return tokens, positions, branch, needs


def worth_packing(seqs):
    """Pack when the shared prefix removes at least a third of the tokens: a packed row needs a full
    attention mask, which costs more per token pair than plain causal attention."""
    return len(seqs) > 1 and common_length(seqs, "left") * (len(seqs) - 1) * 3 >= sum(len(s) for s in seqs)


def takes_packed_rows(model):
    """A GPT (or a subclass) takes packed rows and logits_at; any other ids -> logits callable gets plain rows."""
    inner = getattr(model, "module", model)  # DDP
    return isinstance(getattr(inner, "_orig_mod", inner), GPT)  # torch.compile


@torch.no_grad()
def packed_scores(model, rows, pad_id, device, packed):
    """One forward over right-padded rows (packed, or all plain: one sequence each); token_scores for every
    sequence of every row. A model that takes packed rows computes logits at the scored columns only."""
    T = max(len(r[0]) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    positions = torch.zeros((len(rows), T), dtype=torch.long)
    branch = torch.full((len(rows), T), -1, dtype=torch.long)  # padding: a branch of its own
    at_rows, at_cols, targets = [], [], []
    for i, (tokens, pos, br, needs) in enumerate(rows):
        ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        positions[i, : len(pos)] = torch.tensor(pos, dtype=torch.long)
        branch[i, : len(br)] = torch.tensor(br, dtype=torch.long)
        for cols, tgt in needs:
            at_rows += [i] * len(cols)
            at_cols += cols
            targets += tgt
    ids, positions, branch = ids.to(device), positions.to(device), branch.to(device)
    at = (
        torch.tensor(at_rows, dtype=torch.long, device=device),
        torch.tensor(at_cols, dtype=torch.long, device=device),
    )
    if packed and branch.max() > 0:
        q, k = branch[:, :, None], branch[:, None, :]
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        allowed = causal & ((q == k) | ((k == 0) & (q > 0)))
        z = model(ids, positions=positions, allowed=allowed, logits_at=at)
    elif packed:  # plain causal rows: no mask needed
        z = model(ids, logits_at=at)
    else:
        z = model(ids)[at]
    scores = token_scores(z, torch.tensor(targets, dtype=torch.long, device=z.device))
    out, start = [], 0
    for _, _, _, needs in rows:
        n = sum(len(c) for c, _ in needs)
        out.append(split_by_span(tuple(x[start : start + n] for x in scores), [(0, len(c)) for c, _ in needs]))
        start += n
    return out


def decide(task_type, gold, scores, margin):
    """(correct, pred, robust, decisive) from the per-sequence scores of one example. robust: the verdict
    cannot change under logit noise below margin/2 (pred is None for language modelling). decisive: how
    far the verdict is from flipping, > 0 when correct: for choices, the mean loss of the best wrong one
    minus the gold one's; for language modelling, the smallest logit gap of the target over the best other
    token (the greedy match holds iff every gap is > 0)."""
    if task_type == "language_modeling":
        _, gaps, match = scores[0]
        correct = all(match)
        robust = any(g <= -margin for g in gaps) or all(g >= margin for g in gaps)
        return correct, None, robust, min(gaps) if gaps else math.nan
    # fsum: an exactly rounded sum, the same whatever order the losses came in
    means = [math.fsum(losses) / len(losses) if losses else math.nan for losses, _, _ in scores]
    pred = means.index(min(means))  # first of equal minima, as upstream
    ordered = sorted(means)
    robust = all(math.isfinite(m) for m in means) and (len(means) < 2 or ordered[1] - ordered[0] >= margin)
    wrong = [m for j, m in enumerate(means) if j != gold]
    decisive = min(wrong) - means[gold] if wrong else math.inf
    return pred == gold, pred, robust, decisive


def default_max_tokens(device):
    # CPU: compute-bound already at a few hundred tokens, and slower per token once activations
    # outgrow the caches; accelerators need big batches to be busy
    return 1024 if torch.device(device).type == "cpu" else 16384


def default_margin(model, device):
    # fp32 on CPU: batch-shape noise is ~1e-6; bf16/fp16 matmuls or GPU kernels: far larger
    dtype = getattr(getattr(model, "module", model), "compute_dtype", torch.float32)
    fp32_cpu = torch.device(device).type == "cpu" and dtype in (torch.float32, torch.float64)
    return 1e-4 if fp32_cpu else 0.1


def _score_alone(model, ex, task_type, pad_id, device):
    # the reference computation: this example's own sequences in one forward
    return decide(task_type, ex["gold"], forward_scores(model, ex["seqs"], ex["spans"], pad_id, device), 0.0)


def evaluate_example(idx, model, tokenizer, data, device, task_meta):
    """The one-at-a-time reference path: {"idx", "correct", "pred", "margin", "rescored": False} for data[idx]."""
    ex = prepare_examples([idx], data, tokenizer, task_meta, model_context_len(model))[0]
    correct, pred, _, decisive = _score_alone(model, ex, task_meta["task_type"], tokenizer.get_bos_token_id(), device)
    return {"idx": idx, "correct": correct, "pred": pred, "margin": decisive, "rescored": False}


def score_examples(
    model, tokenizer, data, device, task_meta, indices=None, batched=True, batch_size=32, max_tokens=None, margin=None
):
    """Verdicts {"idx", "correct", "pred", "margin", "rescored"} for data[indices] (default: all); margin:
    how far the verdict is from flipping (see decide).
    Batched: each example packed into one row (its shared prefix once: see packed_row), rows sorted by
    length and grouped into forwards of at most batch_size rows and about max_tokens padded tokens
    (default by device); near-tie examples are re-scored by the reference path."""
    indices = list(range(len(data)) if indices is None else indices)
    if not batched:
        return [evaluate_example(i, model, tokenizer, data, device, task_meta) for i in indices]
    task_type = task_meta["task_type"]
    pad_id = tokenizer.get_bos_token_id()
    margin = default_margin(model, device) if margin is None else margin
    max_tokens = default_max_tokens(device) if max_tokens is None else max_tokens
    packed = takes_packed_rows(model)
    examples = prepare_examples(indices, data, tokenizer, task_meta, model_context_len(model))
    # rows: (example k, its sequences js, the row): one packed row per example where that pays, else a row per sequence
    rows = []
    for k, ex in enumerate(examples):
        groups = (
            [range(len(ex["seqs"]))] if packed and worth_packing(ex["seqs"]) else [[j] for j in range(len(ex["seqs"]))]
        )
        rows += [(k, js, packed_row([ex["seqs"][j] for j in js], [ex["spans"][j] for j in js])) for js in groups]
    # rows holding several sequences need a mask, so they go to forwards of their own; longest first,
    # so that running out of memory shows at once
    rows.sort(key=lambda r: (len(r[1]) > 1, -len(r[2][0])))
    scores = [[None] * len(ex["seqs"]) for ex in examples]
    at = 0
    while at < len(rows):
        group = rows[at : at + max(1, min(batch_size, max_tokens // len(rows[at][2][0])))]
        group = [r for r in group if (len(r[1]) > 1) == (len(group[0][1]) > 1)]
        at += len(group)
        for (k, js, _), row_scores in zip(group, packed_scores(model, [r[2] for r in group], pad_id, device, packed)):
            for j, s in zip(js, row_scores):
                scores[k][j] = s
    verdicts = []
    for ex, sc in zip(examples, scores):
        correct, pred, robust, decisive = decide(task_type, ex["gold"], sc, margin)
        if not robust:
            correct, pred, _, decisive = _score_alone(model, ex, task_type, pad_id, device)
        verdicts.append(
            {"idx": ex["idx"], "correct": correct, "pred": pred, "margin": decisive, "rescored": not robust}
        )
    return verdicts


def task_verdicts(model, tokenizer, data, device, task_meta, batched=True, batch_size=32, max_tokens=None, margin=None):
    """The verdict of every example of data, in index order. Under torchrun each rank scores every
    world_size-th example and all ranks get every verdict."""
    if not data:
        raise UserError("no examples to evaluate")
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    verdicts = score_examples(
        model,
        tokenizer,
        data,
        device,
        task_meta,
        range(rank, len(data), world),
        batched=batched,
        batch_size=batch_size,
        max_tokens=max_tokens,
        margin=margin,
    )
    if world > 1:
        shards = [None] * world
        dist.all_gather_object(shards, verdicts)
        verdicts = sorted((v for shard in shards for v in shard), key=lambda v: v["idx"])
    return verdicts


def evaluate_task(model, tokenizer, data, device, task_meta, batched=True, batch_size=32, max_tokens=None, margin=None):
    """Accuracy on data (see task_verdicts)."""
    verdicts = task_verdicts(
        model,
        tokenizer,
        data,
        device,
        task_meta,
        batched=batched,
        batch_size=batch_size,
        max_tokens=max_tokens,
        margin=margin,
    )
    return sum(v["correct"] for v in verdicts) / len(data)


# -----------------------------------------------------------------------------
# The CORE metric


def centered_accuracy(accuracy, random_baseline_percent):
    b = random_baseline_percent / 100
    return (accuracy - b) / (1 - b)


RECORD_COLUMNS = ("task", "idx", "correct", "margin", "item")


def save_records(path, records, settings, write_bytes):
    """Per-example records as parquet, the eval settings (and anything else in settings) as JSON in the
    file's metadata. write_bytes(path, data) does the writing (atomic in base_eval)."""
    table = pa.table(
        {
            "task": pa.array([r["task"] for r in records], pa.string()),
            "idx": pa.array([r["idx"] for r in records], pa.int32()),
            "correct": pa.array([r["correct"] for r in records], pa.bool_()),
            "margin": pa.array([r["margin"] for r in records], pa.float64()),
            "item": pa.array([r["item"] for r in records], pa.string()),
        }
    ).replace_schema_metadata({"nanochat_core": json.dumps(settings, sort_keys=True)})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    write_bytes(path, buf.getvalue())


def load_records(path):
    """(columns {name: list}, settings) of a records file; a missing or unreadable one is a UserError."""
    if not os.path.isfile(path):
        raise UserError(f"{path} is missing")
    try:
        table = pq.read_table(path)
        settings = json.loads((table.schema.metadata or {})[b"nanochat_core"])
        columns = {name: table.column(name).to_pylist() for name in RECORD_COLUMNS}
    except Exception as e:  # pyarrow raises several types for a damaged file; any of them means the same here
        reason = " ".join(str(e).split())[:120]
        raise UserError(
            f"{path} is not a readable CORE records file ({type(e).__name__}: {reason}); rerun scripts.base_eval"
        ) from None
    return columns, settings


def item_key(item):
    """A short content hash of one item: two runs compare only on the very same items."""
    return hashlib.sha1(json.dumps(item, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


def core_summary(results, missing, settings, records, unfinished=()):
    """The CORE dict of the tasks scored so far (evaluate_core's return value). missing: tasks whose file the
    bundle lacks; unfinished: tasks of the bundle not scored yet (all of them scored: empty)."""
    n = len(results)
    partial = sum(r["centered"] for r in results.values()) / n if n else None
    complete = n == NUM_CORE_TASKS and not missing
    return {
        "tasks": dict(results),
        "missing_tasks": list(missing),
        "unfinished_tasks": list(unfinished),
        "num_tasks_scored": n,
        "core_metric": partial if complete else None,
        "partial_core": partial,
        "partial_label": f"partial CORE ({n}/{NUM_CORE_TASKS})",
        "max_per_task": settings["max_per_task"],
        "settings": {**settings, "tasks": dict(settings["tasks"])},  # copies: later tasks leave a given summary alone
        "records": list(records),
    }


def records_by_task(columns):
    """Record dicts of a records file's columns (load_records), grouped by task."""
    out = {}
    for row in zip(*(columns[k] for k in RECORD_COLUMNS)):
        rec = dict(zip(RECORD_COLUMNS, row))
        out.setdefault(rec["task"], []).append(rec)
    return out


def reusable(done, label, task_settings, data):
    """The records of `label` from an earlier unfinished run when they were scored with these very settings on these
    very items (index and content hash, after the shuffle and the cut), else None."""
    if done is None or label not in done["tasks"] or done["settings"].get("tasks", {}).get(label) != task_settings:
        return None
    recs = sorted(done["records"].get(label, []), key=lambda r: r["idx"])
    if [(r["idx"], r["item"]) for r in recs] != [(i, item_key(x)) for i, x in enumerate(data)]:
        return None
    return recs


def evaluate_core(
    model,
    tokenizer,
    device,
    bundle_dir,
    max_per_task=-1,
    batch_size=32,
    log=print,
    batched=True,
    max_tokens=None,
    margin=None,
    on_task=None,
    done=None,
):
    """Every task of core.yaml; missing task files are skipped and listed. Fewer than 22 tasks scored
    gives core_metric None and a partial CORE under its own label.
    Besides the scores, the result holds `records` (one per scored example: task, idx after the shuffle,
    correct, margin, item hash) and `settings` (what decides which items are scored and how), so two runs
    can be compared item by item. on_task(summary) is called after each task, for partial saves; its
    `unfinished_tasks` are the tasks a stop at that point would leave unscored.
    done: an earlier, unfinished run ({"tasks": {label: result}, "records": {label: [record]}, "settings"}):
    a task it scored with the same settings on the same items is taken from it instead of scored again.
    A task with too few items for its few-shot count (small --max-per-task) gets fewer shots, noted once."""
    bundle_dir = ensure_eval_bundle(bundle_dir)
    tasks = load_core_tasks(bundle_dir)
    path_of = {t["label"]: task_path(bundle_dir, t) for t in tasks}
    missing = [t["label"] for t in tasks if not os.path.isfile(path_of[t["label"]])]
    unfinished = [t["label"] for t in tasks if t["label"] not in missing]
    results, records, fewer, kept = {}, [], [], []
    settings = {"max_per_task": max_per_task, "tasks": {}}
    started, scored = time.time(), 0  # the ETA: seconds per task scored so far, times the tasks left
    for task in tasks:
        label = task["label"]
        path = path_of[label]
        if label in missing:
            log(f"{label:<34} missing ({task['dataset_uri']}), skipped")
            continue
        t0 = time.time()
        data = load_task_data(path, task["task_type"])
        random.Random(1337).shuffle(data)  # before truncation, so --max-per-task takes a fixed random subset
        if max_per_task > 0:
            data = data[:max_per_task]
        if not data:
            raise UserError(f"{label}: {path} has no items")
        shots = min(task["num_fewshot"], len(data) - 1)  # the few-shot examples are drawn from the other items
        if shots < task["num_fewshot"]:
            fewer.append(f"{label} {task['num_fewshot']}->{shots}")
        task_meta = {
            "task_type": task["task_type"],
            "num_fewshot": shots,
            "continuation_delimiter": task["continuation_delimiter"],
        }
        task_settings = {
            "task_type": task["task_type"],
            "num_fewshot": shots,
            "num_examples": len(data),
            "continuation_delimiter": task["continuation_delimiter"],
            "random_baseline": task["random_baseline"],
        }
        earlier = reusable(done, label, task_settings, data)
        if earlier is not None:
            results[label], task_records = done["tasks"][label], earlier
            kept.append(label)
        else:
            verdicts = task_verdicts(
                model,
                tokenizer,
                data,
                device,
                task_meta,
                batched=batched,
                batch_size=batch_size,
                max_tokens=max_tokens,
                margin=margin,
            )
            accuracy = sum(v["correct"] for v in verdicts) / len(data)
            results[label] = {
                "accuracy": accuracy,
                "centered": centered_accuracy(accuracy, task["random_baseline"]),
                "num_examples": len(data),
                "num_fewshot": shots,
                "seconds": time.time() - t0,
            }
            task_records = [
                {
                    "task": label,
                    "idx": v["idx"],
                    "correct": bool(v["correct"]),
                    "margin": float(v["margin"]),
                    "item": item_key(data[v["idx"]]),
                }
                for v in verdicts
            ]
        settings["tasks"][label] = task_settings
        records += task_records
        unfinished.remove(label)
        r = results[label]
        scored += earlier is None
        eta = f", eta {fmt_time((time.time() - started) / scored * len(unfinished))}" if scored and unfinished else ""
        log(
            f"{label:<34} {shots:>2}-shot {task['task_type']:<17} n={len(data):<6} "
            f"accuracy {r['accuracy']:.4f}  centered {r['centered']:+.4f}  "
            + ("kept from the interrupted run" if earlier is not None else f"{r['seconds']:6.1f}s")
            + f"  [{len(results)}/{len(results) + len(unfinished)}{eta}]"
        )
        if on_task is not None:
            on_task(core_summary(results, missing, settings, records, unfinished))
    if kept:
        log(f"resumed: {len(kept)} task(s) kept from the interrupted run with the same settings ({', '.join(kept)})")
    if fewer:
        log(
            f"note: fewer few-shot examples than the protocol's, as the tasks hold too few items "
            f"(max_per_task {max_per_task}): {', '.join(fewer)}"
        )
    out = core_summary(results, missing, settings, records)
    if out["core_metric"] is not None:
        log(f"CORE metric: {out['core_metric']:.4f}")
    elif out["partial_core"] is not None:
        log(f"{out['partial_label']}: {out['partial_core']:.4f} (not CORE; missing: {', '.join(missing) or 'none'})")
    return out
