"""
Pretraining batches by BOS-aligned best-fit packing.

Every document is tokenized with <|bos|> in front, and every row of T+1 tokens
starts at the beginning of a document. A row is filled by repeatedly taking the
largest buffered document that still fits the space left; when none fits, the
shortest buffered document is cropped to fill the row exactly, and the rest of it
is dropped. That is the only cropping, so little text is thrown away while no row
ever starts mid-document.

The stream is deterministic: rank r reads row groups r, r+W, r+2W, ... of the
split, cycling over epochs forever. The buffer is refilled across the epoch's end,
so near it rows mix both epochs' copies of a document; an evaluation reads the
split once instead (one_pass), so no text is scored twice. With a data seed the
split's row groups are shuffled before they are dealt out, anew each epoch (see _epoch_row_groups); without
one they are read in file order, every epoch. The state yielded with each batch names the
buffered documents by their position in the stream, so a loader resumed from it
re-reads them and yields exactly the batches the uninterrupted one would have.
"""

import itertools
import queue
import random
import threading
import weakref
from bisect import bisect_left, insort
from collections import defaultdict
from functools import lru_cache

import torch

from nanochat.common import UserError
from nanochat.dataset import list_row_groups, read_row_group, row_group_sizes

STATE_VERSION = 1


def data_loader(
    tokenizer,
    B,
    T,
    split,
    device="cpu",
    rank=0,
    world_size=1,
    resume_state=None,
    buffer_size=1000,
    tokenizer_threads=4,
    data_seed=None,
    one_pass=False,
):
    """Yield (inputs, targets, state) forever: int64 (B, T) tensors on device, targets shifted by one; state resumes the
    stream. data_seed (an int) shuffles the order of the row groups, per epoch; None keeps the file order. one_pass:
    read the split once and stop when its documents run out (the partial last batch dropped), never starting epoch 1."""
    if B < 1 or T < 1:
        raise UserError(f"batch size and sequence length must be positive, got B={B}, T={T}")
    if not 0 <= rank < world_size:
        raise UserError(f"rank {rank} is not in 0..{world_size - 1}")
    all_row_groups = list_row_groups(split)
    if len(all_row_groups) < world_size:  # checked on every rank, so all of them stop, not just the idle ones
        raise UserError(
            f"the {split} split has {len(all_row_groups)} row groups, fewer "
            f"than the {world_size} ranks; use fewer GPUs or more data"
        )
    row_groups = _epoch_row_groups(all_row_groups, rank, world_size, data_seed)
    num_row_groups = len(row_groups(0))  # the same every epoch: only their order changes
    # with a data seed it varies a little by epoch; epoch 0's is kept
    docs_per_epoch = sum(row_group_sizes(row_groups(0)))
    if docs_per_epoch == 0:
        raise UserError(f"the {split} split has no documents for rank {rank}; re-create the data")
    if resume_state is not None:
        _check_state(resume_state, split, rank, world_size, num_row_groups, data_seed)
    # the checks above run now, at the call; the batches come from a generator, read on demand
    return _packed_batches(
        tokenizer,
        B,
        T,
        split,
        torch.device(device),
        row_groups,
        num_row_groups,
        docs_per_epoch,
        rank,
        world_size,
        resume_state,
        buffer_size,
        tokenizer_threads,
        data_seed,
        one_pass,
    )


def _epoch_row_groups(all_row_groups, rank, world_size, data_seed):
    """epoch -> this rank's row groups, in the order it reads them that epoch. The whole split is shuffled
    (by data_seed and epoch only) before it is strided over the ranks, so shard s of S reads the same row
    groups whichever processes and micro-steps the S shards are spread over."""
    if data_seed is None:
        mine = all_row_groups[rank::world_size]  # the file order, the one of every run before data seeds
        return lambda epoch: mine

    @lru_cache(maxsize=4)  # the buffer holds documents of an epoch or two at a time
    def shuffled(epoch):
        order = list(all_row_groups)
        random.Random(f"{data_seed}/{epoch}").shuffle(order)  # a str seed is hashed the same in every process and run
        return order[rank::world_size]

    return shuffled


