"""Whether a decode worker is busy, readable by a prefill worker on the same machine without a call.

Between two bare processes, a prefill instance with more threads than the cores left to it beside a decode
instance (``cluster_configs/local-prefill2.yaml``) runs about 3x slower while the decode instance is busy,
slower than with one thread (``controller/planner/core_sharing.py``). With ``prefill.threads_when_decode_busy``
the prefill worker checks this flag before each step and runs the step on that many threads while decode is
busy, on all of its threads while it is idle. Served on long_doc it measured no gain: there the 2-thread
prefill slows only 1.3-1.4x beside a busy decode (``benchmarks/results/same_session_18``, section 5).

The flag is one byte of a memory-mapped file that the decode worker writes (1 from the start of a step while it
has sequences to decode, 0 once it has none) and prefill workers read: no lock, no system call per read. Workers
on different machines never see each other's file; a prefill worker then reads an idle decode neighbour and
keeps its threads, which is right there.
"""

from __future__ import annotations

import mmap
import os
import tempfile

SHM_DIR = "/dev/shm"  # memory-backed where Linux has it; else the temp directory


def signal_path(cluster_id: str, decode_name: str) -> str:
    """Where the busy flag of decode instance ``decode_name`` of cluster ``cluster_id`` lives."""
    base = SHM_DIR if os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK) else tempfile.gettempdir()
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in f"{cluster_id}-{decode_name}")
    return os.path.join(base, f"magicserve-busy-{safe}")


class BusySignal:
    """One byte in ``path`` (created, zeroed, if missing): ``set`` by the decode worker, ``busy`` by readers."""

    def __init__(self, path: str):
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < 1:
                os.ftruncate(fd, 1)
            self._map = mmap.mmap(fd, 1)
        finally:
            os.close(fd)

    def set(self, busy: bool) -> None:
        self._map[0] = 1 if busy else 0

    @property
    def busy(self) -> bool:
        return self._map[0] != 0

    def close(self, unlink: bool = False) -> None:
        self._map.close()
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class ThreadsBesideBusy:
    """A prefill worker's torch threads step by step: ``busy_threads`` while any of ``signals`` says busy,
    ``threads`` otherwise (``apply`` before each step; it calls ``torch.set_num_threads`` only on a change)."""

    def __init__(self, threads: int, busy_threads: int, signals: list[BusySignal]):
        if not 1 <= busy_threads <= threads:
            raise ValueError(f"threads_when_decode_busy: must be in [1, threads ({threads})], got {busy_threads}")
        self.threads, self.busy_threads, self.signals = threads, busy_threads, signals
        self.current = threads
        self.switches = 0  # how often the thread count changed (for status / tests)

    def apply(self) -> int:
        import torch

        want = self.busy_threads if any(s.busy for s in self.signals) else self.threads
        if want != self.current:
            torch.set_num_threads(want)
            self.current = want
            self.switches += 1
        return want
