"""nanochat.common.Progress: an ETA line at most every `every` seconds on long work, none on short."""

from nanochat import common
from nanochat.common import Progress


def test_progress_lines_are_spaced_and_estimate_the_rest(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(common.time, "time", lambda: clock[0])
    lines = []
    p = Progress("val bpb", 100, "batches", every=30, log=lines.append)
    for done in range(1, 101):
        clock[0] += 1.0  # a batch a second
        p.update(done)
    assert lines == [
        "val bpb: 30/100 batches | 0m30s, eta 1m10s",
        "val bpb: 60/100 batches | 1m00s, eta 0m40s",
        "val bpb: 90/100 batches | 1m30s, eta 0m10s",
    ]
    quick = Progress("train bpb", 10, "batches", every=30, log=lines.append)
    for done in range(1, 11):
        clock[0] += 1.0
        quick.update(done)
    assert len(lines) == 3  # work that ends within `every` prints nothing
