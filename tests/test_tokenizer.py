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
