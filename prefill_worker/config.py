"""Configuration of the prefill pool and each of its workers (the ``prefill:`` section of the cluster YAML)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kv_transfer.channel import TransferConfig
from modeling.instance_config import InstanceConfig, Problems, booleans, compile_steps_problems, integers, set_by


@dataclass(frozen=True)
class PrefillWorkerConfig(InstanceConfig):
    """``kv_cache_tokens`` sizes the block pool (blocks stay held until the receiver acknowledges them);
    ``token_budget`` caps new tokens per forward pass (chunked prefill) and ``max_num_seqs`` the prompts in
    one; ``layerwise_streaming`` sends each layer's KV as soon as it is written (False: after the prompt's last
    chunk); ``prefix_caching`` keeps prompts' full KV blocks once transferred and computes a prompt from its
    longest cached prefix on (``modeling/prefix_cache.py``); ``compile_steps`` runs chunks of at most 16 tokens
    per prompt compiled (``modeling/compiled_step.py``; longer ones run eagerly). ``transfer`` is the cluster's
    ``kv_transfer`` section."""

    token_budget: int = 512
    max_num_seqs: int = 16
    layerwise_streaming: bool = True
    prefix_caching: bool = field(default=True, metadata=set_by("prefix_caching.enabled"))
    compile_steps: bool = False
    transfer: TransferConfig = field(default_factory=TransferConfig, metadata=set_by("kv_transfer"))

    def check(self) -> Problems:
        return super().check() + integers(self, ("token_budget", "max_num_seqs")) + \
            booleans(self, ("layerwise_streaming", "prefix_caching")) + compile_steps_problems(self)
