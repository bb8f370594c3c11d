"""Measuring a decode worker from the same state again and again (benchmarks/spec_decode.py and the
profiler's acceptance measurement): not part of serving."""

from __future__ import annotations

from typing import TYPE_CHECKING

from modeling.output import OutputStream

if TYPE_CHECKING:
    from decode_worker.worker import DecodeWorker


def rewind(worker: "DecodeWorker", request_id: str, num_tokens: int) -> None:
    """Cut a running sequence back to its first ``num_tokens`` tokens (at least prompt + 1), dropping the KV
    of later positions; its text stream restarts from there."""
    live = worker.requests[request_id]
    seq = live.seq
    if not seq.num_prompt < num_tokens <= len(seq.tokens):
        raise ValueError(f"num_tokens: must be in ({seq.num_prompt}, {len(seq.tokens)}], got {num_tokens}")
    del seq.tokens[num_tokens:]
    seq.num_computed = min(seq.num_computed, num_tokens - 1)
    seq.block_table.truncate(worker.pool, num_tokens)
    worker.drafter.on_verified(seq, seq.num_computed)
    live.stream = OutputStream.for_sequence(seq, worker.tokenizer)
    live.stream.push(seq.output_ids, None)
