"""Shared fixtures: tiny random HF checkpoints built on the fly (no downloads), thread pinning."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

# The KV tiers' disk directories of every instance the tests start (workers inherit the environment), away from
# the user's cache directory, and removed when the test process exits (a run writes megabytes of KV blocks there).
if "MAGICSERVE_KV_DIR" not in os.environ:
    os.environ["MAGICSERVE_KV_DIR"] = tempfile.mkdtemp(prefix="magicserve-kv-tests-")
    atexit.register(shutil.rmtree, os.environ["MAGICSERVE_KV_DIR"], True)
# Tests use tiny tensors: one thread avoids OpenMP oversubscription on small CI machines.
torch.set_num_threads(1)
# Without CUDA, Triton kernels run in Triton's CPU interpreter (read when Triton is first imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


from tests.checkpoints import TINY_CONFIGS, build_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """Factory: name in TINY_CONFIGS -> directory of a saved tiny HF checkpoint (with tokenizer)."""
    cache: dict[str, str] = {}

    def make(name: str) -> str:
        if name not in cache:
            cache[name] = build_checkpoint(name, str(tmp_path_factory.mktemp(name)))
        return cache[name]

    return make


@pytest.fixture(scope="session")
def llama_dir(checkpoint_dir):
    return checkpoint_dir("llama_gqa")


def pytest_report_header(config):
    return f"torch {torch.__version__}, threads {torch.get_num_threads()}, cuda {torch.cuda.is_available()}, cpus {os.cpu_count()}"


@pytest.fixture(scope="module")
def reference(llama_dir):
    """The single-process reference engine over the tiny llama checkpoint (the oracle of e2e tests)."""
    from modeling.engine import EngineConfig, ReferenceEngine

    return ReferenceEngine(llama_dir, EngineConfig(kv_cache_tokens=16384, attention_backend="torch"))
