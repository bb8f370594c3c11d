"""Live migration between two decode workers over a real gloo channel (one process, the router's part played
by the test): output is token- and text-identical to decoding without migration, with self-speculation and
with a draft model, greedy and seeded; every failure point leaves the request on exactly one worker and
frees every block."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from controller.output_order import OutputOrder
from decode_worker.config import DecodeWorkerConfig, SpeculationConfig
from decode_worker.messages import DecodeFailure, DecodeRequest, MigrationArrived, MigrationFailed, TokenDelta
from decode_worker.migration import MigrationState, headroom_tokens, should_stop
from decode_worker.worker import DecodeWorker
from kv_transfer.channel import Rendezvous, TransferConfig
from modeling.errors import InvalidRequestError
from modeling.resume import ResumedSequence
from modeling.sampling import SamplingParams
from tests.checkpoints import VOCAB


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


def make_worker(directory, name, kv_cache_tokens=8192, timeout_s=10.0, **spec):
    spec = {"budget": 32, "sink_tokens": 4, **spec}
    cfg = DecodeWorkerConfig(dtype="float32", kv_cache_tokens=kv_cache_tokens, attention_backend="torch",
                             profile_on_start=False, speculation=SpeculationConfig(**spec))
    return DecodeWorker(directory, cfg, name, TransferConfig(timeout_s=timeout_s))


class Pair:
    """Source and destination workers with a migration channel from a to b (formed on two threads, as
    Ray's concurrent actor calls form them)."""

    generation = 0

    def __init__(self, a: DecodeWorker, b: DecodeWorker):
        self.a, self.b = a, b
        self.store, rdv = Rendezvous.host_store()
        Pair.generation += 1
        gen = Pair.generation
        t = threading.Thread(target=b.connect, args=(a.instance_id, rdv, gen))
        t.start()
        a.migrations.connect(b.instance_id, rdv, gen)
        t.join()


class Run:
    """Decodes requests on a pair, collecting every delta per request and where it came from."""

    def __init__(self, pair: Pair):
        self.pair = pair
        self.tokens: dict[str, list[int]] = {}
        self.text: dict[str, str] = {}
        self.sources: dict[str, list[str]] = {}
        self.finished: dict[str, str] = {}
        self.events: list = []
        self.orders: dict[str, OutputOrder] = {}

    def add(self, rid, prompt, params):
        self._take("a", self.pair.a.add_local(rid, prompt, params))

    def step(self):
        self._take("a", self.pair.a.step())
        self._take("b", self.pair.b.step())

    def _take(self, where, items):
        for item in items:
            if isinstance(item, TokenDelta):  # each output position once, in order, as the router emits them
                for cut in self.orders.setdefault(item.request_id, OutputOrder()).accept(item):
                    self.tokens.setdefault(cut.request_id, []).extend(cut.token_ids)
                    self.text[cut.request_id] = self.text.get(cut.request_id, "") + cut.text
                    if cut.token_ids:
                        self.sources.setdefault(cut.request_id, []).append(where)
                    if cut.finished:
                        self.finished[cut.request_id] = cut.finish_reason
            else:
                self.events.append((where, item))

    def until(self, predicate, timeout_s=60.0):
        """Step both workers until ``predicate`` holds (the receivers' threads run beside the steps, so an
        idle step yields to them)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return
            busy = self.pair.a.num_running + self.pair.b.num_running
            self.step()
            if not busy:
                time.sleep(0.001)
        raise AssertionError("condition not reached")

    def drain(self):
        self.until(lambda: not self.pair.a.has_work() and not self.pair.b.has_work())

    def migrate(self, rid, prompt):
        """Start migrating ``rid`` from a to b, as the router does."""
        n = len(prompt) + len(self.tokens[rid])
        capacity = self.pair.b.migrations.begin_in(DecodeRequest(rid, tuple(prompt), self.params[rid]), n)
        assert capacity is not None
        assert self.pair.a.migrations.begin_out(rid, self.pair.b.instance_id, capacity) is None
        return capacity

    def arrived(self, rid):
        return any(isinstance(e, MigrationArrived) and e.request_id == rid for _, e in self.events)


def solo_outputs(directory, prompts, params, **spec):
    """What a single worker streams for these requests (the oracle)."""
    w = make_worker(directory, "solo", **spec)
    run = Run.__new__(Run)
    Run.__init__(run, type("P", (), {"a": w, "b": w})())
    for i, p in enumerate(prompts):
        run._take("a", w.add_local(f"r{i}", p, params[i]))
    while w.has_work():
        run._take("a", w.step())
    return run.tokens, run.text


def migrate_midway(directory, prompts, params, migrate_at=6, victim="r1", **spec):
    pair = Pair(make_worker(directory, "dec-a", **spec), make_worker(directory, "dec-b", **spec))
    run = Run(pair)
    run.params = {f"r{i}": params[i] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        run.add(f"r{i}", p, params[i])
    for _ in range(migrate_at):
        run.step()
    run.migrate(victim, prompts[int(victim[1:])])
    run.until(lambda: run.arrived(victim))
    assert pair.b.migrations.commit(victim) and pair.a.migrations.finish(victim)
    run.drain()
    return pair, run


SPECS = {
    "self_sparse_adaptive": dict(drafter="self_sparse", k_policy="adaptive", max_k=4),
    "self_sparse_fixed": dict(drafter="self_sparse", k_policy="fixed", k=3),
    "no_speculation": dict(drafter="none"),
}


@pytest.mark.parametrize("spec", list(SPECS))
def test_greedy_migration_is_token_and_text_identical(llama_dir, spec):
    prompts = prompts_of([40, 90, 23])
    params = [SamplingParams(max_tokens=60, ignore_eos=True)] * 3
    pair, run = migrate_midway(llama_dir, prompts, params, **SPECS[spec])
    want_tokens, want_text = solo_outputs(llama_dir, prompts, params, **SPECS[spec])
    assert run.tokens == want_tokens and run.text == want_text
    src = run.sources["r1"]
    assert src[0] == "a" and src[-1] == "b" and src == sorted(src)  # a's tokens, then b's, never interleaved
    assert all(s == ["a"] * len(s) for r, s in run.sources.items() if r != "r1")
    for w in (pair.a, pair.b):
        assert w.pool.num_free == w.pool.num_blocks and not w.has_work()
    assert pair.a.migrations.legs.sender.stats.completed == 1


def test_closed_migration_channels_end_on_both_sides_and_form_anew(llama_dir):
    """A decode instance that changes role closes the channels it migrates requests over: its destination's
    end breaks too; channels formed again under a new generation carry a migration with unchanged tokens."""
    prompts = prompts_of([40, 60])
    params = [SamplingParams(max_tokens=30, ignore_eos=True)] * 2
    spec = dict(drafter="none")
    pair = Pair(make_worker(llama_dir, "dec-a", **spec), make_worker(llama_dir, "dec-b", **spec))
    destination_end = pair.b.receiver._channels[pair.a.instance_id]
    pair.a.migrations.close()
    assert pair.a.migrations.legs is None
    deadline = time.monotonic() + 10.0
    while destination_end.broken is None and time.monotonic() < deadline:
        pair.b.step()
        time.sleep(0.01)
    assert destination_end.broken is not None
    run = Run(pair)
    run.params = {"r0": params[0], "r1": params[1]}
    for i, p in enumerate(prompts):
        run.add(f"r{i}", p, params[i])
    run.step()
    assert pair.a.migrations.begin_out("r1", pair.b.instance_id, 128) is not None  # no channel: refused
    Pair.__init__(pair, pair.a, pair.b)  # formed anew, under a new generation
    run.migrate("r1", prompts[1])
    run.until(lambda: run.arrived("r1"))
    assert pair.b.migrations.commit("r1") and pair.a.migrations.finish("r1")
    run.drain()
    assert run.tokens == solo_outputs(llama_dir, prompts, params, **spec)[0]
    assert run.sources["r1"][-1] == "b"


def test_seeded_sampling_migration_is_identical(llama_dir):
    """A fixed speculation length consumes the same random draws wherever the request runs, so moving the
    generator's state keeps a seeded request's output exact."""
    prompts = prompts_of([50, 70])
    params = [SamplingParams(max_tokens=50, ignore_eos=True, temperature=0.9, top_p=0.95, seed=11 + i) for i in range(2)]
    spec = SPECS["self_sparse_fixed"]
    _, run = migrate_midway(llama_dir, prompts, params, victim="r0", **spec)
    want_tokens, want_text = solo_outputs(llama_dir, prompts, params, **spec)
    assert run.tokens == want_tokens and run.text == want_text


@pytest.mark.parametrize("seeded", [False, True])
def test_draft_model_migration_is_identical(checkpoint_dir, llama_dir, seeded):
    """The draft model's own cache moves with the request (its window's blocks, after the state): greedy and
    seeded output are unchanged, and the source frees its draft blocks."""
    draft = checkpoint_dir("llama_tied")
    spec = dict(drafter="draft_model", draft_model=draft, k_policy="fixed", k=2)
    prompts = prompts_of([60, 30])
    sampling = dict(temperature=0.8, top_p=0.9) if seeded else {}
    params = [SamplingParams(max_tokens=60, ignore_eos=True, seed=i, **sampling) for i in range(2)]
    pair, run = migrate_midway(llama_dir, prompts, params, victim="r0", **spec)
    want_tokens, want_text = solo_outputs(llama_dir, prompts, params, **spec)
    assert run.tokens == want_tokens and run.text == want_text
    for w in (pair.a, pair.b):
        assert w.drafter.pool.num_free == w.drafter.pool.num_blocks


def test_stop_strings_and_held_back_text_move(llama_dir):
    """Text held back for a possible stop string is streamed by the destination; a stop string completed
    there ends the request exactly where the single worker ends it."""
    prompts = prompts_of([30, 30], seed=3)
    base = SamplingParams(max_tokens=60, ignore_eos=True)
    want_tokens, want_text = solo_outputs(llama_dir, prompts, [base, base], drafter="none")
    text = want_text["r0"]
    stop = text[len(text) * 2 // 3: len(text) * 2 // 3 + 3]  # completes well after the migration
    params = [SamplingParams(max_tokens=60, ignore_eos=True, stop=(stop,)), base]
    want_tokens, want_text = solo_outputs(llama_dir, prompts, params, drafter="none")
    _, run = migrate_midway(llama_dir, prompts, params, migrate_at=4, victim="r0", drafter="none")
    assert run.tokens == want_tokens and run.text == want_text and run.finished["r0"] == "stop"


def test_abort_before_commit_keeps_the_request_on_its_source(llama_dir):
    """The router aborts after the destination has everything: the source resumes, the destination frees
    its copy, the output is unchanged and nothing leaks."""
    prompts = prompts_of([40, 50])
    params = [SamplingParams(max_tokens=50, ignore_eos=True)] * 2
    spec = SPECS["self_sparse_adaptive"]
    pair = Pair(make_worker(llama_dir, "dec-a", **spec), make_worker(llama_dir, "dec-b", **spec))
    run = Run(pair)
    run.params = {"r0": params[0], "r1": params[1]}
    for i, p in enumerate(prompts):
        run.add(f"r{i}", p, params[i])
    for _ in range(5):
        run.step()
    run.migrate("r1", prompts[1])
    run.until(lambda: run.arrived("r1"))
    assert pair.b.abort("r1") and pair.a.migrations.abort("r1")
    run.drain()
    want_tokens, want_text = solo_outputs(llama_dir, prompts, params, **spec)
    assert run.tokens == want_tokens and run.text == want_text
    assert set(run.sources["r1"]) == {"a"}
    for w in (pair.a, pair.b):
        assert w.pool.num_free == w.pool.num_blocks and not w.has_work()


def test_destination_without_room_and_a_request_not_decoding_are_refused(llama_dir):
    a = make_worker(llama_dir, "dec-a", drafter="none")
    b = make_worker(llama_dir, "dec-b", kv_cache_tokens=128, drafter="none")
    prompt = prompts_of([100])[0]
    assert b.migrations.begin_in(DecodeRequest("r", tuple(prompt), SamplingParams()), 120) is None  # no room there
    assert not b.has_work() and b.pool.num_free == b.pool.num_blocks
    assert a.migrations.begin_out("r", "dec-b", 200) is not None  # not decoding here: refused, nothing held
    assert not a.has_work()


def test_destination_dies_before_commit(llama_dir):
    """The destination goes away mid-rounds: the source's transfer fails, it reports the migration failed
    and keeps decoding; output unchanged, nothing leaked on the source."""
    prompts = prompts_of([300, 40])
    params = [SamplingParams(max_tokens=40, ignore_eos=True)] * 2
    spec = dict(drafter="none")
    pair = Pair(make_worker(llama_dir, "dec-a", timeout_s=2.0, **spec),
                make_worker(llama_dir, "dec-b", timeout_s=2.0, **spec))
    run = Run(pair)
    run.params = {"r0": params[0], "r1": params[1]}
    for i, p in enumerate(prompts):
        run.add(f"r{i}", p, params[i])
    run.step()
    run.migrate("r0", prompts[0])
    pair.b.receiver.close()  # the destination's channels close mid-rounds (as when its process dies)
    for _ in range(400):
        run._take("a", pair.a.step())
        if any(isinstance(e, MigrationFailed) for _, e in run.events):
            break
        time.sleep(0.005)
    failed = [e for w, e in run.events if isinstance(e, MigrationFailed)]
    assert failed and failed[0].request_id == "r0" and all(w == "a" for w, e in run.events)
    assert pair.a.migrations.abort("r0")
    while pair.a.has_work():
        run._take("a", pair.a.step())
    want_tokens, _ = solo_outputs(llama_dir, prompts, params, **spec)
    assert run.tokens == want_tokens
    assert pair.a.pool.num_free == pair.a.pool.num_blocks


def test_request_finishing_during_rounds_cancels_the_migration(llama_dir):
    """A request that finishes on its source before the stop-and-copy is simply done there: the router
    frees the destination's reservation, nothing leaks."""
    prompts = prompts_of([40])
    params = [SamplingParams(max_tokens=3, ignore_eos=True)]
    pair = Pair(make_worker(llama_dir, "dec-a", drafter="none"), make_worker(llama_dir, "dec-b", drafter="none"))
    run = Run(pair)
    run.params = {"r0": params[0]}
    run.add("r0", prompts[0], params[0])
    run.migrate("r0", prompts[0])
    run.until(lambda: "r0" in run.finished or run.arrived("r0"))
    if "r0" in run.finished:
        assert pair.b.abort("r0")
    else:  # the stop-and-copy came first: commit, and b finishes it
        assert pair.b.migrations.commit("r0") and pair.a.migrations.finish("r0")
    run.drain()
    assert len(run.tokens["r0"]) == 3
    for w in (pair.a, pair.b):
        assert w.pool.num_free == w.pool.num_blocks and not w.has_work()


