"""What every instance of a pool is and runs with, and the one way configs are validated.

The section of the cluster YAML a pool reads (``prefill:``, ``decode:``, ``colocated:``) is the very object
its workers take (``PrefillWorkerConfig``, ``DecodeWorkerConfig``, ``EngineConfig``, all an
:class:`InstanceConfig`): the controller places instances by its placement fields and hands the whole object to
each worker, which reads the rest. Fields marked :func:`set_by` are set by the cluster config from other
sections (``dtype`` from ``model.dtype``, ``device`` from ``devices_per_instance``: :func:`set_by`).

Every config validates itself the same way: ``check()`` lists (field, reason) pairs and construction raises
the first as ``ValueError("field: reason")`` (a config that is always the same sub-section names itself:
``speculation.k``); the YAML loader prefixes the section's path (``decode.speculation.k: must be in [0, 16],
got -1``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

def set_by(section_field: str) -> dict:
    """Dataclass field metadata: a field the cluster config sets from ``section_field``, refused in YAML."""
    return {"yaml": False, "set_by": section_field}
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "flash", "triton")
DEVICES = ("cpu", "cuda")

Problems = list[tuple[str, str]]


def raise_first(problems: Problems) -> None:
    """Raise the first (field, reason) as ``ValueError("field: reason")``."""
    if problems:
        name, reason = problems[0]
        raise ValueError(f"{name}: {reason}")


def integers(obj, names: tuple[str, ...], low: int = 1, high: int | None = None) -> Problems:
    """(field, reason) for each of ``names`` that is not an integer in [low, high]."""
    out = []
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int):
            out.append((name, f"must be an integer, got {value!r}"))
        elif value < low or (high is not None and value > high):
            out.append((name, f"must be {f'>= {low}' if high is None else f'in [{low}, {high}]'}, got {value}"))
    return out


def booleans(obj, names: tuple[str, ...]) -> Problems:
    """(field, reason) for each of ``names`` that is not true or false."""
    return [(name, f"must be true or false, got {getattr(obj, name)!r}") for name in names
            if not isinstance(getattr(obj, name), bool)]


def booleans_or_auto(obj, names: tuple[str, ...]) -> Problems:
    """(field, reason) for each of ``names`` that is not true, false or ``auto``."""
    return [(name, f"must be true, false or auto, got {getattr(obj, name)!r}") for name in names
            if not (isinstance(getattr(obj, name), bool) or getattr(obj, name) == "auto")]


def positive(obj, names: tuple[str, ...]) -> Problems:
    """(field, reason) for each of ``names`` that is not a number > 0."""
    out = []
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            out.append((name, f"must be a number > 0, got {value!r}"))
        elif not value > 0:
            out.append((name, f"must be > 0, got {value}"))
    return out


def one_of(name: str, value, allowed: tuple[str, ...]) -> Problems:
    return [] if value in allowed else [(name, f"must be one of {', '.join(allowed)}, got {value!r}")]


# where the disk tier lives when ``disk_dir`` is empty: $MAGICSERVE_KV_DIR, else the user's cache directory
DISK_DIR_ENV = "MAGICSERVE_KV_DIR"


STORE_BACKENDS = ("none", "mooncake")


@dataclass(frozen=True)
class KVStoreConfig:
    """``kv_tiers.store``: a cluster-wide KV store below every instance's own tiers, where any instance finds
    blocks another computed. ``backend``: ``none`` or ``mooncake`` (Mooncake Store: the
    ``mooncake-transfer-engine`` package and ``libibverbs1``). ``master_address``: ``host:port`` of its master;
    empty: ``magicserve serve`` starts a master, and a segment server holding ``segment_mb`` of the store on the
    head node and on every other node an instance is placed on. ``protocol``: ``tcp`` or ``rdma`` (on
    ``rdma_devices``, empty: found automatically); ``local_buffer_mb``: each instance's transfer buffer;
    ``retry_s``: after a failed call the instances compute instead for this long before trying the store
    again. ``replicas``: copies of each block the store keeps, each in another segment (so on another node);
    a block survives the loss of ``replicas - 1`` nodes (fewer segments than that: one copy in each)."""

    backend: str = "none"
    master_address: str = ""
    segment_mb: int = 4096
    protocol: str = "tcp"
    rdma_devices: str = ""
    local_buffer_mb: int = 64
    retry_s: float = 5.0
    replicas: int = 1

    def __post_init__(self) -> None:
        raise_first(self.check())

    def check(self) -> Problems:
        errs = one_of("backend", self.backend, STORE_BACKENDS) + one_of("protocol", self.protocol, ("tcp", "rdma"))
        errs += integers(self, ("segment_mb", "local_buffer_mb", "replicas")) + positive(self, ("retry_s",))
        if self.master_address and not re.fullmatch(r"[\w.\-]+:\d{1,5}", self.master_address):
            errs.append(("master_address", f"must be host:port, got {self.master_address!r}"))
        return [(f"store.{name}", why) for name, why in errs]

    @property
    def enabled(self) -> bool:
        return self.backend != "none"


@dataclass(frozen=True)
class KVTiersConfig:
    """Per instance: ``host_memory_mb`` of host memory (0: no host tier) and ``disk_mb`` of files under
    ``disk_dir`` (0: no disk tier; empty dir: ``$MAGICSERVE_KV_DIR`` or ``~/.cache/magicserve/kv``), each an
    LRU cache of full KV blocks; below them the cluster-wide ``store`` (:class:`KVStoreConfig`).
    ``write_queue_blocks``: blocks waiting for the writer at most (a block cached while the queue is full is not
    written to disk or the store, and counted); ``read_ahead_mb``: host memory for blocks read from the disk
    tier or the store while their prompt waits (``modeling/kv_tiers/read_ahead.py``; 0: loads read them when
    the prompt is scheduled); ``layered_loads``: a prefill instance writes what it loads into the cache layer by
    layer beside the pass that reads it (``modeling/kv_tiers/layer_load.py``; False: all of it before the pass;
    ``auto``: layer by layer where the cache is on a GPU, whose copy engine runs beside the pass, at once on CPU,
    where the copy would take the cores the pass runs on: ``benchmarks/results/tier_load_overlap.md``)."""

    enabled: bool = True
    host_memory_mb: int = 256
    disk_dir: str = ""
    disk_mb: int = 2048
    write_queue_blocks: int = 4096
    read_ahead_mb: int = 256
    layered_loads: bool | str = "auto"
    store: KVStoreConfig = field(default_factory=KVStoreConfig)

    def __post_init__(self) -> None:
        raise_first(self.check())

    def check(self) -> Problems:
        errs = booleans(self, ("enabled",)) + booleans_or_auto(self, ("layered_loads",))
        errs += integers(self, ("host_memory_mb", "disk_mb", "read_ahead_mb"), low=0)
        errs += integers(self, ("write_queue_blocks",), low=1)
        if not isinstance(self.disk_dir, str):
            errs.append(("disk_dir", f"must be a directory path (a string), got {self.disk_dir!r}"))
        return errs

    @property
    def active(self) -> bool:
        """Enabled with at least one tier: of non-zero size, or the store."""
        return self.enabled and (self.host_memory_mb > 0 or self.disk_mb > 0 or self.store.enabled)

    def loads_layer_by_layer(self, device: str) -> bool:
        """Whether an instance whose cache is on ``device`` (``cpu``, ``cuda``, ``cuda:1``) loads layer by layer."""
        if self.layered_loads == "auto":
            return device.startswith("cuda")
        return self.layered_loads is True

    def resolved_disk_dir(self) -> str:
        """The disk tier's root directory on this node."""
        if self.disk_dir:
            return os.path.abspath(os.path.expanduser(self.disk_dir))
        env = os.environ.get(DISK_DIR_ENV)
        if env:
            return os.path.abspath(os.path.expanduser(env))
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "magicserve", "kv")


