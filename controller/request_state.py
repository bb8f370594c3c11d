"""The request state machine owned by the router (no torch, no Ray: plain Python).

    queued -> prefilling -> transferring -> decoding [-> migrating -> decoding] -> finished | failed | cancelled

(a request that generates nothing, ``max_tokens`` 0, goes from prefilling to finished once its prompt is
scored; one prefilled on its decode instance, from KV cached there, goes from prefilling to decoding; migrating: live migration to another decode instance; the request keeps decoding meanwhile and comes back
to decoding whether the migration commits or aborts)

A colocated request (prefill and decode on one instance, ``kv_transfer=False``) has no hand-off:

    queued -> prefilling -> decoding -> finished | failed | cancelled

Any live state may also go to failed or cancelled. Every transition is checked against this table,
timestamped, logged, and counted, so a request never disappears silently: ``StateCounters`` always
sums to the number of requests ever created.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

log = logging.getLogger("magicserve.requests")


class RequestState(str, enum.Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    DECODING = "decoding"
    MIGRATING = "migrating"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (RequestState.FINISHED, RequestState.FAILED, RequestState.CANCELLED)


_FORWARD = {
    RequestState.QUEUED: {RequestState.PREFILLING},
    # QUEUED: retried elsewhere; FINISHED: nothing to generate (max_tokens 0); DECODING: prefilled on its
    # decode instance (no transfer)
    RequestState.PREFILLING: {RequestState.TRANSFERRING, RequestState.QUEUED, RequestState.FINISHED,
                              RequestState.DECODING},
    RequestState.TRANSFERRING: {RequestState.DECODING, RequestState.QUEUED, RequestState.FINISHED},
    RequestState.DECODING: {RequestState.FINISHED, RequestState.QUEUED,  # QUEUED: re-run, nothing streamed
                            RequestState.MIGRATING},
    RequestState.MIGRATING: {RequestState.DECODING, RequestState.FINISHED},
}
_FORWARD_COLOCATED = {**_FORWARD, RequestState.PREFILLING: {RequestState.DECODING, RequestState.QUEUED,
                                                              RequestState.FINISHED}}
_ENDINGS = {RequestState.FAILED, RequestState.CANCELLED}


class InvalidTransition(RuntimeError):
    pass


class StateCounters:
    """How many requests are in each state (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter = Counter()
        self.transitions = 0

    def move(self, old: RequestState | None, new: RequestState) -> None:
        with self._lock:
            if old is not None:
                self._counts[old] -= 1
            self._counts[new] += 1
            self.transitions += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {s.value: self._counts[s] for s in RequestState}


@dataclass
class RequestRecord:
    """One request's lifecycle. ``history`` holds (state, monotonic time) for each state entered;
    ``kv_transfer`` False: a colocated request, which goes from prefilling straight to decoding."""

    request_id: str
    counters: StateCounters
    kv_transfer: bool = True
    state: RequestState = RequestState.QUEUED
    history: list[tuple[RequestState, float]] = field(default_factory=list)
    error: str = ""
    retries: int = 0

    def __post_init__(self) -> None:
        self.history.append((self.state, time.monotonic()))
        self.counters.move(None, self.state)
        log.debug("request %s: created (%s)", self.request_id, self.state.value)

    def to(self, new: RequestState, reason: str = "", retry: bool = True) -> None:
        """Move to ``new``; raises InvalidTransition for a move the table does not allow. ``retry`` False: a move
        back to QUEUED is not counted against the request's retries (nothing failed)."""
        old = self.state
        if old.terminal:
            raise InvalidTransition(f"request {self.request_id}: already {old.value}, cannot become {new.value}")
        forward = _FORWARD if self.kv_transfer else _FORWARD_COLOCATED
        if new not in forward.get(old, set()) and new not in _ENDINGS:
            raise InvalidTransition(f"request {self.request_id}: {old.value} -> {new.value} is not allowed")
        self.state = new
        self.history.append((new, time.monotonic()))
        if new is RequestState.QUEUED and retry:
            self.retries += 1
        if reason:
            self.error = reason
        self.counters.move(old, new)
        level = logging.WARNING if new is RequestState.FAILED else logging.DEBUG
        log.log(level, "request %s: %s -> %s%s", self.request_id, old.value, new.value, f" ({reason})" if reason else "")

    def entered(self, state: RequestState) -> float | None:
        """Monotonic time this request last entered ``state``."""
        for s, t in reversed(self.history):
            if s is state:
                return t
        return None
