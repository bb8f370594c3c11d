"""decode_worker/scheduler.py on plain objects: admission room, k lowered before anyone is preempted, the
newest preempted first, resumption first in first out, blocks conserved."""

from __future__ import annotations

from dataclasses import dataclass, field

from decode_worker.scheduler import DecodeScheduler
from modeling.block_pool import BlockPool, BlockTable
from modeling.sequence import SequenceStatus

BLOCK = 4


@dataclass(eq=False)
class Seq:
    request_id: str
    num_tokens: int
    num_computed: int = 0
    block_table: BlockTable = field(default_factory=lambda: BlockTable(BLOCK))
    status: SequenceStatus = SequenceStatus.WAITING_FOR_KV


def running(sched: DecodeScheduler, *lengths: int) -> list[Seq]:
    seqs = []
    for i, n in enumerate(lengths):
        seq = Seq(f"r{i}", n)
        assert sched.reserve(seq, n)
        seq.num_computed = n
        sched.start(seq)
        seqs.append(seq)
    return seqs


def test_admission_needs_blocks_for_the_prompt_and_a_step_and_a_free_slot():
    sched = DecodeScheduler(BlockPool(10, BLOCK), max_num_seqs=2)
    assert sched.can_reserve(35) and not sched.can_reserve(40)  # 40 + 1 positions need 11 blocks
    assert sched.can_reserve(15, 23) and not sched.can_reserve(15, 24)  # 4 + 6 blocks fit, 4 + 7 do not
    assert not sched.can_reserve(1, 1, 1)  # three sequences over max_num_seqs
    a, b = running(sched, 7, 3)
    assert (len(a.block_table.blocks), len(b.block_table.blocks)) == (2, 1)  # prompt + 1 position each
    assert not sched.can_reserve(1)  # max_num_seqs running
    sched.finish(a)
    assert sched.can_reserve(1) and sched.pool.num_free == 9 and list(sched.running) == ["r1"]


def test_k_drops_to_zero_before_anyone_is_preempted_then_the_newest_goes():
    sched = DecodeScheduler(BlockPool(6, BLOCK), max_num_seqs=8)
    a, b, c = running(sched, 7, 7, 7)  # 2 blocks each: the pool is full
    k, batch, preempted = sched.make_room(3)  # k = 3 needs 10 positions (3 blocks) each: no room
    assert (k, batch, preempted) == (0, [a, b, c], [])  # k = 0 needs 8 positions: fits
    for s in (a, b, c):
        s.num_tokens = 9  # each step added tokens: 9 positions need 3 blocks each
    k, batch, preempted = sched.make_room(0)
    assert (k, batch, preempted) == (0, [a, b], [c])
    assert c.status is SequenceStatus.WAITING and c.num_computed == 0 and not c.block_table.blocks
    assert sched.num_preemptions == 1 and list(sched.preempted) == [c]


def test_the_preempted_resume_first_in_first_out_when_they_fit():
    sched = DecodeScheduler(BlockPool(9, BLOCK), max_num_seqs=8)
    a, b, c = running(sched, 8, 8, 8)  # 3 blocks each (with the first step's position): the pool is full
    for s in (a, b, c):
        s.num_tokens = 13  # 4 blocks each: only two fit
    _, _, first = sched.make_room(0)
    assert first == [c]
    assert list(sched.resumable()) == []  # no room yet (1 block free)
    sched.finish(a)
    assert [s.request_id for s in sched.resumable()] == ["r2"]
    assert c.status is SequenceStatus.RUNNING and len(c.block_table.blocks) == 4
    assert list(sched.running) == ["r1", "r2"]
    sched.finish(b)
    sched.finish(c)
    assert sched.pool.num_free == sched.pool.num_blocks  # every block back


def test_finish_of_a_preempted_or_reserved_sequence_frees_what_it_holds():
    sched = DecodeScheduler(BlockPool(8, BLOCK), max_num_seqs=8)
    reserved = Seq("x", 10)
    assert sched.reserve(reserved, 10)
    sched.finish(reserved)  # never started: its reservation goes
    a, b = running(sched, 12, 12)
    a.num_tokens = b.num_tokens = 17
    _, _, preempted = sched.make_room(0)
    sched.finish(preempted[0])
    assert not sched.preempted and sched.pool.num_free == sched.pool.num_blocks - len(a.block_table.blocks)
