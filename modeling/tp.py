"""Tensor parallelism applied from outside a plain :class:`CausalLM` (gpt-fast's ``tp.py``, vLLM's
column/row-parallel linears). ``modeling/model.py`` knows nothing of it.

Rank ``r`` of ``t`` holds:

* attention: the query heads ``[r * Hq/t, (r+1) * Hq/t)`` and the KV heads of
  :func:`modeling.heads.shard_heads` (an even split, or one replicated head each when ``t > Hkv``),
  so every local query head's KV head is local; ``q/k/v_proj`` are column-parallel (output rows),
  ``o_proj`` row-parallel (input columns) followed by one all-reduce;
* MLP: ``gate_proj``/``up_proj`` column-parallel over ``intermediate_size / t``, ``down_proj``
  row-parallel followed by one all-reduce;
* embeddings, norms and the LM head replicated: every rank has the full hidden state after each
  all-reduce, and only the rank that samples computes logits.

A row-parallel bias is added once, by rank 0, so the all-reduced sum carries it once.
:func:`slice_plan` tells the checkpoint loader which slice of each tensor a rank reads, so a rank
memory-maps the safetensors files and copies only its own slices, never the whole model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from modeling.config import ModelConfig
from modeling.heads import HeadRange, shard_heads


@dataclass(frozen=True)
class TPShard:
    """Rank ``rank`` of a tensor-parallel group of ``size`` ranks."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"tensor_parallel: must be an integer >= 1, got {self.size!r}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank: must be in [0, {self.size}), got {self.rank!r}")

    @property
    def sharded(self) -> bool:
        return self.size > 1

    def check(self, config: ModelConfig, where: str = "tensor_parallel") -> None:
        """Raise ValueError naming the field if ``config`` cannot be split ``size`` ways."""
        t = self.size
        problems = []
        if config.num_attention_heads % t:
            problems.append(f"num_attention_heads ({config.num_attention_heads})")
        if config.intermediate_size % t:
            problems.append(f"intermediate_size ({config.intermediate_size})")
        hkv = config.num_key_value_heads
        if (t <= hkv and hkv % t) or (t > hkv and t % hkv):
            problems.append(f"num_key_value_heads ({hkv}; tp must divide it or be a multiple of it)")
        if problems:
            raise ValueError(f"{where}: {t} does not divide the model's {', '.join(problems)}")

    def q_heads(self, config: ModelConfig) -> HeadRange:
        per = config.num_attention_heads // self.size
        return HeadRange(self.rank * per, (self.rank + 1) * per)

    def kv_heads(self, config: ModelConfig) -> HeadRange:
        return shard_heads(config.num_key_value_heads, self.size, self.rank)

    def intermediate(self, config: ModelConfig) -> tuple[int, int]:
        per = config.intermediate_size // self.size
        return self.rank * per, (self.rank + 1) * per


@dataclass(frozen=True)
class TensorSlice:
    """Read rows (``dim`` 0) or columns (``dim`` 1) ``[start, stop)`` of a checkpoint tensor."""

    dim: int
    start: int
    stop: int


DROP = None  # a tensor this rank does not hold (a row-parallel bias on ranks other than 0)


def slice_plan(config: ModelConfig, shard: TPShard) -> dict[str, TensorSlice | None]:
    """For each sharded HF tensor name: the slice this rank reads, or ``DROP``. Names not listed are
    read whole (replicated)."""
    if not shard.sharded:
        return {}
    shard.check(config)
    d = config.head_dim
    q, kv = shard.q_heads(config), shard.kv_heads(config)
    i0, i1 = shard.intermediate(config)
    plan: dict[str, TensorSlice | None] = {}
    for layer in range(config.num_hidden_layers):
        attn, mlp = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
        plan[f"{attn}.q_proj.weight"] = TensorSlice(0, q.start * d, q.end * d)
        plan[f"{attn}.k_proj.weight"] = TensorSlice(0, kv.start * d, kv.end * d)
        plan[f"{attn}.v_proj.weight"] = TensorSlice(0, kv.start * d, kv.end * d)
        plan[f"{attn}.o_proj.weight"] = TensorSlice(1, q.start * d, q.end * d)
        if config.qkv_bias:
            plan[f"{attn}.q_proj.bias"] = TensorSlice(0, q.start * d, q.end * d)
            plan[f"{attn}.k_proj.bias"] = TensorSlice(0, kv.start * d, kv.end * d)
            plan[f"{attn}.v_proj.bias"] = TensorSlice(0, kv.start * d, kv.end * d)
        if config.o_bias and shard.rank:
            plan[f"{attn}.o_proj.bias"] = DROP
        plan[f"{mlp}.gate_proj.weight"] = TensorSlice(0, i0, i1)
        plan[f"{mlp}.up_proj.weight"] = TensorSlice(0, i0, i1)
        plan[f"{mlp}.down_proj.weight"] = TensorSlice(1, i0, i1)
        if config.mlp_bias:
            plan[f"{mlp}.gate_proj.bias"] = TensorSlice(0, i0, i1)
            plan[f"{mlp}.up_proj.bias"] = TensorSlice(0, i0, i1)
            if shard.rank:
                plan[f"{mlp}.down_proj.bias"] = DROP
    return plan


def shard_layout(model: nn.Module, shard: TPShard) -> None:
    """Resize a (meta-device) CausalLM's layers to this rank's shard, in place, before weights load."""
    if not shard.sharded:
        return
    config: ModelConfig = model.config
    shard.check(config)
    d, h = config.head_dim, config.hidden_size
    nq, nkv = shard.q_heads(config).size, shard.kv_heads(config).size
    i0, i1 = shard.intermediate(config)
    keep_row_bias = shard.rank == 0
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.num_heads, attn.num_kv_heads = nq, nkv
        attn.q_proj = nn.Linear(h, nq * d, bias=config.qkv_bias, device="meta")
        attn.k_proj = nn.Linear(h, nkv * d, bias=config.qkv_bias, device="meta")
        attn.v_proj = nn.Linear(h, nkv * d, bias=config.qkv_bias, device="meta")
        attn.o_proj = nn.Linear(nq * d, h, bias=config.o_bias and keep_row_bias, device="meta")
        mlp = layer.mlp
        mlp.gate_proj = nn.Linear(h, i1 - i0, bias=config.mlp_bias, device="meta")
        mlp.up_proj = nn.Linear(h, i1 - i0, bias=config.mlp_bias, device="meta")
        mlp.down_proj = nn.Linear(i1 - i0, h, bias=config.mlp_bias and keep_row_bias, device="meta")


@dataclass
class CollectiveStats:
    """Time spent in the model's all-reduces (the host's view: on CUDA, launch plus any sync)."""

    calls: int = 0
    seconds: float = 0.0

    def reset(self) -> None:
        self.calls, self.seconds = 0, 0.0


def install_all_reduce(model: nn.Module, all_reduce: Callable[[torch.Tensor], None]) -> CollectiveStats:
    """Sum the row-parallel outputs (``o_proj``, ``down_proj``) across ranks after each forward, in place.
    Returns the counters the hooks fill."""
    stats = CollectiveStats()

    def hook(_module: nn.Module, _inputs: tuple, out: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        all_reduce(out)
        stats.seconds += time.perf_counter() - t0
        stats.calls += 1
        return out

    for layer in model.model.layers:
        layer.self_attn.o_proj.register_forward_hook(hook)
        layer.mlp.down_proj.register_forward_hook(hook)
    return stats
