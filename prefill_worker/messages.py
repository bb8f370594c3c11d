"""Typed messages between the controller's router and a prefill worker (DESIGN principle 4).

In: :class:`PrefillRequest` (token ids, never raw client input). Out, per step: a
:class:`PrefillStepOutput` with the first tokens sampled this step (the router streams them; the decode
worker receives them with the KV), the prompts whose KV the decode side has acknowledged, and failures the
router can act on (``retryable``: try again, elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modeling.logprobs import TokenLogprob
from modeling.params import SamplingParams
from modeling.prefix_cache import CachedPrompt


@dataclass(frozen=True)
class KVDestination:
    """Where the prompt's KV goes: decode instance ``decode_id``. ``reserved``: it holds room for the request
    already (the router placed it there first), so its receiver accepts the transfer at once; otherwise the
    receiver asks for room when the transfer starts (it may answer BUSY: the prefill worker then holds the
    KV and re-asks until there is room). The decode instance owns its blocks: no block id travels."""

    decode_id: str
    reserved: bool = False

    def __post_init__(self) -> None:
        if not self.decode_id:
            raise ValueError("destination.decode_id: must not be empty")


@dataclass(frozen=True)
class PrefillRequest:
    """One prompt to prefill. ``arrival_time`` (time.perf_counter() clock of this process) defaults to
    when the worker receives it; TTFT is measured from it. ``destination`` None: no KV hand-off (the
    blocks are freed right after the first token; profiling and colocated use).

    ``ahead``: a pass computed ahead, while the request waits for room on a decode instance, only so its prompt's
    full blocks are cached here when it comes back under the same id: no destination, no first token, no
    sampling; it runs in steps no other prompt needs and gives way to any that needs its blocks (reported in
    ``PrefillStepOutput.ahead_ended``). The request itself, arriving, takes over a pass still running.

    ``late``: the prompt misses its TTFT SLO wherever it is computed (the router's load-aware decision,
    ``controller/load_aware.py``): it is computed after every prompt that is not (``PrefillScheduler``)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    destination: KVDestination | None
    arrival_time: float | None = None
    ahead: bool = False
    late: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))
        if self.ahead and self.destination is not None:
            raise ValueError("destination: a pass computed ahead hands no KV off (must be None)")
        if self.ahead and self.late:
            raise ValueError("late: a pass computed ahead already runs only when no other prompt needs a step")


@dataclass(frozen=True)
class FirstToken:
    """The first generated token, for the router to stream (the decode worker gets it, with the sampler's
    state, over the KV transfer), with its text, its log-probability and the prompt's when the request asked
    for them. ``token_id`` None: the request generates nothing (``max_tokens`` 0; it scored its prompt). The
    decode instance continues each sequence after it: at the next position, after ``text``."""

    request_id: str
    token_id: int | None
    ttft_s: float
    num_prompt_tokens: int
    logprob: TokenLogprob | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    # n > 1: the first tokens of sequences 1 .. n-1, (index, token id, log-probability or None, text)
    forks: tuple[tuple[int, int, TokenLogprob | None, str], ...] = ()
    text: str = ""  # the first token's text (stop strings and held-back characters as the decode side cuts them)
    cached: CachedPrompt = CachedPrompt()  # what this instance found of the prompt rather than computing it


@dataclass(frozen=True)
class PrefillFailure:
    """A request this worker gave up on (its blocks are freed)."""

    request_id: str
    reason: str
    retryable: bool


@dataclass
class PrefillStepOutput:
    first_tokens: list[FirstToken] = field(default_factory=list)
    transferred: list[str] = field(default_factory=list)  # KV acknowledged by the decode side
    failed: list[PrefillFailure] = field(default_factory=list)
    tokens_computed: int = 0  # prompt tokens the step's forward pass computed, in ``compute_s`` seconds
    compute_s: float = 0.0  # (the router's measure of how fast the instance prefills)
    ahead_ended: list[str] = field(default_factory=list)  # passes ahead computed, dropped or taken over

    @property
    def empty(self) -> bool:
        return not (self.first_tokens or self.transferred or self.failed or self.tokens_computed or self.ahead_ended)
