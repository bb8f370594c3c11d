"""``RequestRun`` on plain objects: the instances' bookkeeping follows the run's placement, hand-off, migration
and end; output is emitted once per position with its latencies; a resume continues from what was streamed."""

from __future__ import annotations

from controller.migrations import PendingMigration
from controller.request_run import RequestRun
from controller.request_state import RequestRecord, RequestState, StateCounters
from controller.routing import Instance
from decode_worker.messages import PoolLoad, TokenDelta
from modeling.sampling import SamplingParams
from prefill_worker.messages import FirstToken


def _run(rid: str = "r", **params) -> RequestRun:
    return RequestRun(RequestRecord(rid, StateCounters()), [1, 2, 3, 4], SamplingParams(**{"max_tokens": 8, **params}),
                      arrival=0.0)


def _decoding(run: RequestRun) -> None:
    for state in (RequestState.PREFILLING, RequestState.TRANSFERRING, RequestState.DECODING):
        run.record.to(state)


def test_placement_is_counted_on_both_instances_and_undone_whole():
    run, p, d = _run(), Instance("p", "prefill", None), Instance("d", "decode", None)
    d.load = PoolLoad(total_blocks=64, block_size=4)
    run.place(d, p)
    assert run.prefill is p and run.decode is d and run.decoders == {d}
    assert "r" in p.assigned and "r" in d.assigned and d.placed == {"r": 2}  # 4 prompt + 1 step in blocks of 4
    run.unplace()
    assert not p.assigned and not d.assigned and run.prefill is run.decode is None and not run.decoders


def test_detach_names_the_alive_instances_to_abort_and_hand_off_frees_the_prefill_instance():
    run, p, d = _run(), Instance("p", "prefill", None), Instance("d", "decode", None)
    run.place(d, p)
    run.handed_off(p)
    assert "r" not in p.assigned and "r" in d.assigned
    d.alive = False
    assert run.detach() == [p] and not d.assigned


def test_a_failed_call_moves_the_run_off_the_instance_and_avoids_it_once():
    run, d = _run(), Instance("d", "decode", None)
    run.place(d)
    assert run.left(d) and "d" in run.avoid and not d.assigned
    assert not run.left(d)  # not there any more


def _migrating() -> tuple[RequestRun, Instance, Instance, PendingMigration]:
    """A run decoding on ``s`` whose migration to ``t`` started."""
    run, src, dst = _run(), Instance("s", "decode", None), Instance("t", "decode", None)
    run.place(src)
    _decoding(run)
    m = PendingMigration(src, dst, 0.0, None)
    run.migration_started(m)
    return run, src, dst, m


def test_a_migration_moves_the_run_between_the_instances_counts():
    run, src, dst, _ = _migrating()
    assert run.state is RequestState.MIGRATING and dst.migrating_in == {"r"}
    assert run.migration_committed() == (src, dst)
    assert run.decode is dst and run.decoders == {src, dst} and dst.assigned == {"r"} and not src.assigned
    assert not dst.migrating_in and run.migration is None
    run.migration_ended()
    assert run.state is RequestState.DECODING


def test_an_aborted_migration_leaves_the_run_on_its_source():
    run, src, dst, m = _migrating()
    run.migration_dropped(m)
    assert run.decode is src and run.migration is None and not dst.migrating_in and src.assigned == {"r"}


def test_output_is_emitted_once_in_order_with_its_latencies():
    run = _run()
    run.place(Instance("d", "decode", None))
    run.prefilling()
    first = run.first_tokens(FirstToken("r", 10, 0.1, 4))
    assert [(p.token_ids, p.position) for p in first] == [([10], 0)]
    delta, times = run.emit(run.order.accept(first[0])[0])
    assert delta.token_ids == [10] and times.ttft_s is not None and times.gap_s is None
    piece = TokenDelta("r", [11, 12], "bc", False, position=1, text_offset=0, draft_tokens=3, accepted_tokens=2)
    delta, times = run.emit(run.order.accept(piece)[0])
    assert delta.token_ids == [11, 12] and times.tokens == 2 and times.gap_s >= 0
    assert run.order.accept(piece) == []  # a repeat is cut away
    final = run.final("length")
    assert (final.completion_tokens, final.draft_tokens, final.accepted_tokens) == (3, 3, 2)


def test_a_resume_continues_every_running_sequence_from_what_was_streamed():
    run = _run(n=2, temperature=1.0, seed=7)
    run.order.accept(TokenDelta("r", [10, 11], "ab", False, position=0, index=0))
    assert not run.can_resume(3)  # sequence 1 streamed nothing yet
    run.order.accept(TokenDelta("r", [20], "x", False, position=0, index=1))
    assert run.can_resume(3) and not run.can_resume(0)
    request = run.resume_request()
    assert run.resumes == 1 and not run.decoders
    assert [(s.index, s.output_ids, s.text_sent) for s in request.sequences] == [(0, (10, 11), 2), (1, (20,), 1)]
