"""KV-head sharding across tensor-parallel ranks and the N-sender / M-receiver transfer plan.

Pure Python. A TP rank's cache holds a contiguous range of the model's KV heads (global numbering).
With ``tp <= num_kv_heads`` the heads are split evenly; with ``tp > num_kv_heads`` each rank holds one
head and heads are replicated ``tp / num_kv_heads`` times (as in vLLM). A transfer plan lists, for each
receiver rank, which sender rank provides which of its heads: every destination head comes from exactly
one sender, so the receivers' caches are filled once, byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadRange:
    """Global KV heads ``[start, end)``."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"heads: need 0 <= start < end, got [{self.start}, {self.end})")

    @property
    def size(self) -> int:
        return self.end - self.start

    def intersect(self, other: "HeadRange") -> "HeadRange | None":
        lo, hi = max(self.start, other.start), min(self.end, other.end)
        return HeadRange(lo, hi) if lo < hi else None

    def contains(self, other: "HeadRange") -> bool:
        return self.start <= other.start and other.end <= self.end

    def local(self, sub: "HeadRange") -> slice:
        """Slice of this shard's local head axis holding global heads ``sub`` (must be contained)."""
        if not self.contains(sub):
            raise ValueError(f"heads: [{sub.start}, {sub.end}) is not inside [{self.start}, {self.end})")
        return slice(sub.start - self.start, sub.end - self.start)


def shard_heads(num_kv_heads: int, tp: int, rank: int) -> HeadRange:
    """KV heads held by ``rank`` of ``tp`` ranks."""
    if num_kv_heads < 1:
        raise ValueError(f"num_kv_heads: must be >= 1, got {num_kv_heads}")
    if tp < 1:
        raise ValueError(f"tp: must be >= 1, got {tp}")
    if not 0 <= rank < tp:
        raise ValueError(f"rank: must be in [0, {tp}), got {rank}")
    if tp <= num_kv_heads:
        if num_kv_heads % tp:
            raise ValueError(f"tp: {tp} does not divide num_kv_heads ({num_kv_heads})")
        per = num_kv_heads // tp
        return HeadRange(rank * per, (rank + 1) * per)
    if tp % num_kv_heads:
        raise ValueError(f"tp: {tp} is not a multiple of num_kv_heads ({num_kv_heads})")
    head = rank * num_kv_heads // tp
    return HeadRange(head, head + 1)


@dataclass(frozen=True)
class TransferLeg:
    """Sender rank ``src_rank`` sends global heads ``heads`` to receiver rank ``dst_rank``."""

    src_rank: int
    dst_rank: int
    heads: HeadRange


def plan_transfer(num_kv_heads: int, src_tp: int, dst_tp: int) -> list[TransferLeg]:
    """Legs moving every receiver's heads from the sender shards, one sender per destination head.

    Where a head is replicated on several senders, receivers are spread over the replicas
    (``dst_rank % replicas``) so no single sender carries all the traffic.
    """
    src = [shard_heads(num_kv_heads, src_tp, r) for r in range(src_tp)]
    legs: list[TransferLeg] = []
    for d in range(dst_tp):
        want = shard_heads(num_kv_heads, dst_tp, d)
        head = want.start
        while head < want.end:
            holders = [r for r, s in enumerate(src) if s.start <= head < s.end]
            r = holders[d % len(holders)]
            end = min(want.end, src[r].end)
            legs.append(TransferLeg(r, d, HeadRange(head, end)))
            head = end
    return legs


def legs_from(legs: list[TransferLeg], src_rank: int) -> list[TransferLeg]:
    """The legs one sender rank runs."""
    return [leg for leg in legs if leg.src_rank == src_rank]


def legs_to(legs: list[TransferLeg], dst_rank: int) -> list[TransferLeg]:
    """The legs one receiver rank expects."""
    return [leg for leg in legs if leg.dst_rank == dst_rank]


def rank_peer_id(instance_id: str, rank: int, tp: int) -> str:
    """The KV-channel id of one rank of an instance: the instance id itself when it has one rank."""
    return instance_id if tp == 1 else f"{instance_id}#{rank}"


def peer_ranks(num_kv_heads: int, src_tp: int, dst_tp: int, rank: int, sending: bool) -> list[int]:
    """The ranks of the other side that ``rank`` exchanges KV with (sorted: every rank forms its pairs in
    the same global order, so concurrent connects never wait on each other in a cycle)."""
    legs = plan_transfer(num_kv_heads, src_tp, dst_tp)
    if sending:
        return sorted({leg.dst_rank for leg in legs_from(legs, rank)})
    return sorted({leg.src_rank for leg in legs_to(legs, rank)})
