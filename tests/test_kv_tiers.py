"""KV tiers below the pool (``modeling/kv_tiers``): blocks evicted from an instance's pool come back from host
memory or disk instead of being computed, with the tokens of an engine without caching (float32, greedy); a
corrupt or truncated file is recomputed, never served; a restarted instance finds its disk tier; no tier holds
more than its capacity."""

from __future__ import annotations

import os
import random

import pytest

from modeling.block_pool import BlockPool, BlockTable
from modeling.engine import EngineConfig, ReferenceEngine
from modeling.instance_config import KVTiersConfig
from modeling.kv_tiers.disk import HEADER, DiskTier
from modeling.kv_tiers.host import HostTier
from modeling.prefix_cache import PrefixCache
from modeling.prefix_hash import block_hashes
from modeling.sampling import SamplingParams

BLOCK = 16
POOL_TOKENS = 512  # 32 blocks: a 320-token document is evicted by two other long prompts
CFG = EngineConfig(kv_cache_tokens=POOL_TOKENS, block_size=BLOCK, token_budget=128, attention_backend="torch")
GREEDY = SamplingParams(max_tokens=8)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 380) for _ in range(n)]


def _engine(llama_dir, tmp_path, host_mb: int = 0, disk_mb: int = 16, name: str = "colocated-0") -> ReferenceEngine:
    tiers = KVTiersConfig(host_memory_mb=host_mb, disk_dir=str(tmp_path), disk_mb=disk_mb)
    return ReferenceEngine(llama_dir, EngineConfig(**{**CFG.__dict__, "kv_tiers": tiers}), instance_id=name)


@pytest.fixture(scope="module")
def plain(llama_dir):
    return ReferenceEngine(llama_dir, EngineConfig(**{**CFG.__dict__, "prefix_caching": False}))


def _run(engine, prompts):
    return [c.token_ids for c in engine.generate(prompts, GREEDY)]


def _evict_document(engine, rng) -> None:
    """Two prompts that together need more than the pool: every block of earlier prompts is evicted."""
    _run(engine, [_tokens(rng, 400)])
    _run(engine, [_tokens(rng, 400)])
    if engine.core.tiers is not None:
        engine.core.tiers.flush()


def _document_served_then_evicted(engine, seed: int) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """A 320-token document with one question served, then evicted from the pool: (document, the two prompts
    (the second not served yet), the first's output)."""
    rng = random.Random(seed)
    doc = _tokens(rng, 320)
    prompts = [doc + _tokens(rng, rng.randint(4, 12)) for _ in range(2)]
    out = _run(engine, prompts[:1])
    _evict_document(engine, rng)
    return doc, prompts, out


@pytest.mark.parametrize("host_mb,disk_mb", [(0, 16), (16, 0), (16, 16)], ids=["disk", "host", "host+disk"])
def test_a_document_evicted_from_the_pool_is_loaded_from_a_tier(llama_dir, tmp_path, plain, host_mb, disk_mb):
    engine = _engine(llama_dir, tmp_path, host_mb, disk_mb)
    try:
        doc, (first, second), out = _document_served_then_evicted(engine, 0)
        assert engine.pool.cached_run(block_hashes(doc, BLOCK, engine.prefix_cache.salt)) == 0  # gone from the pool
        stats = engine.prefix_cache.stats
        tier_hits0, hits0 = stats.tier_hits, stats.hits
        out += _run(engine, [second])
        # the document's 20 full blocks came from the tier: only the question was computed
        assert stats.tier_hits - tier_hits0 == len(doc) // BLOCK * BLOCK
        assert stats.hits - hits0 == len(doc) // BLOCK * BLOCK
        assert out == _run(plain, [first, second])
        tiers = engine.core.tiers.stats()
        assert sum(t.hits for t in tiers.values()) == len(doc) // BLOCK
        assert all(t.bytes <= t.capacity_bytes for t in tiers.values())
    finally:
        engine.close()


