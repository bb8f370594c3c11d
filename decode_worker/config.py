"""Typed, validated configuration of a decode worker and its speculation."""

from __future__ import annotations

from dataclasses import dataclass, field

DRAFTERS = ("none", "self_sparse", "draft_model")
K_POLICIES = ("fixed", "adaptive")
DRAFT_POSITIONS = ("original", "reindexed")


def _int(path: str, value, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{path}: must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{path}: must be {bound}, got {value}")


def _choice(path: str, value, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{path}: must be one of {', '.join(allowed)}, got {value!r}")


@dataclass(frozen=True)
class SpeculationConfig:
    """How the decode worker speculates.

    drafter: ``none`` (plain decoding), ``self_sparse`` (the target over a sink + window view of its own
    KV) or ``draft_model`` (a small model with its own StreamingLLM-style cache at ``draft_model``).
    budget: KV tokens the draft attends to (sink_tokens of them are the sequence's first tokens, the rest
    the most recent ones). k_policy ``fixed`` always drafts ``k`` tokens; ``adaptive`` picks 0..max_k each
    step from the cost model and the measured acceptance rate, keeping a step under ``tpot_slo_ms``.
    draft_positions: RoPE positions of draft queries, ``original`` (true positions; required for correct
    relative distances to keys cached at their true positions) or ``reindexed`` (positions counted within
    the sparse view, as StreamingLLM does for caches it re-encodes; kept for the measurement).
    """

    drafter: str = "self_sparse"
    budget: int = 256
    sink_tokens: int = 16
    k_policy: str = "adaptive"
    k: int = 3
    max_k: int = 6
    tpot_slo_ms: float | None = None
    draft_model: str | None = None
    draft_positions: str = "original"

    def __post_init__(self) -> None:
        p = "speculation"
        _choice(f"{p}.drafter", self.drafter, DRAFTERS)
        _choice(f"{p}.k_policy", self.k_policy, K_POLICIES)
        _choice(f"{p}.draft_positions", self.draft_positions, DRAFT_POSITIONS)
        _int(f"{p}.k", self.k, 0, 16)
        _int(f"{p}.max_k", self.max_k, 1, 16)
        _int(f"{p}.sink_tokens", self.sink_tokens, 0)
        _int(f"{p}.budget", self.budget, 1)
        if self.sink_tokens >= self.budget:
            raise ValueError(f"{p}.sink_tokens: must be < budget ({self.budget}), got {self.sink_tokens}")
        if self.tpot_slo_ms is not None and (isinstance(self.tpot_slo_ms, bool) or not isinstance(self.tpot_slo_ms, (int, float)) or self.tpot_slo_ms <= 0):
            raise ValueError(f"{p}.tpot_slo_ms: must be a positive number or null, got {self.tpot_slo_ms!r}")
        if self.drafter == "draft_model" and not self.draft_model:
            raise ValueError(f"{p}.draft_model: required when drafter is 'draft_model'")

    @property
    def enabled(self) -> bool:
        return self.drafter != "none"

    @property
    def window(self) -> int:
        """Recent tokens in the draft's view."""
        return self.budget - self.sink_tokens


@dataclass(frozen=True)
class DecodeWorkerConfig:
    """Settings of one decode worker instance."""

    dtype: str = "bfloat16"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_tokens: int = 262144
    max_num_seqs: int = 64
    attention_backend: str = "auto"
    prefill_chunk: int = 1024  # chunk size for local (re)prefill: tests, recompute after preemption
    profile_on_start: bool = True
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)

    def __post_init__(self) -> None:
        _int("decode.block_size", self.block_size, 1)
        _int("decode.kv_cache_tokens", self.kv_cache_tokens, self.block_size)
        _int("decode.max_num_seqs", self.max_num_seqs, 1)
        _int("decode.prefill_chunk", self.prefill_chunk, 1)
