"""The GPU catalogue: each GPU type's public specs, its price per GPU-hour and how many may be rented, for
the cost-aware planner (``magicserve plan --objective cost``) and the analytical profiles.

The default table is ``gpu_catalog.yaml`` beside this module (specs from the vendors' datasheets, prices
from public clouds' on-demand lists, each with its source and date). A user's catalogue file
(``--gpu-catalog FILE``, same format) overrides it field by field and may add types (a new type needs every
spec field); ``--gpu-types H100:4.0,A100:1.8:16,L4`` picks the types a plan may use, each with an optional
price and an optional limit on its GPUs. Names match case-insensitively, by full name or alias.

YAML units are the datasheets': MiB of memory, GB/s of bandwidth, TFLOP/s, microseconds, USD per GPU-hour.
Every error names its field path (``gpus.L4.price_per_gpu_hour: must be > 0, got -1``).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace

import yaml

DEFAULT_CATALOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_catalog.yaml")

SPEC_FIELDS = ("memory_mib", "hbm_bandwidth_gb_s", "bf16_tflops", "link_bandwidth_gb_s", "link",
               "collective_latency_us", "spec_source")
OTHER_FIELDS = ("aliases", "price_per_gpu_hour", "price_sources", "max_gpus", "ray_accelerator_type")


class CatalogError(ValueError):
    """A catalogue or a ``--gpu-types`` selection that cannot be used; the message starts with the field."""


@dataclass(frozen=True)
class GPUSpec:
    """Public peak figures of one GPU (dense, no sparsity)."""

    name: str
    hbm_bandwidth: float  # bytes/s
    bf16_flops: float  # dense bf16 tensor-core FLOP/s
    memory_bytes: float  # usable device memory (what nvidia-smi reports)
    link_bandwidth: float  # GPU-to-GPU bytes/s per direction (NVLink, or PCIe where there is none)
    link: str
    collective_latency_s: float  # one small all-reduce across the node's GPUs
    source: str


@dataclass(frozen=True)
class GPUType:
    """One rentable GPU type: its specs, price and availability, and the Ray resource that places work on
    it (``accelerator_type:<ray_accelerator_type>``, which Ray sets on nodes with that GPU)."""

    spec: GPUSpec
    price_per_gpu_hour: float  # USD
    ray_accelerator_type: str
    aliases: tuple[str, ...] = ()
    price_sources: tuple[str, ...] = ()
    max_gpus: int | None = None  # None: as many as a plan needs

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def ray_resource(self) -> str:
        return f"accelerator_type:{self.ray_accelerator_type}"

    def matches(self, name: str) -> bool:
        key = name.lower()
        return key == self.name.lower() or key in (a.lower() for a in self.aliases)


@dataclass(frozen=True)
class GPUCatalog:
    types: tuple[GPUType, ...]

    def __post_init__(self) -> None:
        if not self.types:
            raise CatalogError("gpus: the catalogue has no GPU types")

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.types]

    def get(self, name: str, field: str = "gpu") -> GPUType:
        for t in self.types:
            if t.matches(name):
                return t
        known = ", ".join(f"{t.name} ({', '.join(t.aliases)})" if t.aliases else t.name for t in self.types)
        raise CatalogError(f"{field}: unknown GPU type {name!r}; known: {known}")

    def specs(self) -> dict[str, GPUSpec]:
        return {t.name: t.spec for t in self.types}

    def select(self, text: str) -> "GPUCatalog":
        """The types named in ``--gpu-types`` (``NAME[:PRICE[:MAX_GPUS]]``, comma-separated), with the prices
        and limits given there replacing the catalogue's."""
        chosen: list[GPUType] = []
        for item in [p.strip() for p in text.split(",")]:
            parts = item.split(":")
            if not item or len(parts) > 3:
                raise CatalogError(f"--gpu-types: expected NAME[:PRICE[:MAX_GPUS]] items, got {item!r}")
            t = self.get(parts[0], "--gpu-types")
            if any(c.name == t.name for c in chosen):
                raise CatalogError(f"--gpu-types: {t.name} is named twice")
            if len(parts) > 1 and parts[1]:
                t = replace(t, price_per_gpu_hour=_number(parts[1], f"--gpu-types {item}: price", positive=True),
                            price_sources=("given on the command line",))
            if len(parts) > 2 and parts[2]:
                t = replace(t, max_gpus=_integer(parts[2], f"--gpu-types {item}: max GPUs"))
            chosen.append(t)
        return GPUCatalog(tuple(chosen))


