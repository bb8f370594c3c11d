"""Reading a waiting prompt's blocks from the disk tier and the store ahead of its load, on a thread of its own.

A prompt that waits to be scheduled (behind other prompts, or for its KV to arrive from a prefill instance)
has its blocks that only the slow tiers hold read while it waits: the reads and their checks run beside the
worker's steps, and when the prompt is scheduled its load copies them from host memory. A load that comes
before its read-ahead has started takes the job back and reads on the worker's thread as before; one that
comes while it runs waits for the rest of it (never reading a block twice).

The thread touches only the disk tier and the store (each guards itself); whatever it reads is handed to the
worker's thread, which alone touches the host tier, the pool and the counters. What is held read ahead is
bounded (``capacity_bytes``): a job stops at the bound, and its remaining blocks are read at load time.

A job may also carry what to do with its blocks once read (``then``, run on the thread: a load that writes them
into blocks of the cache no step reads yet); such a job is not bounded, and is never withdrawn.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ReadBlock:
    """One block read ahead: its KV [L, 2, bs, H, D] on the host, the tier it came from, and the seconds the
    read (and its check) took."""

    kv: torch.Tensor
    tier: str
    seconds: float


# a block's KV from the disk tier or the store, and the tier's name; (None, None): neither holds it whole and intact
Reader = Callable[[int], "tuple[torch.Tensor | None, str | None]"]


@dataclass
class ReadResult:
    """What was read ahead for one request: ``blocks`` by hash, and ``missing``, the block whose read found
    neither slow tier holding it whole and intact (None: the reads stopped at the bound, or ran out), which a
    load need not read again."""

    blocks: dict[int, ReadBlock] = field(default_factory=dict)
    missing: int | None = None
    done_with: object = None  # what the job's ``then`` returned
    error: str = ""  # what its ``then`` raised


@dataclass
class _Job:
    request_id: str
    hashes: tuple[int, ...]
    skip: frozenset[int]  # held in host memory when the job was queued: not read
    then: Callable[[ReadResult], object] | None = None
    started: bool = False
    cancelled: bool = False
    result: ReadResult = field(default_factory=ReadResult)
    done: threading.Event = field(default_factory=threading.Event)


class ReadAhead:
    """One reader thread over ``read``. Methods other than the thread's own are for the worker's thread."""

    def __init__(self, read: Reader, block_bytes: int, capacity_bytes: int):
        self._read = read
        self.block_bytes = block_bytes
        self.capacity_bytes = capacity_bytes
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._jobs: dict[str, _Job] = {}  # request id -> its job, queued, running or done (until taken)
        self._held_bytes = 0  # read ahead and not yet taken
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-tier-read-ahead", daemon=True)
        self._thread.start()

    @property
    def held_bytes(self) -> int:
        return self._held_bytes

    def __len__(self) -> int:
        """Jobs not yet taken or cancelled."""
        return len(self._jobs)

    def submit(self, request_id: str, hashes: Sequence[int], skip: Collection[int] = (),
               then: Callable[[ReadResult], object] | None = None) -> bool:
        """Read ``hashes`` (a prompt's blocks, from the first the pool lacks) ahead, bar those in ``skip``, up to
        the first neither slow tier holds, then call ``then`` with what was read (on the thread; what it returns
        or raises is kept in the result); False (nothing queued) when the request has a job already, there is
        nothing to read and nothing to do, or the reader is closed."""
        todo = tuple(hashes)
        if then is None and (not todo or all(h in skip for h in todo)):
            return False
        with self._cond:
            if self._closed or request_id in self._jobs:
                return False
            job = _Job(request_id, todo, frozenset(skip), then)
            self._jobs[request_id] = job
            self._queue.append(job)
            self._cond.notify()
        return True

    def done(self, request_id: str) -> bool:
        """Whether the request's job (if any) has finished: :meth:`take` then returns at once."""
        with self._cond:
            job = self._jobs.get(request_id)
        return job is None or job.done.is_set()

    def take(self, request_id: str) -> ReadResult:
        """What was read ahead for the request, its job forgotten: waits for a job under way to finish; a job not
        yet started is withdrawn (nothing read: the caller reads its blocks), unless it has a ``then``."""
        with self._cond:
            job = self._jobs.pop(request_id, None)
            if job is None:
                return ReadResult()
            if not job.started and job.then is None:
                job.cancelled = True
                self._queue.remove(job)
                return ReadResult()
        job.done.wait()
        with self._cond:
            self._held_bytes -= self._held_by(job)
        return job.result

    def _held_by(self, job: _Job) -> int:
        return len(job.result.blocks) * self.block_bytes if job.then is None else 0

    def cancel(self, request_id: str) -> None:
        """Forget the request's job (it ended, or its blocks are no longer wanted); a read under way stops at the
        next block and is dropped; a job with a ``then`` under way is waited for (its ``then`` is not called
        once cancelled: nothing is written after this returns)."""
        with self._cond:
            job = self._jobs.pop(request_id, None)
            if job is None:
                return
            job.cancelled = True
            if not job.started:
                self._queue.remove(job)
                return
            if job.done.is_set():
                self._held_bytes -= self._held_by(job)
                job.result = ReadResult()
                return
        if job.then is not None:
            job.done.wait()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for job in self._queue:  # never started: whoever waits on one gets nothing
                job.cancelled = True
                job.done.set()
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join()

    # -- the reader thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
                job.started = True
            try:
                self._fill(job)
                if job.then is not None and not job.cancelled:
                    try:
                        job.result.done_with = job.then(job.result)
                    except Exception as err:  # reported to whoever takes the job
                        job.result.error = f"{type(err).__name__}: {err}"
            finally:
                with self._cond:
                    if job.cancelled:  # cancelled while it ran: what it read goes
                        self._held_bytes -= self._held_by(job)
                        job.result = ReadResult()
                    job.done.set()

    def _fill(self, job: _Job) -> None:
        bounded = job.then is None
        for h in job.hashes:
            if job.cancelled or self._closed:
                return
            if h in job.skip:
                continue
            with self._cond:
                if bounded and self._held_bytes + self.block_bytes > self.capacity_bytes:
                    return  # the rest is read at load time
                if bounded:
                    self._held_bytes += self.block_bytes  # reserved before reading: the bound holds throughout
            t0 = time.perf_counter()
            try:
                kv, tier = self._read(h)
            except Exception:  # a failing read is a miss: the block is computed
                kv = None
            if kv is None:
                if bounded:
                    with self._cond:
                        self._held_bytes -= self.block_bytes
                job.result.missing = h
                return
            job.result.blocks[h] = ReadBlock(kv, tier, time.perf_counter() - t0)
