"""
The pretraining corpus: parquet shards with a `text` column under <base_dir>/base_data/.

Shards are named shard_XXXXX.parquet and sorted by name; the last shard is the
validation split, all others are train. Two ways to get shards:

    python -m nanochat.dataset -n 8          # download ClimbMix shards 0..7 (+ the validation shard) (network)
    python -m nanochat.dataset --offline     # build a corpus from the Python standard library's docs

The ClimbMix mirror (karpathy/climbmix-400b-shuffle on Hugging Face) has 6543
shards, shard_00000 .. shard_06542; shard_06542 is used for validation.
"""

import argparse
import ast
import hashlib
import json
import math
import os
import random
import socket
import sys
import sysconfig
import threading
import time
import tokenize
import urllib.error
import urllib.parse
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor, as_completed

import pyarrow as pa
import pyarrow.parquet as pq

from nanochat.common import (
    UserError,
    exit_on_user_error,
    ensure_writable_dir,
    atomic_write_bytes,
    atomic_write_json,
    get_base_dir,
    print0,
)

BASE_URL = "https://huggingface.co/datasets/karpathy/climbmix-400b-shuffle/resolve/main"
MAX_SHARD = 6542  # index of the last upstream shard (6543 shards in total); it is the validation shard
OFFLINE_MARKER = "offline_corpus.json"  # written next to shards built by build_offline_corpus
MAKE_DATA_HINT = (
    "run `python -m nanochat.dataset -n 8` (download) or `python -m nanochat.dataset --offline` (no network)"
)


# Estimates, not measurements: a ClimbMix shard holds ~250M characters ≈ 55M tokens of a 32K-vocab
# tokenizer (400B tokens / 6,543 shards ≈ 61M) in ~100 MB. BOS-aligned best-fit packing crops the tail of a
# document when nothing else fits a row, and a run reads 1/PACKING_KEPT tokens of text per token trained:
# nanochat states ~35% cropped at T = 2048 on web text; our offline corpus of short documents loses 0.2% at
# T = 2048 and 27% at T = 256 (docs/LOG.md, 2026-12-01). speedrun's plan assumes 40% and adds 5%, so neither
# published run reaches a second epoch; every run logs its measured fraction (metrics.jsonl: data_kept).
TOKENS_PER_SHARD = 55_000_000
SHARD_MB = 100
PACKING_KEPT = 0.60
DATA_MARGIN = 1.05


def shards_for(tokens):
    """ClimbMix train shards for a run of `tokens` training tokens, packing losses and a margin included."""
    return math.ceil(tokens * DATA_MARGIN / (TOKENS_PER_SHARD * PACKING_KEPT))


def expected_epochs(tokens, shards):
    """Passes over the train shards that a run of `tokens` training tokens makes (≤ 1: no document twice)."""
    return tokens / (shards * TOKENS_PER_SHARD * PACKING_KEPT)


def shard_name(index):
    return f"shard_{index:05d}.parquet"


def get_data_dir():
    return os.path.join(get_base_dir(), "base_data")


# -----------------------------------------------------------------------------
# Reading


def list_parquet_files(data_dir=None):
    """Sorted full paths of the parquet shards in data_dir (temp files of unfinished writes excluded)."""
    data_dir = data_dir or get_data_dir()
    if not os.path.isdir(data_dir):
        return []
    names = sorted(f for f in os.listdir(data_dir) if f.endswith(".parquet") and not f.startswith("."))
    return [os.path.join(data_dir, f) for f in names]


def split_files(split, data_dir=None):
    """The shard paths of one split: 'val' is the last shard, 'train' all the others."""
    if split not in ("train", "val"):
        raise UserError(f"split must be 'train' or 'val', got {split!r}")
    data_dir = data_dir or get_data_dir()
    files = list_parquet_files(data_dir)
    if not files:
        raise UserError(f"no parquet shards in {data_dir}; {MAKE_DATA_HINT}")
    if len(files) < 2:
        raise UserError(
            f"only one shard in {data_dir}, need at least 2 (the last one is the validation split); {MAKE_DATA_HINT}"
        )
    return files[:-1] if split == "train" else files[-1:]


