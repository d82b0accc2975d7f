"""
BPE tokenizer: trained with rustbpe, run with tiktoken.

rustbpe learns the merges; tiktoken encodes and decodes fast with them. Saved as
<base_dir>/tokenizer/tokenizer.pkl (the pickled tiktoken.Encoding) plus
token_bytes.pt (the UTF-8 byte length of every token, 0 for special tokens),
which turns a summed loss into bits per byte.
"""

import os
import pickle
import hashlib

import torch

from nanochat.common import UserError, atomic_torch_save, atomic_write_bytes, get_base_dir

# GPT-4's split pattern with numbers split into runs of at most 2 digits (nanochat's variant; GPT-4 uses {1,3}),
# which spends fewer vocabulary entries on numbers in a small vocab.
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)

SPECIAL_TOKENS = [
    "<|bos|>",  # begins every document
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    "<|python_start|>",
    "<|python_end|>",
    "<|output_start|>",
    "<|output_end|>",
]


ENCODING, TOKEN_BYTES = "tokenizer.pkl", "token_bytes.pt"  # the tokenizer's two files, named here only


def get_tokenizer_dir(base_dir=None):
    return os.path.join(base_dir or get_base_dir(), "tokenizer")


def has_tokenizer(base_dir=None):
    """Whether a trained tokenizer (both of its files) is in place under base_dir (default $NANOCHAT_BASE_DIR)."""
    d = get_tokenizer_dir(base_dir)
    return all(os.path.exists(os.path.join(d, f)) for f in (ENCODING, TOKEN_BYTES))


class Tokenizer:
    """A tiktoken Encoding with the special tokens above; encode() never turns text into special tokens."""

    def __init__(self, enc):
        self.enc = enc
        self.bos_token_id = enc.encode_single_token("<|bos|>")

    @classmethod
    def train_from_iterator(cls, text_iterator, vocab_size):
        import rustbpe
        import tiktoken

        num_merged = vocab_size - len(SPECIAL_TOKENS)
        if num_merged < 256:
            raise UserError(
                f"vocab size {vocab_size} is too small: need at least {256 + len(SPECIAL_TOKENS)} (256 bytes + "
                f"{len(SPECIAL_TOKENS)} special tokens)"
            )
        trainer = rustbpe.Tokenizer()
        trainer.train_from_iterator(text_iterator, num_merged, pattern=SPLIT_PATTERN)
        ranks = {bytes(token): rank for token, rank in trainer.get_mergeable_ranks()}
        specials = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
        enc = tiktoken.Encoding(
            name="rustbpe", pat_str=trainer.get_pattern(), mergeable_ranks=ranks, special_tokens=specials
        )
        return cls(enc)

    @classmethod
    def from_directory(cls, directory):
        path = os.path.join(directory, ENCODING)
        if not os.path.exists(path):
            raise UserError(f"no tokenizer at {path}; run `python -m scripts.tok_train`")
        try:
            with open(path, "rb") as f:
                enc = pickle.load(f)
        except Exception as e:
            raise UserError(
                f"cannot load tokenizer {path} ({type(e).__name__}: {e}); re-run `python -m scripts.tok_train`"
            ) from None
        import tiktoken

        if not isinstance(enc, tiktoken.Encoding):
            raise UserError(
                f"{path} is not a tokenizer (it holds a {type(enc).__name__}); re-run `python -m scripts.tok_train`"
            )
        return cls(enc)

    def save(self, directory):
        """Write tokenizer.pkl and token_bytes.pt into directory (each atomically)."""
        os.makedirs(directory, exist_ok=True)
        atomic_write_bytes(os.path.join(directory, ENCODING), pickle.dumps(self.enc))
        atomic_torch_save(self.token_bytes(), os.path.join(directory, TOKEN_BYTES))

    def token_bytes(self):
        """int32 tensor (vocab,): UTF-8 byte length of each token; 0 for special tokens, which stand for no text."""
        special_ids = {self.enc.encode_single_token(t) for t in self.enc.special_tokens_set}
        lengths = [
            0 if i in special_ids else len(self.enc.decode_single_token_bytes(i)) for i in range(self.enc.n_vocab)
        ]
        return torch.tensor(lengths, dtype=torch.int32)

    def get_vocab_size(self):
        return self.enc.n_vocab

    def fingerprint(self):
        """A short hash of what decides every token id: the split pattern, the merges (token bytes and rank)
        and the special tokens. Two tokenizers of one vocab size trained on other text differ here."""
        h = hashlib.sha256(self.enc._pat_str.encode())
        for token, rank in sorted(self.enc._mergeable_ranks.items(), key=lambda kv: kv[1]):
            h.update(rank.to_bytes(4, "little") + len(token).to_bytes(2, "little") + token)
        for name, rank in sorted(self.enc._special_tokens.items()):
            h.update(name.encode() + rank.to_bytes(4, "little"))
        return h.hexdigest()[:16]

    def get_bos_token_id(self):
        return self.bos_token_id

    def get_special_tokens(self):
        return set(self.enc.special_tokens_set)

    def encode_special(self, text):
        try:
            return self.enc.encode_single_token(text)
        except KeyError:
            raise UserError(f"{text!r} is not a special token; known: {', '.join(SPECIAL_TOKENS)}") from None

    def _as_id(self, token):
        return self.encode_special(token) if isinstance(token, str) else int(token)

    def encode(self, text, prepend=None, append=None, num_threads=8):
        """str -> list[int]; list[str] -> list[list[int]] (in parallel). prepend/append: a token id or special-token
        string."""
        first = [self._as_id(prepend)] if prepend is not None else []
        last = [self._as_id(append)] if append is not None else []
        if isinstance(text, str):
            return first + self.enc.encode_ordinary(text) + last
        if isinstance(text, (list, tuple)):
            return [first + ids + last for ids in self.enc.encode_ordinary_batch(list(text), num_threads=num_threads)]
        raise TypeError(f"encode takes a str or a list of str, got {type(text).__name__}")

    __call__ = encode

    def decode(self, ids):
        return self.enc.decode(ids.tolist() if hasattr(ids, "tolist") else list(ids))

    def id_to_token(self, token_id):
        return self.enc.decode([token_id])


