"""Runs the model for one step over the paged KV cache.

Shared by the reference engine, the prefill worker and the decode worker: each builds a list of
:class:`StepInput` (which tokens of which sequence to compute, where its blocks are), and gets back
logits for the last ``num_logits`` positions of each input. A KV connector's layer hook
(:class:`~modeling.kv_connector.LayerHook`) rides along: eagerly it is called around each layer's cache write,
after a compiled step for every layer (a compiled step cannot call back inside the pass).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modeling.attention import AttentionBackend, AttentionMetadata, LayerHookContext, PagedAttentionContext
from modeling.compiled_step import CompiledSteps
from modeling.kv_cache import PagedKVCache
from modeling.kv_connector import LayerHook
from modeling.model import CausalLM
from modeling.step_graphs import GraphSteps


@dataclass(frozen=True)
class StepInput:
    """Compute ``token_ids`` at positions ``start .. start + len - 1`` of a sequence whose KV lives in
    ``block_table`` (large enough for them). ``num_logits``: how many final positions need logits
    (1 to sample the next token, k + 1 to verify k drafts, 0 for a mid-prompt chunk).
    ``positions`` overrides the RoPE positions (drafts may re-index); default start + i."""

    token_ids: list[int]
    start: int
    block_table: list[int]
    num_logits: int = 1
    positions: list[int] | None = None


class ModelRunner:
    """Owns nothing but references: the model, its cache, the attention backend."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, backend: AttentionBackend):
        self.model = model
        self.cache = cache
        self.backend = backend
        self.compiled: CompiledSteps | GraphSteps | None = None  # set by build_runner when compile_steps is on
        self.device = cache.device
        self.block_size = cache.spec.block_size

    def build(self, inputs: list[StepInput], sink_len: int = 0, window_starts: list[int] | None = None):
        """Flatten inputs into (input_ids [T], positions [T], metadata, logit row indices)."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        logit_rows: list[int] = []
        for inp in inputs:
            n = len(inp.token_ids)
            ids.extend(inp.token_ids)
            positions.extend(inp.positions if inp.positions is not None else range(inp.start, inp.start + n))
            table = inp.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(inp.start, inp.start + n))
            query_start.append(query_start[-1] + n)
            seq_lens.append(inp.start + n)
            logit_rows.extend(range(query_start[-1] - inp.num_logits, query_start[-1]))
        meta = AttentionMetadata(
            query_start=query_start,
            seq_lens=seq_lens,
            block_tables=[inp.block_table for inp in inputs],
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            block_size=bs,
            sink_len=sink_len,
            window_starts=window_starts,
        )
        return (
            torch.tensor(ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            meta,
            logit_rows,
        )

    @torch.inference_mode()
    def run(self, inputs: list[StepInput], sink_len: int = 0, window_starts: list[int] | None = None,
            kv_hook: LayerHook | None = None) -> torch.Tensor:
        """Compute the step; returns float32 logits [sum(num_logits), vocab] in input order. On CUDA the
        step has finished when this returns (every caller reads the logits next), so the pass timings the
        workers take around it (cost models, pass logs) are device time, not kernel-launch time.
        ``kv_hook``: as in :meth:`forward`."""
        if not inputs:
            return torch.empty(0, self.model.config.vocab_size)
        hidden, logit_rows = self.forward(inputs, sink_len, window_starts, kv_hook)
        if not logit_rows:
            logits = torch.empty(0, self.model.config.vocab_size)
        else:
            rows = torch.tensor(logit_rows, dtype=torch.int64, device=hidden.device)
            logits = self.model.logits(hidden.index_select(0, rows))
        if hidden.device.type == "cuda":
            torch.cuda.synchronize(hidden.device)
        return logits

    @torch.inference_mode()
    def forward(self, inputs: list[StepInput], sink_len: int = 0, window_starts: list[int] | None = None,
                kv_hook: LayerHook | None = None) -> tuple[torch.Tensor, list[int]]:
        """The step's forward pass without logits: (final hidden states [T, hidden], logit row indices).
        Writes the inputs' KV into the cache. ``kv_hook``: a KV connector's layer hook, each of whose methods
        sees every layer exactly once, in order: around each layer's cache write when the step runs eagerly;
        ``wait_for_layer_load`` for every layer before and ``save_kv_layer`` for every layer after a compiled
        step (:mod:`modeling.compiled_step`, :mod:`modeling.step_graphs`)."""
        input_ids, positions, meta, logit_rows = self.build(inputs, sink_len, window_starts)
        hidden = None
        loads_waited = False
        if self.compiled is not None and self.compiled.eligible(meta):
            if kv_hook is not None:
                for layer in range(self.model.config.num_hidden_layers):
                    kv_hook.wait_for_layer_load(layer)
                loads_waited = True
            hidden = self.compiled.forward(input_ids, positions, meta)  # None: it failed, run eagerly
            if hidden is not None and kv_hook is not None:
                for layer in range(self.model.config.num_hidden_layers):
                    kv_hook.save_kv_layer(layer)
        if hidden is None:
            ctx = PagedAttentionContext(self.cache, meta, self.backend) if kv_hook is None else \
                LayerHookContext(self.cache, meta, self.backend, kv_hook, loads=not loads_waited)
            hidden = self.model(input_ids, positions, ctx)
        return hidden, logit_rows