def test_preempted_source_fails_the_migration(llama_dir):
    """A source that must preempt the migrating request drops its KV: the migration fails (the request is
    recomputed on the source as any preempted one) and the destination's copy is freed by the router."""
    # two 111-token prompts fill a 14-block pool exactly (7 blocks each with the first token): the second
    # step needs an eighth block for each, so the newest (the migrating one) is preempted before its rounds end
    prompts = prompts_of([111, 111], seed=5)
    params = [SamplingParams(max_tokens=30, ignore_eos=True)] * 2
    spec = dict(drafter="none")
    pair = Pair(make_worker(llama_dir, "dec-a", kv_cache_tokens=224, **spec), make_worker(llama_dir, "dec-b", **spec))
    run = Run(pair)
    run.params = {"r0": params[0], "r1": params[1]}
    for i, p in enumerate(prompts):
        run.add(f"r{i}", p, params[i])
    assert pair.a.pool.num_free == 0
    run.migrate("r1", prompts[1])
    run._take("a", pair.a.step())  # round 1 goes out
    run._take("a", pair.a.step())  # r1 is preempted
    failed = [e for _, e in run.events if isinstance(e, MigrationFailed)]
    assert pair.a.metrics.preemptions == 1 and [e.request_id for e in failed] == ["r1"]
    assert "preempted" in failed[0].reason
    assert pair.b.abort("r1") and not pair.a.migrations.abort("r1")  # the source already forgot it
    run.drain()
    want_tokens, _ = solo_outputs(llama_dir, prompts, params, kv_cache_tokens=224, **spec)
    assert run.tokens == want_tokens
    for w in (pair.a, pair.b):
        assert w.pool.num_free == w.pool.num_blocks and not w.has_work()