def _packed_batches(
    tokenizer,
    B,
    T,
    split,
    device,
    row_groups,
    num_row_groups,
    docs_per_epoch,
    rank,
    world_size,
    resume_state,
    buffer_size,
    tokenizer_threads,
    data_seed,
    one_pass,
):
    # a small split is buffered once, not many times over
    buffer_target = max(1, min(buffer_size, docs_per_epoch))
    bos = tokenizer.get_bos_token_id()
    row_len = T + 1

    # buffer: keys (num_tokens, epoch, row_group_pos, doc_index) kept sorted, so best fit is a bisect
    keys = []
    tokens = {}  # (epoch, row_group_pos, doc_index) -> token ids, BOS first

    def add_docs(epoch, pos, doc_indices=None):
        texts = read_row_group(*row_groups(epoch)[pos])
        if doc_indices is None:
            doc_indices = range(len(texts))
        ids = tokenizer([texts[d] for d in doc_indices], prepend=bos, num_threads=tokenizer_threads)
        for d, doc in zip(doc_indices, ids):
            tokens[(epoch, pos, d)] = doc
            insort(keys, (len(doc), epoch, pos, d))

    # tokens cropped away so far: the data budget's loss
    dropped = 0 if resume_state is None else resume_state.get("dropped_tokens", 0)
    if resume_state is None:
        epoch, next_pos = 0, 0
    else:
        epoch, next_pos = resume_state["epoch"], resume_state["next_pos"]
        wanted = defaultdict(list)
        for doc_epoch, pos, d in resume_state["buffer"]:
            wanted[(doc_epoch, pos)].append(d)
        for (doc_epoch, pos), doc_indices in sorted(wanted.items()):
            try:
                add_docs(doc_epoch, pos, sorted(doc_indices))
            except IndexError:
                raise UserError(
                    f"the data changed since this loader state was saved (row group {row_groups(doc_epoch)[pos]} lacks "
                    "a document); resume with the same data"
                ) from None

    while True:
        rows = []
        for _ in range(B):
            row = []
            while len(row) < row_len:
                # keep the buffer full so the best fit has many documents to choose from
                while len(keys) < buffer_target and not (one_pass and epoch > 0):
                    add_docs(epoch, next_pos)
                    next_pos += 1
                    if next_pos == num_row_groups:
                        if rank == 0 and not one_pass:
                            print(
                                f"dataloader: finished reading epoch {epoch} of "
                                f"the {split} split, starting epoch {epoch + 1}",
                                flush=True,
                            )
                        epoch, next_pos = epoch + 1, 0
                if not keys:  # one pass, and every document used
                    return
                remaining = row_len - len(row)
                i = bisect_left(keys, (remaining + 1,)) - 1  # largest document with at most `remaining` tokens
                if i >= 0:
                    row.extend(tokens.pop(keys.pop(i)[1:]))
                else:
                    doc = tokens.pop(keys.pop(0)[1:])  # crop the shortest
                    row.extend(doc[:remaining])
                    dropped += len(doc) - remaining
            rows.append(row)
        batch = to_device(torch.tensor(rows, dtype=torch.long), device)
        state = {
            "version": STATE_VERSION,
            "split": split,
            "rank": rank,
            "world_size": world_size,
            "num_row_groups": num_row_groups,
            "data_seed": data_seed,
            "epoch": epoch,
            "next_pos": next_pos,
            "buffer": [k[1:] for k in keys],
            "dropped_tokens": dropped,
        }
        yield batch[:, :-1].contiguous(), batch[:, 1:].contiguous(), state


