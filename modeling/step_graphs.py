"""CUDA graphs of decode, verification and draft steps (``compile_steps: true`` on CUDA with Triton attention).

A step whose sequences all have the same number ``Q`` <= :data:`~modeling.compiled_step.MAX_QUERY` of new
tokens is padded to a batch bucket (:data:`BUCKETS`) and captured once per (bucket, Q, view) as a CUDA graph,
then replayed with the step's tokens, positions, slots and block tables copied into the graph's static
buffers: one launch per step instead of one per kernel. Padding tokens belong to no sequence (zero-length
sequences pad the batch) and write their KV to a scratch block outside the block pool. The Triton kernel reads
every per-sequence value from device tensors and its launch only from the bucket's shape, so a graph replays
for any lengths and block tables; the key splits are fixed at the longest context's. Without capture the same
padded static path runs eagerly, which CI checks on CPU under Triton's interpreter. A step whose capture or
replay fails runs eagerly, as every later one (logged once).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from modeling.attention import PagedAttentionContext
from modeling.attention.metadata import AttentionMetadata
from modeling.attention.triton_backend import TritonAttentionBackend, launch_shape, split_keys_for
from modeling.compiled_step import MAX_QUERY
from modeling.kv_cache import PagedKVCache
from modeling.model import CausalLM

log = logging.getLogger(__name__)

# Batch sizes a captured step is padded to.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class _Graph:
    """One captured (or, without capture, statically replayed) step shape and its static buffers."""

    ids: torch.Tensor  # int64 [T_pad]
    positions: torch.Tensor  # int64 [T_pad]
    slots: torch.Tensor  # int64 [T_pad]
    tensors: dict[str, torch.Tensor]  # the Triton kernel's metadata tensors, bucket-sized
    meta: AttentionMetadata  # launch shape (Python side) over those tensors
    hidden: torch.Tensor | None = None  # [T_pad, hidden], the graph's output
    graph: object | None = None  # torch.cuda.CUDAGraph


class GraphSteps:
    """Steps of ``Q`` new tokens per sequence, padded to a batch bucket and replayed from static buffers.

    ``cache`` needs a scratch block (``PagedKVCache(..., scratch_blocks=1)``): padding tokens write there.
    ``max_len``: the longest sequence a step may hold (sizes the block tables and the key splits).
    ``split_keys``: the eager Triton backend's keys per split (by default ``split_keys_for(max_len)``, what
    ``make_backend`` gives for that length). ``capture``: record CUDA graphs (CUDA); without it the padded
    static step runs eagerly, the same computation (CPU tests under Triton's interpreter)."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, max_len: int, capture: bool | None = None,
                 split_keys: int | None = None):
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.block_size = cache.spec.block_size
        self.scratch_slot = cache.scratch_slot
        self.max_blocks = -(-max_len // self.block_size)
        self.capture = self.device.type == "cuda" if capture is None else capture
        c = model.config
        # one split count for every replay, enough for the longest sequence, over the eager backend's chunks
        # (``split_keys``): a replayed row then equals the eager step's bit for bit
        split_keys = split_keys_for(max_len) if split_keys is None else split_keys
        splits = launch_shape(1, cache.spec.num_kv_heads, c.num_attention_heads // c.num_key_value_heads,
                              c.head_dim, 1, max_len, split_keys).num_splits
        self.backend = TritonAttentionBackend(split_keys, num_splits=splits)
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