def data_fingerprint(split, data_dir=None):
    """A short hash of a split's shard files (names and sizes): a run resumed or evaluated on other data differs here.
    Sizes, not contents, so it costs nothing on 300 shards; a rewritten shard of the same size is not caught."""
    h = hashlib.sha256()
    for path in split_files(split, data_dir):
        h.update(f"{os.path.basename(path)}:{os.path.getsize(path)};".encode())
    return h.hexdigest()[:16]


def _open_parquet(path):
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for corrupt or truncated files
        raise UserError(
            f"cannot read parquet shard {path} ({type(e).__name__}: {e}); delete it and re-create the data"
        ) from None


def list_row_groups(split, start=0, step=1, data_dir=None):
    """(path, row_group_index) pairs of a split in file order, strided by (start, step) across all shards."""
    pairs = []
    for path in split_files(split, data_dir):
        pf = _open_parquet(path)
        if "text" not in pf.schema_arrow.names:
            raise UserError(f"parquet shard {path} has no 'text' column; delete it and re-create the data")
        pairs.extend((path, i) for i in range(pf.num_row_groups))
    return pairs[start::step]


def row_group_sizes(row_groups):
    """Number of documents in each (path, row_group_index) pair, from the parquet footers (no data read)."""
    metadata = {}
    for path, _ in row_groups:
        if path not in metadata:
            metadata[path] = _open_parquet(path).metadata
    return [metadata[path].row_group(rg).num_rows for path, rg in row_groups]


def read_row_group(path, row_group):
    """The texts (list[str]) in one row group of one shard."""
    try:
        table = _open_parquet(path).read_row_group(row_group, columns=["text"])
    except UserError:
        raise
    except Exception as e:
        raise UserError(
            f"cannot read row group {row_group} of parquet shard {path} "
            f"({type(e).__name__}: {e}); delete it and re-create the data"
        ) from None
    return [t if t is not None else "" for t in table.column("text").to_pylist()]


def parquets_iter_batched(split, start=0, step=1, data_dir=None):
    """Yield the documents of a split one row group at a time (list[str]); row groups strided by (start, step) for
    ranks."""
    row_groups = list_row_groups(split, start, step, data_dir)
    num_docs = 0
    for path, rg in row_groups:
        texts = read_row_group(path, rg)
        num_docs += len(texts)
        yield texts
    if num_docs == 0:
        raise UserError(f"the {split} split (rank offset {start} of {step}) has no documents; {MAKE_DATA_HINT}")


# -----------------------------------------------------------------------------
# Downloading ClimbMix


def _open_url(url, timeout):
    # the one place that touches the network, so tests can replace it
    return urllib.request.urlopen(url, timeout=timeout)


class TruncatedDownload(Exception):
    pass


def _is_connection_error(e):
    # DNS failure, refused or unreachable network, timeouts: the host is out of reach (HTTP errors are not)
    if isinstance(e, urllib.error.HTTPError):
        return False
    if isinstance(e, urllib.error.URLError):
        return isinstance(e.reason, OSError)
    return isinstance(e, (ConnectionError, TimeoutError, socket.gaierror))


def _offline_error(url):
    host = urllib.parse.urlparse(url).hostname or url
    return UserError(
        f"cannot reach {host} to download {url}; build the offline corpus with `python -m nanochat.dataset --offline`"
    )


class _Progress:
    """Shards done / total and megabytes so far, on one updating line."""

    def __init__(self, total):
        self.total, self.done, self.bytes = total, 0, 0
        self.lock = threading.Lock()
        self.last_print = 0.0

    def add_bytes(self, n):
        with self.lock:
            self.bytes += n
            self._show(force=False)

    def shard_done(self):
        with self.lock:
            self.done += 1
            self._show(force=True)

    def _show(self, force):
        now = time.time()
        if not force and now - self.last_print < 0.5:
            return
        self.last_print = now
        end = "\n" if self.done == self.total else ""
        print(
            f"\rdownloaded {self.done}/{self.total} shards, {self.bytes / 1e6:.1f} MB",
            end=end,
            file=sys.stderr,
            flush=True,
        )


