"""A worker's prefix cache over its block pool (``modeling/block_pool.py``): a new sequence starts from the
cached blocks of its longest cached prefix, and each sequence's blocks are cached as they fill with final
tokens. Pure Python (no torch).

Only final tokens enter the cache: the caller says how many of a sequence's positions hold final KV
(computed, and not a speculative draft that verification may reject), and only blocks those positions fill
completely are cached, so a cancelled or failed request never leaves a half-written block behind. A prompt
keeps at least its last token to compute: its logits sample the first output token.

Below the pool may sit tiers (:class:`LowerTiers`, ``modeling/kv_tiers``): every block the cache caches is
handed to them too, and a prompt whose prefix runs past the pool's cached blocks loads the blocks the tiers
hold next into fresh blocks (cached in the pool from then on) instead of computing them. A prompt that waits
to be scheduled may have those blocks read ahead (:meth:`PrefixCache.read_ahead`), so its load finds them in
host memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from modeling.block_pool import BlockPool
from modeling.prefix_hash import block_hashes


@dataclass(frozen=True)
class PrefixCacheEvents:
    """What an instance's cache started and stopped holding, for the router's index (``controller/kv_index.py``):
    ``events`` are (block hash, stored) in order (stored False: evicted). ``reset``: the events list everything
    held now and replace whatever the router knew of the instance. ``salt`` and ``block_size`` say how the
    instance hashes a prompt (``modeling/prefix_hash.py``). ``tier_events``: the same for the tiers below the pool,
    (tier name, block hash, stored), the host and disk tiers' listed in full with ``reset``; ``tiers``: the tiers
    the instance loads from (``host``, ``disk``, ``store``: ``modeling/kv_tiers/events.py``)."""

    salt: bytes
    block_size: int
    events: tuple[tuple[int, bool], ...]
    reset: bool = False
    tier_events: tuple[tuple[str, int, bool], ...] = ()
    tiers: tuple[str, ...] = ()


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up and found (vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``, in tokens);
    ``tier_hits``: those of the hits loaded from the tiers below the pool. A sequence's prompt counts once, as its
    latest lookup found it: a lookup repeated while it waits for room replaces the one before."""

    queries: int = 0
    hits: int = 0
    tier_hits: int = 0


@dataclass(frozen=True)
class CachedPrompt:
    """What an instance found of one prompt rather than computing it (OpenAI's ``usage.prompt_tokens_details
    .cached_tokens``): ``tokens`` from its KV pool or the tiers below it, ``from_tiers`` those loaded from the
    tiers."""

    tokens: int = 0
    from_tiers: int = 0


