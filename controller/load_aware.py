"""Load-aware disaggregation (no torch, no Ray): whether a prompt is prefilled on a decode instance, beside
its decoding batch, rather than in the prefill pool.

Each side's time to a first token is predicted from what the instances measured:

* the prefill pool's: the prompt tokens queued on the prefill instance that would compute the prompt (placed
  there, not yet prefilled, late prompts not counted: they come after it) and the prompt's own, at that
  instance's measured seconds per token (``PrefillRate``, from the tokens and seconds each of its steps
  reports);
* a decode instance's: its queued local-prefill tokens, those placed on it since its last report, and the
  prompt's, at the rate its steps compute them within the TPOT slack of the sequences decoding there
  (``PoolLoad.prefill_tokens_per_s``, ``decode_worker/prefill_budget.py``). An instance without slack reports
  0 and takes none: a decoding request's TPOT is never spent on another's prompt.

A prompt goes to a decode instance only when the prefill pool's prediction misses the TTFT target
(``LoadAwarePolicy.ttft_s``) and that decode instance's prediction is shorter; it goes to the one whose
prediction is shortest. Otherwise to the prefill pool, as without this policy. Every decision is counted by
where the prompt went and why (``Decision.reason``).

A prompt that misses the TTFT SLO itself (``LoadAwarePolicy.late_s``) wherever it goes, by both predictions, is
late: it no longer counts towards goodput, but ahead of other prompts in a first-come queue each of them would
wait for it, and miss in turn. So it is computed in a late lane, after every prompt that is not late: on the
prefill instance (``PrefillRequest.late``, ``PrefillScheduler``), in the steps no prompt that is not late needs,
or on the decode instance with slack (``LocalPrefill.late``) if that one is predicted sooner, every queued prompt
counted. Under a backlog the prompts that can still be served in time are served first; a late prompt waits
longer than it would have in a first-come queue, but never holds up a decoding request (the decode instance
computes prompts within its TPOT slack) and never waits forever (each lane is computed whenever the one ahead
of it leaves room).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Container

DECAY = 0.8  # weight of what a prefill instance measured before its newest step

# why a prompt went where it went
OFF = "off"  # the policy is off (or the request needs a prefill instance: its prompt's log-probabilities)
UNMEASURED = "unmeasured"  # the prefill instance has not measured its speed yet
MEETS_SLO = "prefill_meets_slo"  # the prefill pool's prediction is within the target
NO_SLACK = "no_decode_slack"  # the prefill pool misses the target, and no decode instance would be sooner
BACKLOG = "prefill_backlog"  # the prefill pool misses the target; a decode instance is sooner: it prefills
LATE = "prefill_late"  # the prompt misses the SLO itself wherever it goes: computed in a late lane
REFUSED = "decode_refused"  # that decode instance had no room after all (or could not be reached)


@dataclass(frozen=True)
class LoadAwarePolicy:
    """``enabled``: decide per prompt (off: every prompt not cached on its decode instance goes to the prefill
    pool). ``ttft_s``: the time to first token a prompt's placement aims for (the SLO times its margin).
    ``late_s``: a prompt predicted past it wherever it goes is late (the SLO itself; None: no prompt is)."""

    enabled: bool = True
    ttft_s: float = 1.6
    late_s: float | None = None


@dataclass
class PrefillRate:
    """A prefill instance's measured seconds per prompt token: the tokens and seconds its steps reported, each
    step's weighing ``DECAY`` times less at every newer one."""

    tokens: float = 0.0
    seconds: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        self.tokens = DECAY * self.tokens + tokens
        self.seconds = DECAY * self.seconds + seconds

    @property
    def seconds_per_token(self) -> float | None:
        return self.seconds / self.tokens if self.tokens else None


@dataclass(frozen=True)
class DecodeOption:
    """A decode instance that could prefill the prompt: its ``name``, the prompt tokens it would compute
    (``tokens``: the prompt less what it holds cached), those queued before them (``queued``), and how fast
    its steps compute them now (``tokens_per_s``, 0: no slack)."""

    name: str
    tokens: int
    queued: int
    tokens_per_s: float

    @property
    def ttft_s(self) -> float:
        return (self.queued + self.tokens) / self.tokens_per_s if self.tokens_per_s > 0 else float("inf")