def download_one(index, data_dir, base_url=BASE_URL, attempts=5, retry_delay=2.0, timeout=60, progress=None):
    """Download one shard to data_dir unless it is already there; retries with exponential backoff.

    The bytes go to a hidden temp file that is renamed into place only once complete and
    readable as parquet, so an interrupted download never leaves a half shard behind.
    """
    path = os.path.join(data_dir, shard_name(index))
    if os.path.exists(path):
        return path
    url = f"{base_url}/{shard_name(index)}"
    tmp = os.path.join(data_dir, f".{shard_name(index)}.tmp{os.getpid()}.{threading.get_ident()}")
    last_error = None
    for attempt in range(attempts):
        if attempt > 0:
            time.sleep(retry_delay * 2 ** (attempt - 1))
        try:
            with _open_url(url, timeout) as resp, open(tmp, "wb") as f:
                expected = resp.headers.get("Content-Length") if getattr(resp, "headers", None) else None
                written = 0
                while chunk := resp.read(1 << 20):
                    f.write(chunk)
                    written += len(chunk)
                    if progress:
                        progress.add_bytes(len(chunk))
            if expected is not None and int(expected) != written:
                raise TruncatedDownload(f"got {written} of {expected} bytes")
            pq.read_metadata(tmp)  # the parquet footer is at the end: a cut-off file fails here
            os.replace(tmp, path)
            return path
        except urllib.error.HTTPError as e:
            last_error = e
            if e.code in (401, 403, 404):  # retrying will not help
                _remove_quietly(tmp)
                raise UserError(
                    f"download of {url} failed with HTTP {e.code}; check the shard index (0..{MAX_SHARD})"
                ) from None
        except BaseException as e:
            last_error = e
            if not isinstance(e, Exception):  # KeyboardInterrupt and friends: stop now, temp file gone
                raise
        finally:
            _remove_quietly(tmp)
        print(
            f"\nshard {index}: attempt {attempt + 1}/{attempts} failed: {type(last_error).__name__}: {last_error}",
            file=sys.stderr,
        )
    if _is_connection_error(last_error):
        raise _offline_error(url)
    raise UserError(f"download of {url} failed after {attempts} attempts ({type(last_error).__name__}: {last_error})")


def _remove_quietly(path):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _check_reachable(url):
    # fail fast with one clear line when there is no network, instead of retrying every shard
    parts = urllib.parse.urlparse(url)
    if parts.scheme not in ("http", "https"):
        return
    try:  # DNS lookup and a TCP connect, with a short timeout for firewalls that drop packets silently
        socket.create_connection(
            (parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)), timeout=15
        ).close()
    except OSError:
        raise _offline_error(url) from None


def download_shards(indices, data_dir=None, workers=4, base_url=BASE_URL, attempts=5, retry_delay=2.0):
    """Download the given ClimbMix shard indices in parallel; shards already present are skipped."""
    data_dir = data_dir or get_data_dir()
    os.makedirs(data_dir, exist_ok=True)
    if os.path.exists(os.path.join(data_dir, OFFLINE_MARKER)):
        raise UserError(
            f"{data_dir} holds the offline corpus; delete its shards and {OFFLINE_MARKER} (or use another "
            "NANOCHAT_BASE_DIR) before downloading"
        )
    bad = [i for i in indices if not 0 <= i <= MAX_SHARD]
    if bad:
        raise UserError(f"shard index {bad[0]} out of range; ClimbMix shards are 0..{MAX_SHARD}")
    todo = sorted(i for i in set(indices) if not os.path.exists(os.path.join(data_dir, shard_name(i))))
    print0(
        f"{len(set(indices)) - len(todo)} of {len(set(indices))} shards already "
        f"in {data_dir}; downloading {len(todo)} with {workers} workers"
    )
    if not todo:
        return
    _check_reachable(base_url)
    progress = _Progress(len(todo))

    def job(i):
        download_one(i, data_dir, base_url, attempts, retry_delay, progress=progress)
        progress.shard_done()

    pool = ThreadPoolExecutor(max_workers=max(1, workers))
    try:
        for future in as_completed([pool.submit(job, i) for i in todo]):
            future.result()  # re-raises the first failure
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # on failure, shards not yet started are dropped


