"""The pretraining shards: layout, errors, the offline corpus, and downloads with retries."""

import io
import os
import socket
import urllib.error

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanochat import dataset
from nanochat.common import UserError
from nanochat.dataset import (
    build_offline_corpus,
    climbmix_indices,
    download_shards,
    list_parquet_files,
    list_row_groups,
    parquets_iter_batched,
    split_files,
    split_long_text,
)


def write_shard(path, texts, row_group_size=2):
    pq.write_table(pa.table({"text": texts}), str(path), row_group_size=row_group_size)


def write_txt_dir(root, docs):
    root.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (root / f"{i:03d}.txt").write_text(doc, encoding="utf-8")
    return str(root)


def shard_bytes(data_dir):
    return {os.path.basename(p): open(p, "rb").read() for p in list_parquet_files(data_dir)}


@pytest.fixture
def base_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    return tmp_path / "base"


# -----------------------------------------------------------------------------
# reading and splits


def test_tiny_corpus_layout(tiny_base_dir, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", tiny_base_dir)
    files = list_parquet_files()
    assert [os.path.basename(f) for f in files] == [f"shard_{i:05d}.parquet" for i in range(5)]
    assert split_files("val") == files[-1:]
    assert split_files("train") == files[:-1]
    assert all(pq.ParquetFile(f).num_row_groups > 1 for f in files)
    train_docs = [t for batch in parquets_iter_batched("train") for t in batch]
    val_docs = [t for batch in parquets_iter_batched("val") for t in batch]
    assert len(train_docs) + len(val_docs) == 300
    assert not set(train_docs) & set(val_docs)  # each tiny doc is unique ("Document i.")


def test_row_group_striding_partitions_the_split(tiny_base_dir, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", tiny_base_dir)
    everything = list_row_groups("train")
    rank0, rank1 = list_row_groups("train", 0, 2), list_row_groups("train", 1, 2)
    assert rank0 and rank1 and not set(rank0) & set(rank1)
    assert sorted(rank0 + rank1) == sorted(everything)
    docs0 = [t for b in parquets_iter_batched("train", 0, 2) for t in b]
    docs1 = [t for b in parquets_iter_batched("train", 1, 2) for t in b]
    assert docs0 and docs1 and not set(docs0) & set(docs1)


def test_no_shards_error_names_both_commands(base_dir):
    with pytest.raises(UserError) as e:
        next(parquets_iter_batched("train"))
    assert "nanochat.dataset -n" in str(e.value) and "--offline" in str(e.value)


def test_single_shard_is_an_error(base_dir):
    (base_dir / "base_data").mkdir(parents=True)
    write_shard(base_dir / "base_data" / "shard_00000.parquet", ["a", "b"])
    with pytest.raises(UserError, match="at least 2"):
        split_files("train")


def test_bad_split_name(base_dir):
    with pytest.raises(UserError, match="'train' or 'val'"):
        split_files("test")


def test_empty_dataset_is_an_error(base_dir):
    data = base_dir / "base_data"
    data.mkdir(parents=True)
    for i in range(3):
        write_shard(data / f"shard_{i:05d}.parquet", pa.array([], type=pa.string()))
    with pytest.raises(UserError, match="no documents"):
        list(parquets_iter_batched("train"))


def test_corrupt_shard_error_names_the_file(base_dir):
    data = base_dir / "base_data"
    data.mkdir(parents=True)
    write_shard(data / "shard_00000.parquet", ["hello", "world"])
    (data / "shard_00001.parquet").write_bytes(b"this is not parquet at all")
    with pytest.raises(UserError, match="shard_00001.parquet"):
        next(parquets_iter_batched("val"))


def test_temp_files_are_not_shards(base_dir):
    data = base_dir / "base_data"
    data.mkdir(parents=True)
    write_shard(data / "shard_00000.parquet", ["a"])
    (data / ".shard_00001.parquet.tmp123").write_bytes(b"partial")
    assert [os.path.basename(p) for p in list_parquet_files()] == ["shard_00000.parquet"]


# -----------------------------------------------------------------------------
# offline corpus


def test_offline_txt_corpus_is_deterministic_and_complete(tmp_path):
    docs = [f"Text number {i}. " * (1 + i % 7) for i in range(50)]
    txt = write_txt_dir(tmp_path / "txt", docs)
    a = build_offline_corpus(str(tmp_path / "a"), txt_dir=txt, num_train_shards=3, docs_per_row_group=4)
    build_offline_corpus(str(tmp_path / "b"), txt_dir=txt, num_train_shards=3, docs_per_row_group=4)
    assert len(a) == 4 and os.path.basename(a[-1]) == "shard_00003.parquet"
    assert shard_bytes(tmp_path / "a") == shard_bytes(tmp_path / "b")
    texts = [t for p in a for t in pq.read_table(p).column("text").to_pylist()]
    assert sorted(texts) == sorted(docs)
    assert texts != docs  # shuffled
    assert pq.ParquetFile(a[0]).num_row_groups > 1


def test_offline_stdlib_corpus_is_deterministic(tmp_path):
    a = build_offline_corpus(str(tmp_path / "a"), num_train_shards=2, max_docs=40)
    build_offline_corpus(str(tmp_path / "b"), num_train_shards=2, max_docs=40)
    assert shard_bytes(tmp_path / "a") == shard_bytes(tmp_path / "b")
    texts = [t for p in a for t in pq.read_table(p).column("text").to_pylist()]
    assert any(t.startswith("Module ") for t in texts)
    assert sum(len(t) for t in texts) > 10_000


def test_offline_rebuild_replaces_previous_offline_build(tmp_path):
    txt = write_txt_dir(tmp_path / "txt", [f"doc {i}" for i in range(20)])
    build_offline_corpus(str(tmp_path / "d"), txt_dir=txt, num_train_shards=5)
    build_offline_corpus(str(tmp_path / "d"), txt_dir=txt, num_train_shards=2)
    assert len(list_parquet_files(str(tmp_path / "d"))) == 3


def test_offline_refuses_to_mix_with_downloaded_shards(tmp_path):
    data = tmp_path / "d"
    data.mkdir()
    write_shard(data / "shard_00000.parquet", ["downloaded"])
    txt = write_txt_dir(tmp_path / "txt", ["x", "y", "z"])
    with pytest.raises(UserError, match="already holds"):
        build_offline_corpus(str(data), txt_dir=txt, num_train_shards=1)


def test_offline_txt_dir_errors(tmp_path):
    with pytest.raises(UserError, match="not a directory"):
        build_offline_corpus(str(tmp_path / "d"), txt_dir=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no .txt files"):
        build_offline_corpus(str(tmp_path / "d"), txt_dir=str(tmp_path / "empty"))
    txt = write_txt_dir(tmp_path / "few", ["only one"])
    with pytest.raises(UserError, match="only 1 documents"):
        build_offline_corpus(str(tmp_path / "d"), txt_dir=txt, num_train_shards=1)


def test_split_long_text_respects_limit_and_keeps_text():
    text = "\n\n".join(["para " * n for n in (1, 30, 2, 50, 3)] + ["x" * 400])
    pieces = split_long_text(text, 100)
    assert all(len(p) <= 100 for p in pieces)
    assert "".join(pieces).replace("\n", "") == text.replace("\n", "")


def test_cli_offline_with_txt_dir(tmp_path, base_dir, capsys):
    txt = write_txt_dir(tmp_path / "txt", [f"line {i}" for i in range(30)])
    dataset.main(["--offline", "--txt-dir", txt, "--offline-train-shards", "2"])
    assert "2 train shards + 1 val shard" in capsys.readouterr().out
    assert len(list_parquet_files()) == 3


def test_cli_without_action_is_a_one_line_error(base_dir, capsys):
    with pytest.raises(SystemExit) as e:
        dataset.main([])
    assert e.value.code == 1
    assert capsys.readouterr().err.count("\n") == 1


# -----------------------------------------------------------------------------
# downloading (no network: file:// URLs and a fake opener)


@pytest.fixture
def upstream(tmp_path):
    """A local directory posing as the Hugging Face dataset, served over file://."""
    root = tmp_path / "upstream"
    root.mkdir()
    for i in (0, 1, 2, dataset.MAX_SHARD):
        write_shard(root / dataset.shard_name(i), [f"shard {i} doc {j}" for j in range(4)])
    return root


def test_climbmix_indices_always_include_validation_shard():
    assert climbmix_indices(3) == [0, 1, 2, dataset.MAX_SHARD]
    assert climbmix_indices(-1)[-1] == dataset.MAX_SHARD and len(climbmix_indices(-1)) == dataset.MAX_SHARD + 1
    with pytest.raises(UserError, match="-n must be"):
        climbmix_indices(0)


def test_download_from_file_url_and_skip_existing(upstream, tmp_path, monkeypatch):
    data = tmp_path / "data"
    download_shards(climbmix_indices(3), str(data), workers=2, base_url=upstream.as_uri(), retry_delay=0)
    names = sorted(os.listdir(data))
    assert names == [dataset.shard_name(i) for i in (0, 1, 2, dataset.MAX_SHARD)]
    assert split_files("val", str(data)) == [str(data / dataset.shard_name(dataset.MAX_SHARD))]
    assert (data / "shard_00001.parquet").read_bytes() == (upstream / "shard_00001.parquet").read_bytes()

    def must_not_fetch(url, timeout):
        raise AssertionError("present shards must not be downloaded again")

    monkeypatch.setattr(dataset, "_open_url", must_not_fetch)
    download_shards(climbmix_indices(3), str(data), base_url=upstream.as_uri())


class FlakyOpener:
    """Fails `failures` times (connection reset or cut-off body), then serves the real bytes."""

    def __init__(self, payload, failures, how):
        self.payload, self.failures, self.how, self.calls = payload, failures, how, 0

    def __call__(self, url, timeout):
        self.calls += 1
        if self.calls <= self.failures:
            if self.how == "reset":
                raise ConnectionResetError("connection reset by peer")
            return io.BytesIO(self.payload[: len(self.payload) // 2])  # truncated body, no parquet footer
        return io.BytesIO(self.payload)


@pytest.mark.parametrize("how", ["reset", "truncate"])
def test_download_retries_then_succeeds(upstream, tmp_path, monkeypatch, how):
    opener = FlakyOpener((upstream / "shard_00000.parquet").read_bytes(), failures=2, how=how)
    monkeypatch.setattr(dataset, "_open_url", opener)
    sleeps = []
    monkeypatch.setattr(dataset.time, "sleep", sleeps.append)
    out = tmp_path / "out"
    out.mkdir()
    path = dataset.download_one(0, str(out), base_url="https://example.invalid/x", retry_delay=1.0)
    assert opener.calls == 3
    assert sleeps == [1.0, 2.0]  # exponential backoff
    assert pq.read_table(path).num_rows == 4
    assert os.listdir(out) == ["shard_00000.parquet"]


def test_failed_download_leaves_no_partial_file(upstream, tmp_path, monkeypatch):
    opener = FlakyOpener((upstream / "shard_00000.parquet").read_bytes(), failures=99, how="truncate")
    monkeypatch.setattr(dataset, "_open_url", opener)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(UserError, match="failed after 3 attempts"):
        dataset.download_one(0, str(out), base_url="https://example.invalid/x", attempts=3, retry_delay=0)
    assert opener.calls == 3
    assert os.listdir(out) == []


def test_interrupted_download_leaves_no_partial_file(tmp_path, monkeypatch):
    class Interrupting(io.BytesIO):
        def read(self, n=-1):
            if self.tell() > 0:
                raise KeyboardInterrupt
            return super().read(10)

    monkeypatch.setattr(dataset, "_open_url", lambda url, timeout: Interrupting(b"x" * 100))
    with pytest.raises(KeyboardInterrupt):
        dataset.download_one(0, str(tmp_path), base_url="https://example.invalid/x", retry_delay=0)
    assert os.listdir(tmp_path) == []


def test_http_404_is_not_retried(tmp_path, monkeypatch):
    calls = []

    def not_found(url, timeout):
        calls.append(url)
        raise urllib.error.HTTPError(url, 404, "Not Found", {}, None)

    monkeypatch.setattr(dataset, "_open_url", not_found)
    with pytest.raises(UserError, match="HTTP 404"):
        dataset.download_one(5, str(tmp_path), base_url="https://example.invalid/x", retry_delay=0)
    assert len(calls) == 1 and calls[0].endswith("/shard_00005.parquet")


def test_offline_dns_failure_is_one_clear_line(tmp_path, monkeypatch):
    def no_dns(*args, **kwargs):
        raise socket.gaierror(-3, "Temporary failure in name resolution")

    monkeypatch.setattr(dataset.socket, "getaddrinfo", no_dns)
    with pytest.raises(UserError) as e:
        download_shards([0, dataset.MAX_SHARD], str(tmp_path), retry_delay=0)
    msg = str(e.value)
    assert "cannot reach huggingface.co" in msg and "python -m nanochat.dataset --offline" in msg and "\n" not in msg
    assert os.listdir(tmp_path) == []


def test_connection_failures_after_retries_report_offline(tmp_path, monkeypatch):
    def refused(url, timeout):
        raise urllib.error.URLError(ConnectionRefusedError(111, "Connection refused"))

    monkeypatch.setattr(dataset, "_open_url", refused)
    with pytest.raises(UserError, match="cannot reach example.invalid.*--offline"):
        dataset.download_one(0, str(tmp_path), base_url="https://example.invalid/x", attempts=2, retry_delay=0)


def test_download_refuses_offline_corpus_dir_and_bad_index(tmp_path):
    txt = write_txt_dir(tmp_path / "txt", ["a", "b", "c"])
    build_offline_corpus(str(tmp_path / "d"), txt_dir=txt, num_train_shards=1)
    with pytest.raises(UserError, match="offline corpus"):
        download_shards([0], str(tmp_path / "d"))
    with pytest.raises(UserError, match="out of range"):
        download_shards([dataset.MAX_SHARD + 1], str(tmp_path / "e"))
