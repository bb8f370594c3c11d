"""The cluster configuration: one frozen, typed tree loaded from YAML.

Every component receives only its sub-config, and the pool sections are the workers' own configs
(``prefill``: ``PrefillWorkerConfig``, ``decode``: ``DecodeWorkerConfig``, ``colocated``: ``EngineConfig``,
``kv_transfer``: ``TransferConfig``): no layer translates them. Each config checks itself
(``modeling/instance_config.py``); loading fails on the first problem with the field path and the reason, e.g.
``decode.speculation.k: must be in [0, 16], got -1`` or ``prefill.instnaces: unknown field; allowed:
instances, ...``. The schema is documented field by field
in ``docs/configuration.md``; ``cluster_configs/local.yaml`` is the embedded default.

``mode`` picks the serving system: ``disaggregated`` (prefill and decode pools, KV transfer, speculative
decoding) or ``colocated`` (the ``colocated`` pool: instances of the single-process reference engine, the
baseline the disaggregated system is compared against; the prefill, decode and kv_transfer sections are
then unused).
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field

import yaml

from controller.kv_index import PrefixRouting
from controller.load_aware import LoadAwarePolicy
from controller.migration_policy import PolicyConfig
from decode_worker.config import DecodeWorkerConfig
from kv_transfer.channel import TransferConfig
from modeling.dtype_choice import AUTO, DtypeChoice, choose_dtype
from modeling.dtypes import DTYPES
from modeling.engine import EngineConfig
from modeling.instance_config import (InstanceConfig, KVTiersConfig, Problems, booleans, booleans_or_auto, integers,
                                      raise_first)
from prefill_worker.config import PrefillWorkerConfig

MODES = ("disaggregated", "colocated")
TOOL_PARSERS = ("hermes", "llama3_json")  # server.tool_call_parser: the parsers of frontend/tool_calls.py

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cluster_configs")
LOCAL_CONFIG = os.path.join(CONFIG_DIR, "local.yaml")


class ConfigError(ValueError):
    """An invalid cluster config; the message starts with the field path."""


@dataclass(frozen=True)
class ModelSection:
    path: str = ""  # local HF checkpoint dir; relative paths resolve against the config file's directory
    # auto: bf16 where the hardware computes it natively, float32 elsewhere on CPU (modeling/dtype_choice.py)
    dtype: str = AUTO

    def __post_init__(self) -> None:
        raise_first(self.check())

    def check(self) -> Problems:
        errs = []
        if not self.path:
            errs.append(("path", "required (a local Hugging Face checkpoint directory)"))
        if self.dtype != AUTO and self.dtype not in DTYPES:
            errs.append(("dtype", f"must be one of {AUTO}, {', '.join(DTYPES)}, got {self.dtype!r}"))
        return errs


@dataclass(frozen=True)
class RaySection:
    address: str = ""  # "" = start a local Ray; "auto" / "host:port" = existing cluster; "ray://host:10001" = client
    num_cpus: int | None = None  # local Ray only
    num_gpus: int | None = None  # local Ray only: logical GPUs to declare (placement tests on CPU)
    # local Ray only: custom logical resources to declare, e.g. {"accelerator_type:H100": 1} (placement tests)
    resources: dict[str, float] = field(default_factory=dict)
    namespace: str = "magicserve"

    def __post_init__(self) -> None:
        raise_first(self.check())

    def check(self) -> Problems:
        errs = []
        for name in ("num_cpus", "num_gpus"):
            v = getattr(self, name)
            if v is not None and v < 0:
                errs.append((name, f"must be >= 0, got {v}"))
        for name, amount in self.resources.items():
            if not name or name in ("CPU", "GPU", "memory", "object_store_memory") or amount < 0:
                errs.append((f"resources.{name}", f"must be a custom resource name with an amount >= 0, got {amount!r}"))
        if self.address and not re.fullmatch(r"auto|(ray://)?[\w.\-]+:\d+", self.address):
            errs.append(("address", f"must be empty, 'auto', 'host:port' or 'ray://host:port', got {self.address!r}"))
        return errs


@dataclass(frozen=True)
class SLOSection:
    ttft_ms: float = 2000.0
    tpot_ms: float = 200.0
    attainment: float = 0.9

    def __post_init__(self) -> None:
        raise_first(self.check())

    def check(self) -> Problems:
        errs = [(n, f"must be > 0, got {getattr(self, n)}") for n in ("ttft_ms", "tpot_ms") if getattr(self, n) <= 0]
        if not 0 < self.attainment <= 1:
            errs.append(("attainment", f"must be in (0, 1], got {self.attainment}"))
        return errs


@dataclass(frozen=True)
class ServerSection:
    host: str = "127.0.0.1"  # localhost unless configured
    port: int = 50051  # gRPC (0: any free port)
    http_port: int | None = 8000  # the OpenAI-compatible HTTP front and /metrics (0: any free port; null: off)
    tls_cert: str = ""  # PEM files; both or neither
    tls_key: str = ""
    auth_token_env: str = ""  # name of an environment variable holding a bearer token ("" = no auth)
    # the operator calls (MigrateRequest, DrainInstance, DrainPassLog) then need this token instead of the
    # clients' ("" = the clients' token, if any, admits them too)
    admin_token_env: str = ""
    max_message_bytes: int = 4 * 1024 * 1024
    # DrainPassLog: hand out (and forget) the workers' timed passes, for measuring the cluster in place
    # (benchmarks/slo_sweep.py). Off by default: a second reader would take records the first expects
    pass_log_rpc: bool = False
    # how chat completions with tool_choice "auto" find tool calls in the model's output: "hermes"
    # (<tool_call>{...}</tool_call> blocks: Qwen, Hermes), "llama3_json" (Llama 3.1 / 3.2), or null (auto refused)
    tool_call_parser: str | None = "hermes"

    def __post_init__(self) -> None:
        raise_first(self.check())

    def check(self) -> Problems:
        errs = []
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            errs.append(("tool_call_parser", f"must be one of {', '.join(TOOL_PARSERS)} or null, got "
                                             f"{self.tool_call_parser!r}"))
        if not 0 <= self.port <= 65535:
            errs.append(("port", f"must be in [0, 65535], got {self.port}"))
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            errs.append(("http_port", f"must be in [0, 65535] or null (no HTTP front), got {self.http_port}"))
        elif self.http_port and self.http_port == self.port:
            errs.append(("http_port", f"must differ from port ({self.port})"))
        if bool(self.tls_cert) != bool(self.tls_key):
            errs.append(("tls_cert", "tls_cert and tls_key must be given together"))
        local = self.host in ("127.0.0.1", "localhost", "::1")
        if not local and not (self.tls_cert and self.auth_token_env):
            errs.append(("host", f"binding {self.host!r} (not localhost) requires tls_cert/tls_key and auth_token_env"))
        if self.max_message_bytes < 1024:
            errs.append(("max_message_bytes", f"must be >= 1024, got {self.max_message_bytes}"))
        return errs

    def token(self) -> str | None:
        """The bearer token both fronts require (read from ``auth_token_env``; None: no auth)."""
        return _token_from("auth_token_env", self.auth_token_env)

    def admin_token(self) -> str | None:
        """The bearer token the operator calls require (read from ``admin_token_env``; None: the clients')."""
        return _token_from("admin_token_env", self.admin_token_env)


def _token_from(field_name: str, env: str) -> str | None:
    if not env:
        return None
    token = os.environ.get(env, "")
    if not token:
        raise ValueError(f"server.{field_name}: environment variable {env} is empty or unset")
    return token


@dataclass(frozen=True)
class LimitsSection:
    max_prompt_tokens: int = 8000
    max_tokens: int = 4096
    max_concurrent_requests: int = 64  # admitted (prefilling, transferring or decoding) at once
    max_queue_length: int = 256  # waiting beyond that; more get RESOURCE_EXHAUSTED
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        raise_first(self.check())

    def check(self) -> Problems:
        errs = integers(self, ("max_prompt_tokens", "max_tokens", "max_concurrent_requests"))
        if self.max_queue_length < 0:
            errs.append(("max_queue_length", f"must be >= 0, got {self.max_queue_length}"))
        if self.request_timeout_s <= 0:
            errs.append(("request_timeout_s", f"must be > 0, got {self.request_timeout_s}"))
        return errs


@dataclass(frozen=True)
class MigrationSection:
    """Live migration of decoding requests between decode instances and the global rescheduling policy
    (``controller/migration_policy.py``). ``enabled``: every ``interval_s`` the router reads the decode
    instances' loads and migrates requests to balance them, de-fragment and keep headroom for high-priority
    requests; off, requests move only when asked (``MigrateRequest``, ``magicserve drain``)."""

    enabled: bool = False
    interval_s: float = 0.5
    timeout_s: float = 60.0  # a migration not committed by then is aborted (the request stays put)
    migrate_out_freeness: float = 8.0
    migrate_in_freeness: float = 32.0
    priority_headroom_blocks: int = 64
    max_migrations_per_round: int = 4
    cooldown_s: float = 30.0

    def __post_init__(self) -> None:
        raise_first(self.check())

    def check(self) -> Problems:
        errs = [(n, f"must be > 0, got {getattr(self, n)}") for n in ("interval_s", "timeout_s")
                if not getattr(self, n) > 0]
        try:
            self.policy()
        except ValueError as err:
            name, _, why = str(err).partition(": ")
            errs.append((name, why))
        return errs

    def policy(self):
        """The policy's thresholds (``PolicyConfig``)."""
        return PolicyConfig(self.migrate_out_freeness, self.migrate_in_freeness, self.priority_headroom_blocks,
                            self.max_migrations_per_round, self.cooldown_s)


@dataclass(frozen=True)
class PrefixCachingSection:
    """Keeping computed KV and routing to it (``controller/kv_index.py``). ``enabled``: every pool keeps full
    KV blocks after their requests end (prompts on prefill instances; prompts and generated tokens on decode
    and colocated instances) and starts each prompt from its longest cached prefix, and the router places
    requests where their prefix is cached. ``overlap_weight``: how much a block the request would have to
    compute weighs against a block already in use on the instance when choosing one (Dynamo's
    ``overlap_score_weight``; 0: load alone). ``tier_load_cost``: what loading a block back from a tier below the
    pool (``kv_tiers``: host memory, disk, the cluster's store) costs as a fraction of computing it, in that
    choice (0: free; 1: as dear as computing). ``local_prefill_tokens``: a request whose decode instance already
    holds all of its prompt (in its pool or its tiers) but at most this many tokens is prefilled there, with no
    prefill instance involved (0: never). ``prefill_ahead``: while a request waits for room on a decode instance,
    an idle prefill instance computes its prompt ahead, so its full blocks are cached there when it is placed;
    ``auto``: where the prefill instances run on GPUs of their own (on CPU the instances share the host's cores, and
    it measured no gain beyond the run-to-run spread: ``benchmarks/results/prefill_ahead.md``)."""

    enabled: bool = True
    overlap_weight: float = 1.0
    local_prefill_tokens: int = 256
    tier_load_cost: float = 0.2
    prefill_ahead: bool | str = "auto"

    def __post_init__(self) -> None:
        raise_first(self.check())

    def check(self) -> Problems:
        errs = booleans(self, ("enabled",)) + integers(self, ("local_prefill_tokens",), low=0)
        errs += booleans_or_auto(self, ("prefill_ahead",))
        w = self.overlap_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0:
            errs.append(("overlap_weight", f"must be a number >= 0, got {w!r}"))
        c = self.tier_load_cost
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 <= c <= 1:
            errs.append(("tier_load_cost", f"must be a number in [0, 1], got {c!r}"))
        return errs

    def routing(self, prefill_on_gpus: bool = False) -> PrefixRouting:
        """What the router reads of it (``prefill_on_gpus``: the prefill instances run on GPUs, for ``auto``)."""
        ahead = prefill_on_gpus if self.prefill_ahead == "auto" else self.prefill_ahead
        return PrefixRouting(self.enabled, float(self.overlap_weight), self.local_prefill_tokens if self.enabled else 0,
                             float(self.tier_load_cost), self.enabled and ahead is True)


@dataclass(frozen=True)
class LoadAwareSection:
    """Load-aware disaggregation (``controller/load_aware.py``): with ``enabled``, a prompt is prefilled on a decode
    instance, beside its decoding batch, when the prefill pool's measured queue would miss the TTFT SLO and that
    instance's TPOT slack computes it sooner. ``slo_margin``: the fraction of each SLO (``slo.ttft_ms``,
    ``slo.tpot_ms``) the decisions aim at, the rest absorbing the predictions' error. Whether or not
    ``enabled``, a decode instance never lets a prompt it prefills push its decoding sequences' time per output
    token past ``slo.tpot_ms`` times ``slo_margin`` (``decode_worker/prefill_budget.py``). ``late_lane``: a prompt
    that misses ``slo.ttft_ms`` itself wherever it goes is computed after the prompts that can still meet it (in
    the late lane of the prefill instance or of a decode instance, whichever is predicted sooner), rather than
    ahead of them in a first-come queue (off: where it is sooner, in turn)."""

    enabled: bool = True
    slo_margin: float = 0.8
    late_lane: bool = True

    def __post_init__(self) -> None:
        raise_first(self.check())

    def check(self) -> Problems:
        errs = booleans(self, ("enabled", "late_lane"))
        m = self.slo_margin
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m <= 1:
            errs.append(("slo_margin", f"must be a number in (0, 1], got {m!r}"))
        return errs

    def policy(self, slo: SLOSection) -> LoadAwarePolicy:
        """What the router reads of it."""
        return LoadAwarePolicy(self.enabled, slo.ttft_ms / 1e3 * self.slo_margin,
                               slo.ttft_ms / 1e3 if self.late_lane else None)


@dataclass(frozen=True)
class PoolBounds:
    """How far a pool may be resized while serving: ``min_instances`` to ``max_instances`` (null: as many as
    Ray can place). Only the prefill pool may go down to 0 (its instances all switched to decoding: the decode
    instances then prefill every prompt themselves); the others keep at least 1."""

    min_instances: int = 1
    max_instances: int | None = None

    def __post_init__(self) -> None:
        raise_first(self.check())

    def check(self) -> Problems:
        errs = integers(self, ("min_instances",), low=0)
        top = self.max_instances
        if not errs and top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < self.min_instances):
            errs.append(("max_instances", f"must be an integer >= min_instances ({self.min_instances}) or null, "
                                          f"got {top!r}"))
        return errs