def test_stop_rule_and_state_codec():
    assert not should_stop(caught_up=True, rounds=0, num_tokens=100, step_tokens=4, capacity_tokens=200)
    assert should_stop(caught_up=True, rounds=1, num_tokens=100, step_tokens=4, capacity_tokens=200)
    assert not should_stop(caught_up=False, rounds=5, num_tokens=100, step_tokens=4, capacity_tokens=200)
    assert should_stop(caught_up=False, rounds=5, num_tokens=196, step_tokens=4, capacity_tokens=200)
    assert headroom_tokens(max_k=6, block_size=16) == 112 and headroom_tokens(0, 16) == 16
    state = MigrationState((5, 6, 7), 42, "00ff", 3)
    assert MigrationState.decode(state.encode()) == state
    timed = MigrationState((5, 6, 7), 42, "00ff", 3, first_token_at=1.75e9)  # the request's TPOT counts from it
    assert MigrationState.decode(timed.encode()).first_token_at == 1.75e9
    for bad, field in [(dict(output_ids=()), "output_ids"), (dict(num_computed=-1), "num_computed"),
                       (dict(output_ids=(1, True)), "output_ids"), (dict(text_sent=1.5), "text_sent"),
                       (dict(first_token_at=float("nan")), "first_token_at"), (dict(first_token_at="x"), "first_token_at")]:
        with pytest.raises(ValueError, match=field):
            MigrationState(**{"output_ids": (1,), "num_computed": 1, "sampler_state": "", "text_sent": 0, **bad})
    with pytest.raises(ValueError):
        MigrationState((1,), 1, "zz", 0)


