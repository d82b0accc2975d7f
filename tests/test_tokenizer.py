"""The BPE tokenizer: specials, round trips, save and load, training, and the tok_* scripts."""

import os
import shutil

import pytest
import torch

from nanochat.common import UserError
from nanochat.tokenizer import SPECIAL_TOKENS, Tokenizer, get_token_bytes, get_tokenizer

TEXTS = [
    "Hello world! The model's loss went down 12345 times.",
    "  leading spaces,\ttabs\nand\r\nnewlines \n\n",
    "unicode: café naïve 東京 данные 🙂 e\u0301 \u200b",
    "",
]


@pytest.fixture
def tok(tiny_base_dir, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", tiny_base_dir)
    return get_tokenizer()


def test_vocab_and_specials(tok):
    assert tok.get_vocab_size() == 512
    ids = [tok.encode_special(s) for s in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS) and all(503 <= i < 512 for i in ids)
    assert tok.get_bos_token_id() == tok.encode_special("<|bos|>")
    assert tok.id_to_token(tok.get_bos_token_id()) == "<|bos|>"
    assert tok.decode([tok.encode_special("<|user_start|>")]) == "<|user_start|>"
    with pytest.raises(UserError, match="not a special token"):
        tok.encode_special("<|nope|>")


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(isinstance(i, int) and 0 <= i < 512 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids, dtype=torch.long)) == text


def test_merges_compress(tok):
    text = "the model and the data and the token"
    assert len(tok.encode(text)) < len(text.encode("utf-8")) / 2


def test_special_token_text_is_not_special(tok):
    ids = tok.encode("<|bos|>")
    assert tok.get_bos_token_id() not in ids
    assert tok.decode(ids) == "<|bos|>"


def test_batch_encode_with_prepend_and_append(tok):
    bos = tok.get_bos_token_id()
    out = tok(TEXTS, prepend=bos)
    assert isinstance(out, list) and len(out) == len(TEXTS)
    for text, ids in zip(TEXTS, out):
        assert ids[0] == bos and ids[1:] == tok.encode(text)
    out = tok.encode(TEXTS[:2], prepend="<|bos|>", append="<|assistant_end|>", num_threads=1)
    assert out[0][0] == bos and out[0][-1] == tok.encode_special("<|assistant_end|>")
    assert tok.encode("hi", append=bos)[-1] == bos
    with pytest.raises(TypeError):
        tok.encode(123)


def test_token_bytes(tok, tiny_base_dir):
    token_bytes = get_token_bytes()
    assert token_bytes.dtype == torch.int32 and token_bytes.shape == (512,)
    assert torch.equal(token_bytes, tok.token_bytes())
    for s in SPECIAL_TOKENS:
        assert token_bytes[tok.encode_special(s)] == 0
    assert (token_bytes[:256] == 1).all()  # the 256 byte tokens
    for text in TEXTS:
        ids = tok.encode(text, prepend=tok.get_bos_token_id())
        assert token_bytes[ids].sum().item() == len(text.encode("utf-8"))


def test_save_and_load_round_trip(tok, tmp_path):
    tok.save(str(tmp_path / "copy"))
    again = Tokenizer.from_directory(str(tmp_path / "copy"))
    assert sorted(os.listdir(tmp_path / "copy")) == ["token_bytes.pt", "tokenizer.pkl"]
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text)


def test_missing_tokenizer_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    with pytest.raises(UserError, match="no tokenizer at .*scripts.tok_train"):
        get_tokenizer()
    with pytest.raises(UserError, match="scripts.tok_train"):
        get_token_bytes()
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.pkl").write_bytes(b"garbage")
    with pytest.raises(UserError, match="cannot load tokenizer"):
        get_tokenizer()


def test_train_rejects_tiny_vocab():
    with pytest.raises(UserError, match="too small"):
        Tokenizer.train_from_iterator(iter(["abc"]), 100)


def test_train_is_deterministic():
    texts = ["the cat sat on the mat", "the dog sat on the log"] * 20
    a = Tokenizer.train_from_iterator(iter(texts), 280)
    b = Tokenizer.train_from_iterator(iter(texts), 280)
    assert a.encode("the cat and the dog") == b.encode("the cat and the dog")
    assert a.get_vocab_size() == 280


