"""How many prompt tokens a decode step prefills locally (no torch): as many as fit in the TPOT slack of the
sequences decoding beside them, and how fast that computes the queued prompts.

While sequences decode, a step's local-prefill chunk rides in their decode (or verify) pass: one pass, one
read of the weights, the chunk's positions beside their tokens. The whole step stays within what the decoding
sequences can afford:

    n* = the largest n <= chunk with  fused_s(n) <= limit_s - decode_s,   limit_s = paced_s (else tpot_slo_s)

``decode_s`` is a moving average of what the decoding sequences wait between two steps beyond the chunk's
share (the decode pass and the loop's own work). ``fused_s`` is what the chunk adds to that pass: a linear
cost model fitted on this instance's measured prefill passes (seeded by the start-up profile) without its
per-pass term, times a correction of its recent error, measured as the fused pass's time beyond what the
decode pass alone is predicted to take: the ``FUSED_RATIO_QUANTILE`` quantile of the last
``FUSED_RATIO_WINDOW`` ratios of measured over predicted, so that a step overruns its bound about once in ten
rather than every other time (on a shared host the error swings from step to step, and a step that overruns
costs the TPOT of every sequence in it). A step of several chunks is sized chunk by chunk, each at its own
depth into its prompt. The fit is trusted only near what it saw: a chunk is at most twice the largest one
measured, starting from ``PROBE_TOKENS``. With no sequence decoding, or no SLO, a step computes the whole
chunk in a pass of its own (nobody's TPOT is at stake). With no slack, or none known yet (no decode pass
measured), it computes nothing: the queued prompts wait, a decoding request's TPOT is never spent on them.

A request's TPOT, as clients measure it, is its mean gap after its first token, the first gap included (the KV
transfer's tail, the wait for a step boundary). ``paced_s`` (``pace_limit_s``) keeps that mean within
``tpot_slo_s``: a sequence whose first gap ran long holds the chunks back so that its next tokens make up for
it, and a sequence whose speculative steps give it several tokens each affords a longer step. A sequence
assumes one token a step until it has taken ``MIN_PACE_STEPS`` steps here (so without a pace, the bound is
``tpot_slo_s`` itself); the rule corrects itself from the tokens it actually got, as a run of rejected drafts
shows in its pace at once.

A request whose KV is arriving (its prefill instance has begun sending it) joins the batch at the next step
boundary, its first token already streamed: its first gap is the rest of the step under way and its own first
step. It has no tokens banked, so a long step spent on the credit of sequences ahead of their pace would cost it
its SLO, most of all with few tokens to come (``arrival_limit_s``): while such a request arrives, steps are held
to what its TPOT affords too.

The rate the router predicts a local prefill's wait with (``tokens_per_s``) is sampled over the steps of the
last ``RATE_WINDOW_S`` beside decoding sequences: what a step computed while prompts were queued, what it
could have computed (the chunk its paces allowed, at the predicted cost) while none were. So it counts the
steps the pace limit holds back and the batch's own growth, which a single step's slack does not.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable

from decode_worker.policy import LinearCostModel, PassShape

PROBE_TOKENS = 64  # the first chunk measured beside decoding sequences, with nothing measured yet
SMOOTHING = 0.3  # weight of the newest step in the moving averages
MAX_CORRECTION = 4.0  # the correction of the prefill cost model stays within [1/4, 4]
FUSED_RATIO_WINDOW = 32  # the fused chunks' correction: over this many recent ratios of measured to predicted ...
FUSED_RATIO_QUANTILE = 0.9  # ... this quantile of them ...
MIN_FUSED_RATIOS = 4  # ... once there are this many (a moving average until then)
RATE_WINDOW_S = 5.0  # the local-prefill rate reported is sampled over the steps of this many seconds ...
MIN_RATE_STEPS = 4  # ... once there are this many
PACE_HORIZON_TOKENS = 32  # a sequence's time per output token is held to the target over this many tokens ahead
MIN_PACE_STEPS = 4  # a sequence's measured tokens per step count once it has taken this many steps here


def prefill_shape(start: int, tokens: int) -> PassShape:
    """One prefill pass over ``tokens`` prompt positions after ``start`` computed ones (each new position
    attends to the KV before it and to itself)."""
    end = start + tokens
    return PassShape(1, end, tokens, kv_queries=tokens * start + tokens * (tokens + 1) // 2)


@dataclass(frozen=True)
class Pace:
    """A decoding sequence's time per output token so far: seconds since the client got its first token, the
    tokens it got since, how many more the sequence may produce (its ``max_tokens``, or the context's end), and
    the tokens a step gives it (measured over its steps here; 1 until there are ``MIN_PACE_STEPS``)."""

    since_first_s: float
    tokens_since_first: int
    remaining: int
    tokens_per_step: float = 1.0

    @classmethod
    def measured(cls, since_first_s: float, tokens_since_first: int, remaining: int, steps_here: int,
                 tokens_here: int) -> Pace:
        """A pace whose tokens per step are ``tokens_here / steps_here`` once ``steps_here >= MIN_PACE_STEPS``
        (never below 1: a step always gives one)."""
        per_step = max(1.0, tokens_here / steps_here) if steps_here >= MIN_PACE_STEPS else 1.0
        return cls(since_first_s, tokens_since_first, remaining, per_step)


def pace_limit_s(paces: Iterable[Pace], target_s: float, decode_s: float) -> float:
    """The longest step that every sequence can afford on average from now on and still end within
    ``target_s`` of time per output token since its first token, over its next
    ``h = min(remaining, PACE_HORIZON_TOKENS)`` tokens, which take it ``h / tokens_per_step`` steps:

        (since_first_s + h / tokens_per_step * step) / (tokens_since_first + h) <= target_s

    A first gap that ran long is so made up over the tokens after it, not all in the next step. A sequence
    that could not end within ``target_s`` even if its next steps took only ``decode_s`` is past saving: it
    does not hold the others back to pure decode steps, but it falls no further behind either, each step
    held to ``target_s`` per token it gives (``tokens_per_step * target_s``). ``inf`` when no sequence
    counts."""
    limit = math.inf
    for p in paces:
        per_step = max(1.0, p.tokens_per_step)
        h = max(1, min(p.remaining, PACE_HORIZON_TOKENS))
        steps = h / per_step
        budget_s = target_s * (p.tokens_since_first + h) - p.since_first_s
        limit = min(limit, per_step * target_s if budget_s < steps * decode_s else budget_s / steps)
    return limit


def arrival_limit_s(arriving: Iterable[int], target_s: float, decode_s: float) -> float:
    """The longest step that each arriving request (``arriving``: the output tokens each may still produce after
    its first) can afford. Over its next ``h = min(tokens, PACE_HORIZON_TOKENS)`` tokens it ends within
    ``target_s`` of time per output token if its first gap (at most this step and its own first, so two steps)
    and ``h - 1`` steps of ``decode_s`` after it fit in ``h * target_s``:

        2 * step + (h - 1) * decode_s <= h * target_s

    ``inf`` when none arrives with a token to come (a request of one token has no TPOT)."""
    limit = math.inf
    for tokens in arriving:
        if tokens < 1:
            continue
        h = min(tokens, PACE_HORIZON_TOKENS)
        limit = min(limit, (h * target_s - (h - 1) * decode_s) / 2)
    return limit


class PrefillBudget:
    """The local-prefill tokens of each step (see the module doc). ``tpot_slo_s`` None: always the whole
    ``chunk``."""

    def __init__(self, chunk: int, tpot_slo_s: float | None):
        self.chunk = chunk
        self.tpot_slo_s = tpot_slo_s
        self.cost = LinearCostModel(window=128, refit_every=4)
        self.correction = 1.0  # measured over predicted seconds of the recent prefill passes, moving average
        self.fused_correction = 1.0  # the same, of the recent chunks fused into a decode pass (a high quantile)
        self.fused_ratios: deque[float] = deque(maxlen=FUSED_RATIO_WINDOW)
        self.largest_measured = 0
        self.decode_s: float | None = None  # what a step costs the decoding sequences beside the chunk, average
        self.rate_samples: deque[tuple[float, int, float]] = deque()  # (ended at, tokens prefilled, step seconds)
        self._sampled_tokens, self._sampled_s = 0, 0.0  # their sums

    def observe_prefill(self, start: int, tokens: int, seconds: float) -> None:
        """A measured prefill pass of ``tokens`` positions after ``start``."""
        if self.cost.ready:
            ratio = seconds / max(self.cost.predict(prefill_shape(start, tokens)), 1e-9)
            self.correction = min(MAX_CORRECTION, max(1 / MAX_CORRECTION, _average(self.correction, ratio)))
        self.cost.observe(prefill_shape(start, tokens), seconds)
        self.largest_measured = max(self.largest_measured, tokens)

    def observe_fused(self, chunks: list[tuple[int, int]], seconds: float) -> None:
        """What the chunks ``(start, tokens)`` added to the decode pass they rode in, measured."""
        predicted = sum(self.fused_s(start, n, corrected=False) for start, n in chunks)
        if self.cost.ready and predicted > 0:
            ratio = seconds / predicted
            self.fused_ratios.append(ratio)
            if len(self.fused_ratios) >= MIN_FUSED_RATIOS:
                ranked = sorted(self.fused_ratios)
                correction = ranked[min(len(ranked) - 1, int(FUSED_RATIO_QUANTILE * len(ranked)))]
            else:
                correction = _average(self.fused_correction, ratio)
            self.fused_correction = min(MAX_CORRECTION, max(1 / MAX_CORRECTION, correction))
        self.largest_measured = max([self.largest_measured] + [n for _, n in chunks])

    def observe_step(self, seconds: float) -> None:
        """What a step cost its decoding sequences beyond its prefill chunk."""
        self.decode_s = _average(self.decode_s, seconds)

    def observe_rate(self, now: float, decode_s: float, prefilled: int | None, prefill_s: float = 0.0,
                     start: int = 0, paces: Iterable[Pace] = ()) -> None:
        """A step beside decoding sequences ended at ``now``, its decode pass (and the loop's work) ``decode_s``
        long: a sample of the local-prefill rate. Begun with prompts queued, what it did: ``prefilled`` tokens
        in ``prefill_s``; else what it could have done: the chunk the sequences' ``paces`` allowed (the
        queue's head having ``start`` computed), its predicted seconds added."""
        if prefilled is None:
            if not self.cost.ready:
                return
            prefilled = self.tokens(start, True, paces)
            prefill_s = self.fused_s(start, prefilled)
        self.rate_samples.append((now, prefilled, decode_s + prefill_s))
        self._sampled_tokens += prefilled
        self._sampled_s += decode_s + prefill_s
        self._expire(now)

    def _expire(self, now: float) -> None:
        while self.rate_samples and self.rate_samples[0][0] < now - RATE_WINDOW_S:
            _, n, seconds = self.rate_samples.popleft()
            self._sampled_tokens -= n
            self._sampled_s -= seconds
        if not self.rate_samples:  # no rounding left behind by the subtractions
            self._sampled_tokens, self._sampled_s = 0, 0.0

    def sampled_tokens_per_s(self, now: float) -> float | None:
        """Prompt tokens per second of the steps of the last ``RATE_WINDOW_S`` (None: too few samples)."""
        self._expire(now)
        if len(self.rate_samples) < MIN_RATE_STEPS:
            return None
        return self._sampled_tokens / max(self._sampled_s, 1e-9)

    def prefill_s(self, start: int, tokens: int) -> float:
        """Predicted seconds of a prefill pass (0 for no tokens); needs a measured pass."""
        return self.cost.predict(prefill_shape(start, tokens)) * self.correction if tokens else 0.0

    def fused_s(self, start: int, tokens: int, corrected: bool = True) -> float:
        """Predicted seconds the chunk adds to the decode pass it rides in (0 for no tokens); needs a measured
        pass."""
        if not tokens:
            return 0.0
        fixed, per_token, per_square = self._fused_terms(start)
        return max(1e-6, fixed + per_token * tokens + per_square * tokens * tokens) * \
            (self.fused_correction if corrected else 1.0)

    def _fused_terms(self, start: int) -> tuple[float, float, float]:
        """The fit's prediction for ``n`` prompt positions after ``start``, without its per-pass and per-sequence
        terms (the pass the chunk rides in pays them; a prefill pass is always one sequence, so its fit cannot
        tell the two apart), as ``fixed + per_token * n + per_square * n * n``: the features of
        ``prefill_shape`` (KV read ``start + n``, ``n`` new, ``n * start + n * (n + 1) / 2`` query-KV pairs)."""
        c = self.cost.coefficients()
        return (c["kv_tokens"] * start, c["kv_tokens"] + c["new_tokens"] + c["kv_queries"] * (start + 0.5),
                c["kv_queries"] * 0.5)

    def slack_s(self, paces: Iterable[Pace] = (), arriving: Iterable[int] = ()) -> float:
        """Seconds a step beside the decoding sequences (``paces``: theirs, one per sequence) may spend
        prefilling (negative: none), the requests ``arriving`` (``arrival_limit_s``) included. Without a pace
        that counts, a step is held to ``tpot_slo_s``."""
        decode_s = self.decode_s or 0.0
        limit = pace_limit_s(paces, self.tpot_slo_s, decode_s)
        limit = min(self.tpot_slo_s if math.isinf(limit) else limit,
                    arrival_limit_s(arriving, self.tpot_slo_s, decode_s))
        return limit - decode_s

    def tokens(self, start: int, decoding: bool, paces: Iterable[Pace] = (), arriving: Iterable[int] = (),
               spent_s: float = 0.0) -> int:
        """Prompt tokens the next step prefills, the head of the queue having ``start`` computed; ``paces``: the
        decoding sequences' (none given: the step bound alone, as a rate over many steps uses); ``arriving``:
        the output tokens still to come of each request whose KV is arriving; ``spent_s``: the predicted
        seconds of the step's chunks before this one (a step of several chunks sizes each at its own start)."""
        if self.tpot_slo_s is None or not decoding:
            return self.chunk
        if self.decode_s is None:  # the batch's decode pass not measured yet: its slack is unknown
            return 0
        cap = min(self.chunk, max(PROBE_TOKENS, 2 * self.largest_measured))
        slack = self.slack_s(paces, arriving) - spent_s
        if not self.cost.ready:
            return cap if slack > 0 else 0
        # the largest n in [0, cap] whose predicted share fits the slack (cost rises with n); the fit's terms
        # once, not per probe (the simulator asks this every step)
        fixed, per_token, per_square = self._fused_terms(start)
        budget = slack / self.fused_correction
        lo, hi = 0, cap
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fixed + per_token * mid + per_square * mid * mid <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def tokens_per_s(self, start: int, decoding: bool, now: float | None = None) -> float:
        """How fast the queued prompts are computed now, in tokens per second of steps (0: they wait); until a
        pass is measured, 0 too (the router does not count on a rate it cannot know). At ``now``, while
        sequences decode, what the recent steps did or could have done (``sampled_tokens_per_s``), once
        sampled."""
        n = self.tokens(start, decoding)
        if n == 0 or not self.cost.ready:
            return 0.0
        step = self.fused_s(start, n) + (self.decode_s or 0.0) if decoding else self.prefill_s(start, n)
        sampled = self.sampled_tokens_per_s(now) if decoding and now is not None else None
        return n / max(step, 1e-6) if sampled is None else sampled


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
