"""Sampling parameters, their validation, and token selection.

``target_probs`` turns logits into the exact distribution a request samples from (temperature, top-k,
top-p applied); speculative verification uses the same function so that it preserves that distribution.
Randomness comes from one ``torch.Generator`` per request, seeded from ``seed`` when given: the same
seed gives the same output whatever else is in the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from modeling.errors import InvalidRequestError

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    temperature 0 means greedy; top_k 0 and top_p 1.0 disable those filters; seed None draws a random
    seed; stop strings end the output before the string (which is not returned).
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples (frozen, hashable).
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raise InvalidRequestError naming the first bad field; return self when all are valid."""
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_float("temperature", self.temperature, low=0.0, high=100.0)
        _check_int("top_k", self.top_k, low=0)
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=MAX_SEED)
        for i, tok in enumerate(self.stop_token_ids):
            _check_int(f"stop_token_ids[{i}]", tok, low=0, high=None if vocab_size is None else vocab_size - 1)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop[{i}]", "must be a non-empty string")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(f"stop[{i}]", f"at most {MAX_STOP_STRING_CHARS} characters")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError("ignore_eos", "must be a boolean")
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


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request generator; an unseeded request gets a fresh random seed."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
    return gen


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from. logits: float32 [N, V] -> probs [N, V]."""
    scaled = logits / params.temperature
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        sorted_p = sorted_p.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_from(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from probs [V] with the request's generator."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


@dataclass
class RequestSampler:
    """Per-request sampling state: parameters plus the generator that makes it reproducible."""

    params: SamplingParams
    generator: torch.Generator = field(repr=False, default=None)

    def __post_init__(self) -> None:
        if self.generator is None:
            self.generator = make_generator(self.params.seed)

    def choose(self, logits: torch.Tensor) -> int:
        """logits: float32 [V] -> next token id."""
        if self.params.greedy:
            return int(torch.argmax(logits).item())
        return sample_from(target_probs(logits.unsqueeze(0), self.params)[0], self.generator)