def test_tok_train_and_tok_eval_scripts(tiny_base_dir, tmp_path, monkeypatch, capsys):
    from scripts import tok_eval, tok_train

    shutil.copytree(os.path.join(tiny_base_dir, "base_data"), tmp_path / "base_data")
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    tok_train.main(["--vocab-size", "300", "--max-chars", "20000", "--doc-cap", "500"])
    out = capsys.readouterr().out
    assert "300-token vocabulary" in out and "bytes/token" in out
    assert get_tokenizer().get_vocab_size() == 300
    tok_eval.main(["--max-chars", "5000"])
    out = capsys.readouterr().out
    assert "val shard" in out and "train sample" in out and "bytes/token" in out


def test_tok_train_text_iterator_caps(tiny_base_dir, monkeypatch):
    from nanochat.tokenizer import train_texts as text_iterator

    monkeypatch.setenv("NANOCHAT_BASE_DIR", tiny_base_dir)
    texts = list(text_iterator(max_chars=1000, doc_cap=50))
    assert all(len(t) <= 50 for t in texts)
    assert sum(len(t) for t in texts) == 1000


def test_tok_train_without_data_is_one_line_error(tmp_path, monkeypatch, capsys):
    from scripts import tok_train

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        tok_train.main(["--vocab-size", "300"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--offline" in err


@pytest.fixture
def base_with_run(tiny_base_dir, tmp_path, monkeypatch):
    """A base dir with its own copy of the session's corpus and vocab-512 tokenizer, and a run "gpt" whose config.json
    records that tokenizer's fingerprint, as base_train writes it."""
    import json

    for name in ("base_data", "tokenizer"):
        shutil.copytree(os.path.join(tiny_base_dir, name), tmp_path / name)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    (tmp_path / "runs" / "gpt").mkdir(parents=True)
    config = {"run": "gpt", "fingerprints": {"tokenizer": get_tokenizer().fingerprint()}}
    (tmp_path / "runs" / "gpt" / "config.json").write_text(json.dumps(config))
    return tmp_path


NEW_TOKENIZER = ["--vocab-size", "300", "--max-chars", "20000", "--doc-cap", "500"]


def test_tok_train_keeps_a_tokenizer_that_runs_were_trained_with(base_with_run, script_error):
    """It used to write the new tokenizer over the old one without a word: the runs trained with it then failed with
    "checkpoint vocab 512 does not match the tokenizer's 300"."""
    from scripts import tok_train

    before = get_tokenizer().fingerprint()
    err = script_error(tok_train.main, *NEW_TOKENIZER)
    assert "1 run(s)" in err and "(gpt)" in err and "--replace" in err and "512 tokens" in err
    assert get_tokenizer().fingerprint() == before
    assert not (base_with_run / "replaced").exists()


def test_tok_train_replace_keeps_the_old_tokenizer(base_with_run, capsys):
    from scripts import tok_train

    before = get_tokenizer().fingerprint()
    tok_train.main([*NEW_TOKENIZER, "--replace"])
    out = capsys.readouterr().out
    assert get_tokenizer().get_vocab_size() == 300
    (kept,) = (base_with_run / "replaced").glob("*/tokenizer")
    assert Tokenizer.from_directory(str(kept)).fingerprint() == before
    assert f"kept in {kept}" in out and "gpt were trained with" in out and "move it back" in out


def test_tok_train_replaces_a_tokenizer_no_run_uses_and_says_so(base_with_run, capsys):
    from scripts import tok_train

    shutil.rmtree(base_with_run / "runs")
    tok_train.main(NEW_TOKENIZER)
    out = capsys.readouterr().out
    (kept,) = (base_with_run / "replaced").glob("*/tokenizer")
    assert get_tokenizer().get_vocab_size() == 300 and "no run under runs/ was trained with it" in out
    assert f"kept in {kept}" in out


@pytest.mark.parametrize("command", ["tok_train", "tok_eval"])
@pytest.mark.parametrize("value", ["-5", "0"])
def test_tok_max_chars_follows_the_number_rule(command, value, tiny_base_dir, monkeypatch, script_error):
    """tok_eval --max-chars -5 (or 0) used to report a figure from one document; tok_train refused it in its own
    words. Both now refuse it as every command refuses a count: one `error: --flag must be positive` line."""
    import importlib

    monkeypatch.setenv("NANOCHAT_BASE_DIR", tiny_base_dir)
    main = importlib.import_module(f"scripts.{command}").main
    assert script_error(main, "--max-chars", value) == f"error: --max-chars must be positive; got {value}"