@dataclass(frozen=True)
class AutoscaleSection:
    """Resizing the pools while serving (``controller/scaling.py``): ``magicserve scale POOL N`` (the
    ``ScalePool`` operator call) adds instances (each placed in a placement group of its own, its KV
    channels formed before it takes requests) or removes them without losing a request (a decode instance
    by live migration of its requests, a prefill instance by finishing what it holds), within each pool's
    bounds. ``placement_timeout_s``: how long a new instance may wait for Ray to place it (an autoscaling
    Ray cluster adds a node meanwhile); ``drain_timeout_s``: how long an instance may take to empty.

    ``enabled`` runs the online planner (``planner/online.py``): every ``interval_s`` it replays
    the requests of the last ``window_s`` seconds (``headroom`` times faster) on the hardware ``profile``
    (``magicserve profile``) for the pool sizes within the bounds and resizes to the smallest that meets
    the ``slo:`` section's targets (each decision within ``decision_time_limit_s``); it grows a pool at once
    and shrinks one by an instance after ``scale_down_after`` decisions in a row asked for fewer, never
    twice within ``cooldown_s``, and leaves alone a pool sized by hand. A window of fewer than
    ``min_window_requests`` requests asks for the smallest shape (the bounds' minimums). With
    ``role_changes_only`` the planner keeps the cluster's instances and devices and only moves instances
    between the prefill and decode pools (a role change) when the shape misses the targets; a window too small
    to plan for leaves the shape as it is."""

    prefill: PoolBounds = field(default_factory=PoolBounds)
    decode: PoolBounds = field(default_factory=PoolBounds)
    colocated: PoolBounds = field(default_factory=PoolBounds)
    placement_timeout_s: float = 120.0
    drain_timeout_s: float = 600.0
    enabled: bool = False
    profile: str = ""
    interval_s: float = 10.0
    window_s: float = 60.0
    headroom: float = 1.2
    cooldown_s: float = 30.0
    scale_down_after: int = 3
    min_window_requests: int = 10
    decision_time_limit_s: float = 5.0
    role_changes_only: bool = False

    def __post_init__(self) -> None:
        raise_first(self.check())

    def check(self) -> Problems:
        errs = [(n, f"must be > 0, got {getattr(self, n)}") for n in (
            "placement_timeout_s", "drain_timeout_s", "interval_s", "window_s", "cooldown_s",
            "decision_time_limit_s") if not getattr(self, n) > 0]
        errs += booleans(self, ("enabled", "role_changes_only"))
        errs += integers(self, ("scale_down_after", "min_window_requests"), low=1)
        if not self.headroom >= 1.0:
            errs.append(("headroom", f"must be >= 1.0 (1.2: plan for 20 % more load than seen), got {self.headroom}"))
        if self.enabled and not self.profile:
            errs.append(("profile", "required when enabled: a hardware profile (magicserve profile --out FILE)"))
        return errs

    def planning_bounds(self, pools) -> dict[str, tuple[int, int]]:
        """Pool -> (min, max) instances for the online planner (every pool it runs must have a max)."""
        out = {}
        for role in pools:
            b = getattr(self, role)
            if b.max_instances is None:
                raise ConfigError(f"autoscale.{role}.max_instances: required when autoscale.enabled (the planner "
                                  "searches up to it)")
            out[role] = (b.min_instances, b.max_instances)  # only the prefill pool may have 0 (validated)
        return out


