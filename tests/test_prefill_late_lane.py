"""The prefill instance's late lane (``PrefillRequest.late``, the router's load-aware decision for a prompt past its
TTFT SLO wherever it goes): a late prompt gets a step only when no prompt that is not late, running or waiting, has
a chunk to run (a step's time grows with its tokens), and never takes blocks a prompt that is not late waits for. The scheduler on plain sequences;
the worker against the reference engine."""

from __future__ import annotations

from modeling.block_pool import BlockPool
from modeling.engine import EngineConfig, ReferenceEngine
from modeling.sampling import SamplingParams
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.messages import PrefillRequest
from prefill_worker.scheduler import PrefillScheduler
from prefill_worker.worker import PrefillWorker
from tests.test_decode_worker import prompts_of
from tests.test_prefill_ahead_worker import _run, _seq


def test_a_late_prompt_gets_the_steps_no_other_prompt_needs():
    pool = BlockPool(64, 4)
    sched = PrefillScheduler(PrefillWorkerConfig(token_budget=8, max_num_seqs=8), pool)
    sched.add(_seq("late", 20), late=True)
    assert _run(sched) == [("late", 8)]  # nothing else to compute: the whole budget
    sched.add(_seq("a", 6, first=100))
    sched.add(_seq("b", 12, first=200))
    assert sched.queued_tokens() == 30 and sched.queued_tokens(late=False) == 18
    # the late prompt runs already, yet the waiting prompts that are not late come first
    assert _run(sched) == [("a", 6), ("b", 2)]
    assert _run(sched) == [("b", 8)]
    assert _run(sched) == [("b", 2)]  # budget left, but a late chunk would lengthen b's step
    assert _run(sched) == [("late", 8)]
    assert _run(sched) == [("late", 4)] and not sched.running and set(sched.handed_off) == {"a", "b", "late"}
    sched.release("late")  # its transfer acknowledged
    assert not sched.late


def test_a_late_prompt_is_not_admitted_while_one_that_is_not_waits_for_blocks():
    pool = BlockPool(6, 4)  # 24 tokens of KV
    sched = PrefillScheduler(PrefillWorkerConfig(token_budget=12, max_num_seqs=8), pool)
    sched.add(_seq("first", 16))  # 4 blocks
    assert _run(sched) == [("first", 12)]
    sched.add(_seq("big", 12, first=100))  # 3 blocks: 2 are free
    sched.add(_seq("small_late", 4, first=200), late=True)  # 1 block: it would fit, and budget is left
    assert _run(sched) == [("first", 4)] and [s.request_id for s in sched.waiting] == ["big", "small_late"]
    assert _run(sched) == [] and pool.num_free == 2  # first's KV in transfer: big waits, and small_late behind it
    sched.release("first")  # its transfer acknowledged
    assert _run(sched) == [("big", 12)]
    assert _run(sched) == [("small_late", 4)]  # blocks were free for it all along


def test_late_prompts_give_the_reference_tokens(llama_dir):
    """A late prompt queued first and one that is not: the one not late is sampled first, and both sample the
    reference engine's first token."""
    late, on_time = prompts_of([300, 200], seed=3)
    params = SamplingParams(max_tokens=1)
    ref = ReferenceEngine(llama_dir, EngineConfig(block_size=4, attention_backend="torch")).generate(
        [late, on_time], [params, params])
    worker = PrefillWorker(llama_dir, PrefillWorkerConfig(block_size=4, kv_cache_tokens=1024, token_budget=128,
                                                          attention_backend="torch"))
    worker.add_request(PrefillRequest("late", tuple(late), params, None, late=True))
    worker.add_request(PrefillRequest("on_time", tuple(on_time), params, None))
    firsts = []
    while worker.has_work():
        firsts += worker.step().first_tokens
    assert [(ft.request_id, ft.token_id) for ft in firsts] == [("late", ref[0].token_ids[0]),
                                                                ("on_time", ref[1].token_ids[0])][::-1]
    assert worker.pool.num_free == worker.pool.num_blocks
