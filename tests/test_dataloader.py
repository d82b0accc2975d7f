"""The training data loader: packing, determinism, exact resume, data seeds, ranks and errors."""

import io
import itertools
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from nanochat.common import UserError
from nanochat.dataloader import data_loader, packing_kept_fraction
from nanochat.dataset import list_row_groups, read_row_group
from nanochat.tokenizer import get_tokenizer


@pytest.fixture
def tok(tiny_base_dir, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", tiny_base_dir)
    return get_tokenizer()


def take(loader, n):
    return list(itertools.islice(loader, n))


def segments(row, bos):
    """Split a row of token ids at BOS positions: one list per (piece of a) document."""
    starts = [i for i, t in enumerate(row) if t == bos]
    return [row[a:b] for a, b in zip(starts, starts[1:] + [len(row)])]


def all_docs(tok, split):
    from nanochat.dataset import parquets_iter_batched

    texts = [t for batch in parquets_iter_batched(split) for t in batch]
    return {tuple(ids) for ids in tok(texts, prepend=tok.get_bos_token_id())}


def test_batch_shapes_and_packing_invariants(tok):
    B, T = 4, 64
    bos = tok.get_bos_token_id()
    full_docs = all_docs(tok, "train")
    for inputs, targets, state in take(data_loader(tok, B, T, "train", buffer_size=64), 20):
        assert inputs.shape == targets.shape == (B, T)
        assert inputs.dtype == targets.dtype == torch.int64
        assert inputs.is_contiguous() and targets.is_contiguous()
        assert (inputs[:, 0] == bos).all()  # every row starts a document
        assert int(inputs.max()) < tok.get_vocab_size() and int(targets.max()) < tok.get_vocab_size()
        assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are inputs shifted by one
        for r in range(B):
            row = inputs[r].tolist() + [targets[r, -1].item()]
            pieces = segments(row, bos)
            # only the last document of a row may be cropped
            assert all(tuple(p) in full_docs for p in pieces[:-1])
            assert any(d[: len(pieces[-1])] == tuple(pieces[-1]) for d in full_docs)


class CharTokenizer:
    """Token id = character code, BOS = 0: makes packing decisions readable."""

    def get_bos_token_id(self):
        return 0

    def __call__(self, texts, prepend=None, num_threads=1):
        return [[prepend] + [ord(c) for c in t] for t in texts]


def test_best_fit_fills_rows_and_crops_only_the_shortest(tmp_path, monkeypatch):
    data = tmp_path / "base_data"
    data.mkdir()
    # documents of 6, 4, 3 and 9 tokens (BOS included), rows of 10 tokens
    pq.write_table(pa.table({"text": ["AAAAA", "BBB", "CC", "DDDDDDDD"]}), str(data / "shard_00000.parquet"))
    pq.write_table(pa.table({"text": ["val"]}), str(data / "shard_00001.parquet"))
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    batches = take(data_loader(CharTokenizer(), 1, 9, "train"), 3)
    rows = [x[0].tolist() + [y[0, -1].item()] for x, y, _ in batches]
    A, B, D = [ord("A")] * 5, [ord("B")] * 3, [ord("D")] * 8
    # D fits best; nothing fits the last slot, so the shortest (CC) is cropped to its BOS
    assert rows[0] == [0] + D + [0]
    assert rows[1] == [0] + D + [0]  # the next epoch's D, and C cropped again
    assert rows[2] == [0] + A + [0] + B  # A, then B fills the remaining 4 exactly (C would leave a gap)
    # the crops are counted: 2 of CC's 3 tokens each time
    assert [state["dropped_tokens"] for _, _, state in batches] == [2, 4, 4]
    assert packing_kept_fraction(CharTokenizer(), 1, 9, num_batches=3) == 30 / 34  # 3 rows of 10 tokens kept, 4 dropped


def test_deterministic(tok):
    a = take(data_loader(tok, 2, 32, "train", buffer_size=40), 10)
    b = take(data_loader(tok, 2, 32, "train", buffer_size=40), 10)
    for (xa, ya, sa), (xb, yb, sb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb) and sa == sb


@pytest.mark.parametrize("k", [1, 9, 75])
def test_exact_resume(tok, k):
    B, T = 4, 128
    uninterrupted = take(data_loader(tok, B, T, "train", buffer_size=50), k + 5)
    state = uninterrupted[k - 1][2]
    # the state goes through a checkpoint
    buf = io.BytesIO()
    torch.save({"loader": state}, buf)
    buf.seek(0)
    state = torch.load(buf)["loader"]
    resumed = take(data_loader(tok, B, T, "train", buffer_size=50, resume_state=state), 5)
    for (x1, y1, s1), (x2, y2, s2) in zip(uninterrupted[k:], resumed):
        assert torch.equal(x1, x2) and torch.equal(y1, y2) and s1 == s2
    if k == 75:
        assert state["epoch"] >= 1  # the resume point lies past an epoch boundary


def test_data_seed_none_is_the_file_order(tok, monkeypatch):
    import nanochat.dataloader as dl

    # the loader read the row groups in file order before data seeds: a loader made to read exactly that list
    # (a data seed's shuffle turned into the identity) gives the batches of data_seed=None, states aside
    default = take(data_loader(tok, 2, 32, "train", rank=1, world_size=3, buffer_size=30), 40)
    monkeypatch.setattr(dl, "random", SimpleNamespace(Random=lambda seed: SimpleNamespace(shuffle=lambda order: None)))
    unshuffled = take(data_loader(tok, 2, 32, "train", rank=1, world_size=3, buffer_size=30, data_seed=5), 40)
    for (xa, ya, sa), (xb, yb, sb) in zip(default, unshuffled):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert sa["data_seed"] is None and sb["data_seed"] == 5 and dict(sa, data_seed=5) == sb


def test_data_seed_changes_the_order(tok):
    def first(data_seed):
        return torch.cat(
            [x for x, _, _ in take(data_loader(tok, 2, 32, "train", buffer_size=8, data_seed=data_seed), 10)]
        )

    default, seven, eight = first(None), first(7), first(8)
    assert not torch.equal(default, seven) and not torch.equal(seven, eight)
    assert torch.equal(seven, first(7))  # a seed gives one order


def reads(tok, monkeypatch, n, **kw):
    """The first n row groups the loader reads, in order."""
    import nanochat.dataloader as dl

    read = []
    monkeypatch.setattr(dl, "read_row_group", lambda *rg: read.append(rg) or read_row_group(*rg))
    loader = data_loader(tok, 2, 32, "train", buffer_size=8, **kw)
    while len(read) < n:
        next(loader)
    return read[:n]


def test_data_seed_reads_each_row_group_once_per_epoch_in_a_new_order(tok, monkeypatch):
    everything = list_row_groups("train")
    N = len(everything)
    assert reads(tok, monkeypatch, 2 * N) == everything * 2  # no seed: the file order, every epoch
    read = reads(tok, monkeypatch, 2 * N, data_seed=7)
    epoch0, epoch1 = read[:N], read[N:]
    # every row group (so every document) once per epoch, in an order of its own
    assert sorted(epoch0) == sorted(epoch1) == sorted(everything)
    assert epoch0 != everything and epoch1 != epoch0
    # the shards of any split of the data together read the whole split per epoch, each row group once, and
    # shard s of S reads the order a single loader's shuffle deals it: rows s, s+S, ... of one shuffle
    for S in (2, 3):
        shards = [reads(tok, monkeypatch, len(everything[s::S]), data_seed=7, rank=s, world_size=S) for s in range(S)]
        assert sorted(rg for shard in shards for rg in shard) == sorted(everything)
        assert all(shard == epoch0[s::S] for s, shard in enumerate(shards))


@pytest.mark.parametrize("k", [1, 75])
def test_exact_resume_with_a_data_seed(tok, k):
    B, T = 4, 128
    uninterrupted = take(data_loader(tok, B, T, "train", buffer_size=50, data_seed=3), k + 5)
    state = uninterrupted[k - 1][2]
    assert state["data_seed"] == 3
    resumed = take(data_loader(tok, B, T, "train", buffer_size=50, resume_state=state, data_seed=3), 5)
    for (x1, y1, s1), (x2, y2, s2) in zip(uninterrupted[k:], resumed):
        assert torch.equal(x1, x2) and torch.equal(y1, y2) and s1 == s2
    if k == 75:
        assert state["epoch"] >= 1  # past an epoch boundary: the next epoch's order is drawn again the same
    # a state of another data seed is refused
    for other in (4, None):
        with pytest.raises(UserError, match="same --data-seed"):
            next(data_loader(tok, B, T, "train", buffer_size=50, resume_state=state, data_seed=other))
    # one without a data seed is an earlier version's, whatever the seed now (it was read as seed None)
    old = {key: v for key, v in state.items() if key != "data_seed"}
    for other in (3, None):
        with pytest.raises(UserError, match="records no data seed: a state of an earlier version"):
            next(data_loader(tok, B, T, "train", buffer_size=50, resume_state=old, data_seed=other))


def test_train_and_val_cycle_forever(tok, capsys):
    *_, (_, _, state) = take(data_loader(tok, 4, 128, "val", buffer_size=16), 40)
    assert state["epoch"] >= 2
    assert "finished reading epoch 0 of the val split" in capsys.readouterr().out


def test_one_pass_reads_each_document_once_and_stops(tmp_path, monkeypatch):
    from nanochat.loss_eval import held_batches

    data = tmp_path / "base_data"
    data.mkdir()
    # 30 documents of 2..12 characters, document i written in character 256 + i: a row's pieces name their documents
    docs = [chr(256 + i) * (2 + i * 7 % 11) for i in range(30)]
    pq.write_table(pa.table({"text": ["train"]}), str(data / "shard_00000.parquet"))
    pq.write_table(pa.table({"text": docs}), str(data / "shard_00001.parquet"), row_group_size=4)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    tok, B, T = CharTokenizer(), 2, 9
    batches = list(data_loader(tok, B, T, "val", buffer_size=8, one_pass=True))  # ends: a finite stream
    used = [p[1] for x, y, _ in batches for row in torch.cat([x, y[:, -1:]], 1).tolist() for p in segments(row, 0)
            if len(p) > 1]
    assert len(used) == len(set(used)) > len(batches)  # no document twice
    # the cycling loader mixes the next epoch's copies in before the first ends: the count is of one pass
    assert held_batches(tok, B, T, "val", 10**6) == len(batches) < sum(len(d) + 1 for d in docs) // (B * (T + 1))
    assert held_batches(tok, B, T, "val", 3) == 3
    with pytest.raises(UserError, match="less than one batch"):
        held_batches(tok, 50, T, "val", 1)


def test_ranks_see_different_documents(tok):
    bos = tok.get_bos_token_id()

    def complete_docs(rank):
        docs = set()
        for x, y, _ in take(data_loader(tok, 2, 64, "train", rank=rank, world_size=2, buffer_size=20), 10):
            for r in range(x.shape[0]):
                docs.update(tuple(p) for p in segments(x[r].tolist() + [y[r, -1].item()], bos)[:-1])
        return docs

    d0, d1 = complete_docs(0), complete_docs(1)
    assert d0 and d1 and not d0 & d1


def test_bad_arguments_and_state(tok):
    with pytest.raises(UserError, match="fewer than the 1000 ranks"):
        next(data_loader(tok, 1, 8, "val", rank=0, world_size=1000))
    with pytest.raises(UserError, match="rank 2"):
        next(data_loader(tok, 1, 8, "train", rank=2, world_size=2))
    with pytest.raises(UserError, match="positive"):
        next(data_loader(tok, 0, 8, "train"))
    _, _, state = next(data_loader(tok, 1, 8, "train"))
    with pytest.raises(UserError, match="same setup"):
        next(data_loader(tok, 1, 8, "val", resume_state=state))
    with pytest.raises(UserError, match="not one this loader wrote"):
        next(data_loader(tok, 1, 8, "train", resume_state={"foo": 1}))
    with pytest.raises(UserError, match="data changed"):
        next(data_loader(tok, 1, 8, "train", resume_state=dict(state, num_row_groups=state["num_row_groups"] + 1)))


def test_missing_data_error(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    with pytest.raises(UserError, match="--offline"):
        next(data_loader(CharTokenizer(), 1, 8, "train"))
