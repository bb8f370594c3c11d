"""Compiled forward passes for the steps that repeat every few milliseconds: decode, k + 1 verification and
draft steps (every sequence with at most :data:`MAX_QUERY` new tokens). ``compile_steps: true`` turns them
on: :class:`~modeling.step_graphs.GraphSteps` (CUDA graphs) on CUDA with the ``triton`` attention backend,
:class:`CompiledSteps` (this module) on CPU with the ``cpu`` backend.

On CPU with the ``cpu`` attention backend, the model's forward is compiled once with ``torch.compile``
(dynamic shapes: one graph for every batch size), the extension's kernels kept in the graph as custom
operators (:mod:`modeling.cpu_ops`), the elementwise work between them (norms, rotary embedding, residuals,
SwiGLU) fused into a few loops. Inductor's ``emulate_precision_casts`` makes the fused code round to the
model's dtype wherever eager code does, so the logits equal the eager step's bit for bit (tested), and greedy
tokens with them. Prefill chunks and other long steps stay eager.

:class:`CompiledSteps` is what the runner holds; :meth:`CompiledSteps.eligible` says whether a step goes
through it, and a step whose compilation fails runs eagerly from then on (logged once), so a compiler
problem costs speed, never a request.
"""

from __future__ import annotations

import logging
import math

import torch

from modeling.attention.metadata import AttentionMetadata
from modeling.kv_cache import PagedKVCache
from modeling.model import CausalLM

log = logging.getLogger(__name__)

# Steps whose sequences have at most this many new tokens each (the CPU kernel's decode/verify range).
MAX_QUERY = 16


def compiled_steps_supported(device: torch.device | str, backend_name: str) -> bool:
    """True where compiled steps run: :class:`CompiledSteps` on CPU with the ``cpu`` attention backend,
    :class:`~modeling.step_graphs.GraphSteps` on CUDA with ``triton``."""
    kind = torch.device(device).type
    return (kind == "cpu" and backend_name == "cpu") or (kind == "cuda" and backend_name == "triton")


class _OperatorContext:
    """The model's AttentionContext inside the compiled graph: only tensors and fixed scalars, through the
    extension's custom operators."""

    def __init__(self, kv: torch.Tensor, meta_tensors: dict[str, torch.Tensor], slots: torch.Tensor, sink_len: int):
        self.kv = kv  # [L, 2, blocks, block_size, Hkv, D]
        self.t = meta_tensors
        self.slots = slots
        self.sink_len = sink_len

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sliding_window: int | None = None) -> torch.Tensor:
        torch.ops.magicserve.write_kv(self.kv, layer, self.slots, k, v)
        k_cache, v_cache = self.kv[layer, 0], self.kv[layer, 1]
        d = k_cache.shape[3]
        t = self.t
        return torch.ops.magicserve.cpu_paged_attention(
            q, k_cache, v_cache, t["block_tables"], t["seq_lens"], t["query_start"], self.sink_len,
            t["window_starts"], 1.0 / math.sqrt(d), sliding_window or 0)


def _forward(model: CausalLM, input_ids: torch.Tensor, positions: torch.Tensor, ctx: _OperatorContext) -> torch.Tensor:
    return model(input_ids, positions, ctx)


class CompiledSteps:
    """The compiled forward of one model over one cache (see the module docstring)."""

    def __init__(self, model: CausalLM, cache: PagedKVCache):
        from modeling.cpu_ops import register_cpu_ops

        register_cpu_ops()
        self.model = model
        self.cache = cache
        self.failed: str | None = None  # why compiling failed (then every step runs eagerly)
        self.steps = 0
        self._fn = torch.compile(_forward, dynamic=True, options={"emulate_precision_casts": True})

    def eligible(self, meta: AttentionMetadata) -> bool:
        """A step this runs: no failure so far, and at most :data:`MAX_QUERY` new tokens per sequence."""
        if self.failed is not None or meta.num_tokens == 0:
            return False
        qs = meta.query_start
        return qs[-1] <= MAX_QUERY or all(e - s <= MAX_QUERY for s, e in zip(qs, qs[1:]))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The step's final hidden states [T, hidden], writing its KV into the cache; None when compiling
        failed (the caller then runs the step eagerly)."""
        ctx = _OperatorContext(self.cache.kv, meta.tensors(self.cache.device), meta.slot_mapping, meta.sink_len)
        try:
            hidden = self._fn(self.model, input_ids, positions, ctx)
        except Exception as err:  # a compiler problem: this process runs eagerly from now on
            self.failed = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            log.warning("compiled steps disabled, running eagerly: %s", self.failed)
            return None
        self.steps += 1
        return hidden

