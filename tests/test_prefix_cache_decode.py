"""Prefix caching on the decode worker: a finished request leaves its prompt and generated tokens' KV cached,
a conversation's next turn is prefilled here from it (``add_prefill``) with the tokens of a cold run, only
final KV is ever cached (never a draft position or a half-computed prompt), and nothing leaks."""

from __future__ import annotations

import pytest

from decode_worker.config import DecodeWorkerConfig, SpeculationConfig
from decode_worker.messages import DecodeRequest
from decode_worker.worker import DecodeWorker
from modeling.engine import EngineConfig, ReferenceEngine
from modeling.sampling import SamplingParams
from tests.test_decode_worker import prompts_of

BS = 16


def cold_reference(directory, prompts, params):
    """Outputs of the colocated engine with caching off: every prompt computed from its first token."""
    engine = ReferenceEngine(directory, EngineConfig(kv_cache_tokens=16384, attention_backend="torch",
                                                     prefix_caching=False))
    return [c.token_ids for c in engine.generate(prompts, params)]


def decode_worker(directory, kv_cache_tokens=16384, prefill_chunk=1024, **spec):
    spec = {"drafter": "self_sparse", "k_policy": "fixed", "k": 3, "budget": 32, "sink_tokens": 4, **spec}
    cfg = DecodeWorkerConfig(dtype="float32", kv_cache_tokens=kv_cache_tokens, attention_backend="torch",
                             profile_on_start=False, prefill_chunk=prefill_chunk,
                             speculation=SpeculationConfig(**spec))
    return DecodeWorker(directory, cfg)


def serve_in_turn(worker, prompts, params) -> list[list[int]]:
    """Admit the prompts one a step (prefilled here), then step until idle; each request's token ids."""
    outs = {}
    for i, p in enumerate(prompts):
        for d in worker.add_local(f"r{i}", p, params):
            outs.setdefault(d.request_id, []).extend(d.token_ids)
        for d in worker.step():
            outs.setdefault(d.request_id, []).extend(d.token_ids)
    drain(worker, outs)
    return [outs[f"r{i}"] for i in range(len(prompts))]


def drain(worker, outs=None):
    """Step until idle; returns {request id: every token id its deltas carried} (a further sequence of
    a request under ``"<id>/<index>"``)."""
    outs = {} if outs is None else outs
    while worker.has_work():
        for d in worker.step():
            outs.setdefault(d.request_id if d.index == 0 else f"{d.request_id}/{d.index}", []).extend(d.token_ids)
    return outs


def assert_idle(worker):
    """Nothing held: every block free (cached ones among them) and no per-request cache state left."""
    assert not worker.has_work()
    assert worker.pool.num_free == worker.pool.num_blocks
    assert worker.pool.num_evictable == worker.pool.num_cached
    assert worker.prefix_cache.num_tracked == 0


@pytest.mark.parametrize("drafter", ["self_sparse", "none"])
def test_next_turn_is_prefilled_from_the_previous_turns_kv(llama_dir, drafter):
    """Turn 2 = turn 1's prompt + its output + a new message: prefilled on the decode worker from the KV turn 1
    left (prompt and generated blocks), with the tokens of a cold run on the reference engine."""
    p1, question = prompts_of([70, 37], seed=3)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    worker = decode_worker(llama_dir, drafter=drafter)
    outs = {"t1": []}
    for d in worker.add_local("t1", p1, params):
        outs["t1"].extend(d.token_ids)
    drain(worker, outs)
    out1 = outs["t1"]
    assert out1 == cold_reference(llama_dir, [p1], params)[0]
    assert_idle(worker)
    # turn 1's last token has no KV: the final positions are its prompt and every output token but the last
    final = len(p1) + len(out1) - 1
    assert worker.pool.num_cached == final // BS

    p2 = p1 + out1 + question
    before = (worker.prefix_cache.stats.queries, worker.prefix_cache.stats.hits)
    assert worker.add_prefill(DecodeRequest("t2", tuple(p2), params))
    assert worker.requests["t2"].seq.num_computed == final // BS * BS  # found cached, marked computed
    out2 = drain(worker)["t2"]
    assert out2 == cold_reference(llama_dir, [p2], params)[0]
    assert worker.prefix_cache.stats.queries - before[0] == len(p2)
    assert worker.prefix_cache.stats.hits - before[1] == final // BS * BS
    assert_idle(worker)


