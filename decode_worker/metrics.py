"""A decode worker's counters (no torch: the controller reads their summary)."""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass, field


@dataclass
class WorkerMetrics:
    """Counters of a decode worker (see ``summary``)."""

    steps: int = 0
    tokens: int = 0  # emitted tokens
    draft_tokens: int = 0
    accepted_tokens: int = 0
    seq_spec_steps: int = 0  # (sequence, step) pairs with k > 0
    k_counts: dict[int, int] = field(default_factory=dict)  # steps by the speculation length chosen
    last_k: int = 0  # the speculation length of the latest step
    step_times: deque = field(default_factory=lambda: deque(maxlen=1024))
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    preemptions: int = 0

    def summary(self) -> dict:
        times = sorted(self.step_times)
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            "mean_accepted_length": self.accepted_tokens / self.seq_spec_steps if self.seq_spec_steps else 0.0,
            "seq_spec_steps": self.seq_spec_steps,
            "k_counts": dict(sorted(self.k_counts.items())),
            "last_k": self.last_k,
            "median_step_ms": 1e3 * times[len(times) // 2] if times else 0.0,
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
            "preemptions": self.preemptions,
            "grammar_mask_s": _grammar_mask_seconds(),
        }


def _grammar_mask_seconds() -> float:
    """Time this process spent on grammar masks (0 until a request with structured output came)."""
    grammar = sys.modules.get("modeling.grammar")
    return grammar.mask_seconds() if grammar is not None else 0.0