def test_the_router_index_follows_the_tiers_and_predicts_what_an_instance_loads(llama_dir, tmp_path, plain):
    """The instance's tier events (host and disk, through ``PrefixCache.take_events``) keep the router's index
    equal to what each tier holds, and the index's tier run for a prompt is what the instance then loads."""
    from controller.kv_index import PrefixIndex

    engine = _engine(llama_dir, tmp_path, host_mb=1, disk_mb=16)
    index = PrefixIndex()

    def report() -> None:
        engine.core.tiers.flush()
        events = engine.prefix_cache.take_events()
        if events is not None:
            index.apply("colocated-0", events)

    tiers = engine.core.tiers
    tiers.host.capacity_bytes = tiers.host.stats.capacity_bytes = 32 * tiers.block_bytes  # less than the run needs
    try:
        report()  # the first report: everything held so far, and the tiers start logging
        doc, (first, second), out = _document_served_then_evicted(engine, 5)
        report()
        assert tiers.host.stats.evicted > 0  # the host tier dropped blocks (still on disk), and said so
        assert index.tier_blocks("colocated-0", "host") == len(tiers.host)
        assert index.tier_blocks("colocated-0", "disk") == len(tiers.disk)
        predicted = index.cached("colocated-0", second, {})
        assert predicted.pool == 0 and predicted.tiers == len(doc) // BLOCK * BLOCK
        tier_hits0 = engine.prefix_cache.stats.tier_hits
        out += _run(engine, [second])
        assert engine.prefix_cache.stats.tier_hits - tier_hits0 == predicted.tiers
        assert out == _run(plain, [first, second])
        report()
        assert index.cached("colocated-0", second, {}).pool == predicted.tiers  # back in the pool now
    finally:
        engine.close()


def test_a_corrupt_or_truncated_file_is_recomputed_not_served(llama_dir, tmp_path, plain):
    engine = _engine(llama_dir, tmp_path, host_mb=0, disk_mb=16)
    try:
        _, (first, second), out = _document_served_then_evicted(engine, 1)
        disk = engine.core.tiers.disk
        files = sorted(os.path.join(disk.directory, f) for f in os.listdir(disk.directory) if f.endswith(".kv"))
        assert files
        for i, path in enumerate(files):  # every file: a flipped payload byte or a cut-off end
            with open(path, "r+b") as f:
                if i % 2:
                    f.truncate(os.path.getsize(path) - 3)
                else:
                    f.seek(HEADER.size + 5)
                    byte = f.read(1)
                    f.seek(HEADER.size + 5)
                    f.write(bytes([byte[0] ^ 0xFF]))
        tier_hits0 = engine.prefix_cache.stats.tier_hits
        out += _run(engine, [second])
        assert out == _run(plain, [first, second])
        assert disk.stats.corrupt >= 1
        # the first of the document's blocks failed its check: nothing after it was loaded
        assert engine.prefix_cache.stats.tier_hits == tier_hits0
    finally:
        engine.close()


def test_a_restarted_instance_finds_its_disk_tier(llama_dir, tmp_path, plain):
    rng = random.Random(2)
    doc = _tokens(rng, 320)
    first, second = doc + _tokens(rng, 4), doc + _tokens(rng, 8)
    before = _engine(llama_dir, tmp_path)
    out = _run(before, [first])
    before.close()  # finishes the queued writes
    after = _engine(llama_dir, tmp_path)
    try:
        assert len(after.core.tiers.disk) >= len(doc) // BLOCK
        out += _run(after, [second])
        assert after.prefix_cache.stats.tier_hits == len(doc) // BLOCK * BLOCK
        assert out == _run(plain, [first, second])
    finally:
        after.close()