def test_only_verified_positions_are_cached(llama_dir):
    """With speculation, a block is cached only once every position in it holds verified target KV: the
    blocks cached while a request runs never reach past its computed positions."""
    prompt = prompts_of([50], seed=4)[0]
    worker = decode_worker(llama_dir, k=5)
    worker.add_local("a", prompt, SamplingParams(max_tokens=60, ignore_eos=True))
    seq = worker.requests["a"].seq
    while worker.has_work():
        worker.step()
        if worker.has_work():
            cached = [b for b in seq.block_table.blocks if worker.pool.cached_hash(b) is not None]
            assert cached == seq.block_table.blocks[:len(cached)]
            assert len(cached) * BS <= seq.num_computed
    assert worker.metrics.draft_tokens > worker.metrics.accepted_tokens  # drafts were rejected along the way


def test_an_aborted_local_prefill_leaves_no_block_cached(llama_dir):
    """A request aborted halfway through its local prefill caches nothing of what it computed; the cached
    prefix it started from stays cached, and every block is free again."""
    base = prompts_of([64], seed=5)[0]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    worker = decode_worker(llama_dir, prefill_chunk=32)
    worker.add_local("warm", base + [5], params)  # caches the first 4 blocks of base
    drain(worker)
    cached = worker.pool.num_cached
    long = base + prompts_of([200], seed=6)[0]
    assert worker.add_prefill(DecodeRequest("b", tuple(long), params))
    assert worker.requests["b"].seq.num_computed == 64
    worker.step()  # one 32-token chunk of the 200 uncached tokens
    assert worker.requests["b"].seq.num_computed == 96
    assert worker.abort("b")
    assert worker.pool.num_cached == cached
    assert_idle(worker)


def test_preempted_requests_resume_from_their_cached_blocks(llama_dir):
    """A preempted request recomputes only what is no longer cached (here, its blocks were not needed by
    anyone else): outputs unchanged, hits counted."""
    prompts = prompts_of([100, 120, 90, 110], seed=9)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    expected = cold_reference(llama_dir, prompts, params)
    worker = decode_worker(llama_dir, kv_cache_tokens=640)
    assert serve_in_turn(worker, prompts, params) == expected
    assert worker.metrics.preemptions > 0 and worker.prefix_cache.stats.hits > 0
    assert_idle(worker)


def test_several_sequences_and_no_room(llama_dir):
    """n = 2 prefilled here: both sequences start from the cached prefix (greedy: the same tokens); a
    request with no room is refused without holding a block."""
    base = prompts_of([80], seed=7)[0]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    worker = decode_worker(llama_dir, kv_cache_tokens=320)
    worker.add_local("warm", base, params)
    drain(worker)
    prompt = base + [9, 10, 11]
    assert worker.add_prefill(DecodeRequest("two", tuple(prompt), SamplingParams(max_tokens=12, n=2, ignore_eos=True)))
    outs = drain(worker)
    expected = cold_reference(llama_dir, [prompt], params)[0]
    assert outs["two"] == outs["two/1"] == expected
    assert_idle(worker)
    assert not worker.add_prefill(DecodeRequest("big", tuple(prompts_of([400], seed=8)[0]), params))
    assert "big" not in worker.requests
    assert_idle(worker)


def test_preempted_requests_whose_blocks_were_evicted_resume_from_the_tiers(llama_dir, tmp_path):
    """Under memory pressure a preempted request's KV goes down to the host tier as it is cached (write-through),
    so when the pool has given its blocks to others it resumes from the tier instead of recomputing: outputs
    unchanged, tier hits counted."""
    import dataclasses

    from modeling.instance_config import KVTiersConfig

    prompts = prompts_of([100, 120, 90, 110], seed=19)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    expected = cold_reference(llama_dir, prompts, params)
    base = decode_worker(llama_dir, kv_cache_tokens=640).config
    worker = DecodeWorker(llama_dir, dataclasses.replace(base, kv_tiers=KVTiersConfig(host_memory_mb=16, disk_mb=0)))
    try:
        assert serve_in_turn(worker, prompts, params) == expected
        assert worker.metrics.preemptions > 0 and worker.prefix_cache.stats.tier_hits > 0
        assert_idle(worker)
    finally:
        worker.close()


DISK_READ_DELAY_S = 0.03  # per block: a disk slower than this VM's page cache, so the load visibly runs beside