TIERS_OFF = KVTiersConfig(enabled=False)


@dataclass(frozen=True)
class InstanceConfig:
    """Placement (``instances`` of ``tensor_parallel`` ranks, each rank with its share of
    ``devices_per_instance`` GPUs of ``accelerator_type`` and ``cpus_per_instance`` CPUs, ``threads`` torch
    threads) and what every worker of the pool shares: the KV cache (``kv_cache_tokens`` positions in blocks of
    ``block_size``), the attention kernels, and how long a tensor-parallel rank may wait in one collective."""

    instances: int = 1
    tensor_parallel: int = 1
    devices_per_instance: int = 0  # GPUs per instance; 0 = CPU
    cpus_per_instance: float = 1.0
    threads: int = 1  # torch threads per worker (keep workers from oversubscribing cores)
    # the GPU type every instance of the pool runs on, as Ray names it (the ``accelerator_type:<name>`` resource
    # Ray sets on nodes with that GPU, e.g. H100, A100-80G, L40S); empty: any GPU
    accelerator_type: str = ""
    # tensor parallel: the longest a rank waits in one all-reduce, and the longest a rank may go without
    # answering the controller's health check; a hung rank fails and restarts its instance after this long
    collective_timeout_s: float = 60.0
    kv_cache_tokens: int = 65536
    block_size: int = 16
    attention_backend: str = "auto"
    dtype: str = field(default="float32", metadata=set_by("model.dtype"))
    device: str = field(default="cpu", metadata=set_by("devices_per_instance (cuda when > 0)"))
    kv_tiers: KVTiersConfig = field(default=TIERS_OFF, metadata=set_by("kv_tiers"))

    def __post_init__(self) -> None:
        raise_first(self.check())

    def check(self) -> Problems:
        errs = integers(self, ("instances", "tensor_parallel", "threads", "kv_cache_tokens", "block_size"))
        errs += integers(self, ("devices_per_instance",), low=0)
        errs += positive(self, ("cpus_per_instance", "collective_timeout_s"))
        if errs:
            return errs
        if self.devices_per_instance % self.tensor_parallel:
            errs.append(("devices_per_instance", f"must be a multiple of tensor_parallel ({self.tensor_parallel})"))
        errs += one_of("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if self.kv_cache_tokens < self.block_size:
            errs.append(("kv_cache_tokens", f"must be >= block_size ({self.block_size}), got {self.kv_cache_tokens}"))
        if self.accelerator_type and not re.fullmatch(r"[\w.\-]+", self.accelerator_type):
            errs.append(("accelerator_type", f"must be a Ray accelerator type name (letters, digits, '.', '-', '_'), "
                                             f"got {self.accelerator_type!r}"))
        if self.accelerator_type and not self.devices_per_instance:
            errs.append(("accelerator_type", "needs devices_per_instance > 0 (a GPU pool)"))
        if self.device.split(":")[0] not in DEVICES:
            errs.append(("device", f"must be cpu, cuda or cuda:<index>, got {self.device!r}"))
        return errs


def compile_steps_problems(cfg) -> Problems:
    """``compile_steps`` of a pool (small steps compiled: decode, verification and draft steps, prefill chunks of
    at most 16 tokens per sequence): a boolean, on the attention backend whose kernels compile on the pool's
    device."""
    errs = booleans(cfg, ("compile_steps",))
    gpu = cfg.devices_per_instance > 0 or str(cfg.device).startswith("cuda")
    allowed = ("auto", "triton") if gpu else ("auto", "cpu")
    if cfg.compile_steps is True and cfg.attention_backend not in allowed:
        errs.append(("compile_steps", "runs with the triton attention backend on GPUs and the cpu backend on CPU "
                                      f"(attention_backend {' or '.join(allowed)}), got {cfg.attention_backend!r}"))
    return errs