def climbmix_indices(num_train_shards):
    """Train shards 0..n-1 plus the validation shard, so the 'last shard is val' convention holds."""
    if num_train_shards == -1:
        num_train_shards = MAX_SHARD
    if not 1 <= num_train_shards <= MAX_SHARD:
        raise UserError(f"-n must be between 1 and {MAX_SHARD} (or -1 for all), got {num_train_shards}")
    return list(range(num_train_shards)) + [MAX_SHARD]


# -----------------------------------------------------------------------------
# Offline corpus: real English text that every Python installation carries

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def _python_file_document(path, module_name):
    """Module, class and function docstrings of one source file, in source order, as one text."""
    try:
        with tokenize.open(path) as f:
            source = f.read()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # old escape sequences in some stdlib files
            tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return ""
    parts = []

    def visit(node, prefix):
        for child in node.body:
            if isinstance(child, ast.ClassDef):
                kind = "class"
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                kind = "def"
            else:
                continue
            name = prefix + child.name
            doc = ast.get_docstring(child)
            if doc:
                parts.append(f"{kind} {name}\n{doc}")
            visit(child, name + ".")

    doc = ast.get_docstring(tree)
    if doc:
        parts.append(doc)
    visit(tree, "")
    if not parts:
        return ""
    return f"Module {module_name}\n\n" + "\n\n".join(parts)


def stdlib_documents():
    """Yield the standard library's documentation as texts, in a fixed order: docstrings per module, .txt/.rst files,
    pydoc topics."""
    root = sysconfig.get_paths()["stdlib"]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if name.endswith(".py"):
                module = rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
                text = _python_file_document(path, module)
            elif name.endswith((".txt", ".rst")):
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read()
            else:
                continue
            if text.strip():
                yield text
    try:
        from pydoc_data.topics import topics  # the language reference that help() shows
    except ImportError:
        topics = {}
    for key in sorted(topics):
        if topics[key].strip():
            yield topics[key]


def txt_documents(txt_dir):
    """Yield the contents of every .txt file under txt_dir, in sorted path order."""
    if not os.path.isdir(txt_dir):
        raise UserError(f"--txt-dir {txt_dir} is not a directory")
    paths = []
    for dirpath, dirnames, filenames in os.walk(txt_dir):
        dirnames.sort()
        paths.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".txt"))
    if not paths:
        raise UserError(
            f"no .txt files under {txt_dir}; put some plain-text files there or drop --txt-dir to use the stdlib docs"
        )
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if text.strip():
            yield text


def split_long_text(text, max_chars):
    """Cut a text into pieces of at most max_chars, at paragraph breaks where possible."""
    pieces, current = [], ""
    for para in text.split("\n\n"):
        while len(para) > max_chars:  # a single huge paragraph: hard cut
            if current:
                pieces.append(current)
                current = ""
            pieces.append(para[:max_chars])
            para = para[max_chars:]
        if current and len(current) + 2 + len(para) > max_chars:
            pieces.append(current)
            current = para
        else:
            current = current + "\n\n" + para if current else para
    if current.strip():
        pieces.append(current)
    return [p for p in pieces if p.strip()]


