"""Where each prompt's KV is cached across the cluster, and the KV-aware choices built on it (plain Python).

Every instance with prefix caching on reports the block hashes its cache starts and stops holding
(``PrefixCacheEvents``, with its outputs); :class:`PrefixIndex` keeps, per instance, the set it holds. A
request's prompt is hashed the way each instance hashes it (its salt and block size: the same function,
``modeling/prefix_hash.py``), and the longest leading run of those hashes an instance holds is the prefix it
would not compute again.

Choosing an instance weighs that against load, as Dynamo's KV router and llm-d's prefix scorer do: an
instance's cost is ``overlap_weight`` x (the request's blocks it would have to compute) + (the blocks already
in use or queued there), lowest first. With nothing cached anywhere, the choice is the load-only one it
would be without caching. The index can be behind an instance by a step (an eviction not reported yet): the
instance's own lookup when the request arrives stays the authority, so a stale entry costs time, never
correctness.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from modeling.prefix_cache import PrefixCacheEvents
from modeling.prefix_hash import block_hashes, leading_run


@dataclass(frozen=True)
class PrefixRouting:
    """The router's prefix-caching settings (``prefix_caching`` in the cluster YAML): ``enabled`` routes by
    cached prefix; ``overlap_weight`` weighs a block to compute against a block in use; a request whose decode
    instance holds all of its prompt but at most ``local_prefill_tokens`` tokens is prefilled there."""

    enabled: bool = True
    overlap_weight: float = 1.0
    local_prefill_tokens: int = 256


class PrefixIndex:
    """Per instance (by name), the block hashes its cache holds, as its events reported them."""

    def __init__(self) -> None:
        self._held: dict[str, set[int]] = {}
        self._hashing: dict[str, tuple[bytes, int]] = {}  # instance -> (salt, block size)

    def apply(self, instance: str, report: PrefixCacheEvents) -> None:
        held = self._held.setdefault(instance, set())
        if report.reset:
            held.clear()
        self._hashing[instance] = (report.salt, report.block_size)
        for block_hash, stored in report.events:
            if stored:
                held.add(block_hash)
            else:
                held.discard(block_hash)

    def drop(self, instance: str) -> None:
        """The instance went down: what it cached is gone (a restarted one reports afresh)."""
        self._held.pop(instance, None)
        self._hashing.pop(instance, None)

    def num_blocks(self, instance: str) -> int:
        return len(self._held.get(instance, ()))

    def block_size(self, instance: str) -> int | None:
        hashing = self._hashing.get(instance)
        return None if hashing is None else hashing[1]

    def cached_tokens(self, instance: str, prompt_ids: Sequence[int], memo: dict) -> int:
        """Prompt tokens whose KV ``instance`` holds cached: its longest cached prefix of the prompt but the
        last token (that one is always computed: its logits sample the first token). ``memo`` keeps the
        prompt's hashes per way of hashing, for the request's other lookups."""
        hashing, held = self._hashing.get(instance), self._held.get(instance)
        if not hashing or not held:
            return 0
        salt, block_size = hashing
        hashes = memo.get(hashing)
        if hashes is None:
            hashes = memo[hashing] = block_hashes(prompt_ids[: len(prompt_ids) - 1], block_size, salt)
        return leading_run(hashes, held) * block_size


def blocks_of(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def by_cost(candidates: list, num_tokens: int, block_size: int, cached: Callable[[object], int],
            load_blocks: Callable[[object], int], overlap_weight: float) -> list:
    """``candidates`` cheapest first (a stable sort: equal costs keep their order): ``overlap_weight`` x the
    blocks of a ``num_tokens``-position request not cached there + the blocks in use there."""
    total = blocks_of(num_tokens, block_size)
    return sorted(candidates, key=lambda i: overlap_weight * (total - cached(i) // block_size) + load_blocks(i))


def cached_first(order: list, num_tokens: int, block_size: int, cached: Callable[[object], int],
                 used_blocks: Callable[[object], int], free_blocks: Callable[[object], int],
                 overlap_weight: float) -> list:
    """A load-only ``order`` of decode instances with the ones that have room for ``num_tokens`` positions
    first, cheapest first (:func:`by_cost`), then the rest as they were; unchanged when none holds a cached
    prefix."""
    if not any(cached(i) for i in order):
        return order
    blocks = blocks_of(num_tokens, block_size)
    roomy = [i for i in order if free_blocks(i) >= blocks]
    return by_cost(roomy, num_tokens, block_size, cached, used_blocks, overlap_weight) + \
        [i for i in order if i not in roomy]


def cheapest(pool: list, num_tokens: int, block_size: int, cached: Callable[[object], int],
             queued_blocks: Callable[[object], int], overlap_weight: float):
    """The instance of ``pool`` (objects with ``assigned``) to compute a ``num_tokens``-token prompt: the fewest
    assigned requests when none holds a cached prefix of it, else the cheapest by :func:`by_cost` against the
    prompt blocks queued there. None for an empty pool."""
    if not pool:
        return None
    if not any(cached(i) for i in pool):
        return min(pool, key=lambda i: len(i.assigned))
    return by_cost(pool, num_tokens, block_size, cached, queued_blocks, overlap_weight)[0]
