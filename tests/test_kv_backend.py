"""``kv_transfer.backend``: which data path a KV pair uses (``kv_transfer.channel.data_backend``), and the
config's refusal of a backend its pools cannot use. The paths themselves are exercised by every transfer test
(gloo on CPU) and on a GPU by ``tests/test_gpu.py`` (NCCL; gloo staged through host memory)."""

from __future__ import annotations

import pytest

from controller.config import ConfigError, parse_config
from kv_transfer.channel import TransferConfig, data_backend
from kv_transfer.errors import TransferError


@pytest.mark.parametrize("devices,expected", [(("cuda", "cuda"), "nccl"), (("cuda", "cpu"), "gloo"),
                                              (("cpu", "cuda"), "gloo"), (("cpu", "cpu"), "gloo")])
def test_auto_uses_nccl_only_between_two_cuda_caches(devices, expected):
    assert data_backend("auto", "auto", *devices) == expected


def test_gloo_on_either_end_carries_cuda_caches_through_host_memory():
    assert data_backend("gloo", "auto", "cuda", "cuda") == "gloo"
    assert data_backend("auto", "gloo", "cuda", "cuda") == "gloo"


def test_nccl_needs_cuda_on_both_ends_and_ends_must_agree():
    assert data_backend("nccl", "auto", "cuda", "cuda") == "nccl"
    for args in (("nccl", "auto", "cuda", "cpu"), ("auto", "nccl", "cpu", "cpu"), ("nccl", "gloo", "cuda", "cuda")):
        with pytest.raises(TransferError, match="kv_transfer.backend") as info:
            data_backend(*args)
        assert not info.value.retryable  # a placement or config mistake: retrying cannot help


def test_config_refuses_nccl_for_cpu_pools_and_unknown_backends():
    with pytest.raises(ConfigError, match="kv_transfer.backend: nccl needs both pools on GPUs"):
        parse_config({"model": {"path": "m"}, "kv_transfer": {"backend": "nccl"}})
    with pytest.raises(ConfigError, match="kv_transfer.backend: must be one of auto, gloo, nccl, got 'rdma'"):
        parse_config({"model": {"path": "m"}, "kv_transfer": {"backend": "rdma"}})
    gpu = {"devices_per_instance": 1}
    cfg = parse_config({"model": {"path": "m"}, "prefill": gpu, "decode": gpu, "kv_transfer": {"backend": "nccl"}})
    assert cfg.kv_transfer.backend == "nccl" and cfg.prefill.transfer == cfg.kv_transfer
    assert (cfg.prefill.device, cfg.decode.device) == ("cuda", "cuda")
    with pytest.raises(ValueError, match="backend: must be one of"):
        TransferConfig(backend="tcp")