def _number(value, where: str, positive: bool = True) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise CatalogError(f"{where}: must be a number, got {value!r}") from None
    if isinstance(value, bool) or not math.isfinite(x) or (x <= 0 if positive else x < 0):
        raise CatalogError(f"{where}: must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return x


def _integer(value, where: str) -> int:
    try:
        x = int(value)
    except (TypeError, ValueError):
        raise CatalogError(f"{where}: must be an integer, got {value!r}") from None
    if isinstance(value, bool) or x < 1 or (isinstance(value, float) and value != x):
        raise CatalogError(f"{where}: must be an integer >= 1, got {value!r}")
    return x


def _string(value, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise CatalogError(f"{where}: must be a non-empty string, got {value!r}")
    return value


def _strings(value, where: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise CatalogError(f"{where}: must be a list of strings, got {value!r}")
    return tuple(_string(v, f"{where}[{i}]") for i, v in enumerate(value))


def _gpu_type(name: str, raw: dict, where: str) -> GPUType:
    unknown = sorted(set(raw) - set(SPEC_FIELDS) - set(OTHER_FIELDS))
    if unknown:
        raise CatalogError(f"{where}.{unknown[0]}: unknown field; allowed: {', '.join(SPEC_FIELDS + OTHER_FIELDS)}")
    for f in SPEC_FIELDS + ("price_per_gpu_hour", "ray_accelerator_type"):
        if f not in raw:
            raise CatalogError(f"{where}.{f}: required")
    spec = GPUSpec(
        name,
        hbm_bandwidth=_number(raw["hbm_bandwidth_gb_s"], f"{where}.hbm_bandwidth_gb_s") * 1e9,
        bf16_flops=_number(raw["bf16_tflops"], f"{where}.bf16_tflops") * 1e12,
        memory_bytes=_number(raw["memory_mib"], f"{where}.memory_mib") * 2**20,
        link_bandwidth=_number(raw["link_bandwidth_gb_s"], f"{where}.link_bandwidth_gb_s") * 1e9,
        link=_string(raw["link"], f"{where}.link"),
        collective_latency_s=_number(raw["collective_latency_us"], f"{where}.collective_latency_us") * 1e-6,
        source=_string(raw["spec_source"], f"{where}.spec_source"),
    )
    max_gpus = raw.get("max_gpus")
    return GPUType(
        spec,
        price_per_gpu_hour=_number(raw["price_per_gpu_hour"], f"{where}.price_per_gpu_hour"),
        ray_accelerator_type=_string(raw["ray_accelerator_type"], f"{where}.ray_accelerator_type"),
        aliases=_strings(raw.get("aliases", []), f"{where}.aliases"),
        price_sources=_strings(raw.get("price_sources", []), f"{where}.price_sources"),
        max_gpus=None if max_gpus is None else _integer(max_gpus, f"{where}.max_gpus"),
    )


def _entries(raw, source: str) -> dict[str, dict]:
    if not isinstance(raw, dict) or not isinstance(raw.get("gpus"), dict):
        raise CatalogError(f"gpus: {source} must hold a mapping 'gpus' of GPU type name -> fields")
    extra = sorted(set(raw) - {"gpus"})
    if extra:
        raise CatalogError(f"{extra[0]}: unknown top-level field in {source}; allowed: gpus")
    for name, fields in raw["gpus"].items():
        if not isinstance(name, str) or not name.strip():
            raise CatalogError(f"gpus: type names must be non-empty strings, got {name!r}")
        if not isinstance(fields, dict):
            raise CatalogError(f"gpus.{name}: must be a mapping of fields, got {fields!r}")
    return raw["gpus"]


def parse_catalog(raw, base: dict[str, dict] | None = None, source: str = "the catalogue") -> GPUCatalog:
    """A catalogue from its YAML mapping; ``base``: entries it overrides field by field (and adds to)."""
    merged = {name: dict(fields) for name, fields in (base or {}).items()}
    for name, fields in _entries(raw, source).items():  # an entry overrides the type it names (or aliases)
        key = next((k for k, f in merged.items()
                    if name.lower() in (k.lower(), *(str(a).lower() for a in f.get("aliases") or []))), name)
        merged[key] = {**merged.get(key, {}), **fields}
    types = tuple(_gpu_type(name, fields, f"gpus.{name}") for name, fields in merged.items())
    seen: dict[str, str] = {}
    for t in types:
        for key in (t.name, *t.aliases):
            if key.lower() in seen and seen[key.lower()] != t.name:
                raise CatalogError(f"gpus.{t.name}.aliases: {key!r} also names {seen[key.lower()]}")
            seen[key.lower()] = t.name
    return GPUCatalog(types)


def _read(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except OSError as err:
        raise CatalogError(f"--gpu-catalog: cannot read {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise CatalogError(f"--gpu-catalog: {path} is not valid YAML: {err}") from None


@functools.cache
def default_catalog() -> GPUCatalog:
    """The default table (read once: a catalogue is immutable)."""
    return parse_catalog(_read(DEFAULT_CATALOG), source=DEFAULT_CATALOG)


def load_catalog(path: str | None = None) -> GPUCatalog:
    """The default catalogue, overridden by the user's file at ``path`` (if given)."""
    default = _entries(_read(DEFAULT_CATALOG), DEFAULT_CATALOG)
    if path is None:
        return parse_catalog({"gpus": default}, source=DEFAULT_CATALOG)
    return parse_catalog(_read(path), base=default, source=path)