@dataclass(frozen=True)
class Decision:
    """Where a prompt is prefilled: on decode instance ``decode``, or in the prefill pool (None), ``reason``
    why, and the two predictions it compared (None: not predicted)."""

    decode: str | None
    reason: str
    prefill_ttft_s: float | None = None
    decode_ttft_s: float | None = None

    @property
    def late(self) -> bool:
        """The prompt misses the SLO wherever it goes: the instance that computes it queues it in its late lane."""
        return self.reason == LATE


def prefill_ttft_s(queued_tokens: int, tokens: int, rate: PrefillRate | None) -> float | None:
    """The prefill instance's predicted time to the prompt's first token (None: its speed is not measured)."""
    spt = None if rate is None else rate.seconds_per_token
    return None if spt is None else (queued_tokens + tokens) * spt


def decide(policy: LoadAwarePolicy, prefill_s: float | None, options: list[DecodeOption],
           prefill_late_s: float | None = None) -> Decision:
    """Where the prompt is prefilled (see the module doc), given the prefill pool's prediction ``prefill_s``
    (behind the prompts queued there that are not late; ``prefill_late_s``: behind all of them, None: the same)
    and the decode instances that have room for it (in the placement's order: ties go to the earlier)."""
    if not policy.enabled:
        return Decision(None, OFF)
    if prefill_s is None:
        return Decision(None, UNMEASURED)
    if prefill_s <= policy.ttft_s:
        return Decision(None, MEETS_SLO, prefill_s)
    best = min(options, key=lambda o: o.ttft_s, default=None)
    decode_s = None if best is None or best.ttft_s == float("inf") else best.ttft_s
    if policy.late_s is not None and prefill_s > policy.late_s and (decode_s is None or decode_s > policy.late_s):
        behind = prefill_s if prefill_late_s is None else max(prefill_s, prefill_late_s)
        return Decision(best.name if decode_s is not None and decode_s < behind else None, LATE, prefill_s, decode_s)
    if best is None or not best.ttft_s < prefill_s:
        return Decision(None, NO_SLACK, prefill_s, decode_s)
    return Decision(best.name, BACKLOG, prefill_s, best.ttft_s)


@dataclass
class LoadAwareState:
    """What the router keeps for the policy: each prefill instance's measured speed, the local-prefill tokens
    placed on each decode instance since its last report (request id -> tokens), and the decisions by
    (where, reason)."""

    policy: LoadAwarePolicy = field(default_factory=LoadAwarePolicy)
    rates: dict[str, PrefillRate] = field(default_factory=dict)
    placed_local: dict[str, dict[str, int]] = field(default_factory=dict)
    counts: Counter = field(default_factory=Counter)

    def observe_prefill(self, instance: str, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.rates.setdefault(instance, PrefillRate()).observe(tokens, seconds)

    def placed_since_report(self, instance: str, holds: frozenset, live: Container[str]) -> int:
        """Local-prefill tokens placed on ``instance`` that its last report (holding ``holds``) does not count;
        requests no longer ``live`` (ended, cancelled) before any report counted them are let go."""
        placed = self.placed_local.get(instance, {})
        for rid in [r for r in placed if r in holds or r not in live]:
            del placed[rid]
        return sum(placed.values())

    def count(self, decision: Decision) -> None:
        self.counts["decode" if decision.decode else "prefill", decision.reason] += 1

    def placing(self, instance: str, request_id: str, tokens: int) -> None:
        """A local prefill of ``tokens`` placed on ``instance``: counted queued there until the instance reports
        holding ``request_id``."""
        self.placed_local.setdefault(instance, {})[request_id] = tokens

    def forget(self, instance: str, request_id: str) -> None:
        """A local prefill placed on ``instance`` that did not hold (no room, or the call failed)."""
        self.placed_local.get(instance, {}).pop(request_id, None)