def _parquet_bytes(texts, docs_per_row_group):
    # at least 8 row groups per shard where possible, so 8 ranks can share even the single validation shard
    rows_per_group = max(1, min(docs_per_row_group, len(texts) // 8))
    table = pa.table({"text": pa.array(texts, type=pa.string())})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=rows_per_group, compression="zstd")
    return sink.getvalue().to_pybytes()


def build_offline_corpus(
    data_dir=None, txt_dir=None, num_train_shards=8, docs_per_row_group=32, max_doc_chars=1_000, max_docs=None, seed=42
):
    """Write an offline corpus as parquet shards: num_train_shards train shards plus one validation shard (the last
    index).

    Source: the standard library's docstrings and docs by default, or every .txt file under txt_dir.
    Deterministic: the same machine gives the same bytes on every build. Returns the shard paths.
    """
    data_dir = data_dir or get_data_dir()
    if num_train_shards < 1 or docs_per_row_group < 1 or max_doc_chars < 1:
        raise UserError("num_train_shards, docs_per_row_group and max_doc_chars must all be at least 1")
    existing = list_parquet_files(data_dir)
    marker = os.path.join(data_dir, OFFLINE_MARKER)
    if existing and not os.path.exists(marker):
        raise UserError(
            f"{data_dir} already holds {len(existing)} downloaded "
            "shards; use another NANOCHAT_BASE_DIR or delete them first"
        )

    source = txt_documents(txt_dir) if txt_dir else stdlib_documents()
    docs = []
    for i, text in enumerate(source):
        if max_docs is not None and i >= max_docs:
            break
        docs.extend(split_long_text(text, max_doc_chars))
    num_shards = num_train_shards + 1
    if len(docs) < num_shards:
        raise UserError(
            f"only {len(docs)} documents found, need at least {num_shards} for {num_train_shards} train shards + 1 "
            "validation shard; add text or lower --offline-train-shards"
        )
    random.Random(seed).shuffle(docs)

    for path in existing:  # replace the previous offline build
        os.remove(path)
    paths = []
    for s in range(num_shards):
        shard_docs = docs[s * len(docs) // num_shards : (s + 1) * len(docs) // num_shards]
        path = os.path.join(data_dir, shard_name(s))
        atomic_write_bytes(path, _parquet_bytes(shard_docs, docs_per_row_group))
        paths.append(path)
    atomic_write_json(
        marker,
        {
            "source": "txt_dir" if txt_dir else "python stdlib docs",
            "num_docs": len(docs),
            "num_chars": sum(len(d) for d in docs),
            "num_train_shards": num_train_shards,
            "docs_per_row_group": docs_per_row_group,
            "max_doc_chars": max_doc_chars,
            "seed": seed,
        },
    )
    return paths


# -----------------------------------------------------------------------------


def main(argv=None):
    parser = argparse.ArgumentParser(description="Download ClimbMix shards, or build an offline corpus.")
    parser.add_argument(
        "-n",
        "--num-train-shards",
        type=int,
        default=None,
        help="ClimbMix train shards to download (-1 = all); the validation shard is always added",
    )
    parser.add_argument("-w", "--workers", type=int, default=4, help="parallel downloads")
    parser.add_argument("--offline", action="store_true", help="build a corpus from local text instead of downloading")
    parser.add_argument(
        "--txt-dir",
        default=None,
        help="with --offline: use every .txt file under this directory instead of the stdlib docs",
    )
    parser.add_argument("--offline-train-shards", type=int, default=8, help="with --offline: number of train shards")
    args = parser.parse_args(argv)
    with exit_on_user_error():
        ensure_writable_dir(get_data_dir())
        if args.offline:
            t0 = time.time()
            paths = build_offline_corpus(txt_dir=args.txt_dir, num_train_shards=args.offline_train_shards)
            with open(os.path.join(os.path.dirname(paths[0]), OFFLINE_MARKER)) as f:
                info = json.load(f)
            print(
                f"offline corpus: {info['num_docs']:,} docs, {info['num_chars'] / 1e6:.1f}M chars, {len(paths) - 1} "
                f"train shards + 1 val shard in {os.path.dirname(paths[0])} ({time.time() - t0:.1f}s)"
            )
        elif args.num_train_shards is not None:
            download_shards(climbmix_indices(args.num_train_shards), workers=args.workers)
        else:
            raise UserError(
                "give -n NUM_TRAIN_SHARDS to download ClimbMix, or --offline to build a corpus without network"
            )


if __name__ == "__main__":
    main()
