"""The router's request state machine: legal paths, illegal moves refused, counts always add up."""

import pytest

from controller.request_state import InvalidTransition, RequestRecord, RequestState, StateCounters

S = RequestState


def test_happy_path_and_counts():
    counters = StateCounters()
    r = RequestRecord("a", counters)
    for s in (S.PREFILLING, S.TRANSFERRING, S.DECODING, S.FINISHED):
        r.to(s)
    assert [s for s, _ in r.history] == [S.QUEUED, S.PREFILLING, S.TRANSFERRING, S.DECODING, S.FINISHED]
    assert counters.snapshot()["finished"] == 1 and sum(counters.snapshot().values()) == 1


def test_retry_and_endings():
    counters = StateCounters()
    a, b, c = RequestRecord("a", counters), RequestRecord("b", counters), RequestRecord("c", counters)
    a.to(S.PREFILLING)
    a.to(S.QUEUED, "prefill instance died")
    assert a.retries == 1 and a.error == "prefill instance died"
    b.to(S.CANCELLED)
    c.to(S.PREFILLING)
    c.to(S.FAILED, "boom")
    snap = counters.snapshot()
    assert snap == {"queued": 1, "prefilling": 0, "transferring": 0, "decoding": 0, "migrating": 0, "finished": 0,
                    "failed": 1, "cancelled": 1}


def test_migration_round_trip_and_finish_while_migrating():
    r = RequestRecord("m", StateCounters())
    for s in (S.PREFILLING, S.TRANSFERRING, S.DECODING, S.MIGRATING, S.DECODING, S.MIGRATING, S.FINISHED):
        r.to(s)
    assert r.state is S.FINISHED


def test_prefilled_on_the_decode_instance_skips_the_transfer():
    r = RequestRecord("local", StateCounters())
    for s in (S.PREFILLING, S.DECODING, S.FINISHED):
        r.to(s)
    assert [s for s, _ in r.history] == [S.QUEUED, S.PREFILLING, S.DECODING, S.FINISHED]


@pytest.mark.parametrize("path", [[S.DECODING], [S.QUEUED, S.TRANSFERRING], [S.FINISHED],
                                  [S.PREFILLING, S.TRANSFERRING, S.MIGRATING],
                                  [S.PREFILLING, S.TRANSFERRING, S.DECODING, S.MIGRATING, S.QUEUED]])
def test_illegal_moves_refused(path):
    r = RequestRecord("x", StateCounters())
    with pytest.raises(InvalidTransition, match="is not allowed"):
        for s in path:
            r.to(s)


def test_terminal_is_final():
    r = RequestRecord("x", StateCounters())
    r.to(S.CANCELLED)
    with pytest.raises(InvalidTransition, match="already cancelled"):
        r.to(S.FAILED)