def test_a_new_worker_over_the_same_cache_layout_keeps_the_previous_host_tier(llama_dir, tmp_path, plain):
    """A role change builds a new worker on the instance: the previous worker's host tier is kept where the
    blocks are keyed alike (served from it, unchanged tokens), and nothing is kept where they are not."""
    rng = random.Random(3)
    doc = _tokens(rng, 320)
    first, second = doc + _tokens(rng, 4), doc + _tokens(rng, 8)
    before = _engine(llama_dir, tmp_path, host_mb=16, disk_mb=0)
    out = _run(before, [first])
    before.close()
    host, salt = before.core.tiers.host, before.prefix_cache.salt
    assert len(host) >= len(doc) // BLOCK
    other_layout = ReferenceEngine(llama_dir, EngineConfig(**{**CFG.__dict__, "block_size": 32,
                                                             "kv_tiers": KVTiersConfig(host_memory_mb=16, disk_mb=0)}))
    after = _engine(llama_dir, tmp_path, host_mb=16, disk_mb=0)
    try:
        assert other_layout.core.adopt_host_tier(host, salt) == 0  # keyed for another block size
        assert other_layout.core.adopt_host_tier(host, other_layout.prefix_cache.salt) == 0  # blocks of another shape
        assert after.core.adopt_host_tier(host, b"another model") == 0
        assert after.core.adopt_host_tier(host, salt) == len(host)
        assert after.core.tiers.host.hashes() == host.hashes()  # in the same recency order
        out += _run(after, [second])
        assert after.prefix_cache.stats.tier_hits == len(doc) // BLOCK * BLOCK
        assert out == _run(plain, [first, second])
    finally:
        after.close()
        other_layout.close()


def test_a_second_instance_of_the_same_name_takes_its_own_directory(tmp_path):
    one = DiskTier.open(str(tmp_path), "decode-0", 1 << 20)
    two = DiskTier.open(str(tmp_path), "decode-0", 1 << 20)
    try:
        assert one.directory != two.directory and two.directory.endswith("decode-0.1")
    finally:
        one.close()
        two.close()
    again = DiskTier.open(str(tmp_path), "decode-0", 1 << 20)  # released: the first directory is free again
    assert again.directory == one.directory
    again.close()


def test_the_tiers_never_hold_more_than_their_capacity(llama_dir, tmp_path):
    engine = _engine(llama_dir, tmp_path, host_mb=1, disk_mb=1)
    rng = random.Random(3)
    try:
        for _ in range(6):
            _run(engine, [_tokens(rng, 480)])
        engine.core.tiers.flush()
        tiers = engine.core.tiers
        block_bytes = tiers.block_bytes
        assert tiers.host.stats.evicted > 0 and tiers.disk.stats.evicted > 0
        assert tiers.host.stats.bytes <= 1 << 20 and len(tiers.host) == tiers.host.stats.blocks
        on_disk = sum(os.path.getsize(os.path.join(tiers.disk.directory, f))
                      for f in os.listdir(tiers.disk.directory) if f.endswith(".kv"))
        assert on_disk == tiers.disk.stats.bytes <= 1 << 20
        assert on_disk // (HEADER.size + block_bytes) == len(tiers.disk)
    finally:
        engine.close()


def test_host_tier_evicts_the_least_recently_used():
    import torch

    tier = HostTier(capacity_bytes=3 * 64)
    for h in range(3):
        tier.put(h, torch.zeros(16, dtype=torch.float32))
    assert tier.get(0) is not None  # 0 is now the most recently used
    tier.put(3, torch.zeros(16, dtype=torch.float32))
    assert 1 not in tier and all(h in tier for h in (0, 2, 3))
    assert not tier.put(4, torch.zeros(64, dtype=torch.float32))  # larger than the tier: not kept
    assert tier.stats.bytes == 3 * 64 and tier.stats.evicted == 1


class _ListedTiers:
    """Tiers holding ``held`` hashes, of which the load finds only the first ``loadable`` (the rest evicted
    between the lookup and the load)."""

    def __init__(self, held: list[int], loadable: int):
        self.held, self.loadable, self.saved = held, loadable, []

    def find(self, hashes):
        n = 0
        while n < len(hashes) and hashes[n] in self.held:
            n += 1
        return n

    def load(self, hashes, blocks, request_id=""):
        self.loads = getattr(self, "loads", 0) + 1
        return min(len(hashes), self.loadable)

    def read_ahead(self, request_id, hashes):
        return False

    def cancel_read_ahead(self, request_id):
        pass

    def save(self, blocks, hashes):
        self.saved += list(hashes)


class _Seq:
    def __init__(self, request_id: str, tokens: list[int]):
        self.request_id, self.prompt_ids, self.tokens = request_id, tokens, tokens
        self.block_table, self.num_computed = BlockTable(4), 0


