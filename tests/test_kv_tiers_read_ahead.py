"""Reading a waiting prompt's blocks ahead from the slower KV tiers (``modeling/kv_tiers/read_ahead.py``): the
reads run on their own thread while the prompt waits, its load takes them from host memory, the tokens are the
reference's, what is held stays within its bound, and nothing is left once the requests end."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch

from modeling.engine import EngineConfig, ReferenceEngine
from modeling.instance_config import KVTiersConfig
from modeling.kv_tiers.read_ahead import ReadAhead, ReadResult
from modeling.prefix_hash import block_hashes
from modeling.sampling import SamplingParams

BLOCK = 16
CFG = EngineConfig(kv_cache_tokens=512, block_size=BLOCK, token_budget=128, attention_backend="torch",
                   max_num_seqs=1)
READ_DELAY_S = 0.003  # per block read from disk: a slower disk than this VM's page cache


# -- the reader on plain blocks ----------------------------------------------------------------------------------

def _reader(held: dict[int, torch.Tensor], delay_s: float = 0.0, gate: threading.Event | None = None):
    reads = []

    def read(h: int):
        if gate is not None:
            gate.wait()
        time.sleep(delay_s)
        reads.append(h)
        if h == 99:
            raise OSError("failing read")
        kv = held.get(h)
        return (kv, "disk") if kv is not None else (None, None)
    return read, reads


def _blocks(hashes) -> dict[int, torch.Tensor]:
    return {h: torch.full((4,), float(h)) for h in hashes}


def test_reads_ahead_in_order_up_to_the_first_missing_block_skipping_the_held():
    read, reads = _reader(_blocks([1, 2, 3, 5]))
    ahead = ReadAhead(read, block_bytes=16, capacity_bytes=1 << 20)
    try:
        assert ahead.submit("a", [1, 2, 3, 4, 5], skip={2})
        _until(lambda: len(reads) == 3)
        got = ahead.take("a")
        assert reads == [1, 3, 4] and sorted(got.blocks) == [1, 3]  # 2 held already, 4 missing: 5 is not read
        assert got.missing == 4 and got.blocks[3].kv[0].item() == 3.0 and got.blocks[3].tier == "disk"
        assert ahead.held_bytes == 0 and len(ahead) == 0
        assert not ahead.submit("b", [2], skip={2})  # nothing to read
        assert ahead.take("b") == ReadResult()
    finally:
        ahead.close()


def _until(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)


def test_what_is_held_ahead_stays_within_the_bound_and_a_failing_read_is_a_miss():
    read, reads = _reader(_blocks(range(10)))
    ahead = ReadAhead(read, block_bytes=16, capacity_bytes=3 * 16)
    try:
        ahead.submit("a", [0, 1, 2, 3, 4])
        ahead.submit("b", [5, 6])
        _until(lambda: len(reads) == 3)
        time.sleep(0.05)
        assert reads == [0, 1, 2] and ahead.held_bytes == 48  # a stopped at the bound, b read nothing
        a = ahead.take("a")
        assert sorted(a.blocks) == [0, 1, 2] and a.missing is None and ahead.held_bytes == 0
        assert ahead.take("b") == ReadResult()
        ahead.submit("c", [7, 99, 8])
        _until(lambda: 99 in reads)
        c = ahead.take("c")
        assert sorted(c.blocks) == [7] and c.missing == 99 and 8 not in reads  # the failing read ended the run
        assert ahead.held_bytes == 0 and len(ahead) == 0
    finally:
        ahead.close()


def test_a_job_not_started_is_withdrawn_and_one_cancelled_while_reading_is_dropped():
    gate = threading.Event()
    read, reads = _reader(_blocks(range(10)), gate=gate)
    ahead = ReadAhead(read, block_bytes=16, capacity_bytes=1 << 20)
    try:
        ahead.submit("a", [0, 1, 2])
        ahead.submit("b", [3, 4])
        time.sleep(0.05)  # a has started and waits at the gate; b is queued
        assert ahead.take("b") == ReadResult()  # withdrawn: the caller reads its blocks itself
        ahead.cancel("a")
        gate.set()
        _until(lambda: len(reads) >= 1)
        time.sleep(0.05)
        assert ahead.held_bytes == 0 and len(ahead) == 0
        assert 3 not in reads and 4 not in reads
    finally:
        ahead.close()


# -- an engine whose waiting prompt finds its document on disk ----------------------------------------------------

def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 380) for _ in range(n)]


def _engine(llama_dir, tmp_path, read_ahead_mb: int, name: str) -> ReferenceEngine:
    tiers = KVTiersConfig(host_memory_mb=0, disk_dir=str(tmp_path), disk_mb=16, read_ahead_mb=read_ahead_mb)
    return ReferenceEngine(llama_dir, EngineConfig(**{**CFG.__dict__, "kv_tiers": tiers}), instance_id=name)


def _slow_disk(engine) -> None:
    disk = engine.core.tiers.disk
    read = disk.read

    def slow_read(block_hash, expected_bytes):
        time.sleep(READ_DELAY_S)
        return read(block_hash, expected_bytes)
    disk.read = slow_read


def _queued_behind_a_long_prompt(engine, seed: int):
    """A document served and evicted from the pool (kept on disk), then a question on it queued behind a long
    prompt (one sequence at a time): (the outputs, the disk tier's counters)."""
    rng = random.Random(seed)
    doc = _tokens(rng, 320)
    first, second = (doc + _tokens(rng, 6) for _ in range(2))
    greedy = SamplingParams(max_tokens=8)
    out = [c.token_ids for c in engine.generate([first], greedy)]
    for _ in range(2):  # evicts every block of the document from the pool
        engine.generate([_tokens(rng, 400)], greedy)
    engine.core.tiers.flush()
    _slow_disk(engine)
    disk = engine.core.tiers.disk.stats
    before = (disk.hits, disk.load_s)
    out += [c.token_ids for c in engine.generate([_tokens(rng, 400), second], SamplingParams(max_tokens=64))][1:]
    return out, disk, before


@pytest.fixture(scope="module")
def plain(llama_dir):
    return ReferenceEngine(llama_dir, EngineConfig(**{**CFG.__dict__, "prefix_caching": False}))


def test_a_waiting_prompt_has_its_document_read_ahead_and_loaded_from_memory(llama_dir, tmp_path, plain):
    ahead = _engine(llama_dir, tmp_path / "ahead", read_ahead_mb=64, name="ahead")
    inline = _engine(llama_dir, tmp_path / "inline", read_ahead_mb=0, name="inline")
    try:
        out, disk, (hits0, load0) = _queued_behind_a_long_prompt(ahead, 7)
        out_inline, disk_inline, (hits0_inline, load0_inline) = _queued_behind_a_long_prompt(inline, 7)
        blocks = 320 // BLOCK
        assert disk.hits - hits0 == blocks == disk_inline.hits - hits0_inline
        # read while the prompt waited, not on the worker's step
        assert disk.read_ahead == blocks and disk.read_ahead_s >= blocks * READ_DELAY_S
        assert disk_inline.read_ahead == 0
        on_step, on_step_inline = disk.load_s - load0, disk_inline.load_s - load0_inline
        assert on_step_inline >= blocks * READ_DELAY_S
        assert on_step < 0.5 * on_step_inline, (on_step, on_step_inline)
        rng = random.Random(7)
        doc = _tokens(rng, 320)
        first, second = (doc + _tokens(rng, 6) for _ in range(2))
        assert out[0] == plain.generate([first], SamplingParams(max_tokens=8))[0].token_ids
        assert out[1] == plain.generate([second], SamplingParams(max_tokens=64))[0].token_ids
        assert out_inline == out
        # nothing is held ahead once the requests have ended
        assert ahead.core.tiers.read_ahead_held() == (0, 0)
    finally:
        ahead.close()
        inline.close()


# -- a load in the background, into blocks no step reads yet ------------------------------------------------------

def _cache_and_tiers(tmp_path, device: str = "cpu"):
    from modeling.block_pool import BlockPool
    from modeling.kv_cache import KVCacheSpec, PagedKVCache
    from modeling.kv_tiers.disk import DiskTier
    from modeling.kv_tiers.tiers import KVTiers
    from modeling.prefix_cache import PrefixCache

    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
    cache = PagedKVCache(spec, num_blocks=16, device=device)
    tiers = KVTiers(cache, None, DiskTier.open(str(tmp_path), "decode-0", 1 << 20), read_ahead_bytes=1 << 20)
    pool = BlockPool(num_blocks=16, block_size=4)
    return cache, tiers, pool, PrefixCache(pool, b"s", tiers=tiers)


class _Seq:
    def __init__(self, request_id: str, tokens: list[int]):
        from modeling.block_pool import BlockTable

        self.request_id, self.prompt_ids, self.tokens = request_id, tokens, tokens
        self.block_table, self.num_computed = BlockTable(4), 0


def _written_down(cache, tiers, prefix, tokens: list[int]) -> torch.Tensor:
    """A sequence's 4 full blocks computed (random KV), cached, written to disk and evicted from the pool: their
    KV [4, L, 2, bs, H, D]."""
    seq = _Seq("writer", tokens)
    seq.block_table.ensure_capacity(prefix.pool, len(tokens))
    kv = torch.randn(4, *tiers.block_shape)
    cache.write_blocks(seq.block_table.blocks[:4], kv)
    prefix.commit(seq, 16)
    tiers.flush()
    seq.block_table.release(prefix.pool)
    prefix.forget("writer")
    for _ in range(2):  # every free block taken and given back: the cached ones are evicted
        prefix.pool.free(prefix.pool.allocate(prefix.pool.num_free))
    return kv


def _loading(prefix, tokens: list[int]) -> tuple[_Seq, int]:
    """A sequence over ``tokens`` attached, its tiers' blocks loading in the background: (it, the tokens they
    cover)."""
    seq = _Seq("reader", tokens)
    prefix.attach(seq, load_tiers=False)
    return seq, prefix.load_from_tiers(seq, in_background=True)


def _ended(prefix, seq) -> None:
    seq.block_table.release(prefix.pool)
    prefix.forget(seq.request_id)


@pytest.fixture
def written(tmp_path):
    """(cache, tiers, pool, prefix cache, tokens, their 4 blocks' KV): the blocks on disk only."""
    cache, tiers, pool, prefix = _cache_and_tiers(tmp_path)
    tokens = list(range(3, 20))
    kv = _written_down(cache, tiers, prefix, tokens)
    yield cache, tiers, pool, prefix, tokens, kv
    tiers.close()


def test_a_background_load_fills_its_blocks_and_caches_them_when_finished(written):
    cache, tiers, pool, prefix, tokens, kv = written
    assert pool.cached_run(block_hashes(tokens[:16], 4, b"s")) == 0 and len(tiers.disk) == 4
    seq, covered = _loading(prefix, tokens)
    assert covered == 16 and seq.num_computed == 16
    assert pool.num_cached == 0  # not cached (findable by others) before its KV is written
    assert prefix.finish_load(seq)
    assert torch.equal(cache.read_blocks(seq.block_table.blocks), kv)
    assert pool.num_cached == 4 and tiers.disk.stats.read_ahead == 4 and prefix.stats.tier_hits == 16
    _ended(prefix, seq)
    assert prefix.num_tracked == 0 and tiers.read_ahead_held() == (0, 0)


def test_a_background_load_that_meets_a_corrupt_block_fails_and_is_not_counted(written):
    _, tiers, pool, prefix, tokens, _ = written
    h = block_hashes(tokens[:16], 4, b"s")[2]
    with open(os.path.join(tiers.disk.directory, f"{h:016x}.kv"), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\xff")
    seq, covered = _loading(prefix, tokens)
    assert covered == 16  # found on disk: the corruption is seen when read
    assert not prefix.finish_load(seq)  # two blocks loaded, the third corrupt: the sequence cannot run
    assert pool.num_cached == 2 and prefix.stats.hits == 0 and prefix.stats.tier_hits == 0
    assert tiers.disk.stats.corrupt == 1 and h not in tiers.disk
    _ended(prefix, seq)
    assert prefix.num_tracked == 0


def test_a_request_dropped_while_its_load_runs_gets_no_write_after(written):
    cache, tiers, pool, prefix, tokens, _ = written
    gate, read = threading.Event(), tiers.disk.read
    tiers.disk.read = lambda block_hash, n: (gate.wait(), read(block_hash, n))[1]
    seq, _ = _loading(prefix, tokens)
    blocks = list(seq.block_table.blocks)
    cache.write_blocks(blocks, torch.zeros(len(blocks), *tiers.block_shape))
    threading.Timer(0.05, gate.set).start()
    prefix.forget("reader")  # waits for the read under way; its write does not happen
    seq.block_table.release(pool)
    assert torch.count_nonzero(cache.read_blocks(blocks)) == 0
    assert prefix.num_tracked == 0 and tiers.read_ahead_held() == (0, 0) and pool.num_cached == 0


@pytest.mark.gpu
def test_on_cuda_a_background_load_is_written_before_it_is_finished(tmp_path):
    """The pool on the GPU: the background thread's copy into the cache has completed, not only been queued, once
    ``finish_load`` returns (the worker's steps read the blocks from then on, on their own stream)."""
    cache, tiers, pool, prefix = _cache_and_tiers(tmp_path, "cuda")
    try:
        tokens = list(range(3, 20))
        kv = _written_down(cache, tiers, prefix, tokens)
        seq, covered = _loading(prefix, tokens)
        assert covered == 16 and prefix.finish_load(seq)
        with torch.cuda.stream(torch.cuda.Stream()):  # read on another stream, as a step may
            got = cache.read_blocks(seq.block_table.blocks).cpu()
        assert torch.equal(got, kv) and pool.num_cached == 4 and tiers.disk.stats.read_ahead == 4
    finally:
        tiers.close()
