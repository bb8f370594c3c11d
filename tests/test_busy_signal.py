"""controller/busy_signal.py: a decode worker's busy flag read by a prefill worker in another process, the
prefill worker's threads following it, and a served cluster whose prefill yields threads to a busy decode
instance giving the reference engine's tokens."""

from __future__ import annotations

import concurrent.futures
import multiprocessing as mp
import os

import pytest
import torch

from controller.busy_signal import BusySignal, ThreadsBesideBusy, signal_path
from controller.config import ConfigError, parse_config
from modeling.engine import EngineConfig, ReferenceEngine
from modeling.sampling import SamplingParams
from tests.serving import e2e_config, prompts_of, running_server, stream_ids


def _writer(path: str, busy: bool, done) -> None:
    BusySignal(path).set(busy)
    done.set()


def test_a_flag_set_in_another_process_is_read_here(tmp_path):
    path = str(tmp_path / "flag")
    reader = BusySignal(path)
    assert not reader.busy  # created zeroed
    ctx = mp.get_context("spawn")
    for busy in (True, False, True):
        done = ctx.Event()
        proc = ctx.Process(target=_writer, args=(path, busy, done))
        proc.start()
        assert done.wait(60)
        proc.join(30)
        assert reader.busy is busy
    reader.close(unlink=True)
    assert not os.path.exists(path)
    assert signal_path("a/b", "decode-0") != signal_path("a/c", "decode-0")
    assert "/" not in os.path.basename(signal_path("../x", "decode 0"))


def test_prefill_threads_follow_the_flag_and_switch_only_on_change(tmp_path):
    before = torch.get_num_threads()
    signals = [BusySignal(str(tmp_path / f"d{i}")) for i in range(2)]
    try:
        threads = ThreadsBesideBusy(2, 1, signals)
        assert threads.apply() == 2 and threads.switches == 0
        signals[1].set(True)  # any busy decode instance
        assert threads.apply() == 1 and torch.get_num_threads() == 1
        assert threads.apply() == 1 and threads.switches == 1
        signals[1].set(False)
        assert threads.apply() == 2 and torch.get_num_threads() == 2 and threads.switches == 2
        with pytest.raises(ValueError, match="threads_when_decode_busy"):
            ThreadsBesideBusy(2, 3, signals)
    finally:
        torch.set_num_threads(before)
        for s in signals:
            s.close()


def test_the_config_field_is_validated():
    base = {"model": {"path": "."}}
    assert parse_config({**base, "prefill": {"threads": 2, "threads_when_decode_busy": 1}}).prefill.threads_when_decode_busy == 1
    with pytest.raises(ConfigError, match="threads_when_decode_busy"):
        parse_config({**base, "prefill": {"threads": 2, "threads_when_decode_busy": 3}})
    with pytest.raises(ConfigError, match="threads_when_decode_busy"):
        parse_config({**base, "prefill": {"threads": 2, "threads_when_decode_busy": -1}})


def test_a_served_prefill_yields_threads_to_busy_decode_and_tokens_are_unchanged(llama_dir):
    """2-thread prefill, 1 thread while decode decodes: long prompts prefilled while other requests decode
    switch the prefill worker's threads (read from the actor's status), greedy tokens equal the reference
    engine's, and the flag files are gone after shutdown."""
    import glob

    import ray

    from controller.busy_signal import SHM_DIR

    cfg = e2e_config(
        llama_dir,
        prefill={"threads": 2, "threads_when_decode_busy": 1, "kv_cache_tokens": 8192, "attention_backend": "torch",
                 "chunk_tokens": 32},
        decode={"kv_cache_tokens": 8192, "attention_backend": "torch",
                "speculation": {"k_policy": "fixed", "k": 2, "budget": 32, "sink_tokens": 4}},
        kv_transfer={"timeout_s": 10},
    )
    prompts = prompts_of([16, 500, 24, 480, 450, 20], seed=3)
    reference = ReferenceEngine(llama_dir, EngineConfig(kv_cache_tokens=16384, attention_backend="torch"))
    expected = [c.token_ids for c in reference.generate(prompts, SamplingParams(max_tokens=60, ignore_eos=True))]
    pattern = os.path.join(SHM_DIR if os.path.isdir(SHM_DIR) else "/tmp", "magicserve-busy-*")
    before = set(glob.glob(pattern))
    with running_server(cfg) as address:
        assert len(set(glob.glob(pattern)) - before) == 1  # one decode instance, one flag
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: stream_ids(address, p, max_tokens=60, ignore_eos=True), prompts))
        status = ray.get(ray.get_actor("magicserve-prefill-0", namespace=cfg.ray.namespace).status.remote())
    assert [ids for ids, _ in results] == expected
    assert status["thread_switches"] >= 1
    assert set(glob.glob(pattern)) - before == set()
