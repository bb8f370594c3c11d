"""Sampling parameters and their validation (no torch: the router and the message modules import them).

The surface is vLLM's (what OpenAI-compatible clients send), applied to the target model's logits in this
order at every position, speculated positions included (``modeling/sampling.py``):

1. ``logit_bias`` is added; while fewer than ``min_tokens`` tokens are out, EOS (unless ``ignore_eos``) and
   ``stop_token_ids`` are masked;
2. penalties over the tokens before the position: ``repetition_penalty`` (prompt and output tokens; a
   positive logit is divided by it, a negative one multiplied), then ``frequency_penalty`` x the token's
   count in the output and ``presence_penalty`` if it occurs there at all (both subtracted);
3. greedy (``temperature`` 0) takes the argmax here; otherwise the logits are divided by the temperature,
   tokens below ``min_p`` x the top token's probability are dropped, then ``top_k`` and ``top_p`` filter.

``top_k`` 0 and ``top_p`` 1.0 disable those filters; ``seed`` None draws a random seed. Stop strings end the
output before the string unless ``include_stop_str_in_output``. ``logprobs`` / ``prompt_logprobs`` (None:
off; N in 0..20: the chosen token's log-probability and the N most likely) report the target model's
log-softmax before any of the processing above (vLLM's default, "raw" log-probabilities). ``n`` sequences
are returned per request; ``best_of`` (>= n) are generated and the n with the highest cumulative
log-probability returned. ``max_tokens`` 0 generates nothing (the prompt alone is scored).

``structured`` constrains the output to a grammar (``modeling/structured_output.py``): after the stages
above, every token the grammar forbids at a position is masked, drafts and verified positions alike, and the
sequence stops when the grammar is complete.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from modeling.errors import InvalidRequestError
from modeling.structured_output import StructuredOutput

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # top log-probabilities per position (OpenAI's and vLLM's default limit)
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_SEQUENCES = 16  # n and best_of


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens, what it reports, and when it stops."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    best_of: int | None = None
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # Accept lists and dicts from callers but store tuples (frozen, hashable).
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((tok, val) for tok, val in bias)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes the logits before greedy selection or temperature (penalties,
        min_tokens, logit_bias)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or self.min_tokens > 0 or bool(self.logit_bias))

    @property
    def num_sequences(self) -> int:
        """Sequences generated: ``best_of`` when given, else ``n``."""
        return self.best_of if self.best_of is not None else self.n

    def with_ranking_logprobs(self) -> "SamplingParams":
        """These parameters, computing the log-probabilities ``best_of`` > n ranks its sequences by (their
        cumulative log-probability): ``logprobs`` 0 when none were asked for."""
        if self.num_sequences > self.n and self.logprobs is None:
            return replace(self, logprobs=0)
        return self

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raise InvalidRequestError naming the first bad field; return self when all are valid."""
        top_id = None if vocab_size is None else vocab_size - 1
        _check_int("max_tokens", self.max_tokens, low=0)
        _check_float("temperature", self.temperature, low=0.0, high=100.0)
        _check_int("top_k", self.top_k, low=0)
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=MAX_SEED)
        for i, tok in enumerate(self.stop_token_ids):
            _check_int(f"stop_token_ids[{i}]", tok, low=0, high=top_id)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop[{i}]", "must be a non-empty string")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(f"stop[{i}]", f"at most {MAX_STOP_STRING_CHARS} characters")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(name, "must be a boolean")
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _check_float("repetition_penalty", self.repetition_penalty, low=0.0, high=10.0, low_open=True)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        _check_int("min_tokens", self.min_tokens, low=0, high=self.max_tokens)
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for tok, bias in self.logit_bias:
            _check_int("logit_bias", tok, low=0, high=top_id)
            _check_float(f"logit_bias[{tok}]", bias, low=-100.0, high=100.0)
        if len({tok for tok, _ in self.logit_bias}) != len(self.logit_bias):
            raise InvalidRequestError("logit_bias", "a token id appears twice")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), low=0, high=MAX_LOGPROBS)
        _check_int("n", self.n, low=1, high=MAX_SEQUENCES)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, low=self.n, high=MAX_SEQUENCES)
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidRequestError("structured_outputs", f"must be a StructuredOutput, got {self.structured!r}")
        return self


def _check_int(name: str, value, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(name, f"must be an integer, got {value!r}")
    if low is not None and value < low:
        raise InvalidRequestError(name, f"must be >= {low}, got {value}")
    if high is not None and value > high:
        raise InvalidRequestError(name, f"must be <= {high}, got {value}")


def _check_float(name: str, value, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(name, f"must be a finite number, got {value!r}")
    if (value <= low) if low_open else (value < low):
        raise InvalidRequestError(name, f"must be {'>' if low_open else '>='} {low}, got {value}")
    if value > high:
        raise InvalidRequestError(name, f"must be <= {high}, got {value}")
