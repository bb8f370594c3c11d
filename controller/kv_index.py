"""Where each prompt's KV is cached across the cluster, and the KV-aware choices built on it (plain Python).

Every instance with prefix caching on reports the block hashes its cache starts and stops holding
(``PrefixCacheEvents``, with its outputs), in its pool and in the tiers below it (``modeling/kv_tiers``: its
host memory and disk, and the cluster's store, which every instance that reaches it shares);
:class:`PrefixIndex` keeps where each block is. A request's prompt is hashed the way each instance hashes it
(its salt and block size: the same function, ``modeling/prefix_hash.py``); the longest leading run of those
hashes an instance's pool holds is the prefix it would not compute again, and the run after it that its tiers
hold is what it would load instead of computing.

Choosing an instance weighs that against load, as Dynamo's KV router and llm-d's prefix scorer do: an
instance's cost is ``overlap_weight`` x (the request's blocks it would have to compute, a block loaded from a
tier counting ``tier_load_cost`` of one) + (the blocks already in use or queued there), lowest first. With nothing cached anywhere, the choice is the load-only one it
would be without caching. The index can be behind an instance by a step (an eviction not reported yet): the
instance's own lookup when the request arrives stays the authority, so a stale entry costs time, never
correctness.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from modeling.kv_tiers.events import STORE
from modeling.prefix_cache import PrefixCacheEvents
from modeling.prefix_hash import block_hashes, leading_run


@dataclass(frozen=True)
class PrefixRouting:
    """The router's prefix-caching settings (``prefix_caching`` in the cluster YAML): ``enabled`` routes by
    cached prefix; ``overlap_weight`` weighs a block to compute against a block in use; ``tier_load_cost``: what
    loading a block from a tier below the pool (host, disk, the store) costs, as a fraction of computing it; a
    request whose decode instance holds all of its prompt (in its pool or its tiers) but at most
    ``local_prefill_tokens`` tokens is prefilled there; ``prefill_ahead``: an idle prefill instance computes a
    prompt ahead while it waits for room on a decode instance (``controller/prefill_ahead.py``)."""

    enabled: bool = True
    overlap_weight: float = 1.0
    local_prefill_tokens: int = 256
    tier_load_cost: float = 0.2
    prefill_ahead: bool = True


@dataclass(frozen=True)
class Cached:
    """What an instance holds of a prompt: ``pool`` tokens cached in its pool, then ``tiers`` more that its tiers
    (host, disk, the cluster's store) can load back; ``saved``: the tokens' worth of computing that spares it
    (a tier token counts ``1 - tier_load_cost``)."""

    pool: int = 0
    tiers: int = 0
    saved: float = 0.0

    @property
    def tokens(self) -> int:
        """Prompt tokens the instance would not compute."""
        return self.pool + self.tiers


NOTHING = Cached()
STORE_INDEX_BLOCKS = 1 << 20  # store entries the index remembers (the most recently written): ~100 MiB at most


class PrefixIndex:
    """Per instance (by name), the block hashes its pool and its own tiers (host, disk) hold, and the blocks any
    instance wrote to the cluster's store, as their events reported them. A store entry outlives the instance
    that wrote it (a drained, retired or dead instance's blocks stay findable there)."""

    def __init__(self) -> None:
        self._held: dict[str, set[int]] = {}
        self._tiered: dict[str, dict[str, set[int]]] = {}  # instance -> tier -> hashes (its host and disk)
        self._reaches_store: set[str] = set()
        self._stored: OrderedDict[int, None] = OrderedDict()  # the store, oldest write first
        self._hashing: dict[str, tuple[bytes, int]] = {}  # instance -> (salt, block size)

    def apply(self, instance: str, report: PrefixCacheEvents) -> None:
        held = self._held.setdefault(instance, set())
        tiered = self._tiered.setdefault(instance, {})
        if report.reset:
            held.clear()
            tiered.clear()
        self._hashing[instance] = (report.salt, report.block_size)
        for block_hash, stored in report.events:
            if stored:
                held.add(block_hash)
            else:
                held.discard(block_hash)
        if STORE in report.tiers:
            self._reaches_store.add(instance)
        else:
            self._reaches_store.discard(instance)
        for tier, block_hash, stored in report.tier_events:
            if tier == STORE:
                self._note_stored(block_hash, stored)
            elif stored:
                tiered.setdefault(tier, set()).add(block_hash)
            else:
                tiered.get(tier, set()).discard(block_hash)

    def _note_stored(self, block_hash: int, stored: bool) -> None:
        if not stored:
            self._stored.pop(block_hash, None)
            return
        self._stored[block_hash] = None
        self._stored.move_to_end(block_hash)
        if len(self._stored) > STORE_INDEX_BLOCKS:
            self._stored.popitem(last=False)

    def drop(self, instance: str) -> None:
        """The instance went down: what its pool and its own tiers held is gone to the router (a restarted one
        reports afresh); what it wrote to the store stays."""
        self._held.pop(instance, None)
        self._tiered.pop(instance, None)
        self._reaches_store.discard(instance)
        self._hashing.pop(instance, None)

    def num_blocks(self, instance: str) -> int:
        return len(self._held.get(instance, ()))

    def tier_blocks(self, instance: str, tier: str) -> int:
        """Blocks the index believes ``tier`` holds for ``instance`` (``store``: the cluster's, if it reaches it)."""
        if tier == STORE:
            return len(self._stored) if instance in self._reaches_store else 0
        return len(self._tiered.get(instance, {}).get(tier, ()))

    def block_size(self, instance: str) -> int | None:
        hashing = self._hashing.get(instance)
        return None if hashing is None else hashing[1]

    def cached(self, instance: str, prompt_ids: Sequence[int], memo: dict, tier_load_cost: float = 0.0) -> Cached:
        """What ``instance`` holds of the prompt but its last token (that one is always computed: its logits
        sample the first token): its pool's longest cached prefix, then the run after it that its tiers hold
        (as the instance's own lookup reads them: the pool first, then the tiers). ``memo`` keeps the prompt's
        hashes per way of hashing, for the request's other lookups."""
        hashing = self._hashing.get(instance)
        if not hashing:
            return NOTHING
        held = self._held.get(instance, set())
        below = [s for s in self._tiered.get(instance, {}).values() if s]
        if instance in self._reaches_store and self._stored:
            below.append(self._stored)
        if not held and not below:
            return NOTHING
        salt, block_size = hashing
        hashes = memo.get(hashing)
        if hashes is None:
            hashes = memo[hashing] = block_hashes(prompt_ids[: len(prompt_ids) - 1], block_size, salt)
        pool = leading_run(hashes, held)
        end = pool
        while end < len(hashes) and any(hashes[end] in tier for tier in below):
            end += 1
        pool_tokens, tier_tokens = pool * block_size, (end - pool) * block_size
        return Cached(pool_tokens, tier_tokens, pool_tokens + tier_tokens * (1.0 - tier_load_cost))


def blocks_of(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def by_cost(candidates: list, num_tokens: int, block_size: int, cached: Callable[[object], float],
            load_blocks: Callable[[object], int], overlap_weight: float) -> list:
    """``candidates`` cheapest first (a stable sort: equal costs keep their order): ``overlap_weight`` x the
    blocks of a ``num_tokens``-position request to compute there + the blocks in use there. ``cached``: the
    tokens' worth of computing an instance's cache spares (``Cached.saved``: a block its tiers load counts
    part of one)."""
    total = blocks_of(num_tokens, block_size)
    return sorted(candidates, key=lambda i: overlap_weight * (total - cached(i) / block_size) + load_blocks(i))


def cached_first(order: list, num_tokens: int, block_size: int, cached: Callable[[object], float],
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


def cheapest(pool: list, num_tokens: int, block_size: int, cached: Callable[[object], float],
             queued_blocks: Callable[[object], int], overlap_weight: float):
    """The instance of ``pool`` (objects with ``assigned``) to compute a ``num_tokens``-token prompt: the fewest
    assigned requests when none holds a cached prefix of it, else the cheapest by :func:`by_cost` against the
    prompt blocks queued there. None for an empty pool."""
    if not pool:
        return None
    if not any(cached(i) for i in pool):
        return min(pool, key=lambda i: len(i.assigned))
    return by_cost(pool, num_tokens, block_size, cached, queued_blocks, overlap_weight)[0]
