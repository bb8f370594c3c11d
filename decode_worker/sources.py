"""Where a request admitted to a decode instance comes from: the ``source`` of ``DecodeWorker.admit``
(no torch). Each source says how the request's KV gets here; every one reserves its blocks through the same
call (``KVSlots.allocate_slots``) and is held by the worker from then until it finishes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the sources carry no torch
    from modeling.sampling import RequestSampler


@dataclass(frozen=True)
class RemoteKV:
    """The prompt's KV and first token come from a prefill instance: the request waits for them
    (``waiting_for_kv``) in blocks reserved now for its prompt and first decode step, from its prompt's longest
    cached prefix here on (the sender skips those blocks). The request is a ``DecodeRequest``."""


@dataclass(frozen=True)
class LocalPrefill:
    """The prompt is computed here, from its longest cached prefix on, ``prefill_chunk`` tokens per step
    (``prefilling``), with no prefill instance involved. The request is a ``DecodeRequest``. ``late``: it misses
    its TTFT SLO wherever it is computed (the router's load-aware decision, ``controller/load_aware.py``): it is
    computed after every queued prompt that is not late."""

    late: bool = False


@dataclass(frozen=True)
class Resume:
    """A request another decode instance streamed part of (it died): each of its sequences still running
    waits (``waiting``, ahead of the preempted) for its KV to be computed again here, then continues from its
    next output position. The request is a ``modeling.resume.ResumeRequest``."""


@dataclass(frozen=True)
class Fork:
    """Sequence ``index`` >= 1 of a request of n > 1 whose first sequence (``parent_id``) has its prompt
    computed here: it shares the prompt's full blocks and takes its own from those reserved with the request.
    ``sampler``: its own grammar state and generator. The request is a ``DecodeRequest`` under the sequence's
    id (``modeling.forks.sequence_id``)."""

    parent_id: str
    index: int
    sampler: RequestSampler


@dataclass(frozen=True)
class MigrationIn:
    """A running request migrating here from another decode instance: blocks for ``capacity_tokens``
    positions (its length now and headroom for the steps its source runs meanwhile), into which its KV and
    state arrive like a prompt's (``decode_worker/live_migration.py``). The request is a ``DecodeRequest``."""

    capacity_tokens: int


AdmissionSource = RemoteKV | LocalPrefill | Resume | Fork | MigrationIn