def to_device(tensor, device):
    """A host tensor on `device`; to a GPU through pinned memory, so the copy is queued without waiting for the
    device."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def packing_kept_fraction(tokenizer, B, T, split="train", num_batches=50):
    """Of the tokens the loader reads, the fraction that reaches a batch (the rest is cropped away):
    how many tokens of text a run of N training tokens consumes is N / this."""
    loader = data_loader(tokenizer, B, T, split)
    for _ in range(num_batches):
        _, _, state = next(loader)
    kept = num_batches * B * (T + 1)
    return kept / (kept + state["dropped_tokens"])


def _check_state(state, split, rank, world_size, num_row_groups, data_seed):
    try:
        ok = state["version"] == STATE_VERSION
        saved = (state["split"], state["rank"], state["world_size"])
    except (KeyError, TypeError):
        raise UserError("the dataloader resume state is not one this loader wrote; start without it") from None
    if not ok:
        raise UserError(f"dataloader resume state version {state['version']} is not {STATE_VERSION}; start without it")
    if saved != (split, rank, world_size):
        raise UserError(
            f"dataloader resume state is for split/rank/world_size {saved}, "
            f"not {(split, rank, world_size)}; resume with the same setup"
        )
    if state["num_row_groups"] != num_row_groups:
        raise UserError(
            f"the {split} data changed since the checkpoint ({state['num_row_groups']} row groups for this rank then, "
            f"{num_row_groups} now); resume with the same shards"
        )
    if "data_seed" not in state:
        raise UserError(
            "the dataloader resume state records no data seed: a state of an earlier version of this code, "
            "which this one does not resume; start without it"
        )
    if state["data_seed"] != data_seed:
        raise UserError(
            f"dataloader resume state is for data seed {state['data_seed']}, not {data_seed}; "
            "resume with the same --data-seed"
        )


class MicroBatches:
    """This process's micro-batches, in order: micro-step m of every step reads shard m's loader. A background thread
    reads and packs the next ones while the device works (tiktoken and pyarrow release the GIL) and keeps up to AHEAD
    of them ready, so a step waits for data only when the host packs slower than the device trains. The loader
    states kept for a checkpoint are those of the micro-batches taken, never of one read ahead; an error in the thread
    is raised by take. The thread ends on close or when the MicroBatches is dropped, and never keeps a process alive."""

    AHEAD = 2

    def __init__(self, loaders, device):
        self.device, self.states, self.error = torch.device(device), [None] * len(loaders), None
        self.ready, self.stopped = queue.Queue(maxsize=self.AHEAD), threading.Event()
        # the thread holds the loaders, the queue and the event but not self, so a dropped self stops it (finalize)
        threading.Thread(
            target=_read_ahead, args=(loaders, self.ready, self.stopped), name="micro-batches", daemon=True
        ).start()
        weakref.finalize(self, self.stopped.set)

    def take(self):
        """The next micro-batch (inputs, targets) on the device; waits while the thread is still packing it."""
        if self.error is None:
            item = self.ready.get()
            if isinstance(item, BaseException):
                self.error = item
        if self.error is not None:
            raise self.error  # again at every later take: the thread has ended
        micro, x, y, self.states[micro] = item
        # copied here, not in the thread: all CUDA work stays on the training thread, in order with the work before it
        return to_device(x, self.device), to_device(y, self.device)

    def close(self):
        self.stopped.set()


def _read_ahead(loaders, ready, stopped):
    """MicroBatches' thread: the loaders' batches in turn, into `ready`, until stopped; an error is passed on."""
    try:
        for micro in itertools.cycle(range(len(loaders))):
            if not _put(ready, stopped, (micro, *next(loaders[micro]))):
                return
    except BaseException as e:  # StopIteration too: a training loader never runs out
        _put(ready, stopped, e)


def _put(ready, stopped, item):
    """Puts item once the queue has room; False if stopped first (polled: a queue cannot wait for an event too)."""
    while not stopped.is_set():
        try:
            ready.put(item, timeout=0.1)
            return True
        except queue.Full:
            pass
    return False
