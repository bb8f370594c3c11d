"""Typed, validated configuration of a decode worker and its speculation."""

from __future__ import annotations

from dataclasses import dataclass, field

from modeling.instance_config import (InstanceConfig, Problems, booleans, compile_steps_problems, integers, one_of,
                                      raise_first, set_by)

DRAFTERS = ("none", "self_sparse", "draft_model")
K_POLICIES = ("fixed", "adaptive")
DRAFT_POSITIONS = ("original", "reindexed")


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
    grammar_drafts: a request with structured output drafts only tokens its grammar allows (the matcher
    walked along the draft path); false masks the verification alone, as most servers do (kept to measure
    the acceptance it loses). Either way the output is the same: verification applies the grammar.
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
    grammar_drafts: bool = True

    def __post_init__(self) -> None:
        raise_first([(f"speculation.{name}", why) for name, why in self.check()])  # always that sub-section

    def check(self) -> Problems:
        errs = (one_of("drafter", self.drafter, DRAFTERS) + one_of("k_policy", self.k_policy, K_POLICIES)
                + one_of("draft_positions", self.draft_positions, DRAFT_POSITIONS)
                + integers(self, ("k",), 0, 16) + integers(self, ("max_k",), 1, 16)
                + integers(self, ("sink_tokens",), 0) + integers(self, ("budget",))
                + booleans(self, ("grammar_drafts",)))
        if errs:
            return errs
        if self.sink_tokens >= self.budget:
            errs.append(("sink_tokens", f"must be < budget ({self.budget}), got {self.sink_tokens}"))
        slo = self.tpot_slo_ms
        if slo is not None and (isinstance(slo, bool) or not isinstance(slo, (int, float)) or slo <= 0):
            errs.append(("tpot_slo_ms", f"must be a positive number or null, got {slo!r}"))
        if self.drafter == "draft_model" and not self.draft_model:
            errs.append(("draft_model", "required when drafter is 'draft_model'"))
        return errs

    @property
    def enabled(self) -> bool:
        return self.drafter != "none"

    @property
    def window(self) -> int:
        """Recent tokens in the draft's view."""
        return self.budget - self.sink_tokens


@dataclass(frozen=True)
class DecodeWorkerConfig(InstanceConfig):
    """The decode pool and each of its workers (the ``decode:`` section of the cluster YAML):
    ``max_num_seqs`` sequences decode at once; ``prefill_chunk`` is the chunk of a local (re)prefill (after a
    preemption, and a request prefilled on the decode worker itself); ``prefill_tpot_slo_ms`` bounds what a step
    prefills beside decoding sequences so that their time per output token stays within it
    (``decode_worker/prefill_budget.py``; set from the ``slo:`` and ``load_aware:`` sections, None: the whole
    chunk each step); ``profile_on_start`` measures the
    worker's own step costs before it serves (the adaptive speculation length reads them); ``prefix_caching``
    keeps finished requests' full KV blocks (prompt and generated tokens) so that a request prefilled here
    starts from its longest cached prefix (``modeling/prefix_cache.py``)."""

    kv_cache_tokens: int = 262144
    max_num_seqs: int = 64
    prefill_chunk: int = 1024
    prefill_tpot_slo_ms: float | None = field(default=None, metadata=set_by("slo.tpot_ms"))
    profile_on_start: bool = True
    prefix_caching: bool = field(default=True, metadata=set_by("prefix_caching.enabled"))
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    # run decode, verification and draft steps through a compiled forward (modeling/compiled_step.py): on CUDA
    # with the triton attention backend, CUDA graphs per batch bucket; on CPU with the cpu backend,
    # torch.compile with the kernels as custom operators (logits identical to eager, measured no faster on
    # small models: benchmarks/decode_step.py --compile)
    compile_steps: bool = False

    def check(self) -> Problems:
        errs = super().check() + integers(self, ("max_num_seqs", "prefill_chunk")) + \
            booleans(self, ("profile_on_start", "prefix_caching")) + compile_steps_problems(self)
        slo = self.prefill_tpot_slo_ms
        if slo is not None and (isinstance(slo, bool) or not isinstance(slo, (int, float)) or slo <= 0):
            errs.append(("prefill_tpot_slo_ms", f"must be a positive number or null, got {slo!r}"))
        return errs
