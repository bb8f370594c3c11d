"""flash-attn paged attention (CUDA only; ``flash_attn`` is imported lazily).

Uses ``flash_attn_varlen_func`` with ``block_table`` so one call serves a mixed step (prefill chunks,
decode tokens, k+1 verification tokens). flash-attn's causal mask is aligned to the bottom right, i.e.
the new tokens are the last ones of each sequence: exactly the visibility rule of
:mod:`modeling.attention.metadata`. Paged KV in flash-attn needs a block size that is a multiple of 256.
A sparse (sink + window) view is expressed as a virtual block table that skips the hidden blocks, so
its boundaries must be block-aligned.

A layer's sliding window ``W`` (a query at position ``p`` sees keys ``p - W + 1 .. p``) is flash-attn's
``window_size=(W - 1, 0)``: key ``j`` is visible iff ``p - (W - 1) <= j <= p`` in the bottom-right
aligned numbering. Over a virtual (sparse) block table that numbering counts only the view's keys; it
still gives exactly the layer's window when the view hides no sink key, or when no query's window edge
falls between the sink and the view's window start (the window then either covers the sink or holds only
the view's recent keys). Other sparse steps go to the torch gather path (draft passes only).
"""

from __future__ import annotations

import torch

from modeling.attention.metadata import AttentionMetadata
from modeling.attention.torch_backend import TorchAttentionBackend

FLASH_BLOCK_MULTIPLE = 256
FLASH_DTYPES = (torch.float16, torch.bfloat16)  # flash-attn has no float32 kernels


def flash_attn_available() -> bool:
    """True when CUDA is present and the flash_attn package imports."""
    if not torch.cuda.is_available():
        return False
    try:
        import flash_attn  # noqa: F401 - optional (the gpu extra), absent on CPU machines
    except ImportError:
        return False
    return True


class FlashAttentionBackend:
    """Paged attention through flash-attn's varlen kernel."""

    name = "flash"

    def __init__(self, block_size: int):
        if block_size % FLASH_BLOCK_MULTIPLE:
            raise ValueError(
                f"block_size: flash-attn paged KV needs a multiple of {FLASH_BLOCK_MULTIPLE}, got {block_size}"
            )
        try:
            from flash_attn import flash_attn_varlen_func  # optional (the gpu extra)
        except ImportError as err:
            raise RuntimeError("attention backend 'flash' needs the flash-attn package (pip install magicserve[gpu])") from err
        self._varlen = flash_attn_varlen_func
        self._gather = TorchAttentionBackend()

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata,
                sliding_window: int | None = None) -> torch.Tensor:
        """q: [T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; returns [T, Hq, D].
        ``sliding_window``: the layer's window (None: full attention)."""
        if meta.window_starts is not None and not (
                self._block_aligned(meta) and self._window_exact_on_view(meta, sliding_window)):
            # a sink + window view that does not fall on block boundaries cannot be a block table, and one
            # whose sink the layer's window partly hides cannot be windowed by flash: the torch backend
            # gathers it (draft passes only; the target's passes stay on flash)
            return self._gather.forward(q, k, v, k_cache, v_cache, meta, sliding_window)
        t = meta.tensors(q.device)
        if meta.window_starts is None:
            tables, seq_lens = t["block_tables"], t["seq_lens"]
        else:
            tables, seq_lens = self._sparse_tables(meta, q.device)
        cu_k = torch.zeros(meta.num_seqs + 1, dtype=torch.int32, device=q.device)
        cu_k[1:] = torch.cumsum(seq_lens, 0)
        max_q = max(meta.q_len(b) for b in range(meta.num_seqs))
        return self._varlen(
            q, k_cache, v_cache,
            cu_seqlens_q=t["query_start"], cu_seqlens_k=cu_k,
            max_seqlen_q=max_q, max_seqlen_k=int(seq_lens.max().item()),
            causal=True, window_size=(-1, -1) if sliding_window is None else (sliding_window - 1, 0),
            block_table=tables,
        )

    @staticmethod
    def _block_aligned(meta: AttentionMetadata) -> bool:
        bs = meta.block_size
        return meta.sink_len % bs == 0 and all(max(w, meta.sink_len) % bs == 0 for w in meta.window_starts)

    @staticmethod
    def _window_exact_on_view(meta: AttentionMetadata, sliding_window: int | None) -> bool:
        """True when ``window_size=(W - 1, 0)`` over the virtual block table gives exactly the layer's
        window intersected with the view for every query row (see the module docstring)."""
        if sliding_window is None or meta.sink_len == 0:
            return True
        for b in range(meta.num_seqs):
            ws = max(meta.window_starts[b], meta.sink_len)
            # rows' first visible positions run from ctx - W + 1 (first new token) to seq_len - W (last)
            first, last = meta.context_len(b) - sliding_window + 1, meta.seq_lens[b] - sliding_window
            if ws > meta.sink_len and last > 0 and first < ws:
                return False
        return True

    @staticmethod
    def _sparse_tables(meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        bs = meta.block_size
        if meta.sink_len % bs:
            raise ValueError(f"sink_len: flash backend needs a multiple of block_size {bs}, got {meta.sink_len}")
        rows, lens = [], []
        for b in range(meta.num_seqs):
            ws = max(meta.window_starts[b], meta.sink_len)
            if ws % bs:
                raise ValueError(f"window start: flash backend needs a multiple of block_size {bs}, got {ws}")
            table = meta.block_tables[b]
            rows.append(table[: meta.sink_len // bs] + table[ws // bs :])
            lens.append(meta.sink_len + meta.seq_lens[b] - ws)
        width = max(len(r) for r in rows)
        tables = torch.zeros(len(rows), width, dtype=torch.int32)
        for i, r in enumerate(rows):
            tables[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
        return tables.to(device), torch.tensor(lens, dtype=torch.int32, device=device)
