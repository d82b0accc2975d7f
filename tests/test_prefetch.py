"""MicroBatches' loader thread: a step waits for the slower of data and device, not for both."""

import gc
import threading
import time

import pytest
import torch

from conftest import TINY_TRAIN
from nanochat.common import UserError
from nanochat.dataloader import MicroBatches
from scripts import base_train


def numbered(first, count=None, delay=0.0, error=None):
    """A stand-in loader: batches first, first + 1, ... (each sleeping `delay` before it), with the state after each;
    after `count` of them it raises `error`, or runs out when that is None."""
    n = first
    while count is None or n < first + count:
        time.sleep(delay)
        n += 1
        yield torch.tensor([n - 1]), torch.tensor([n]), {"next": n}
    if error is not None:
        raise error


def loader_threads():
    return {t for t in threading.enumerate() if t.name == "micro-batches"}


def test_a_step_waits_for_the_slower_of_data_and_device_not_both():
    packing = step = 0.2  # seconds the host packs a batch, and a step keeps the host busy (its one host read)
    steps = 5
    batches = MicroBatches([numbered(0, delay=packing)], "cpu")
    start = time.perf_counter()
    for _ in range(steps):
        batches.take()
        time.sleep(step)
    took = time.perf_counter() - start
    batches.close()
    # overlapped: the first batch, then max(packing, step) a step (1.2 s); in turn, packing + step a step (2.0 s)
    assert took < 0.75 * steps * (packing + step), took


def test_micro_batches_come_in_turn_and_the_states_are_those_taken():
    batches = MicroBatches([numbered(0), numbered(100)], "cpu")
    x, y = batches.take()
    deadline = time.monotonic() + 10
    while not batches.ready.full() and time.monotonic() < deadline:  # the thread two batches ahead of the step
        time.sleep(0.01)
    assert batches.ready.full()
    assert (x.item(), y.item()) == (0, 1) and batches.states == [{"next": 1}, None]
    assert [batches.take()[0].item() for _ in range(3)] == [100, 1, 101]
    assert batches.states == [{"next": 2}, {"next": 102}]  # not those of the ones read ahead
    batches.close()


def test_an_error_in_the_thread_is_raised_by_take_with_its_own_message():
    batches = MicroBatches([numbered(0, count=2, error=UserError("the shard is unreadable"))], "cpu")
    assert [batches.take()[0].item() for _ in range(2)] == [0, 1]
    for _ in range(2):  # every later take too, never a wait on a thread that has ended
        with pytest.raises(UserError, match="the shard is unreadable"):
            batches.take()
    with pytest.raises(StopIteration):  # a loader that ran out
        MicroBatches([numbered(0, count=0)], "cpu").take()


def test_close_or_dropping_ends_the_thread():
    before = loader_threads()
    for drop in (False, True):
        batches = MicroBatches([numbered(0)], "cpu")
        (thread,) = loader_threads() - before
        batches.take()
        if drop:
            del batches
            gc.collect()
        else:
            batches.close()
        thread.join(timeout=10)  # it was waiting to hand over the batches it read ahead
        assert not thread.is_alive()


def test_a_loader_error_in_training_is_one_line(run_base, script_error, monkeypatch):
    real_loader = base_train.data_loader

    def failing_loader(tokenizer, B, T, split, *args, **kwargs):
        batches = real_loader(tokenizer, B, T, split, *args, **kwargs)

        def three_then_fail():
            for _ in range(3):
                yield next(batches)
            raise UserError("the shard is unreadable")

        return three_then_fail() if split == "train" else batches

    monkeypatch.setattr(base_train, "data_loader", failing_loader)
    before = loader_threads()
    line = script_error(base_train.main, *TINY_TRAIN, "--num-iterations", "6", "--eval-every", "-1")
    assert line == "error: the shard is unreadable"
    for thread in loader_threads() - before:
        thread.join(timeout=10)
        assert not thread.is_alive()
