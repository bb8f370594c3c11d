"""A worker's recent forward passes, timed where they run, for measuring a serving cluster in place.

The profiler times passes on an idle machine; a worker serving real traffic shares its cores with the
rest of the cluster. Each worker keeps its last passes here (kind, shape, duration, wall-clock end, so
passes of different processes can be lined up) and hands them over on request
(the calibration, ``benchmarks/host_contention.py`` and the ``DrainPassLog`` RPC). Recording is a deque append per pass; handing over swaps the deque under a lock of its own,
so the worker's loop never waits for records being converted.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

PASS_KINDS = ("prefill", "decode", "draft", "verify", "step", "mixed")


@dataclass(frozen=True)
class PassRecord:
    """One timed pass. ``shape``: prefill: ``chunks`` as [start, length] pairs; decode / verify:
    ``seqs``, ``kv_tokens`` (KV positions read, summed over the batch), ``new_tokens``; draft: the k draft
    passes of one speculative step as one record, ``passes`` (k) and the same three fields summed over them.
    A decode worker's step is one ``decode`` record, or one ``draft`` record followed by one ``verify``, then
    one ``step`` record: the whole step (choice of k, memory, passes, verification, commit), ``k`` and
    ``seqs``; what it has beyond its passes is the step's fixed cost. mixed: one step of the colocated
    reference engine, prefill chunks and decode tokens in one pass: ``chunks`` as [start, length] pairs
    (prompt chunks, and generated tokens recomputed after preemption) and the decode part as
    ``decode_seqs`` and ``decode_kv_tokens`` (KV positions read, including the new token's); also a decode
    worker's decode or verify pass with local-prefill chunks in it, each sequence's k + 1 verified positions
    counted as decode tokens."""

    kind: str
    end_s: float  # time.time() when the pass ended
    seconds: float
    shape: dict


class PassLog:
    """The last ``capacity`` passes of one worker (older ones drop off, counted). Thread-safe: the worker
    records on its loop thread, a caller drains from another."""

    def __init__(self, capacity: int = 65536):
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        self._capacity = capacity
        self._records: deque[PassRecord] = deque(maxlen=capacity)
        self._dropped = 0
        self._lock = threading.Lock()

    def record(self, kind: str, seconds: float, **shape) -> None:
        if kind not in PASS_KINDS:
            raise ValueError(f"kind: must be one of {list(PASS_KINDS)}, got {kind!r}")
        rec = PassRecord(kind, time.time(), seconds, shape)
        with self._lock:
            if len(self._records) == self._capacity:
                self._dropped += 1
            self._records.append(rec)

    def take(self) -> tuple[list[dict], int]:
        """(every kept record as a plain dict, oldest first; how many dropped off since the last
        ``take`` / ``drain``); the log is emptied."""
        with self._lock:
            records, self._records = self._records, deque(maxlen=self._capacity)
            dropped, self._dropped = self._dropped, 0
        return [{"kind": r.kind, "end_s": r.end_s, "seconds": r.seconds, "shape": r.shape} for r in records], dropped

    def drain(self) -> list[dict]:
        """Every kept record as a plain dict (oldest first); the log is emptied."""
        return self.take()[0]

    def __len__(self) -> int:
        return len(self._records)
