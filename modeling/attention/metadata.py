"""Per-step attention metadata: which cached tokens each new query token may attend to.

A step processes ``T`` new tokens belonging to ``B`` sequences, laid out back to back: sequence ``b``
owns tokens ``query_start[b] : query_start[b+1]``. Before attention runs, the new tokens' keys and values
are written to the cache at ``slot_mapping``, so after the write sequence ``b`` has ``seq_lens[b]`` cached
tokens and its new tokens are the last ``q_len(b)`` of them.

Visibility rule (shared by every backend): query token ``i`` of sequence ``b`` sits at position
``p = seq_lens[b] - q_len(b) + i`` and sees cached token ``j`` iff ``j <= p`` and (full view, or
``j < sink_len``, or ``j >= window_starts[b]``) and, on a layer with sliding window ``W``, ``j > p - W``
(keys ``p - W + 1 .. p``, as transformers' sliding-window mask). The sparse sink + window view is what
MagicDec drafts use; the layer's window is passed to the backend per layer (it is a property of the model,
the view one of the step), and the two combine as above.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Describes one forward step over the paged cache (see module docstring)."""

    query_start: list[int]  # [B + 1], query_start[0] == 0, query_start[B] == T
    seq_lens: list[int]  # [B] cached tokens per sequence after this step's write
    block_tables: list[list[int]]  # [B][blocks]
    slot_mapping: torch.Tensor  # int64 [T] flat cache slot of each new token
    block_size: int
    sink_len: int = 0
    window_starts: list[int] | None = None  # None: full view
    _device_tensors: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        b = len(self.seq_lens)
        if len(self.query_start) != b + 1 or len(self.block_tables) != b:
            raise ValueError("query_start must have B + 1 entries and block_tables B rows")
        if self.window_starts is not None:
            if len(self.window_starts) != b:
                raise ValueError("window_starts must have one entry per sequence")
            for i in range(b):
                if self.window_starts[i] > self.context_len(i):
                    raise ValueError("window_starts must not hide the step's own new tokens")

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1]

    def q_len(self, b: int) -> int:
        return self.query_start[b + 1] - self.query_start[b]

    def context_len(self, b: int) -> int:
        """Tokens cached before this step (the prefix every new token of ``b`` may see)."""
        return self.seq_lens[b] - self.q_len(b)

    def prefix_ranges(self, b: int) -> list[tuple[int, int]]:
        """Visible prefix positions of sequence ``b`` as [start, end) ranges."""
        ctx = self.context_len(b)
        if self.window_starts is None:
            return [(0, ctx)] if ctx > 0 else []
        sink_end = min(self.sink_len, ctx)
        win = max(self.window_starts[b], sink_end)
        ranges = [(0, sink_end)] if sink_end > 0 else []
        if win < ctx:
            ranges.append((win, ctx))
        return ranges

    def shared_prefix_ranges(self, b: int, sliding_window: int | None) -> list[tuple[int, int]]:
        """Prefix positions that every new token of ``b`` sees under ``sliding_window`` (no per-token mask
        needed): the view's ranges from ``seq_lens[b] - sliding_window`` on (the last token's first key)."""
        if sliding_window is None:
            return self.prefix_ranges(b)
        return _clip(self.prefix_ranges(b), self.seq_lens[b] - sliding_window, self.context_len(b))

    def window_edge_ranges(self, b: int, sliding_window: int) -> list[tuple[int, int]]:
        """Prefix positions that some but not all new tokens of ``b`` see: new token ``i`` (position ``p``)
        sees those ``> p - sliding_window``. Empty for a single new token; at most ``q_len - 1`` positions."""
        ctx = self.context_len(b)
        return _clip(self.prefix_ranges(b), ctx - sliding_window + 1, self.seq_lens[b] - sliding_window)

    def tensors(self, device: torch.device) -> dict[str, torch.Tensor]:
        """int32 device tensors for kernels: block_tables [B, max_blocks] (padded with 0),
        seq_lens [B], query_start [B + 1], context_lens [B], window_starts [B]."""
        key = str(device)
        if key not in self._device_tensors:
            width = max((len(t) for t in self.block_tables), default=0) or 1
            tables = torch.zeros(self.num_seqs, width, dtype=torch.int32)
            for i, t in enumerate(self.block_tables):
                tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
            ctx = [self.context_len(i) for i in range(self.num_seqs)]
            win = self.window_starts if self.window_starts is not None else [0] * self.num_seqs
            self._device_tensors[key] = {
                "block_tables": tables.to(device),
                "seq_lens": torch.tensor(self.seq_lens, dtype=torch.int32, device=device),
                "query_start": torch.tensor(self.query_start, dtype=torch.int32, device=device),
                "context_lens": torch.tensor(ctx, dtype=torch.int32, device=device),
                "window_starts": torch.tensor(win, dtype=torch.int32, device=device),
            }
        return self._device_tensors[key]


def _clip(ranges: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of [start, end) ``ranges`` inside [lo, hi), empty ones dropped."""
    out = []
    for start, end in ranges:
        start, end = max(start, lo), min(end, hi)
        if start < end:
            out.append((start, end))
    return out


def physical_runs(block_table: list[int], block_size: int, start: int, end: int) -> list[tuple[int, int]]:
    """Split logical positions [start, end) into runs of consecutive cache slots.

    Returns (first_slot, length) pairs; a run spans physically adjacent blocks, so the cache slab
    ``flat[first_slot : first_slot + length]`` is a zero-copy view of those tokens.
    """
    runs: list[tuple[int, int]] = []
    pos = start
    while pos < end:
        bi = pos // block_size
        slot = block_table[bi] * block_size + pos % block_size
        # extend across physically adjacent blocks
        last = bi
        while (last + 1) * block_size < end and block_table[last + 1] == block_table[last] + 1:
            last += 1
        run_end = min(end, (last + 1) * block_size)
        runs.append((slot, run_end - pos))
        pos = run_end
    return runs