def test_a_structured_request_migrates_with_its_grammar(llama_dir):
    """The destination's matcher follows the output that arrived (``RequestSampler.catch_up``): a request
    under a grammar moved midway ends as the single worker ends it, inside its grammar."""
    pytest.importorskip("llguidance")
    from modeling.structured_output import StructuredOutput

    prompts = prompts_of([40, 30], seed=5)
    structured = StructuredOutput("regex", r"[a-z]{2,6}( [a-z]{2,6}){6,12}\.")
    params = [SamplingParams(max_tokens=60, structured=structured),
              SamplingParams(max_tokens=60, ignore_eos=True)]
    spec = SPECS["self_sparse_fixed"]
    want_tokens, want_text = solo_outputs(llama_dir, prompts, params, **spec)
    _, run = migrate_midway(llama_dir, prompts, params, migrate_at=3, victim="r0", **spec)
    assert run.tokens == want_tokens and run.text == want_text
    assert run.finished["r0"] == "stop" and re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){6,12}\.", run.text["r0"])
    assert run.sources["r0"][-1] == "b"  # the grammar's end was reached on the destination


def test_a_request_resumes_from_its_streamed_tokens_on_another_worker(llama_dir):
    """A decode instance's death: another one continues each request from the prompt and the tokens the
    client received (``DecodeWorker.add_resume``), recomputing their KV: greedy output with penalties, a stop
    string, a grammar, and seeded sampling (the generator's state rides on the deltas) all end exactly as on
    one undisturbed worker, the text going on from the characters already sent."""
    pytest.importorskip("llguidance")
    from modeling.resume import ResumeRequest
    from modeling.structured_output import StructuredOutput

    prompts = prompts_of([40, 30, 35, 25], seed=7)
    base_text = solo_outputs(llama_dir, prompts[1:2], [SamplingParams(max_tokens=50, ignore_eos=True)],
                             drafter="none")[1]["r0"]
    params = [SamplingParams(max_tokens=50, ignore_eos=True, frequency_penalty=0.5),
              SamplingParams(max_tokens=50, ignore_eos=True, stop=(base_text[30:33],)),
              SamplingParams(max_tokens=60, structured=StructuredOutput("regex", r"[a-z]{2,6}( [a-z]{2,6}){6,12}\.")),
              SamplingParams(max_tokens=50, ignore_eos=True, temperature=0.9, top_p=0.95, seed=5)]
    spec = SPECS["self_sparse_fixed"]
    want_tokens, want_text = solo_outputs(llama_dir, prompts, params, **spec)
    a, b = make_worker(llama_dir, "dec-a", **spec), make_worker(llama_dir, "dec-b", **spec)
    run = Run(type("P", (), {"a": a, "b": b})())
    states: dict[str, bytes] = {}
    for i, p in enumerate(prompts):
        run.add(f"r{i}", p, params[i])
    for _ in range(4):
        items = a.step()
        states.update({d.request_id: d.sampler_state for d in items if isinstance(d, TokenDelta) and d.sampler_state})
        run._take("a", items)
    assert states.get("r3") and not states.get("r0")  # only a seeded sampling request carries its state
    for i, p in enumerate(prompts):  # "a" dies here: its requests go on at "b"
        rid = f"r{i}"
        assert b.add_resume(ResumeRequest(rid, tuple(p), params[i], [ResumedSequence(
            0, tuple(run.tokens[rid]), len(run.text[rid]), states.get(rid, b""))]))
    while b.has_work():
        run._take("b", b.step())
    assert run.tokens == want_tokens and run.text == want_text
    assert run.finished["r1"] == run.finished["r2"] == "stop"
    assert all(s[-1] == "b" for s in run.sources.values())
    assert b.pool.num_free == b.pool.num_blocks and not b.requests  # nothing held but what is cached


