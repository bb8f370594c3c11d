"""How many prompt tokens a decode step prefills locally (no torch): as many as fit in the TPOT slack of the
sequences decoding beside them.

A step computes the local-prefill chunk, then the decode (speculative) pass of every running sequence, each of
which gains at least one token from it (all its drafts rejected). So that no decoding sequence's time per output
token passes ``tpot_slo_s``, the whole step stays within it:

    n* = the largest n <= chunk with  prefill_s(n) <= tpot_slo_s - decode_s

``decode_s`` is a moving average of what the decoding sequences wait between two steps beyond the prefill chunk
(the decode pass and the loop's own work); ``prefill_s`` is a linear cost model fitted on this instance's
measured prefill passes (seeded by the start-up profile), times a moving correction of its recent error (a
prompt deep into a long context costs more than the fit at a short one says). The fit is trusted only near
what it saw: a chunk is at most twice the largest one measured, starting from ``PROBE_TOKENS``. With no
sequence decoding, or no SLO, a step computes the whole chunk (nobody's TPOT is at stake). With no slack, or
none known yet (no decode pass measured), it computes nothing: the queued prompts wait, a decoding request's
TPOT is never spent on them.
"""

from __future__ import annotations

from decode_worker.policy import LinearCostModel, PassShape

PROBE_TOKENS = 64  # the first chunk measured beside decoding sequences, with nothing measured yet
SMOOTHING = 0.3  # weight of the newest step in the moving averages
MAX_CORRECTION = 4.0  # the correction of the prefill cost model stays within [1/4, 4]


def prefill_shape(start: int, tokens: int) -> PassShape:
    """One prefill pass over ``tokens`` prompt positions after ``start`` computed ones (each new position
    attends to the KV before it and to itself)."""
    end = start + tokens
    return PassShape(1, end, tokens, kv_queries=tokens * start + tokens * (tokens + 1) // 2)


class PrefillBudget:
    """The local-prefill tokens of each step (see the module doc). ``tpot_slo_s`` None: always the whole
    ``chunk``."""

    def __init__(self, chunk: int, tpot_slo_s: float | None):
        self.chunk = chunk
        self.tpot_slo_s = tpot_slo_s
        self.cost = LinearCostModel(window=128, refit_every=4)
        self.correction = 1.0  # measured over predicted seconds of the recent prefill passes, moving average
        self.largest_measured = 0
        self.decode_s: float | None = None  # what a step costs the decoding sequences beside the chunk, average

    def observe_prefill(self, start: int, tokens: int, seconds: float) -> None:
        """A measured prefill pass of ``tokens`` positions after ``start``."""
        if self.cost.ready:
            ratio = seconds / max(self.cost.predict(prefill_shape(start, tokens)), 1e-9)
            self.correction = min(MAX_CORRECTION, max(1 / MAX_CORRECTION, _average(self.correction, ratio)))
        self.cost.observe(prefill_shape(start, tokens), seconds)
        self.largest_measured = max(self.largest_measured, tokens)

    def observe_step(self, seconds: float) -> None:
        """What a step cost its decoding sequences beyond its prefill chunk."""
        self.decode_s = _average(self.decode_s, seconds)

    def prefill_s(self, start: int, tokens: int) -> float:
        """Predicted seconds of a prefill pass (0 for no tokens); needs a measured pass."""
        return self.cost.predict(prefill_shape(start, tokens)) * self.correction if tokens else 0.0

    def slack_s(self) -> float:
        """Seconds a step beside the decoding sequences may spend prefilling (negative: none)."""
        return self.tpot_slo_s - (self.decode_s or 0.0)

    def tokens(self, start: int, decoding: bool) -> int:
        """Prompt tokens the next step prefills, the head of the queue having ``start`` computed."""
        if self.tpot_slo_s is None or not decoding:
            return self.chunk
        if self.decode_s is None:  # the batch's decode pass not measured yet: its slack is unknown
            return 0
        cap = min(self.chunk, max(PROBE_TOKENS, 2 * self.largest_measured))
        if not self.cost.ready:
            return cap if self.slack_s() > 0 else 0
        slack = self.slack_s()
        lo, hi = 0, cap  # the largest n in [0, cap] whose predicted pass fits the slack (cost rises with n)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.prefill_s(start, mid) <= slack:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def tokens_per_s(self, start: int, decoding: bool) -> float:
        """How fast the queued prompts are computed now, in tokens per second of steps (0: they wait); until a
        pass is measured, 0 too (the router does not count on a rate it cannot know)."""
        n = self.tokens(start, decoding)
        if n == 0 or not self.cost.ready:
            return 0.0
        step = self.prefill_s(start, n) + ((self.decode_s or 0.0) if decoding else 0.0)
        return n / max(step, 1e-6)


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
