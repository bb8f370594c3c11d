"""The decode instance's one door (``DecodeWorker.admit``) and its one allocation call
(``KVSlots.allocate_slots``): the call is all or nothing, looks the cached prefix up and reserves the further
sequences' own blocks with the first's; every source admits through the door and frees every block it took;
live migration reaches the instance only through ``MigrationHost``."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from decode_worker.kv_slots import KVSlots
from decode_worker.live_migration import LiveMigrations
from decode_worker.messages import DecodeRequest, TokenDelta
from decode_worker.sources import LocalPrefill, MigrationIn, RemoteKV, Resume
from modeling.block_pool import BlockPool, BlockTable
from modeling.errors import InvalidRequestError
from modeling.prefix_cache import PrefixCache
from modeling.resume import ResumedSequence, ResumeRequest
from modeling.sampling import SamplingParams
from tests.test_decode_worker import prompts_of, worker_for

BLOCK = 4


@dataclass(eq=False)
class Seq:
    request_id: str
    prompt_ids: list[int]
    num_computed: int = 0
    block_table: BlockTable = field(default_factory=lambda: BlockTable(BLOCK))

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids


def test_allocate_slots_grants_whole_or_nothing_with_lookahead_and_fork_blocks():
    pool = BlockPool(10, BLOCK)
    slots = KVSlots(pool)
    seq = Seq("a", list(range(9)))
    grant = slots.allocate_slots(seq, 9, lookahead_tokens=1, num_forks=2)
    # 10 positions: 3 blocks; each fork owns the partly filled prompt block and its first step's: 1 apiece
    assert len(grant.blocks) == 3 and len(grant.fork_blocks) == 2 and grant.cached_blocks == 0
    assert slots.fork_blocks_each(9) == 1 and slots.fork_blocks_each(8) == 1 and slots.fork_blocks_each(7) == 1
    big = Seq("b", list(range(20)))
    assert slots.allocate_slots(big, 20, lookahead_tokens=1, num_forks=1) is None  # 6 + 2 blocks: 5 free
    assert pool.num_free == 5 and not big.block_table.blocks  # nothing taken
    assert slots.allocate_slots(big, 19) is not None and pool.num_free == 0


def test_allocate_slots_starts_from_the_cached_prefix_and_gives_it_back_when_refused():
    pool = BlockPool(6, BLOCK)
    cache = PrefixCache(pool, b"salt")
    slots = KVSlots(pool, cache)
    first = Seq("a", list(range(1, 10)))
    slots.allocate_slots(first, 9, lookahead_tokens=1)
    first.num_computed = 9
    cache.commit(first, 9)  # its first two blocks are final and cached
    first.block_table.release(pool)
    cache.forget("a")
    again = Seq("b", list(range(1, 10)) + [99])
    grant = slots.allocate_slots(again, 10, lookahead_tokens=1, cached_upto=9)
    assert grant.cached_blocks == 2 and again.num_computed == 8 and len(grant.blocks) == 3
    hog = Seq("c", list(range(1, 10)) + [7, 7, 7, 7, 7, 7, 7, 7])
    free = pool.num_free
    assert slots.allocate_slots(hog, 24, cached_upto=16) is None  # 6 blocks, sharing 2: 4 more, 3 free
    assert hog.num_computed == 0 and not hog.block_table.blocks and pool.num_free == free


def test_every_source_admits_through_the_door_and_frees_what_it_took(llama_dir):
    worker = worker_for(llama_dir, drafter="self_sparse", k_policy="fixed", k=2, kv_cache_tokens=1024)
    prompt, other = prompts_of([30, 21], seed=3)
    with pytest.raises(InvalidRequestError, match="receives no KV"):
        worker.admit(DecodeRequest("r", tuple(prompt), SamplingParams()), RemoteKV())
    with pytest.raises(TypeError, match="source"):
        worker.admit(DecodeRequest("r", tuple(prompt), SamplingParams()), "remote")
    # local prefill of three sequences: the further two own their blocks from admission on, and fork at the start
    free = worker.pool.num_free
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=3, ignore_eos=True)
    assert worker.admit(DecodeRequest("p", tuple(prompt), params), LocalPrefill())
    bs = worker.pool.block_size
    own = worker.pool.blocks_for_tokens(31) - 30 // bs  # the partly filled prompt block and the first step's
    assert len(worker.requests["p"].fork_blocks) == 2 * own
    assert free - worker.pool.num_free == worker.pool.blocks_for_tokens(31) + 2 * own
    # a request another instance streamed part of: waits, ahead of the preempted, to be recomputed here
    resumed = ResumeRequest("q", tuple(other), SamplingParams(max_tokens=8, ignore_eos=True),
                            (ResumedSequence(0, (5, 6, 7), 0),))
    assert worker.admit(resumed, Resume())
    outputs: dict[tuple[str, int], list[int]] = {}
    while worker.has_work():
        for d in worker.step():
            assert isinstance(d, TokenDelta)
            outputs.setdefault((d.request_id, d.index), []).extend(d.token_ids)
    assert sorted(outputs) == [("p", 0), ("p", 1), ("p", 2), ("q", 0)]
    assert all(len(v) == 6 for k, v in outputs.items() if k[0] == "p") and len(outputs["q", 0]) == 5
    assert worker.pool.num_free == worker.pool.num_blocks and not worker.requests


class FakeHost:
    """A ``MigrationHost`` of plain objects: what live migration may ask of its instance, recorded."""

    instance_id, block_size, max_model_len, ranks = "dec-x", 16, 4096, None

    def __init__(self, room: bool):
        self.room = room
        self.admitted: list = []

    def max_k(self) -> int:
        return 3

    def admit(self, request, source) -> bool:
        self.admitted.append((request.request_id, source))
        return self.room

    def held(self, request_id):
        return None


def test_migration_in_is_admitted_through_the_hosts_door_with_headroom():
    host = FakeHost(room=True)
    migrations = LiveMigrations(host)
    request = DecodeRequest("m", (1, 2, 3), SamplingParams())
    assert migrations.begin_in(request, 10) == 10 + 16 * 4  # 16 steps of k = 3 + 1, whole blocks
    assert host.admitted == [("m", MigrationIn(74))] and migrations.incoming == {"m"}
    with pytest.raises(InvalidRequestError, match="num_tokens"):
        migrations.begin_in(request, 3)  # not even the prompt and one token
    full = LiveMigrations(FakeHost(room=False))
    assert full.begin_in(request, 10) is None and not full.incoming
    assert "not decoding" in migrations.begin_out("m", "dec-y", 100)