@dataclass(frozen=True)
class ClusterConfig:
    """The whole tree. ``source`` is the file it came from (relative paths resolve against it)."""

    mode: str = "disaggregated"
    model: ModelSection = field(default_factory=ModelSection)
    ray: RaySection = field(default_factory=RaySection)
    prefill: PrefillWorkerConfig = field(default_factory=PrefillWorkerConfig)
    decode: DecodeWorkerConfig = field(default_factory=DecodeWorkerConfig)
    colocated: EngineConfig = field(default_factory=EngineConfig)
    kv_transfer: TransferConfig = field(default_factory=TransferConfig)
    slo: SLOSection = field(default_factory=SLOSection)
    server: ServerSection = field(default_factory=ServerSection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    migration: MigrationSection = field(default_factory=MigrationSection)
    prefix_caching: PrefixCachingSection = field(default_factory=PrefixCachingSection)
    load_aware: LoadAwareSection = field(default_factory=LoadAwareSection)
    kv_tiers: KVTiersConfig = field(default_factory=KVTiersConfig)
    autoscale: AutoscaleSection = field(default_factory=AutoscaleSection)
    source: str = ""

    def __post_init__(self) -> None:
        raise_first(self.check())
        # the pools' workers run the model's dtype (auto: resolved once for all pools, whose KV must agree) on the
        # devices their placement gives them, and cache KV (with the tiers below) when prefix caching is on; the
        # prefill workers send with the kv_transfer settings
        dtype = self.dtype_choice.dtype
        for role in ("prefill", "decode", "colocated"):
            pool = getattr(self, role)
            object.__setattr__(self, role, dataclasses.replace(
                pool, dtype=dtype, device="cuda" if pool.devices_per_instance else "cpu",
                prefix_caching=self.prefix_caching.enabled, kv_tiers=self.kv_tiers))
        object.__setattr__(self, "prefill", dataclasses.replace(self.prefill, transfer=self.kv_transfer))
        object.__setattr__(self, "decode", dataclasses.replace(
            self.decode, prefill_tpot_slo_ms=self.slo.tpot_ms * self.load_aware.slo_margin))

    def check(self) -> Problems:
        if self.mode not in MODES:
            return [("mode", f"must be one of {', '.join(MODES)}, got {self.mode!r}")]
        if self.autoscale.enabled:
            try:
                self.autoscale.planning_bounds(self.pools)
            except ConfigError as err:
                name, _, why = str(err).partition(": ")
                return [(name, why)]
        if self.autoscale.role_changes_only and self.mode != "disaggregated":
            return [("autoscale.role_changes_only", "moves instances between the prefill and decode pools; a "
                                                    f"{self.mode} cluster has one pool")]
        for role in ("decode", "colocated"):
            if getattr(self.autoscale, role).min_instances < 1:
                return [(f"autoscale.{role}.min_instances", f"must be >= 1 (only the prefill pool may empty), got "
                                                            f"{getattr(self.autoscale, role).min_instances}")]
        for role, pool in self.pools.items():
            bounds = getattr(self.autoscale, role)
            top = bounds.max_instances
            if not bounds.min_instances <= pool.instances <= (top if top is not None else pool.instances):
                return [(f"autoscale.{role}", f"{role}.instances ({pool.instances}) must be within "
                                              f"[{bounds.min_instances}, {top if top is not None else 'any'}]")]
        if self.mode == "disaggregated" and self.kv_transfer.backend == "nccl" and \
                not (self.prefill.devices_per_instance and self.decode.devices_per_instance):
            return [("kv_transfer.backend", "nccl needs both pools on GPUs (prefill and decode "
                                            "devices_per_instance > 0); use auto or gloo")]
        return []

    @property
    def pools(self) -> dict[str, InstanceConfig]:
        """The pools this mode runs, by role: prefill and decode, or colocated."""
        if self.mode == "colocated":
            return {"colocated": self.colocated}
        return {"prefill": self.prefill, "decode": self.decode}

    def describe_pools(self) -> str:
        """E.g. ``1 prefill + 1 decode instance(s)`` or ``2 colocated instance(s)``."""
        return " + ".join(f"{p.instances} {role}" for role, p in self.pools.items()) + " instance(s)"

    @property
    def dtype_choice(self) -> DtypeChoice:
        """``model.dtype`` resolved for the devices the pools run on (``auto``: see modeling/dtype_choice.py)."""
        device = "cuda" if any(p.devices_per_instance for p in self.pools.values()) else "cpu"
        return choose_dtype(self.model.dtype, device)

    @property
    def model_path(self) -> str:
        """The model directory, resolved against the config file's directory."""
        if os.path.isabs(self.model.path) or not self.source:
            return self.model.path
        return os.path.normpath(os.path.join(os.path.dirname(self.source), self.model.path))


    @property
    def autoscale_profile(self) -> str:
        """``autoscale.profile``, resolved against the config file's directory."""
        p = self.autoscale.profile
        if not p or os.path.isabs(p) or not self.source:
            return p
        return os.path.normpath(os.path.join(os.path.dirname(self.source), p))


def load_config(path: str = LOCAL_CONFIG, overrides: dict | None = None) -> ClusterConfig:
    """Read and validate a YAML cluster config (``overrides`` is merged over it, e.g. from the CLI)."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({err})") from None
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at top level")
    if overrides:
        raw = _merge(raw, overrides)
    config = parse_config(raw)
    return dataclasses.replace(config, source=os.path.abspath(path))


def parse_config(raw: dict) -> ClusterConfig:
    """Validate a config mapping (already parsed); raises ConfigError naming the field path."""
    raw = dict(raw)
    raw.pop("source", None)
    return _build(ClusterConfig, raw, "")


def to_dict(config) -> dict:
    """The config as plain data, as YAML holds it (for YAML output, e.g. by the planner)."""
    out = {}
    for f in dataclasses.fields(config):
        if f.name == "source" or not f.metadata.get("yaml", True):
            continue
        value = getattr(config, f.name)
        out[f.name] = to_dict(value) if dataclasses.is_dataclass(value) else value
    return out


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _build(cls, raw, path: str):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "source" and f.metadata.get("yaml", True)}
    for f in dataclasses.fields(cls):
        if f.name in raw and "set_by" in f.metadata:
            raise ConfigError(f"{_join(path, f.name)}: not set here; it follows {f.metadata['set_by']}")
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"{_join(path, unknown[0])}: unknown field; allowed: {', '.join(fields)}")
    hints = typing.get_type_hints(cls)
    values = {name: _convert(hints[name], raw[name], _join(path, name)) for name in raw}
    try:
        return cls(**values)
    except ConfigError:
        raise
    except ValueError as err:  # "field: reason" from the config's own check() (a sub-section may name itself)
        msg, leaf = str(err), path.rsplit(".", 1)[-1]
        if path and msg.startswith(leaf + "."):
            msg = msg[len(leaf) + 1:]
        raise ConfigError(_join(path, msg)) from None


def _convert(hint, value, path: str):
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        if len(args) > 1 and all(a in (bool, int, float, str) for a in args):
            return value  # one of several kinds of scalar: the section's own check() says which values it takes
        return _convert(args[0], value, path)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path)
    if origin is dict:
        key_t, value_t = typing.get_args(hint)
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        return {_convert(key_t, k, f"{path} key {k!r}"): _convert(value_t, v, _join(path, str(k)))
                for k, v in value.items()}
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: must be a string, got {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported field type {hint}")


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
