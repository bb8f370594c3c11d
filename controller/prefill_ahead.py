"""Prompts computed ahead while they wait for room on a decode instance (no torch, no Ray).

A request whose decode instances are all short of KV room waits before its prompt goes to a prefill instance (the
placer's back-pressure: ``controller/placer.py``). A prefill instance with no prompt of its own meanwhile idles.
``PrefillAhead`` gives such an instance a waiting prompt to compute ahead (``PrefillRequest.ahead``): its full
blocks are cached there (in the pool, and written down to the tiers below it), so that when a decode instance has
room and the request is placed, the router's index (``controller/kv_index.py``) sends it to the instance that
holds them, which computes only its last block; a pass still running then is taken over by the request. The
prompt is held back from its decode instance, never from its prefill.

Idle capacity only: one pass per prefill instance at a time, only on an instance with no request of its own
queued or prefilling, and on the instance the pass runs in steps no other prompt needs (``prefill_worker``'s
scheduler). The oldest waiting request goes first (the highest priority first), and only one with at least one
block its instance lacks, and none a decode instance holding its prompt would prefill itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from controller.kv_index import Cached
from controller.request_run import RequestRun
from controller.request_state import RequestState
from controller.routing import Instance

_QUEUED = (RequestState.QUEUED, RequestState.PREFILLING)
SCANNED = 8  # waiting requests looked at for a pass, the oldest not started first
RESCAN_S = 0.02  # how long a choice stands while nothing it depends on changed here (the index may, meanwhile)


@dataclass(frozen=True)
class AheadPass:
    """A pass running for request ``request_id`` on an instance of generation ``generation`` (a pass of an earlier
    generation died with it)."""

    request_id: str
    generation: int


class PrefillAhead:
    """Which waiting request a prefill instance computes ahead (see the module doc). ``enabled`` False: none."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._waiting: dict[str, RequestRun] = {}  # requests waiting for decode room, oldest first
        self._started: set[str] = set()  # waiting requests whose pass started
        self._running: dict[str, AheadPass] = {}  # prefill instance name -> its pass
        self._choice: tuple[str, Instance] | None = None  # (request, instance) the last scan chose
        self._chosen_at = float("-inf")  # when (-inf: to scan again)
        self.passes = 0  # passes started

    @property
    def running(self) -> list[AheadPass]:
        return list(self._running.values())

    def wait(self, run: RequestRun) -> None:
        """``run`` waits for room on a decode instance."""
        if self.enabled and run.params.prompt_logprobs is None:  # a prompt scored in full finds nothing cached
            self._waiting[run.request_id] = run
            self._chosen_at = float("-inf")

    def leave(self, run: RequestRun) -> None:
        """``run`` waits no longer (placed, failed or cancelled); a pass of it still running goes on (its request,
        arriving, takes it over; else it ends by itself)."""
        self._waiting.pop(run.request_id, None)
        self._started.discard(run.request_id)
        self._chosen_at = float("-inf")

    def started(self, run: RequestRun, inst: Instance) -> None:
        self._started.add(run.request_id)
        self._running[inst.name] = AheadPass(run.request_id, inst.generation)
        self.passes += 1
        self._chosen_at = float("-inf")

    def ended(self, instance: str, request_id: str) -> None:
        """``instance`` reported the pass for ``request_id`` ended (computed, dropped, or taken over)."""
        p = self._running.get(instance)
        if p is not None and p.request_id == request_id:
            del self._running[instance]
            self._chosen_at = float("-inf")

    def instance_for(self, run: RequestRun, pool: list[Instance], runs: dict[str, RequestRun],
                     cached: Callable[[RequestRun, Instance], Cached], block_size: Callable[[str], int | None],
                     skip: Callable[[RequestRun], bool] = lambda run: False) -> Instance | None:
        """The prefill instance to compute ``run``'s prompt ahead now, when ``run`` is the first waiting request
        some idle instance has a block to compute for (None otherwise: each waiting request asks for itself, so
        its pass is submitted before it looks for room again). ``cached``: what an instance holds of a prompt, by
        the router's index; ``block_size``: an instance's, None when it keeps no prefix cache; ``skip``: a request
        no prefill instance is to compute (a decode instance holding it will)."""
        if run.request_id not in self._waiting or run.request_id in self._started:
            return None
        now = time.monotonic()
        if now - self._chosen_at > RESCAN_S:
            self._choice, self._chosen_at = self._scan(pool, runs, cached, block_size, skip), now
        if self._choice is None or self._choice[0] != run.request_id:
            return None
        return self._choice[1]

    def _scan(self, pool: list[Instance], runs: dict[str, RequestRun], cached: Callable[[RequestRun, Instance], Cached],
              block_size: Callable[[str], int | None],
              skip: Callable[[RequestRun], bool]) -> tuple[str, Instance] | None:
        """The first of the ``SCANNED`` oldest waiting requests not started that an idle instance has a block to
        compute for, and that instance."""
        idle = [i for i in pool if self._idle(i, runs) and block_size(i.name)]
        if not idle:
            return None
        candidates = [r for r in sorted(self._waiting.values(), key=lambda r: -r.priority)  # stable: oldest first
                      if r.request_id not in self._started][:SCANNED]
        for waiting in candidates:
            if skip(waiting):
                continue
            inst = self._best(waiting, idle, cached, block_size)
            if inst is not None:
                return waiting.request_id, inst
        return None

    def _idle(self, inst: Instance, runs: dict[str, RequestRun]) -> bool:
        """No pass of this instance's generation running, and no request of its own queued or prefilling."""
        if not inst.alive or inst.draining:
            return False
        p = self._running.get(inst.name)
        if p is not None and p.generation == inst.generation:
            return False
        return not any(r in runs and runs[r].state in _QUEUED for r in inst.assigned)

    @staticmethod
    def _best(run: RequestRun, idle: list[Instance], cached: Callable[[RequestRun, Instance], Cached],
              block_size: Callable[[str], int | None]) -> Instance | None:
        """Of ``idle``, the instance holding the most of the prompt with at least one block of it to compute."""
        best, most = None, -1
        for inst in idle:
            held = cached(run, inst).tokens
            if len(run.prompt_ids) - 1 - held >= block_size(inst.name) and held > most:
                best, most = inst, held
        return best