def get_tokenizer():
    return Tokenizer.from_directory(get_tokenizer_dir())


def get_token_bytes(device="cpu"):
    path = os.path.join(get_tokenizer_dir(), TOKEN_BYTES)
    if not os.path.exists(path):
        raise UserError(f"no token_bytes at {path}; run `python -m scripts.tok_train`")
    try:
        return torch.load(path, map_location=device)
    except Exception as e:
        raise UserError(f"cannot load {path} ({type(e).__name__}); re-run `python -m scripts.tok_train`") from None


def train_texts(max_chars, doc_cap):
    """Train documents, each cut to doc_cap characters, until max_chars characters in total."""
    from nanochat.dataset import parquets_iter_batched  # here: encoding text needs no dataset code

    seen = 0
    for texts in parquets_iter_batched("train"):
        for text in texts:
            text = text[:doc_cap]
            if seen + len(text) > max_chars:
                text = text[: max_chars - seen]
            seen += len(text)
            yield text
            if seen >= max_chars:
                return


def train_tokenizer(vocab_size, max_chars, doc_cap=10_000):
    """A BPE tokenizer trained on the train split and saved to the base dir's tokenizer/. A tokenizer already there
    moves first to <base>/replaced/<time>/tokenizer/, never deleted: runs trained with it need it back to be read.
    Returns (the new tokenizer, where the old one went, or None). Trained before anything moves: a training that fails
    or is interrupted leaves the old one in place."""
    from nanochat.run_dir import set_aside  # here: encoding text needs no run-directory code

    tokenizer = Tokenizer.train_from_iterator(train_texts(max_chars, doc_cap), vocab_size)
    tok_dir = get_tokenizer_dir()
    base, name = os.path.split(tok_dir)
    old = os.path.join(set_aside(base, [name]), name) if os.path.exists(tok_dir) else None
    tokenizer.save(tok_dir)
    return tokenizer, old
