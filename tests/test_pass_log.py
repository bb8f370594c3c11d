"""modeling/pass_log.py: a worker's bounded log of timed passes, drained from another thread."""

from __future__ import annotations

import threading
import time

import pytest

from modeling.pass_log import PassLog


def test_take_counts_the_passes_that_dropped_off():
    log = PassLog(capacity=3)
    for i in range(5):
        log.record("decode", 0.01 * (i + 1), seqs=i)
    records, dropped = log.take()
    assert dropped == 2 and [r["shape"]["seqs"] for r in records] == [2, 3, 4]  # the newest kept
    assert set(records[0]) == {"kind", "end_s", "seconds", "shape"} and records[0]["kind"] == "decode"
    assert log.take() == ([], 0)  # emptied, and the count restarts
    before = time.time()
    log.record("prefill", 0.5, chunks=[[0, 8]])
    (rec,) = log.drain()
    assert before <= rec["end_s"] <= time.time()  # wall-clock end, lines up passes of different processes
    assert (rec["kind"], rec["seconds"], rec["shape"]) == ("prefill", 0.5, {"chunks": [[0, 8]]})


def test_bad_kind_and_capacity_are_refused():
    with pytest.raises(ValueError, match="kind: must be one of"):
        PassLog().record("sideways", 0.1)
    with pytest.raises(ValueError, match="capacity: must be >= 1, got 0"):
        PassLog(capacity=0)


def test_drains_from_another_thread_lose_nothing():
    """Records are taken while a thread keeps recording: every record comes out exactly once."""
    log = PassLog(capacity=1_000_000)
    n = 50_000

    def writer():
        for i in range(n):
            log.record("step", 0.0, seq=i)

    t = threading.Thread(target=writer)
    t.start()
    seen = []
    while t.is_alive():
        seen += [r["shape"]["seq"] for r in log.drain()]
    t.join()
    seen += [r["shape"]["seq"] for r in log.drain()]
    assert seen == list(range(n))
