"""What every worker actor shares with the router beside the workers' own messages (no torch, no Ray: the
router imports it)."""

from __future__ import annotations

from dataclasses import dataclass

from modeling.params import SamplingParams


@dataclass(frozen=True)
class WorkerCrashed:
    """The worker loop raised; the actor stops serving (the router treats it as dead)."""

    reason: str


@dataclass(frozen=True)
class ColocatedRequest:
    """One request for a colocated instance: prefill and decode both run there (no KV hand-off)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
