"""Counters of one KV tier, as an instance reports them (``/metrics``, ``magicserve status``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class TierStats:
    """``hits``: blocks loaded from the tier into the pool; ``bytes_in``: their bytes; ``load_s``: seconds spent
    loading them; ``stored`` / ``bytes_out``: blocks and bytes written into the tier; ``evicted``: blocks it
    dropped for room; ``corrupt``: entries found truncated or failing their checksum (dropped, recomputed);
    ``dropped``: blocks not written because the writer was behind; ``read_ahead`` / ``read_ahead_s``: of the
    hits, blocks read while their prompt waited (``modeling/kv_tiers/read_ahead.py``) and the seconds those
    reads took off the worker's thread (``load_s`` counts only the worker's: its waits and copies);
    ``blocks`` / ``bytes`` / ``capacity_bytes``: what it holds now and may hold."""

    hits: int = 0
    bytes_in: int = 0
    load_s: float = 0.0
    stored: int = 0
    bytes_out: int = 0
    evicted: int = 0
    corrupt: int = 0
    dropped: int = 0
    read_ahead: int = 0
    read_ahead_s: float = 0.0
    blocks: int = 0
    bytes: int = 0
    capacity_bytes: int = 0

    def as_dict(self) -> dict:
        return asdict(self)