def _history_on_disk(llama_dir, tmp_path, params, in_memory: bool = False):
    """A decode worker over a slow disk tier (``in_memory``: a host tier instead) that served a 320-token turn and
    then lost it from its pool (every free block allocated once): (the worker, the next turn's prompt, the
    history's full blocks)."""
    import dataclasses
    import time

    from modeling.instance_config import KVTiersConfig

    base = decode_worker(llama_dir, kv_cache_tokens=1024).config
    tiers = KVTiersConfig(host_memory_mb=16 if in_memory else 0, disk_dir=str(tmp_path),
                          disk_mb=0 if in_memory else 16)
    worker = DecodeWorker(llama_dir, dataclasses.replace(base, kv_tiers=tiers))
    first, question = prompts_of([320, 12], seed=23)
    out = [t for d in worker.add_local("turn-1", first, params) for t in d.token_ids] + drain(worker)["turn-1"]
    worker.pool.free(worker.pool.allocate(worker.pool.num_free))  # the pool's cached blocks evicted
    if in_memory:
        return worker, first + out + question, (len(first) + len(out) - 1) // BS
    disk = worker.prefix_cache.tiers.disk
    worker.prefix_cache.tiers.flush()
    read = disk.read
    disk.read = lambda block_hash, n: (time.sleep(DISK_READ_DELAY_S), read(block_hash, n))[1]
    return worker, first + out + question, (len(first) + len(out) - 1) // BS


def test_a_turn_prefilled_here_loads_its_history_beside_the_decoding_batch(llama_dir, tmp_path):
    """The next turn of a conversation whose history only the disk tier holds, prefilled on this decode
    instance: admitted at once, its blocks read on the tiers' thread while the requests decoding keep getting a
    token every step, and its tokens a cold run's."""
    import time

    params = SamplingParams(max_tokens=16, ignore_eos=True)
    worker, second, blocks = _history_on_disk(llama_dir, tmp_path, SamplingParams(max_tokens=24, ignore_eos=True))
    try:
        busy = prompts_of([40, 50], seed=29)
        for i, p in enumerate(busy):  # two requests decode throughout
            worker.add_local(f"busy-{i}", p, SamplingParams(max_tokens=200, ignore_eos=True))
        t0 = time.perf_counter()
        assert worker.add_prefill(DecodeRequest("turn-2", tuple(second), params))
        admit_s = time.perf_counter() - t0
        steps_while_loading = 0
        outs = {}
        while worker.prefix_cache.loading("turn-2"):
            deltas = worker.step()
            steps_while_loading += any(d.request_id.startswith("busy") and d.token_ids for d in deltas)
            for d in deltas:
                outs.setdefault(d.request_id, []).extend(d.token_ids)
        drain(worker, outs)
        disk = worker.prefix_cache.tiers.disk.stats
        assert admit_s < blocks * DISK_READ_DELAY_S / 2, admit_s  # the disk was not read in the admission
        assert steps_while_loading >= 3, steps_while_loading  # the batch decoded while the blocks were read
        assert outs["turn-2"] == cold_reference(llama_dir, [second], params)[0]
        assert disk.hits == disk.read_ahead == blocks  # every block of the history from disk, off the step
        assert_idle(worker)
    finally:
        worker.close()


def test_a_turn_whose_history_fails_its_check_is_failed_for_the_router_to_run_again(llama_dir, tmp_path):
    import os

    from decode_worker.messages import DecodeFailure
    from modeling.kv_tiers.disk import HEADER

    worker, second, _ = _history_on_disk(llama_dir, tmp_path, SamplingParams(max_tokens=24, ignore_eos=True))
    try:
        disk = worker.prefix_cache.tiers.disk
        for name in [n for n in os.listdir(disk.directory) if n.endswith(".kv")]:  # every block: a flipped byte
            with open(os.path.join(disk.directory, name), "r+b") as f:
                f.seek(HEADER.size + 5)
                byte = f.read(1)
                f.seek(HEADER.size + 5)
                f.write(bytes([byte[0] ^ 0xFF]))
        assert worker.add_prefill(DecodeRequest("turn-2", tuple(second), SamplingParams(max_tokens=4)))
        failures = []
        while worker.has_work():
            failures += [d for d in worker.step() if isinstance(d, DecodeFailure)]
        assert [(f.request_id, f.retryable) for f in failures] == [("turn-2", True)] and "corrupt" in failures[0].reason
        assert disk.stats.corrupt >= 1
        assert_idle(worker)
    finally:
        worker.close()


def test_a_turn_whose_history_is_in_host_memory_on_cpu_loads_it_at_once(llama_dir, tmp_path):
    """On CPU a host-tier load is a copy within the same memory, quicker on the worker's thread than handed to the
    tiers' thread: the turn's admission loads its history, and its first chunk need not wait a step for it."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    worker, second, blocks = _history_on_disk(llama_dir, tmp_path, SamplingParams(max_tokens=24, ignore_eos=True),
                                              in_memory=True)
    try:
        assert worker.add_prefill(DecodeRequest("turn-2", tuple(second), params))
        assert not worker.prefix_cache.loading("turn-2")
        assert worker.prefix_cache.tiers.host.stats.hits == blocks  # loaded in the admission
        assert drain(worker)["turn-2"] == cold_reference(llama_dir, [second], params)[0]
        assert_idle(worker)
    finally:
        worker.close()