class LowerTiers(Protocol):
    """Where full blocks' KV goes below the pool (``modeling/kv_tiers/tiers.py`` ``KVTiers``)."""

    def find(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes``, from the first, the tiers hold."""

    def load(self, hashes: Sequence[int], blocks: Sequence[int], request_id: str = "") -> int:
        """Write the KV of ``hashes[i]`` into ``blocks[i]`` from the first on (taking what was read ahead for
        ``request_id``); how many were loaded."""

    def read_ahead(self, request_id: str, hashes: Sequence[int]) -> bool:
        """Start reading, off the worker's thread, what the slower tiers hold of ``hashes`` (a waiting prompt's
        blocks beyond its pool's), for the request's load; whether anything was queued."""

    def cancel_read_ahead(self, request_id: str) -> None:
        """Drop what was read ahead for the request and stop its started load: nothing writes into its blocks
        once this returns."""

    def start_load(self, request_id: str, hashes: Sequence[int], blocks: Sequence[int]) -> bool:
        """Start :meth:`load` in the background (False, nothing started: it cannot run there)."""

    def load_done(self, request_id: str) -> bool:
        """Whether a started load has written its blocks (``finish_load`` then returns at once)."""

    def finish_load(self, request_id: str) -> int:
        """Wait for a started load; how many of its blocks, from the first, were loaded."""

    def copies_from_memory(self, hashes: Sequence[int]) -> bool:
        """Whether loading the leading run of ``hashes`` the tiers hold is a copy within host memory (nothing worth
        moving off the worker's thread)."""

    def save(self, blocks: Sequence[int], hashes: Sequence[int]) -> None:
        """Keep the KV of ``blocks`` (final, cached under ``hashes``)."""

    @property
    def names(self) -> tuple[str, ...]:
        """The tiers, by name, for the router's index (``host``, ``disk``, ``store``)."""

    def record_events(self) -> tuple[tuple[str, int, bool], ...]:
        """Start logging (tier, block hash, stored) changes; returns what the tiers hold now."""

    def take_events(self) -> tuple[tuple[str, int, bool], ...]:
        """The changes logged since the last call."""


class PrefixCache:
    """``enabled`` False: lookups find nothing and nothing is cached (the pool behaves as without caching)."""

    def __init__(self, pool: BlockPool, salt: bytes, enabled: bool = True, tiers: LowerTiers | None = None):
        self.pool = pool
        self.salt = salt
        self.enabled = enabled
        self.tiers = tiers if enabled else None
        self.stats = PrefixCacheStats()
        self._hashed: dict[str, list[int]] = {}  # sequence id -> hashes of its full blocks seen so far
        self._computed_in_full: set[str] = set()  # sequences that must compute every prompt position
        self._looked_up: dict[str, list[int]] = {}  # sequence id -> its prefix's hashes, attached, tiers not asked
        self._counted: dict[str, PrefixCacheStats] = {}  # sequence id -> what its latest lookup added to ``stats``
        self._loading: dict[str, tuple[list[int], list[int]]] = {}  # sequence id -> (blocks, hashes) of its load
        self._apart: set[str] = set()  # sequences whose lookups are not added to ``stats``
        self._found_before: dict[str, CachedPrompt] = {}  # sequence id -> what a pass ahead found of its prompt
        self._publishing = False

    @property
    def num_tracked(self) -> int:
        """Sequences with per-sequence state here (0 once every one has ended)."""
        return len(self._hashed.keys() | self._computed_in_full | self._looked_up.keys() | self._counted.keys() |
                   self._loading.keys() | self._apart | self._found_before.keys())

    def take_events(self) -> PrefixCacheEvents | None:
        """The cache's changes since the last call (None: none, or caching is off). The first call lists
        everything cached so far (``reset``) and starts the pool recording its changes."""
        if not self.enabled:
            return None
        bs = self.pool.block_size
        tiers = self.tiers
        names = tiers.names if tiers is not None else ()
        if not self._publishing:
            self._publishing = True
            self.pool.record_events()
            return PrefixCacheEvents(self.salt, bs, tuple((h, True) for h in self.pool.cached_hashes), reset=True,
                                     tier_events=tiers.record_events() if tiers is not None else (), tiers=names)
        events = self.pool.take_events()
        tier_events = tiers.take_events() if tiers is not None else ()
        if not events and not tier_events:
            return None
        return PrefixCacheEvents(self.salt, bs, tuple(events), tier_events=tier_events, tiers=names)

    def compute_in_full(self, seq_id: str) -> None:
        """The sequence needs every prompt position computed (its prompt's log-probabilities): no lookup."""
        self._computed_in_full.add(seq_id)

    def count_apart(self, seq_id: str) -> None:
        """The sequence's lookups are its own (:meth:`found`), not added to ``stats``: a pass computing a prompt
        ahead, which is counted when it is served."""
        self._apart.add(seq_id)

    def found_before(self, seq_id: str, found: CachedPrompt) -> None:
        """A pass ahead found ``found`` of the sequence's prompt and computed the rest for it: its lookups count
        at most that as found, whatever the pass left cached."""
        self._found_before[seq_id] = found

    def read_ahead(self, seq) -> bool:
        """A sequence just queued (nothing computed, no blocks): start reading ahead the blocks of its prompt but
        the last token beyond the pool's cached prefix that only the slower tiers (disk, store) hold, while it
        waits; whether a read was queued. Its :meth:`attach` then loads them from host memory."""
        if self.tiers is None or seq.block_table.blocks or seq.num_computed or \
                seq.request_id in self._computed_in_full:
            return False
        hashes = block_hashes(seq.prompt_ids[:-1], self.pool.block_size, self.salt)
        held = self.pool.cached_run(hashes)
        return self.tiers.read_ahead(seq.request_id, hashes[held:])

    def loads_from_memory(self, prompt_ids: Sequence[int]) -> bool:
        """Whether loading what the tiers hold of the prompt (but its last token) beyond the pool's cached run is a
        copy within host memory on CPU (``KVTiers.copies_from_memory``): quicker on the worker's thread than
        handed to another. True without tiers."""
        if self.tiers is None:
            return True
        hashes = block_hashes(list(prompt_ids[:-1]), self.pool.block_size, self.salt)
        return self.tiers.copies_from_memory(hashes[self.pool.cached_run(hashes):])

    def attach(self, seq, upto: int | None = None, load_tiers: bool = True) -> int:
        """A sequence about to be scheduled with no blocks and nothing computed (new, or preempted) starts
        from the cached blocks of the longest cached prefix of its first ``upto`` tokens (default: its prompt
        but the last token), marked computed; returns how many tokens that covers (0 for any other sequence).
        With ``load_tiers`` the blocks the tiers hold after the pool's run are loaded too (:meth:`load_from_tiers`;
        a caller that must first know the rest fits attaches without, then calls it)."""
        if not self.enabled or seq.block_table.blocks or seq.num_computed or seq.request_id in self._computed_in_full:
            return 0
        upto = len(seq.prompt_ids) - 1 if upto is None else upto
        hashes = block_hashes(seq.tokens[:upto], self.pool.block_size, self.salt)
        blocks = self.pool.cached_prefix(hashes)
        seq.block_table.blocks = list(blocks)
        seq.num_computed = len(blocks) * self.pool.block_size
        self._hashed[seq.request_id] = hashes[: len(blocks)]
        self._uncount(seq.request_id)  # a lookup repeated while the prompt waits for room replaces the one before
        self._count(seq.request_id, PrefixCacheStats(upto + 1, seq.num_computed))
        if self.tiers is not None:
            self._looked_up[seq.request_id] = hashes
            if load_tiers:
                self.load_from_tiers(seq)
        return seq.num_computed

    def load_from_tiers(self, seq, in_background: bool = False) -> int:
        """Right after :meth:`attach`: extend the sequence's cached prefix with fresh blocks holding what the
        tiers have next (as many as the pool has room for; cached in the pool), marked computed; returns how
        many tokens they cover. ``in_background``: for a sequence that waits before any step reads its KV (its
        rest arriving from a prefill instance), the blocks are loaded beside the worker's steps where the tiers
        can (:meth:`finish_load` before it runs), else at once."""
        hashes = self._looked_up.pop(seq.request_id, None)
        held = len(seq.block_table.blocks)
        if hashes is None or held >= len(hashes):
            if self.tiers is not None:
                self.tiers.cancel_read_ahead(seq.request_id)
            return 0
        rest, after = hashes[held:], seq.block_table.blocks[-1] if held else None
        loaded = self._load_in_background(seq.request_id, rest, after) if in_background else None
        if loaded is None:
            loaded = self._load_from_tiers(rest, after, seq.request_id)
        seq.block_table.blocks += loaded
        self._hashed[seq.request_id] += hashes[held:held + len(loaded)]
        seq.num_computed += len(loaded) * self.pool.block_size
        self._count(seq.request_id, PrefixCacheStats(0, len(loaded) * self.pool.block_size,
                                                     len(loaded) * self.pool.block_size))
        return len(loaded) * self.pool.block_size

    def _load_in_background(self, request_id: str, hashes: list[int], after: int | None) -> list[int] | None:
        """Fresh blocks the tiers are to fill with the leading run of ``hashes`` they hold, in the background
        (None: they cannot; [] nothing to load)."""
        want = min(self.tiers.find(hashes), self.pool.num_free)
        if not want:
            return []
        blocks = self.pool.allocate(want, after=after)
        if not self.tiers.start_load(request_id, hashes[:want], blocks):
            self.pool.free(blocks)
            return None
        self._loading[request_id] = (blocks, hashes[:want])
        return blocks

    def loading(self, seq_id: str) -> bool:
        """Whether the sequence has a background load (:meth:`load_from_tiers`) not yet finished."""
        return seq_id in self._loading

    def load_done(self, seq_id: str) -> bool:
        """Whether its background load, if any, has written its blocks: :meth:`finish_load` returns at once."""
        return seq_id not in self._loading or self.tiers.load_done(seq_id)

    def finish_load(self, seq) -> bool:
        """The sequence's background load (:meth:`load_from_tiers`) written, its blocks cached in the pool;
        False when some of them could not be loaded (their KV is missing: the sequence cannot run, and its
        lookup is taken back out of the counts). True at once for a sequence with no such load."""
        loading = self._loading.pop(seq.request_id, None)
        if loading is None:
            return True
        blocks, hashes = loading
        got = self.tiers.finish_load(seq.request_id)
        for block, block_hash in zip(blocks[:got], hashes[:got]):
            self.pool.cache(block, block_hash)
        if got < len(blocks):
            self._uncount(seq.request_id)
            return False
        return True

    def _count(self, seq_id: str, found: PrefixCacheStats) -> None:
        """Add what a lookup found to ``stats`` and to the sequence's own count."""
        mine = self._counted.setdefault(seq_id, PrefixCacheStats())
        before = self._found_before.get(seq_id)
        if before is not None:  # the blocks its pass ahead computed were not found: they were computed for it
            hits = max(0, min(found.hits, before.tokens - mine.hits))
            found = PrefixCacheStats(found.queries, hits,
                                     max(0, min(found.tier_hits, before.from_tiers - mine.tier_hits, hits)))
        for total in (mine,) if seq_id in self._apart else (self.stats, mine):
            total.queries += found.queries
            total.hits += found.hits
            total.tier_hits += found.tier_hits

    def _uncount(self, seq_id: str) -> None:
        """Take the sequence's lookups back out of ``stats``."""
        mine = self._counted.pop(seq_id, None)
        if mine is not None and seq_id not in self._apart:
            self.stats.queries -= mine.queries
            self.stats.hits -= mine.hits
            self.stats.tier_hits -= mine.tier_hits

    def found(self, seq_id: str) -> CachedPrompt:
        """What the sequence's counted lookup found of its prompt (nothing for a sequence not looked up, or with
        caching off)."""
        mine = self._counted.get(seq_id)
        return CachedPrompt() if mine is None else CachedPrompt(mine.hits, mine.tier_hits)

    def looked_up(self, seq_id: str) -> bool:
        """Whether the sequence's prompt was looked up (:meth:`found` says what that found)."""
        return seq_id in self._counted

    def give_back(self, seq) -> None:
        """Undo :meth:`attach` for a sequence that could not get room (it is not held here: it comes back, or goes
        elsewhere): its cached prefix released (the blocks stay cached), nothing computed, its lookup not counted."""
        self._uncount(seq.request_id)
        self.forget(seq.request_id)
        seq.block_table.release(self.pool)
        seq.num_computed = 0

    def _load_from_tiers(self, hashes: list[int], after: int | None, request_id: str) -> list[int]:
        """Fresh blocks holding the leading run of ``hashes`` the tiers hold (as many as the pool has room
        for), cached in the pool."""
        want = min(self.tiers.find(hashes), self.pool.num_free)
        if not want:
            self.tiers.cancel_read_ahead(request_id)
            return []
        blocks = self.pool.allocate(want, after=after)
        got = self.tiers.load(hashes[:want], blocks, request_id=request_id)
        if got < want:
            self.pool.free(blocks[got:])
        for block, block_hash in zip(blocks[:got], hashes[:got]):
            self.pool.cache(block, block_hash)
        return blocks[:got]

    def commit(self, seq, num_final: int) -> None:
        """Cache the blocks the sequence's first ``num_final`` positions fill completely (their KV is final)."""
        if not self.enabled:
            return
        bs = self.pool.block_size
        full = min(num_final, len(seq.tokens)) // bs
        hashed = self._hashed.setdefault(seq.request_id, [])
        if full <= len(hashed):
            return
        start = len(hashed)
        hashed += block_hashes(seq.tokens[: full * bs], bs, self.salt, parent=hashed[-1] if hashed else 0,
                               start_block=start)
        for i in range(start, full):
            self.pool.cache(seq.block_table.blocks[i], hashed[i])
        if self.tiers is not None:
            self.tiers.save(seq.block_table.blocks[start:full], hashed[start:full])

    def forget(self, seq_id: str) -> None:
        """The sequence ended: drop what was kept for it (its cached blocks stay in the pool). Called before its
        blocks are freed: a background load into them stops here."""
        self._loading.pop(seq_id, None)
        self._hashed.pop(seq_id, None)
        self._computed_in_full.discard(seq_id)
        self._looked_up.pop(seq_id, None)
        self._counted.pop(seq_id, None)
        self._apart.discard(seq_id)
        self._found_before.pop(seq_id, None)
        if self.tiers is not None:
            self.tiers.cancel_read_ahead(seq_id)
