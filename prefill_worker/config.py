"""Configuration of one prefill worker instance."""

from __future__ import annotations

from dataclasses import dataclass, field

from kv_transfer.channel import TransferConfig


@dataclass(frozen=True)
class PrefillWorkerConfig:
    """``kv_cache_tokens`` sizes the block pool (blocks stay held until the receiver acknowledges
    them); ``token_budget`` caps new tokens per forward pass (chunked prefill); ``layerwise_streaming``
    sends each layer's KV as soon as it is written (False: send after the prompt's last chunk)."""

    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_tokens: int = 65536
    token_budget: int = 2048
    max_num_seqs: int = 64
    attention_backend: str = "auto"
    layerwise_streaming: bool = True
    transfer: TransferConfig = field(default_factory=TransferConfig)

    def __post_init__(self) -> None:
        for name in ("block_size", "kv_cache_tokens", "token_budget", "max_num_seqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"prefill.{name}: must be an integer >= 1, got {value!r}")
        if self.kv_cache_tokens < self.block_size:
            raise ValueError(f"prefill.kv_cache_tokens: must be >= block_size ({self.block_size}), "
                             f"got {self.kv_cache_tokens}")
        if not isinstance(self.layerwise_streaming, bool):
            raise ValueError(f"prefill.layerwise_streaming: must be a boolean, got {self.layerwise_streaming!r}")
