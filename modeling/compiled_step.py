"""Compiled forward passes for the steps that repeat every few milliseconds: decode, k + 1 verification and
draft steps (every sequence with at most :data:`MAX_QUERY` new tokens).

On CUDA with the ``triton`` attention backend (:class:`GraphSteps`), a step whose sequences all have the
same number of new tokens ``Q`` is padded to a batch bucket and captured once per (bucket, Q, view) as a
CUDA graph, then replayed with the step's tokens, positions, slots and block tables copied into the graph's
static buffers: one launch per step instead of one per kernel. Padding tokens belong to no sequence and write
their KV to a scratch block outside the block pool. The same padded static path runs without capture on
CPU under Triton's interpreter, which is how CI checks it.

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
import time

import torch

from dataclasses import dataclass

from modeling.attention import PagedAttentionContext
from modeling.attention.metadata import AttentionMetadata
from modeling.attention.triton_backend import TritonAttentionBackend, launch_shape
from modeling.kv_cache import PagedKVCache
from modeling.model import CausalLM

log = logging.getLogger(__name__)

# Steps whose sequences have at most this many new tokens each (the CPU kernel's decode/verify range).
MAX_QUERY = 16


# Batch sizes a captured step is padded to.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def compiled_steps_supported(device: torch.device | str, backend_name: str) -> bool:
    """True where compiled steps run: :class:`CompiledSteps` on CPU with the ``cpu`` attention backend,
    :class:`GraphSteps` on CUDA with ``triton``."""
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
        self.compile_seconds = 0.0
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
        t0 = time.perf_counter()
        try:
            hidden = self._fn(self.model, input_ids, positions, ctx)
        except Exception as err:  # a compiler problem: this process runs eagerly from now on
            self.failed = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            log.warning("compiled steps disabled, running eagerly: %s", self.failed)
            return None
        if self.steps == 0:
            self.compile_seconds = time.perf_counter() - t0
        self.steps += 1
        return hidden


@dataclass
class _Graph:
    """One captured (or, without capture, statically replayed) step shape and its static buffers."""

    ids: torch.Tensor  # int64 [T_pad]
    positions: torch.Tensor  # int64 [T_pad]
    slots: torch.Tensor  # int64 [T_pad]
    tensors: dict[str, torch.Tensor]  # the kernel's metadata tensors, bucket-sized
    meta: AttentionMetadata  # launch shape (Python side) over those tensors
    hidden: torch.Tensor | None = None  # [T_pad, hidden], the graph's output
    graph: object | None = None  # torch.cuda.CUDAGraph


class GraphSteps:
    """Steps of ``Q`` new tokens per sequence, padded to a batch bucket and replayed from static buffers.

    ``cache`` needs a scratch block (``PagedKVCache(..., scratch_blocks=1)``): padding tokens write there. ``max_len``: the longest sequence a step may hold (sizes the block tables).
    ``capture``: record CUDA graphs (CUDA); without it the padded static step runs eagerly, the same
    computation (CPU tests under Triton's interpreter)."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, max_len: int, capture: bool | None = None):
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.block_size = cache.spec.block_size
        self.scratch_slot = cache.scratch_slot
        self.max_blocks = -(-max_len // self.block_size)
        self.capture = self.device.type == "cuda" if capture is None else capture
        c = model.config
        # one split count for every replay: the launch shape of the longest context at batch 1
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 1
        splits = launch_shape(1, cache.spec.num_kv_heads, c.num_attention_heads // c.num_key_value_heads,
                              c.head_dim, 1, max_len, 2 * sms).num_splits
        self.backend = TritonAttentionBackend(num_splits=splits)
        self.graphs: dict[tuple, _Graph] = {}
        self.failed: str | None = None
        self.steps = 0
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    def eligible(self, meta: AttentionMetadata) -> bool:
        """Every sequence has the same ``Q`` <= :data:`MAX_QUERY` new tokens, the batch fits a bucket and
        every block table fits the static ones."""
        if self.failed is not None or meta.num_seqs == 0 or meta.num_seqs > BUCKETS[-1]:
            return False
        q = meta.q_len(0)
        return (0 < q <= MAX_QUERY and all(meta.q_len(b) == q for b in range(meta.num_seqs))
                and all(len(t) <= self.max_blocks for t in meta.block_tables))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The step's final hidden states [T, hidden], KV written; None when capturing failed (the caller
        then runs the step eagerly, as every later step)."""
        q = meta.q_len(0)
        bucket = next(b for b in BUCKETS if b >= meta.num_seqs)
        key = (bucket, q, meta.window_starts is not None, meta.sink_len)
        try:
            graph = self.graphs.get(key) or self._build(key)
            self._load(graph, input_ids, positions, meta)
            if graph.graph is not None:
                graph.graph.replay()
            else:
                graph.hidden = self._run(graph)
        except Exception as err:  # capture or replay problem: eager from now on
            self.failed = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            log.warning("captured steps disabled, running eagerly: %s", self.failed)
            return None
        self.steps += 1
        return graph.hidden[: meta.num_tokens]

    def _build(self, key: tuple) -> _Graph:
        bucket, q, sparse, sink_len = key
        n = bucket * q
        dev = self.device
        tensors = {
            "block_tables": torch.zeros(bucket, self.max_blocks, dtype=torch.int32, device=dev),
            "seq_lens": torch.full((bucket,), q, dtype=torch.int32, device=dev),
            "query_start": torch.arange(0, n + 1, q, dtype=torch.int32, device=dev),
            "context_lens": torch.zeros(bucket, dtype=torch.int32, device=dev),
            "window_starts": torch.zeros(bucket, dtype=torch.int32, device=dev),
        }
        slots = torch.full((n,), self.scratch_slot, dtype=torch.int64, device=dev)
        # the Python side fixes the launch (bucket sequences of q tokens); the kernel reads the device side
        meta = AttentionMetadata(query_start=list(range(0, n + 1, q)), seq_lens=[q] * bucket,
                                 block_tables=[[0]] * bucket, slot_mapping=slots, block_size=self.block_size,
                                 sink_len=sink_len, window_starts=[0] * bucket if sparse else None)
        meta._device_tensors[str(dev)] = tensors
        graph = _Graph(ids=torch.zeros(n, dtype=torch.int64, device=dev),
                       positions=torch.zeros(n, dtype=torch.int64, device=dev), slots=slots, tensors=tensors, meta=meta)
        if self.capture:
            self._capture(graph)
        self.graphs[key] = graph
        return graph

    def _run(self, graph: _Graph) -> torch.Tensor:
        return self.model(graph.ids, graph.positions, PagedAttentionContext(self.cache, graph.meta, self.backend))

    def _capture(self, graph: _Graph) -> None:
        # warm up on a side stream (compiles the Triton kernels), then record; the padded buffers write only
        # the scratch block while capturing
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._run(graph)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph, pool=self._pool):
            graph.hidden = self._run(graph)
        graph.graph = cuda_graph

    def _load(self, graph: _Graph, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Copy the step into the static buffers; padding keeps the scratch slot and zero-length sequences."""
        n, b = meta.num_tokens, meta.num_seqs
        graph.ids[:n].copy_(input_ids)
        graph.positions[:n].copy_(positions)
        graph.slots[:n].copy_(meta.slot_mapping)
        graph.slots[n:].fill_(self.scratch_slot)
        t = graph.tensors
        src = meta.tensors(self.device)
        width = src["block_tables"].shape[1]
        t["block_tables"][:b, :width].copy_(src["block_tables"])
        t["seq_lens"][:b].copy_(src["seq_lens"])
        t["seq_lens"][b:].fill_(0)
        t["query_start"][: b + 1].copy_(src["query_start"])
        t["query_start"][b + 1 :].fill_(n)
        t["window_starts"][:b].copy_(src["window_starts"])