def test_a_load_that_falls_short_gives_the_rest_back_to_the_pool():
    pool = BlockPool(num_blocks=10, block_size=4)
    tokens = list(range(4 * 5 + 1))
    hashes = block_hashes(tokens[:-1], 4, b"s")
    tiers = _ListedTiers(held=hashes[:4], loadable=2)
    cache = PrefixCache(pool, b"s", tiers=tiers)
    seq = _Seq("a", tokens)
    assert cache.attach(seq) == 8  # 4 found, 2 loaded: the other 2 blocks went back
    assert len(seq.block_table.blocks) == 2 and pool.num_free == 8
    assert pool.cached_run(hashes) == 2 and cache.stats.tier_hits == 8
    seq.block_table.ensure_capacity(pool, len(tokens))
    cache.commit(seq, len(tokens))  # the computed blocks go down to the tiers, the loaded ones do not again
    assert tiers.saved == hashes[2:5]


def test_a_decode_admission_loads_from_the_tiers_only_once_the_rest_fits():
    """``KVSlots.allocate_slots`` asks the tiers only when the whole grant fits: an admission that waits for room
    loads nothing (it would load again at every retry), and one that fits loads the blocks into its grant."""
    from decode_worker.kv_slots import KVSlots

    pool = BlockPool(num_blocks=8, block_size=4)
    tokens = list(range(4 * 6 + 1))
    hashes = block_hashes(tokens[:-1], 4, b"s")
    tiers = _ListedTiers(held=hashes[:4], loadable=4)
    slots = KVSlots(pool, PrefixCache(pool, b"s", tiers=tiers))
    squatter = pool.allocate(3)  # 5 free: the 7 blocks the sequence needs do not fit
    seq = _Seq("a", tokens)
    assert slots.allocate_slots(seq, len(tokens), cached_upto=len(tokens) - 1) is None
    assert getattr(tiers, "loads", 0) == 0 and pool.num_free == 5 and slots.prefix_cache.num_tracked == 0
    assert slots.prefix_cache.stats.queries == 0  # an admission refused for room is not counted
    pool.free(squatter)
    grant = slots.allocate_slots(seq, len(tokens), cached_upto=len(tokens) - 1)
    assert grant is not None and grant.cached_blocks == 4 and tiers.loads == 1 and seq.num_computed == 16
    assert len(grant.blocks) == 7 and pool.num_free == 1
    # the prompt counted once, as the admission that fitted found it: none cached in the pool, 4 blocks loaded
    stats = slots.prefix_cache.stats
    assert (stats.queries, stats.hits, stats.tier_hits) == (len(tokens), 16, 16)
    slots.prefix_cache.forget(seq.request_id)
    assert slots.prefix_cache.num_tracked == 0


def test_a_prompt_looked_up_again_while_it_waits_for_room_counts_once():
    """The prefill scheduler looks a waiting prompt up at every step until it fits: the queries and hits count
    its latest lookup only, as a request's share of cached prompt tokens should."""
    from modeling.sampling import RequestSampler
    from modeling.sequence import Sequence
    from prefill_worker.config import PrefillWorkerConfig
    from prefill_worker.scheduler import PrefillScheduler

    pool = BlockPool(num_blocks=8, block_size=4)
    cache = PrefixCache(pool, b"s")
    scheduler = PrefillScheduler(PrefillWorkerConfig(block_size=4, token_budget=64), pool, cache)
    squatter = pool.allocate(4)  # 4 free: a 24-token prompt (6 blocks) waits
    seq = Sequence("a", list(range(2, 26)), RequestSampler(SamplingParams()), frozenset(), BlockTable(4), 1024)
    scheduler.add(seq)
    for _ in range(3):
        assert scheduler.schedule() == []
    assert (cache.stats.queries, cache.stats.hits) == (24, 0)
    pool.free(squatter)
    assert [c.num_tokens for c in scheduler.schedule()] == [24]
    assert (cache.stats.queries, cache.stats.hits) == (24, 0)


