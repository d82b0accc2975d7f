"""The CORE evaluation (nanochat/core_eval.py): prompts, spans, scoring paths, the bundle, the metric."""

import io
import json
import math
import os
import random
import re
import zipfile
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import PROCESSES
from nanochat import core_eval
from nanochat.common import UserError
from nanochat.core_eval import (
    crop_to_context,
    evaluate_core,
    evaluate_example,
    evaluate_task,
    ensure_eval_bundle,
    fewshot_indices,
    load_core_tasks,
    load_task_data,
    prepare_examples,
    render_prompts_lm,
    render_prompts_mc,
    render_prompts_schema,
    score_examples,
)

MC = {"task_type": "multiple_choice", "num_fewshot": 0, "continuation_delimiter": " "}
SCHEMA = {"task_type": "schema", "num_fewshot": 0, "continuation_delimiter": " "}
LM = {"task_type": "language_modeling", "num_fewshot": 0, "continuation_delimiter": " "}


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, BOS = 256."""

    def get_bos_token_id(self):
        return 256

    def __call__(self, texts, prepend=None):
        first = [] if prepend is None else [prepend]
        if isinstance(texts, str):
            return first + list(texts.encode())
        return [first + list(t.encode()) for t in texts]


class TinyCausalLM(nn.Module):
    """One causal attention layer over byte embeddings: small, random, and sensitive to every earlier token."""

    def __init__(self, vocab=257, dim=32, seq_len=64, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.config = SimpleNamespace(sequence_len=seq_len)
        self.dim = dim
        self.emb = nn.Parameter(torch.randn(vocab, dim, generator=g))
        self.pos = nn.Parameter(0.3 * torch.randn(seq_len, dim, generator=g))
        self.qkv = nn.Parameter(torch.randn(dim, 3 * dim, generator=g) / dim**0.5)
        self.head = nn.Parameter(3 * torch.randn(dim, vocab, generator=g) / dim**0.5)

    def forward(self, ids):
        T = ids.size(1)
        assert T <= self.config.sequence_len, "longer than the model's context"
        x = self.emb[ids] + self.pos[:T]
        q, k, v = (x @ self.qkv).split(self.dim, dim=-1)
        x = x + F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], is_causal=True)[:, 0]
        return x @ self.head


class ShapeNoise(nn.Module):
    """Wraps a model and perturbs logits by up to 1e-5 depending on batch size and row: a stand-in for the
    floating-point differences that real kernels show between batch shapes."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, ids):
        logits = self.inner(ids)
        B, _, V = logits.shape
        flip = torch.tensor([(i + B) % 2 for i in range(B)], dtype=logits.dtype)[:, None, None]
        return logits + 1e-5 * flip * torch.linspace(0, 1, V)


def words(rng, lo, hi):
    vocab = "the cat sat on a mat while dogs ran far away from big red barns in the rain".split()
    return " ".join(rng.choice(vocab) for _ in range(rng.randint(lo, hi)))


