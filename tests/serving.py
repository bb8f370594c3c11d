"""Helpers for end-to-end tests: a real server (``serve_forever`` on a local Ray cluster) in a thread,
random prompts, small gRPC client calls, and a stream consumed on a thread."""

from __future__ import annotations

import os
import tempfile
import threading
import time

from controller.config import ClusterConfig, parse_config
from frontend.client import Client
from frontend.server import serve_in_thread
from tests.checkpoints import VOCAB


def prompts_of(lengths, seed):
    """Random token-id prompts of the given lengths (reproducible by seed)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


def e2e_config(model_dir: str, **sections) -> ClusterConfig:
    """A config for end-to-end tests: float32 model, local Ray, any free port, small limits (8 running,
    4 queued), KV tiers in a directory of their own (as a freshly deployed cluster's); ``sections`` replace
    whole top-level sections or set ``mode``."""
    raw = {"model": {"path": model_dir, "dtype": "float32"}, "ray": {"num_cpus": 6, "num_gpus": 0},
           "server": {"port": 0, "http_port": None},
           "kv_tiers": {"disk_dir": tempfile.mkdtemp(prefix="kv-tiers-", dir=os.environ.get("MAGICSERVE_KV_DIR"))},
           "limits": {"max_concurrent_requests": 8, "max_queue_length": 4, "max_tokens": 512, "max_prompt_tokens": 600}}
    return parse_config({**raw, **sections})


def migration_config(model_dir: str, decode_tp: int = 1, **sections) -> ClusterConfig:
    """1 prefill + 2 decode instances (of ``decode_tp`` ranks) with room to migrate between them."""
    return e2e_config(
        model_dir,
        ray={"num_cpus": 6, "num_gpus": 0},
        prefill={"kv_cache_tokens": 4096, "attention_backend": "torch", "token_budget": 128},
        decode={"instances": 2, "tensor_parallel": decode_tp, "kv_cache_tokens": 4096, "attention_backend": "torch",
                "speculation": {"k_policy": "fixed", "k": 3, "budget": 32, "sink_tokens": 4}},
        kv_transfer={"timeout_s": 5},
        **sections,
    )


def running_server(cfg, start_timeout_s: float = 180.0):
    """Serve ``cfg`` (use ``server.port: 0``) on a background thread; yields ``127.0.0.1:PORT``."""
    return serve_in_thread(cfg, start_timeout_s)


def stream_ids(address, prompt, **kw):
    """Stream a completion; returns (all token ids, the final chunk)."""
    with Client(address) as c:
        chunks = list(c.generate_stream(prompt, **kw))
    return [t for ch in chunks for t in ch.token_ids], chunks[-1]


def free_blocks(address):
    with Client(address) as c:
        return {i.name: (i.free_kv_blocks, i.total_kv_blocks) for i in c.status().instances}


def wait_all_alive(address, timeout=120.0) -> bool:
    """Wait until the server reports every instance alive (e.g. a killed actor restarted and rejoined)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        with Client(address) as c:
            if all(i.alive for i in c.status().instances):
                return True
        time.sleep(0.5)
    return False


def wait_all_free(address, timeout=20.0):
    """Wait until every instance's KV blocks are all free; returns {name: (free, total)}."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        blocks = free_blocks(address)
        if all(free == total for free, total in blocks.values()):
            return blocks
        time.sleep(0.2)
    return free_blocks(address)


def assert_all_free(address) -> None:
    """Every instance's KV blocks are free again (nothing leaked)."""
    blocks = wait_all_free(address)
    assert all(free == total for free, total in blocks.values()), blocks


class Stream:
    """A Generate stream consumed on a thread: its token ids as they arrive."""

    def __init__(self, address, prompt, request_id, **kw):
        self.tokens: list[int] = []
        self.final = None
        self.error = None
        self._thread = threading.Thread(target=self._run, args=(address, prompt, request_id, kw), daemon=True)
        self._thread.start()

    def _run(self, address, prompt, request_id, kw):
        try:
            with Client(address) as c:
                for chunk in c.generate_stream(prompt, request_id=request_id, **kw):
                    self.tokens.extend(chunk.token_ids)
                    if chunk.final:
                        self.final = chunk
        except Exception as err:  # noqa: BLE001 - reported by the test
            self.error = err

    def wait_tokens(self, n, timeout=60.0):
        deadline = time.time() + timeout
        while len(self.tokens) < n and self.final is None and time.time() < deadline:
            time.sleep(0.01)
        assert len(self.tokens) >= n, f"only {len(self.tokens)} tokens after {timeout}s"

    def join(self, timeout=120.0):
        self._thread.join(timeout)
        assert self.error is None, self.error
        assert self.final is not None
        return self.tokens