def test_what_a_prompt_found_is_its_latest_counted_lookup():
    """``found`` is what a request's usage reports as cached prompt tokens: its counted lookup, nothing once that
    lookup is given back, nothing for a sequence never looked up."""
    from modeling.prefix_cache import CachedPrompt
    from modeling.sampling import RequestSampler
    from modeling.sequence import Sequence

    pool = BlockPool(num_blocks=8, block_size=4)
    cache = PrefixCache(pool, b"s")

    def seq(rid, n):
        return Sequence(rid, list(range(2, 2 + n)), RequestSampler(SamplingParams()), frozenset(), BlockTable(4), 1024)

    first = seq("a", 12)
    assert cache.attach(first) == 0 and cache.found("a") == CachedPrompt(0, 0)
    first.block_table.blocks = pool.allocate(3)
    cache.commit(first, 12)
    again = seq("b", 14)  # the first 12 tokens again: 3 full blocks found
    assert cache.attach(again) == 12 and cache.found("b") == CachedPrompt(12, 0)
    cache.give_back(again)
    assert cache.found("b") == CachedPrompt() and cache.found("never") == CachedPrompt()


@pytest.mark.gpu
@pytest.mark.parametrize("host_mb,disk_mb", [(16, 0), (0, 16)], ids=["host", "disk"])
def test_on_cuda_a_document_evicted_from_the_pool_is_loaded_from_a_tier(llama_dir, tmp_path, host_mb, disk_mb):
    """The pool on the GPU: saves copy asynchronously into pinned host memory, loads copy back; tokens equal a
    CUDA engine's without caching (float32)."""
    cuda = dict(device="cuda", dtype="float32")
    plain = ReferenceEngine(llama_dir, EngineConfig(**{**CFG.__dict__, **cuda, "prefix_caching": False}))
    tiers = KVTiersConfig(host_memory_mb=host_mb, disk_dir=str(tmp_path), disk_mb=disk_mb)
    engine = ReferenceEngine(llama_dir, EngineConfig(**{**CFG.__dict__, **cuda, "kv_tiers": tiers}))
    try:
        doc, (first, second), out = _document_served_then_evicted(engine, 4)
        out += _run(engine, [second])
        assert engine.prefix_cache.stats.tier_hits == len(doc) // BLOCK * BLOCK
        assert out == _run(plain, [first, second])
        if host_mb:
            assert all(kv.is_pinned() for kv in engine.core.tiers.host._entries.values())
    finally:
        engine.close()


def test_a_preempted_sequence_resumes_from_its_cached_output_blocks(llama_dir, tmp_path, plain):
    """A colocated engine short of room preempts its newest sequence; the blocks it had filled, prompt and output,
    went down to the host tier as they were cached, so it resumes computing only its last, partial block (and
    the tokens are the reference's)."""
    engine = ReferenceEngine(llama_dir, EngineConfig(**{**CFG.__dict__, "kv_cache_tokens": 256, "token_budget": 256,
                                                        "kv_tiers": KVTiersConfig(host_memory_mb=16, disk_mb=0)}),
                             instance_id="colocated-preempt")
    rng = random.Random(11)
    prompts = [_tokens(rng, 40) for _ in range(4)]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    preempted_at: dict[str, int] = {}
    resumed_from: dict[str, tuple[int, int]] = {}  # request id -> (tokens when preempted, first chunk's start)
    scheduler = engine.scheduler
    preempt, schedule = scheduler.preempt, scheduler.schedule

    def recording_preempt(seq):
        preempted_at[seq.request_id] = seq.num_tokens
        preempt(seq)

    def recording_schedule():
        chunks = schedule()
        for c in chunks:
            if c.seq.request_id in preempted_at:  # its first chunk since: the resume
                resumed_from[c.seq.request_id] = (preempted_at.pop(c.seq.request_id), c.start)
        return chunks

    scheduler.preempt, scheduler.schedule = recording_preempt, recording_schedule
    try:
        out = [c.token_ids for c in engine.generate(prompts, params)]
        assert out == [c.token_ids for c in plain.generate(prompts, params)]
        assert scheduler.num_preemptions > 0 and resumed_from
        for tokens, start in resumed_from.values():
            assert start == (tokens - 1) // BLOCK * BLOCK, (tokens, start)  # only the last, partial block
        assert any(tokens > 40 + BLOCK for tokens, _ in resumed_from.values())  # output blocks, not only the prompt's
    finally:
        engine.close()