def mixed_items(task_type, n, seed=0):
    """Items of varied length; a few MC items have duplicate choices (exact ties)."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        if task_type == "multiple_choice":
            choices = [words(rng, 1, 6) for _ in range(rng.randint(2, 4))]
            if i % 7 == 3:
                choices[1] = choices[0]
            items.append({"query": words(rng, 1, 12), "choices": choices, "gold": rng.randrange(len(choices))})
        elif task_type == "schema":
            opts = [words(rng, 2, 9) for _ in range(2)]
            items.append({"context_options": opts, "continuation": words(rng, 1, 5), "gold": rng.randrange(2)})
        else:  # a run of the letter cycle, continued correctly (mostly) or not
            start, n = rng.randrange(10), rng.randint(3, 40)
            context = "".join(CYCLE[(start + j) % 10] for j in range(n))
            follow = "".join(CYCLE[(start + n + j) % 10] for j in range(rng.randint(1, 3)))
            continuation = follow if rng.random() < 0.6 else "".join(rng.choice(CYCLE) for _ in follow)
            items.append({"context": context + ("  " if i % 3 == 0 else ""), "continuation": continuation})
    return items


CYCLE = "abcdefghij"


class CycleLM(nn.Module):
    """TinyCausalLM plus a strong vote for the next letter of CYCLE: greedy completion of a cycle run
    is usually right, so language-modelling verdicts come out both ways."""

    def __init__(self, seq_len=96):
        super().__init__()
        self.inner = TinyCausalLM(seq_len=seq_len)
        self.config = self.inner.config
        nxt = torch.arange(257)
        for i, c in enumerate(CYCLE):
            nxt[ord(c)] = ord(CYCLE[(i + 1) % 10])
        self.vote = 6 * F.one_hot(nxt, 257).float()

    def forward(self, ids):
        return 0.5 * self.inner(ids) + self.vote[ids]


# -----------------------------------------------------------------------------
# prompts


def test_render_mc_zero_and_few_shot():
    item = {"query": "Q: sky?", "choices": ["blue", "green"], "gold": 0}
    shots = [
        {"query": "Q: grass?", "choices": ["red", "green"], "gold": 1},
        {"query": "Q: sun?", "choices": ["hot", "cold"], "gold": 0},
    ]
    assert render_prompts_mc(item, "\nAnswer: ") == ["Q: sky?\nAnswer: blue", "Q: sky?\nAnswer: green"]
    assert render_prompts_mc(item, " ", shots) == [
        "Q: grass? green\n\nQ: sun? hot\n\nQ: sky? blue",
        "Q: grass? green\n\nQ: sun? hot\n\nQ: sky? green",
    ]


def test_render_schema_zero_and_few_shot():
    item = {
        "context_options": ["Ann helped Bo because Ann", "Ann helped Bo because Bo"],
        "continuation": "was kind.",
        "gold": 0,
    }
    shot = {"context_options": ["X", "Y"], "continuation": "went home.", "gold": 1}
    assert render_prompts_schema(item, " ") == [
        "Ann helped Bo because Ann was kind.",
        "Ann helped Bo because Bo was kind.",
    ]
    assert render_prompts_schema(item, " ", [shot]) == [
        "Y went home.\n\nAnn helped Bo because Ann was kind.",
        "Y went home.\n\nAnn helped Bo because Bo was kind.",
    ]


def test_render_lm_strips_contexts_and_the_prompt_without():
    item = {"context": "  The capital of France is \n", "continuation": "Paris"}
    shot = {"context": "The capital of Italy is  ", "continuation": "Rome"}
    assert render_prompts_lm(item, " ") == ["The capital of France is", "The capital of France is Paris"]
    assert render_prompts_lm(item, "\n")[0] == "The capital of France is"  # all trailing whitespace goes
    assert render_prompts_lm(item, "\nAnswer: ", [shot]) == [
        "The capital of Italy is\nAnswer: Rome\n\nThe capital of France is\nAnswer:",
        "The capital of Italy is\nAnswer: Rome\n\nThe capital of France is\nAnswer: Paris",
    ]


def test_fewshot_sampling_is_deterministic_and_matches_sampling_the_list():
    for n, k in [(5, 3), (11, 10), (40, 10), (300, 3)]:
        for idx in [0, 1, n // 2, n - 1]:
            expect = random.Random(1234 + idx).sample([i for i in range(n) if i != idx], k)
            got = fewshot_indices(idx, n, k)
            assert got == expect and idx not in got
            assert fewshot_indices(idx, n, k) == got
    assert fewshot_indices(3, 10, 0) == []
    with pytest.raises(UserError, match="needs at least"):
        fewshot_indices(0, 3, 3)


def test_fewshot_examples_are_rendered_into_the_prompt():
    data = [{"query": f"q{i}", "choices": [f"a{i}", f"b{i}"], "gold": i % 2} for i in range(6)]
    meta = dict(MC, num_fewshot=2)
    ex = prepare_examples([4], data, ByteTokenizer(), meta)[0]
    shots = [data[j] for j in random.Random(1238).sample([0, 1, 2, 3, 5], 2)]
    expect = ByteTokenizer()(render_prompts_mc(data[4], " ", shots), prepend=256)
    assert ex["seqs"] == expect


# -----------------------------------------------------------------------------
# scored spans and cropping


def text_of(seq, span):
    return bytes(seq[span[0] : span[1]]).decode()


def test_mc_span_is_where_choices_differ():
    item = {"query": "Pick:", "choices": ["a cat", "a car", "a carpet"], "gold": 0}
    ex = prepare_examples([0], [item], ByteTokenizer(), MC)[0]
    assert all(seq[0] == 256 for seq in ex["seqs"])
    # common prefix "Pick: a ca" (BOS included); each span is what follows it
    assert [text_of(s, sp) for s, sp in zip(ex["seqs"], ex["spans"])] == ["t", "r", "rpet"]


def test_schema_span_is_the_common_suffix():
    item = {
        "context_options": ["The dog chased the cat because the dog", "The dog chased the cat because the cat"],
        "continuation": "was hungry.",
        "gold": 0,
    }
    ex = prepare_examples([0], [item], ByteTokenizer(), SCHEMA)[0]
    assert [text_of(s, sp) for s, sp in zip(ex["seqs"], ex["spans"])] == [" was hungry."] * 2


def test_lm_span_is_the_continuation_after_the_stripped_context():
    item = {"context": "Two plus two is  ", "continuation": "four"}
    ex = prepare_examples([0], [item], ByteTokenizer(), LM)[0]
    assert len(ex["seqs"]) == 1 and ex["seqs"][0][0] == 256
    assert text_of(ex["seqs"][0], ex["spans"][0]) == " four"
    assert bytes(ex["seqs"][0][1:]).decode() == "Two plus two is four"


def test_left_crop_keeps_the_scored_span():
    rng = random.Random(0)
    data = [{"query": words(rng, 30, 40), "choices": ["yes indeed", "no way"], "gold": 0} for _ in range(6)]
    full = prepare_examples([2], data, ByteTokenizer(), dict(MC, num_fewshot=3))[0]
    cropped = prepare_examples([2], data, ByteTokenizer(), dict(MC, num_fewshot=3), max_len=48)[0]
    assert all(len(s) > 48 for s in full["seqs"])
    for (fs, fsp), (cs, csp) in zip(zip(full["seqs"], full["spans"]), zip(cropped["seqs"], cropped["spans"])):
        assert len(cs) == 48 and cs == fs[-48:]  # the last 48 tokens
        assert text_of(cs, csp) == text_of(fs, fsp) and csp[0] >= 1
    # the model (context 48) takes them, and both scoring paths agree
    model = TinyCausalLM(seq_len=48)
    a = score_examples(model, ByteTokenizer(), data, "cpu", dict(MC, num_fewshot=3), batched=True)
    b = score_examples(model, ByteTokenizer(), data, "cpu", dict(MC, num_fewshot=3), batched=False)
    assert [(v["correct"], v["pred"]) for v in a] == [(v["correct"], v["pred"]) for v in b]


def test_crop_of_a_span_longer_than_the_window_keeps_its_head():
    seq = list(range(20))
    assert crop_to_context(seq, 5, 20, 8) == (list(range(4, 12)), 1, 8)  # window starts one token before the span
    assert crop_to_context(seq, 15, 20, 8) == (list(range(12, 20)), 3, 8)
    assert crop_to_context(seq, 15, 20, None) == (seq, 15, 20)


# -----------------------------------------------------------------------------
# scoring: batched vs one at a time


@pytest.mark.parametrize(
    "task_type,fewshot,delimiter",
    [
        ("multiple_choice", 0, " "),
        ("multiple_choice", 2, "\nAnswer: "),
        ("schema", 1, " "),
        ("language_modeling", 0, ""),
        ("language_modeling", 2, ""),
    ],
)
def test_batched_verdicts_equal_one_at_a_time(task_type, fewshot, delimiter):
    data = mixed_items(task_type, 40, seed=fewshot)
    meta = {"task_type": task_type, "num_fewshot": fewshot, "continuation_delimiter": delimiter}
    model = CycleLM(seq_len=96) if task_type == "language_modeling" else TinyCausalLM(seq_len=96)
    tok = ByteTokenizer()
    ref = [evaluate_example(i, model, tok, data, "cpu", meta) for i in range(len(data))]
    ref = [(v["correct"], v["pred"]) for v in ref]
    for batch_size, max_tokens in [(32, None), (5, 10_000), (64, 200), (1, None)]:
        got = score_examples(model, tok, data, "cpu", meta, batch_size=batch_size, max_tokens=max_tokens)
        assert [v["idx"] for v in got] == list(range(len(data)))
        assert [(v["correct"], v["pred"]) for v in got] == ref
    acc = evaluate_task(model, tok, data, "cpu", meta)
    assert acc == sum(c for c, _ in ref) / len(data)
    assert 0 < acc < 1  # both verdicts occur, so agreement means something
    if task_type == "language_modeling":
        assert all(p is None for _, p in ref)
    else:
        assert len({p for _, p in ref}) > 1


def test_exact_ties_pick_the_first_choice_in_both_paths():
    # an all-zero model gives every choice the same loss: the first choice wins, and every
    # example is a near tie, so the batched path re-scores all of them the reference way
    class Flat(nn.Module):
        config = SimpleNamespace(sequence_len=64)

        def forward(self, ids):
            return torch.zeros(*ids.shape, 257)

    data = [{"query": f"question {i}", "choices": ["x" * (i % 3 + 1), "y", "zz"], "gold": i % 3} for i in range(9)]
    got = score_examples(Flat(), ByteTokenizer(), data, "cpu", MC)
    assert [v["pred"] for v in got] == [0] * 9 and all(v["rescored"] for v in got)
    lm = [{"context": "abc", "continuation": "d"}]
    assert score_examples(Flat(), ByteTokenizer(), lm, "cpu", LM)[0]["rescored"]


def test_near_ties_are_rescored_so_batch_shape_noise_cannot_flip_verdicts():
    data = mixed_items("multiple_choice", 42, seed=5)  # every 7th item has a duplicated choice
    model = ShapeNoise(TinyCausalLM(seq_len=96))
    tok = ByteTokenizer()
    ref = [(v["correct"], v["pred"]) for v in score_examples(model, tok, data, "cpu", MC, batched=False)]
    got = score_examples(model, tok, data, "cpu", MC, batch_size=16)
    assert [(v["correct"], v["pred"]) for v in got] == ref
    assert sum(v["rescored"] for v in got) >= 6
    # without the re-scoring, the same noise does flip some tie-breaks: the guard is what holds them
    raw = score_examples(model, tok, data, "cpu", MC, batch_size=16, margin=0.0)
    assert [(v["correct"], v["pred"]) for v in raw] != ref


def test_batched_equals_one_at_a_time_on_the_gpt():
    gpt = pytest.importorskip("nanochat.gpt")
    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig(sequence_len=64, vocab_size=257, n_layer=2, n_head=2, n_kv_head=2, n_embd=64))
    model.init_weights()
    with torch.no_grad():  # zero-initialised projections and a near-zero lm_head: perturb for real logits
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    for task_type, k in [("multiple_choice", 1), ("schema", 0), ("language_modeling", 1)]:
        data = mixed_items(task_type, 20, seed=3)
        meta = {"task_type": task_type, "num_fewshot": k, "continuation_delimiter": " "}
        a = score_examples(model, ByteTokenizer(), data, "cpu", meta, batch_size=8)
        b = score_examples(model, ByteTokenizer(), data, "cpu", meta, batched=False)
        assert [(v["correct"], v["pred"]) for v in a] == [(v["correct"], v["pred"]) for v in b]


def test_packed_row_layout():
    seqs = [[9, 1, 2, 3, 4], [9, 1, 2, 5], [9, 1, 2]]  # share [9, 1, 2]; the last is all prefix
    spans = [(3, 5), (3, 4), (2, 3)]
    tokens, positions, branch, needs = core_eval.packed_row(seqs, spans)
    assert tokens == [9, 1, 2, 3, 4, 5]
    assert positions == [0, 1, 2, 3, 4, 3]
    assert branch == [0, 0, 0, 1, 1, 2]
    # logits at column c predict the next token of that sequence: [3, 4] from columns 2, 3; [5] from 2
    assert needs == [([2, 3], [3, 4]), ([2], [5]), ([1], [2])]
    assert core_eval.packed_row([[7, 8, 9]], [(1, 3)]) == ([7, 8, 9], [0, 1, 2], [0, 0, 0], [([0, 1], [8, 9])])


def test_packed_scores_equal_the_reference_scores_on_the_gpt():
    gpt = pytest.importorskip("nanochat.gpt")
    torch.manual_seed(0)
    model = gpt.GPT(
        gpt.GPTConfig(
            sequence_len=256, vocab_size=257, n_layer=2, n_head=2, n_kv_head=2, n_embd=64, window_pattern="SL"
        )
    )
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert core_eval.takes_packed_rows(model) and not core_eval.takes_packed_rows(TinyCausalLM())
    data = mixed_items("multiple_choice", 12, seed=4)
    examples = prepare_examples(range(12), data, ByteTokenizer(), dict(MC, num_fewshot=2), max_len=256)
    assert all(core_eval.worth_packing(ex["seqs"]) for ex in examples)  # 2-shot: long shared prefixes
    rows = [core_eval.packed_row(ex["seqs"], ex["spans"]) for ex in examples]
    assert all(len(r[0]) < sum(len(s) for s in ex["seqs"]) for r, ex in zip(rows, examples))
    got = core_eval.packed_scores(model, rows, 256, "cpu", packed=True)
    for ex, g in zip(examples, got):
        ref = core_eval.forward_scores(model, ex["seqs"], ex["spans"], 256, "cpu")
        for (gl, gg, gm), (rl, rg, rm) in zip(g, ref):
            assert len(gl) == len(rl) > 0 and gm == rm
            assert max(abs(x - y) for x, y in zip(gl + gg, rl + rg)) < 1e-4


def test_unknown_task_type_is_a_user_error():
    with pytest.raises(UserError, match="unknown task type"):
        evaluate_task(TinyCausalLM(), ByteTokenizer(), [{"query": "q"}], "cpu", dict(MC, task_type="generation"))


# -----------------------------------------------------------------------------
# the bundle: core.yaml, eval_meta_data.csv, jsonl files


def test_core_yaml_is_read_with_yaml(tmp_path):
    # what the upstream core.yaml uses (flow lists, escaped double quotes, comments) and what a hand-written
    # YAML subset would miss: an inline item, a '' escape, a bare int num_fewshot, a block list
    (tmp_path / "core.yaml").write_text(
        "# bundle\nicl_tasks:\n-\n  label: arc\n  dataset_uri: w/arc.jsonl\n  num_fewshot: [10, 25]  # first one\n"
        "  icl_task_type: multiple_choice\n  continuation_delimiter: \"\\nAnswer: \"\n"
        "- label: 'it''s'\n  dataset_uri: x.jsonl\n  num_fewshot:\n    - 3\n  icl_task_type: schema\n"
        "- {label: lam, dataset_uri: l.jsonl, num_fewshot: 0, icl_task_type: language_modeling}\n"
    )
    (tmp_path / "eval_meta_data.csv").write_text("Eval Task,Random baseline\narc,25\nit's,50\nlam,0\nunused,50\n")
    tasks = load_core_tasks(str(tmp_path))
    assert [
        (t["label"], t["dataset_uri"], t["num_fewshot"], t["continuation_delimiter"], t["random_baseline"])
        for t in tasks
    ] == [
        ("arc", "w/arc.jsonl", 10, "\nAnswer: ", 25.0),
        ("it's", "x.jsonl", 3, " ", 50.0),
        ("lam", "l.jsonl", 0, " ", 0.0),
    ]
    (tmp_path / "core.yaml").write_text("icl_tasks:\n- label: [unclosed\n")
    with pytest.raises(UserError, match="core.yaml is not valid YAML"):
        load_core_tasks(str(tmp_path))
    (tmp_path / "core.yaml").write_text("icl_tasks: 3\n")
    with pytest.raises(UserError, match="expected a list of tasks"):
        load_core_tasks(str(tmp_path))
    assert not hasattr(core_eval, "parse_core_yaml") and not hasattr(core_eval, "_yaml_scalar")


def test_load_core_tasks_reads_settings_and_baselines(tmp_path, write_eval_bundle):
    root = write_eval_bundle(
        tmp_path / "b",
        [("arc", "multiple_choice", 10, 25, None, "\nAnswer: "), ("lam", "language_modeling", 0, 0, None)],
        extra_baselines={"unused": 50},
    )
    tasks = load_core_tasks(root)
    assert tasks == [
        {
            "label": "arc",
            "dataset_uri": "tiny/arc.jsonl",
            "task_type": "multiple_choice",
            "num_fewshot": 10,
            "continuation_delimiter": "\nAnswer: ",
            "random_baseline": 25.0,
        },
        {
            "label": "lam",
            "dataset_uri": "tiny/lam.jsonl",
            "task_type": "language_modeling",
            "num_fewshot": 0,
            "continuation_delimiter": " ",
            "random_baseline": 0.0,
        },
    ]


def test_unknown_task_type_in_core_yaml_is_a_user_error(tmp_path, write_eval_bundle):
    root = write_eval_bundle(tmp_path / "b", [("gen", "generation_task_with_answers", 0, 0, None)])
    with pytest.raises(UserError, match="unknown task type 'generation_task_with_answers'"):
        load_core_tasks(root)
    with pytest.raises(UserError, match="unknown task type"):
        evaluate_core(TinyCausalLM(), ByteTokenizer(), "cpu", root)


def test_missing_baseline_is_a_user_error(tmp_path, write_eval_bundle):
    root = write_eval_bundle(tmp_path / "b", [("arc", "multiple_choice", 0, None, None)], extra_baselines={"other": 25})
    with pytest.raises(UserError, match="no random baseline for task arc"):
        load_core_tasks(root)


def test_malformed_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "copa.jsonl"
    good = json.dumps({"query": "q", "choices": ["a", "b"], "gold": 0})
    path.write_text(good + "\n\n" + good[:-5] + "\n" + good + "\n")
    with pytest.raises(UserError) as e:
        load_task_data(str(path), "multiple_choice")
    msg = str(e.value)
    assert str(path) in msg and "line 3" in msg and "\n" not in msg
    path.write_text(good + "\n" + json.dumps({"query": "q", "choices": ["a"], "gold": 4}) + "\n")
    with pytest.raises(UserError, match="line 2: gold"):
        load_task_data(str(path), "multiple_choice")
    path.write_text(json.dumps({"context": "c"}) + "\n")
    with pytest.raises(UserError, match="line 1: missing field continuation"):
        load_task_data(str(path), "language_modeling")
    path.write_text(good + "\n\n")
    assert len(load_task_data(str(path), "multiple_choice")) == 1  # blank lines are not items


# -----------------------------------------------------------------------------
# the metric


def test_centering_and_the_core_average(tmp_path, monkeypatch, write_eval_bundle):
    labels = [f"t{i:02d}" for i in range(22)]
    baselines = {label: [0, 25, 50, 62][i % 4] for i, label in enumerate(labels)}
    right = {label: 10 + 3 * i for i, label in enumerate(labels)}  # of 100 items
    items = [{"query": f"q{j}", "choices": ["a", "b"], "gold": 0} for j in range(120)]
    root = write_eval_bundle(tmp_path / "b", [(l, "multiple_choice", 0, baselines[l], items) for l in labels])
    calls = []

    def fake_task_verdicts(model, tokenizer, data, device, task_meta, **kw):
        calls.append(len(data))
        k = right[labels[len(calls) - 1]]
        return [
            {"idx": j, "correct": j < k, "pred": 0, "margin": 1.0 if j < k else -1.0, "rescored": False}
            for j in range(len(data))
        ]

    monkeypatch.setattr(core_eval, "task_verdicts", fake_task_verdicts)
    lines, partial = [], []
    out = evaluate_core(None, ByteTokenizer(), "cpu", root, max_per_task=100, log=lines.append, on_task=partial.append)
    assert calls == [100] * 22  # truncated to max_per_task
    accuracies = {l: right[l] / 100 for l in labels}
    centered = {l: (accuracies[l] - baselines[l] / 100) / (1 - baselines[l] / 100) for l in labels}
    assert out["tasks"]["t01"]["centered"] == pytest.approx((0.13 - 0.25) / 0.75)
    for l in labels:
        assert out["tasks"][l]["accuracy"] == accuracies[l]
        assert out["tasks"][l]["centered"] == pytest.approx(centered[l])
        assert out["tasks"][l]["num_examples"] == 100 and out["tasks"][l]["seconds"] >= 0
    assert out["core_metric"] == pytest.approx(sum(centered.values()) / 22)
    assert out["partial_core"] == out["core_metric"] and out["num_tasks_scored"] == 22 and out["missing_tasks"] == []
    assert any(line.startswith("CORE metric:") for line in lines) and len(lines) == 23
    # one record per example, and a partial summary after every task
    assert (
        len(out["records"]) == 22 * 100
        and sum(r["correct"] for r in out["records"] if r["task"] == "t05") == right["t05"]
    )
    assert [p["num_tasks_scored"] for p in partial] == list(range(1, 23)) and partial[0]["core_metric"] is None
    assert set(partial[2]["tasks"]) == {"t00", "t01", "t02"} and len(partial[2]["records"]) == 300


def test_partial_core_is_labelled_and_lists_missing_tasks(tmp_path, write_eval_bundle):
    data = {
        "mc": mixed_items("multiple_choice", 12),
        "wino": mixed_items("schema", 10),
        "lam": mixed_items("language_modeling", 9),
    }
    tasks = [
        ("mc", "multiple_choice", 2, 25, data["mc"]),
        ("gone", "multiple_choice", 0, 25, None),
        ("wino", "schema", 0, 50, data["wino"]),
        ("lam", "language_modeling", 1, 0, data["lam"], "\nAnswer: "),
    ]
    root = write_eval_bundle(tmp_path / "b", tasks)
    lines = []
    out = evaluate_core(TinyCausalLM(seq_len=96), ByteTokenizer(), "cpu", root, max_per_task=8, log=lines.append)
    assert out["missing_tasks"] == ["gone"] and out["num_tasks_scored"] == 3
    assert out["core_metric"] is None and out["partial_label"] == "partial CORE (3/22)"
    assert out["partial_core"] == pytest.approx(sum(r["centered"] for r in out["tasks"].values()) / 3)
    assert set(out["tasks"]) == {"mc", "wino", "lam"} and out["tasks"]["mc"]["num_examples"] == 8
    assert not any("CORE metric" in line for line in lines)
    assert any("partial CORE (3/22)" in line and "gone" in line for line in lines)
    # the accuracy is the one of the shuffled, truncated data
    items = data["mc"][:]
    random.Random(1337).shuffle(items)
    meta = {"task_type": "multiple_choice", "num_fewshot": 2, "continuation_delimiter": " "}
    assert out["tasks"]["mc"]["accuracy"] == evaluate_task(
        TinyCausalLM(seq_len=96), ByteTokenizer(), items[:8], "cpu", meta
    )
    # records: every scored example once, by its index after the shuffle, agreeing with the accuracies
    recs = [r for r in out["records"] if r["task"] == "mc"]
    assert [r["idx"] for r in recs] == list(range(8)) and [r["item"] for r in recs] == [
        core_eval.item_key(x) for x in items[:8]
    ]
    for label, t in out["tasks"].items():
        recs = [r for r in out["records"] if r["task"] == label]
        assert sum(r["correct"] for r in recs) / len(recs) == t["accuracy"]
        # the margin: how far from flipping (nan: no scored tokens)
        assert all((r["margin"] > 0) == r["correct"] for r in recs if r["margin"] != 0 and math.isfinite(r["margin"]))
    assert out["settings"]["tasks"]["lam"] == {
        "task_type": "language_modeling",
        "num_fewshot": 1,
        "num_examples": 8,
        "continuation_delimiter": "\nAnswer: ",
        "random_baseline": 0.0,
    }
    assert out["settings"]["max_per_task"] == 8 and set(out["settings"]["tasks"]) == {"mc", "wino", "lam"}


def test_an_unfinished_run_is_resumed_task_by_task(tmp_path, monkeypatch, write_eval_bundle):
    data = {
        "mc": mixed_items("multiple_choice", 12),
        "wino": mixed_items("schema", 10),
        "lam": mixed_items("language_modeling", 9),
    }
    tasks = [
        ("mc", "multiple_choice", 2, 25, data["mc"]),
        ("gone", "multiple_choice", 0, 25, None),
        ("wino", "schema", 0, 50, data["wino"]),
        ("lam", "language_modeling", 1, 0, data["lam"]),
    ]
    root = write_eval_bundle(tmp_path / "b", tasks)
    model, tok = TinyCausalLM(seq_len=96), ByteTokenizer()
    full = evaluate_core(model, tok, "cpu", root, max_per_task=8, log=lambda line: None)
    assert full["unfinished_tasks"] == [] and full["missing_tasks"] == ["gone"]
    # a run stopped after its first task: the summary it saved says which tasks it did not reach
    partial = []
    real, scored = core_eval.task_verdicts, []

    def stops_after_one(model, tokenizer, data, *a, **kw):
        if scored:
            raise KeyboardInterrupt
        scored.append(data)
        return real(model, tokenizer, data, *a, **kw)

    monkeypatch.setattr(core_eval, "task_verdicts", stops_after_one)
    with pytest.raises(KeyboardInterrupt):
        evaluate_core(model, tok, "cpu", root, max_per_task=8, log=lambda line: None, on_task=partial.append)
    assert [p["unfinished_tasks"] for p in partial] == [["wino", "lam"]] and partial[0]["missing_tasks"] == ["gone"]
    by_task = {}
    for r in partial[0]["records"]:
        by_task.setdefault(r["task"], []).append(r)
    done = {"tasks": partial[0]["tasks"], "records": by_task, "settings": partial[0]["settings"]}
    # resumed: the first task is taken from it, the others scored, and the result is the uninterrupted one
    scored.clear()
    monkeypatch.setattr(core_eval, "task_verdicts", lambda *a, **kw: scored.append(a[2]) or real(*a, **kw))
    lines = []
    out = evaluate_core(model, tok, "cpu", root, max_per_task=8, log=lines.append, done=done)
    assert len(scored) == 2 and any(
        line.startswith("mc") and "kept from the interrupted run  [" in line for line in lines
    )
    # records are compared as JSON, for their nan margins
    timeless = lambda tasks: {k: {f: v for f, v in t.items() if f != "seconds"} for k, t in tasks.items()}
    assert (
        timeless(out["tasks"]) == timeless(full["tasks"])
        and json.dumps(out["records"]) == json.dumps(full["records"])
        and out["unfinished_tasks"] == []
    )
    # other items (another cut of the task) or other settings: scored again
    scored.clear()
    evaluate_core(model, tok, "cpu", root, max_per_task=7, log=lambda line: None, done=done)
    assert len(scored) == 3
    scored.clear()
    write_eval_bundle(root, [("mc", "multiple_choice", 2, 25, data["mc"][::-1])] + tasks[1:])
    evaluate_core(model, tok, "cpu", root, max_per_task=8, log=lambda line: None, done=done)
    assert len(scored) == 3


def test_few_shot_fits_a_small_max_per_task(tmp_path, write_eval_bundle):
    # a 10-shot task cut to 5 items draws its shots from the 4 others, with one note for all such tasks
    data = {"mc": mixed_items("multiple_choice", 12), "lam": mixed_items("language_modeling", 12)}
    root = write_eval_bundle(
        tmp_path / "b", [("mc", "multiple_choice", 10, 25, data["mc"]), ("lam", "language_modeling", 3, 0, data["lam"])]
    )
    lines = []
    out = evaluate_core(TinyCausalLM(seq_len=96), ByteTokenizer(), "cpu", root, max_per_task=3, log=lines.append)
    assert out["tasks"]["mc"]["num_examples"] == 3 and out["tasks"]["mc"]["num_fewshot"] == 2
    assert out["tasks"]["lam"]["num_fewshot"] == 2 and out["settings"]["tasks"]["mc"]["num_fewshot"] == 2
    notes = [line for line in lines if line.startswith("note:")]
    assert len(notes) == 1 and "mc 10->2" in notes[0] and "lam 3->2" in notes[0]
    out = evaluate_core(TinyCausalLM(seq_len=96), ByteTokenizer(), "cpu", root, max_per_task=-1, log=lines.append)
    assert out["tasks"]["mc"]["num_fewshot"] == 10 and len([line for line in lines if line.startswith("note:")]) == 1


def test_all_tasks_present_but_fewer_than_22_is_still_partial(tmp_path, write_eval_bundle):
    root = write_eval_bundle(tmp_path / "b", [("mc", "multiple_choice", 0, 25, mixed_items("multiple_choice", 6))])
    out = evaluate_core(TinyCausalLM(seq_len=96), ByteTokenizer(), "cpu", root, log=lambda line: None)
    assert out["missing_tasks"] == [] and out["num_tasks_scored"] == 1
    assert out["core_metric"] is None and out["partial_label"] == "partial CORE (1/22)"
    assert out["partial_core"] == out["tasks"]["mc"]["centered"]


# -----------------------------------------------------------------------------
# fetching the bundle


def make_zip(path, files):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    path.write_bytes(buf.getvalue())


def test_ensure_eval_bundle_downloads_once_and_unzips(tmp_path, monkeypatch, capsys):
    base = tmp_path / "base"
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    src = tmp_path / "eval_bundle.zip"
    make_zip(
        src, {"eval_bundle/core.yaml": "icl_tasks:\n", "eval_bundle/eval_meta_data.csv": "Eval Task,Random baseline\n"}
    )
    got = ensure_eval_bundle(url=src.as_uri())
    assert got == str(base / "eval_bundle") and (base / "eval_bundle" / "core.yaml").read_text() == "icl_tasks:\n"
    assert "downloading eval bundle" in capsys.readouterr().err
    assert sorted(p.name for p in base.iterdir()) == ["eval_bundle", "eval_bundle.lock"]  # no zip or temp files left
    src.unlink()
    assert ensure_eval_bundle(url=src.as_uri()) == got  # in place: no second download
    assert ensure_eval_bundle(str(base / "eval_bundle")) == got


def test_ensure_eval_bundle_offline_is_one_line_user_error(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    with pytest.raises(UserError) as e:
        ensure_eval_bundle(url=(tmp_path / "nowhere.zip").as_uri())
    assert (
        "cannot download the CORE eval bundle" in str(e.value)
        and "--eval-bundle" in str(e.value)
        and "\n" not in str(e.value)
    )
    assert not (tmp_path / "base" / "eval_bundle").exists()
    bad = tmp_path / "bad.zip"
    bad.write_bytes(b"not a zip")
    with pytest.raises(UserError, match="not a valid zip|did not give a valid zip"):
        ensure_eval_bundle(url=bad.as_uri())
    with pytest.raises(UserError, match="has no core.yaml"):
        ensure_eval_bundle(str(tmp_path))


def test_eval_bundle_url_is_nanochats():
    assert core_eval.EVAL_BUNDLE_URL == "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"


# -----------------------------------------------------------------------------
# torchrun: examples strided over ranks, counts summed


def _rank_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        data = mixed_items("multiple_choice", 15, seed=2)
        acc = evaluate_task(TinyCausalLM(seq_len=96), ByteTokenizer(), data, "cpu", dict(MC, num_fewshot=1))
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(repr(acc))
    finally:
        dist.destroy_process_group()


@PROCESSES
def test_distributed_split_sums_to_the_single_process_accuracy(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_rank_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    data = mixed_items("multiple_choice", 15, seed=2)
    single = evaluate_task(TinyCausalLM(seq_len=96), ByteTokenizer(), data, "cpu", dict(MC, num_fewshot=1))
    got = [float((tmp_path / f"rank{r}.txt").read_text()) for r in range(2)]
    assert got == [single, single] and not math.isnan(single)


def test_each_task_line_counts_the_tasks_and_estimates_the_rest(tmp_path, write_eval_bundle):
    """A CORE evaluation prints a line per task; on a busy CPU it runs for minutes, so each line says how far it got
    and what is left: [k/n, eta ...], with no ETA on the last task."""
    root = tmp_path / "bundle"
    write_eval_bundle(
        root,
        [(f"t{i}", "language_modeling", 0, 0, [{"context": "abc " * 3, "continuation": "abc"}] * 4) for i in range(3)],
    )
    lines = []
    evaluate_core(TinyCausalLM(seq_len=96), ByteTokenizer(), "cpu", str(root), log=lines.append)
    tagged = [re.search(r"\[(\d+)/3(, eta \d+m\d\ds)?\]$", line) for line in lines if line.startswith("t")]
    assert [m.group(1) for m in tagged] == ["1", "2", "3"] and [bool(m.group(2)) for m in tagged] == [
        True,
        True,
        False,
    ], lines