def test_every_running_sequence_of_a_request_resumes(llama_dir):
    """n = 3, seeded sampling: the worker dies after a few steps; another continues the request's three
    sequences from their streamed tokens, each with its own generator state (``ResumedSequence``), and every
    sequence ends as on one undisturbed worker."""
    from modeling.resume import ResumeRequest

    prompt = prompts_of([30], seed=9)[0]
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, top_p=0.95, seed=11, n=3)
    spec = SPECS["self_sparse_fixed"]

    def collect(order, into, items, states=None):
        for item in items:
            if isinstance(item, TokenDelta):
                if states is not None and item.sampler_state:
                    states[item.index] = item.sampler_state
                for cut in order.accept(item):
                    tokens, text = into.setdefault(cut.index, ([], []))
                    tokens.extend(cut.token_ids)
                    text.append(cut.text)

    solo, want = make_worker(llama_dir, "solo", **spec), {}
    order = OutputOrder()
    collect(order, want, solo.add_local("r", prompt, params))
    while solo.has_work():
        collect(order, want, solo.step())
    a, b = make_worker(llama_dir, "dec-a", **spec), make_worker(llama_dir, "dec-b", **spec)
    got, states, order = {}, {}, OutputOrder()
    collect(order, got, a.add_local("r", prompt, params), states)
    for _ in range(4):
        collect(order, got, a.step(), states)
    assert sorted(states) == [0, 1, 2] and all(0 < len(got[i][0]) < 40 for i in range(3))
    sequences = [ResumedSequence(i, *order.emitted(i), states[i]) for i in range(3)]  # "a" dies here
    with pytest.raises(InvalidRequestError, match="sequences"):
        b.add_resume(ResumeRequest("r", tuple(prompt), params, [sequences[0], sequences[0]]))
    assert b.add_resume(ResumeRequest("r", tuple(prompt), params, sequences))
    while b.has_work():
        collect(order, got, b.step())
    assert {i: (t, "".join(x)) for i, (t, x) in got.items()} == {i: (t, "".join(x)) for i, (t, x) in want.items()}
    assert len({tuple(t) for t, _ in got.values()}) == 3  # three different streams
    assert b.pool.num_free == b.pool.num_blocks and not b.requests
