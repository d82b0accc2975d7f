"""
The repo's tokenizer as a transformers fast tokenizer (tokenizer.json) with the same ids.

The repo's tokenizer is a tiktoken Encoding (byte-level BPE merges as ranks, a split pattern, special tokens);
here it becomes a `tokenizers` BPE that transformers loads as a PreTrainedTokenizerFast.

tiktoken stores each token's rank, not the merges that made it; a BPE in `tokenizers` needs both a vocabulary and
ordered merges. Token t of rank r was made by merging two tokens of lower rank, and tiktoken's own merge loop run on
t's bytes with the ranks below r stops at exactly those two: that pair is t's merge, and the merges in rank order
are the BPE's. tiktoken also returns a piece that is a whole token as that token without merging (ignore_merges).
Bytes become characters through the byte-level alphabet of `tokenizers`' ByteLevel pre-tokenizer and decoder.
"""

from nanochat.tokenizer import SPECIAL_TOKENS

# strings whose ids the export checks against tiktoken's: unicode (accents, CJK, emoji, a ZWJ sequence), digits,
# runs of whitespace, contractions, code, and the special tokens in text
CHECK_TEXTS = [
    "The capital of France is Paris.",
    "Héllo wörld — naïve café, résumé, straße; Ünïcödé: ñ ß ø.",
    "東京は日本の首都です。中文字符 данные 🙂🙂 👩‍👩‍👧‍👦",
    "Numbers 1 12 123 1234 12345 3.14159 -42 1e-5 2026-12-01",
    "  leading, trailing and   inner   spaces  \n\n\n\ttabs\t\tand\r\nCRLF\r\n",
    "don't I'LL we've they're she'd YOU'D it's",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n",
    "<|bos|>Hi<|user_start|>question<|user_end|><|assistant_start|>answer<|assistant_end|>",
    "",
    " ",
    "\n",
]


def byte_alphabet():
    """The printable stand-in for each byte (0-255) that `tokenizers`' ByteLevel uses: printable Latin-1 bytes
    stand for themselves, the others for the characters from U+0100 on, in byte order."""
    printable = (
        set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), ord("ÿ") + 1))
    )
    out, shifted = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + shifted)
            shifted += 1
    return out


def merge_of(ranks, token, rank):
    """The two tokens whose merge made `token`: tiktoken's merge loop on its bytes, with the ranks below `rank` only."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < rank and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            raise ValueError(f"token {token!r} (rank {rank}) is not a merge of two lower-ranked tokens")
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def backend_tokenizer(enc):
    """A `tokenizers.Tokenizer` with the Encoding's ids: byte-level BPE behind its split pattern, the special tokens
    added as special (never split, skipped by decode(skip_special_tokens=True))."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    alphabet = byte_alphabet()

    def chars(bs):
        return "".join(alphabet[b] for b in bs)

    ranks = enc._mergeable_ranks
    ordered = sorted(ranks.items(), key=lambda kv: kv[1])
    if [r for _, r in ordered] != list(range(len(ordered))):
        raise ValueError("the tokenizer's ranks are not 0..n-1: its ids cannot be a BPE vocabulary")
    vocab = {chars(t): r for t, r in ordered}
    merges = [tuple(chars(p) for p in merge_of(ranks, t, r)) for t, r in ordered if len(t) > 1]
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(enc._pat_str), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = sorted(enc._special_tokens.items(), key=lambda kv: kv[1])
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name, _ in specials])
    got = {name: tok.token_to_id(name) for name, _ in specials}
    if got != dict(specials):
        raise ValueError(f"special token ids differ after conversion: {got} vs {dict(specials)}")
    return tok


BOS = SPECIAL_TOKENS[0]
# padding must not be <|bos|>: transformers takes every pad id in a prompt given without an attention mask for padding,
# and every prompt starts with <|bos|>. The last special token never occurs in base-model text.
PAD = SPECIAL_TOKENS[-1]


def hf_tokenizer(enc, model_max_length):
    """A PreTrainedTokenizerFast that adds <|bos|> in front of a text (add_special_tokens, the default), as every
    document started in training; <|bos|> is also its eos (the model starts a new document: a sample is over)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=backend_tokenizer(enc),
        bos_token=BOS,
        eos_token=BOS,
        pad_token=PAD,
        add_bos_token=True,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def id_mismatches(enc, tok, texts=CHECK_TEXTS):
    """Texts whose ids differ between tiktoken and the converted tokenizer, as (text, tiktoken ids, converted ids):
    the special tokens in text kept whole (tiktoken's allowed_special="all"), and, with split_special_tokens,
    encoded as plain text (encode_ordinary, what training saw); plus the decoded text of both."""
    bad = []
    for text in texts:
        whole = enc.encode(text, allowed_special="all")
        got = tok(text, add_special_tokens=False, verbose=False)["input_ids"]
        if got != whole or tok.decode(got) != enc.decode(whole):
            bad.append((text, whole, got))
        plain = tok(text, add_special_tokens=False, split_special_tokens=True, verbose=False)["input_ids"]
        if plain != enc.encode_ordinary(text):
            bad.append((text, enc.encode_ordinary(text), plain))
    return bad
