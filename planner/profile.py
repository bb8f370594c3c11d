"""The hardware profile the simulator and the placement search read: fitted latency models per role and
parallel degree, KV transfer cost, decode KV capacity and drafter acceptance rates.

A profile comes from ``magicserve profile`` (measured on the hardware it describes) or from the
analytical model (``planner.analytical``: bytes / bandwidth and FLOPs / peak for a named GPU
type). Either way it is one JSON file with this schema; every fitted model carries its fit error.

Latency models are linear in features (seconds = sum of coefficient x feature):

* ``prefill``: one chunked-prefill step; features ``PREFILL_FEATURES``:
  ``passes`` (1 per step), ``seqs`` (prompts in the step), ``tokens`` (prompt tokens computed),
  ``attn_pairs`` (query x key pairs of attention: for a chunk of n tokens starting at s, n * (s + n)) and
  ``kv_tokens`` (KV entries the chunks attend over, s + n per chunk: attention reads the context once per
  chunk, whatever the chunk's length, so a short chunk deep in a long prompt costs more per pair).
* ``target_pass`` / ``draft_pass``: one decode-side forward pass; features ``decode_worker.policy.FEATURES``
  (``passes``, ``seqs``, ``kv_tokens`` read, ``new_tokens``). A plain decode step is one target pass with
  B new tokens; a speculative step is k draft passes plus one verify pass with B*(k+1) new tokens.
* ``kv_transfer``: moving one prompt's KV from prefill to decode; features ``passes`` (1 per request)
  and ``tokens``.

KV capacity (tokens of KV one instance holds, all layers) is kept per role: a decode and a prefill
instance of the same shape may size their caches differently (``kv_capacity``). ``samples`` keeps the
measured points behind each fitted model (median seconds per point) so a fit can be audited or redone.

Missing data is an error naming what is missing (``ProfileError``), never a silent default.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field

from decode_worker.policy import FEATURES as PASS_FEATURES
from decode_worker.policy import PassShape, fit_nonnegative_relative

PROFILE_VERSION = 2  # 2: CPU instances keyed by (tensor_parallel ranks, threads per rank); 1 read as threads
PREFILL_FEATURES = ("passes", "seqs", "tokens", "attn_pairs", "kv_tokens")
# context_hi of an acceptance range that is open at the top (JSON has no infinity)
CONTEXT_UNBOUNDED = 2**31 - 1
TRANSFER_FEATURES = ("passes", "tokens")


class ProfileError(ValueError):
    """A profile is missing data for what was asked, or its file is malformed."""


@dataclass(frozen=True)
class FittedModel:
    """seconds = sum(coefficients[i] * features[i]); ``fit_error`` is the relative RMS error on the
    ``points`` measurements it was fitted to (0 for an analytical model, which is not fitted)."""

    features: tuple[str, ...]
    coefficients: tuple[float, ...]
    fit_error: float
    points: int

    def predict(self, values: dict[str, float]) -> float:
        missing = [f for f in self.features if f not in values]
        if missing:
            raise ProfileError(f"cost model needs features {missing}")
        return max(1e-7, sum(c * values[f] for f, c in zip(self.features, self.coefficients)))

    def predict_pass(self, shape: PassShape) -> float:
        """``predict`` of a pass's features (summed in the model's feature order, as ``predict`` does)."""
        values = shape.features()
        return max(1e-7, sum(c * values[i] for c, i in zip(self.coefficients, self._pass_index)))

    @functools.cached_property
    def _pass_index(self) -> tuple[int, ...]:
        """Where each of the model's features sits in ``PassShape.features()`` (computed once per model)."""
        missing = [f for f in self.features if f not in PASS_FEATURES]
        if missing:
            raise ProfileError(f"cost model needs features {missing}")
        return tuple(PASS_FEATURES.index(f) for f in self.features)

    @staticmethod
    def fit(features: tuple[str, ...], rows: list[dict[str, float]], seconds: list[float]) -> "FittedModel":
        """Least squares of the relative error (each point weighted by 1 / seconds, so a 1 ms pass counts
        as much as a 1 s one, as in ``fit_error``) with non-negative coefficients (a negative marginal
        cost is fitting noise). With a handful of features the exact non-negative optimum is found by
        solving on every subset of the columns and keeping the best solution that is >= 0 throughout."""
        if len(rows) < len(features):
            raise ProfileError(f"fitting {features} needs at least {len(features)} points, got {len(rows)}")
        if any(not (t > 0 and math.isfinite(t)) for t in seconds):
            raise ProfileError(f"fitting {features}: times must be positive and finite")
        best, err = fit_nonnegative_relative([[r[f] for f in features] for r in rows], seconds)
        return FittedModel(tuple(features), tuple(best), err, len(rows))


@dataclass(frozen=True)
class AcceptanceEntry:
    """Measured per-token acceptance rate of one drafter setting at contexts in [context_lo, context_hi)."""

    drafter: str  # "self_sparse" | "draft_model"
    budget: int  # KV tokens the draft attends to (sink + window)
    context_lo: int
    context_hi: int
    rate: float
    proposed: int  # draft tokens behind the estimate


@dataclass(frozen=True)
class Calibration:
    """Serving-path terms of one mode (``disaggregated`` or ``colocated``) at one thread count, fitted by
    ``calibrate.py`` on isolated requests served by the real cluster.

    The profile times passes in a loop on an idle machine; served, a request also pays for Ray and gRPC hops,
    the worker loops around each pass and the first token's delivery. The simulator's step time is the
    profiled cost times these terms (``sim_instances.StepCosts``):

    * TTFT = ``ttft_overhead_s`` + ``prefill_scale`` x the profiled prefill steps; of that scale, the part
      that holds the prefill worker busy is ``prefill_pass_scale`` (measured on the worker's own passes;
      0.0: unmeasured, the whole scale);
    * decode time = ``decode_start_s`` + ``decode_scale`` x the profiled plain decode steps;
    * ``verify_pass_scale`` / ``draft_pass_scale``: a speculative step's verify and draft passes in place,
      relative to a plain decode pass (the real policy learns these costs online, so the simulated policy
      chooses k with the same relative costs). 1.0: unmeasured.

    ``threads``: the torch threads per instance of the config it was measured on (CPU); each count has its
    own calibration and ``Profile.calibration`` falls back to the 1-thread one."""

    mode: str
    ttft_overhead_s: float
    prefill_scale: float
    decode_start_s: float
    decode_scale: float
    requests: int
    ttft_fit_error: float  # relative RMS
    decode_fit_error: float
    prefill_pass_scale: float = 0.0
    verify_pass_scale: float = 1.0
    draft_pass_scale: float = 1.0
    speculative_passes: int = 0  # verify passes behind the two scales
    threads: int = 1

    @staticmethod
    def identity(mode: str) -> "Calibration":
        return Calibration(mode, 0.0, 1.0, 0.0, 1.0, 0, 0.0, 0.0)

    @property
    def prefill_busy_scale(self) -> float:
        """The factor on a prefill step's profiled time for the time it holds the prefill worker."""
        return self.prefill_pass_scale or self.prefill_scale


@dataclass(frozen=True)
class InstanceCosts:
    """Costs of one instance shape: ``tensor_parallel`` rank processes of ``threads`` torch threads each. A
    device is a GPU, or a core on a CPU, so the shape takes tp x threads devices: on a CPU, (tp 2, threads 1)
    is two 1-thread rank processes and (tp 1, threads 2) one 2-thread process."""

    tensor_parallel: int
    prefill: FittedModel | None
    target_pass: FittedModel | None
    draft_pass: dict[str, FittedModel] = field(default_factory=dict)  # drafter name -> model
    kv_capacity_tokens: int = 0  # KV tokens one decode instance can hold (all layers); 0 = unknown
    prefill_kv_capacity_tokens: int = 0  # the same for a prefill instance; 0 = unknown
    threads: int = 1  # torch threads per rank process (CPU); 1 on GPUs

    @property
    def shape(self) -> tuple[int, int]:
        return self.tensor_parallel, self.threads


def describe_shape(tp: int, threads: int = 1) -> str:
    """``tp2``, with `` x 2 threads`` for CPU ranks of several threads."""
    return f"tp{tp}" + (f" x {threads} threads" if threads > 1 else "")


def calibration_threads(threads: dict[str, int]) -> int:
    """The calibration's thread count for instances of ``threads`` (role -> torch threads per rank): a
    colocated instance's, or the prefill and decode instances' when equal (else the 1-thread calibration)."""
    if "colocated" in threads:
        return threads["colocated"]
    return threads["prefill"] if threads.get("prefill") == threads.get("decode") else 1


@dataclass(frozen=True)
class Profile:
    """Everything the simulator and planner need to know about (hardware, model)."""

    hardware: str  # e.g. "cpu: 2 x Intel Xeon ... (1 thread per worker)" or "gpu: H100-SXM-80GB"
    device_type: str  # "cpu" or a GPU type key of planner.analytical.GPUS
    devices_per_node: int
    model: str
    model_params: int
    kv_bytes_per_token: int
    source: str  # "measured" | "analytical"
    instances: tuple[InstanceCosts, ...]
    kv_transfer: FittedModel
    acceptance: tuple[AcceptanceEntry, ...] = ()
    notes: str = ""
    calibrations: tuple[Calibration, ...] = ()  # serving-path terms per mode (``magicserve profile --calibrate``)
    version: int = PROFILE_VERSION
    # measured points behind the fits: model name ("prefill", "target_pass", "draft_pass/<drafter>",
    # "kv_transfer") -> rows of feature values plus "seconds" (median); empty for analytical profiles
    samples: dict[str, list[dict[str, float]]] = field(default_factory=dict)

    # -- lookups (each names what is missing) ------------------------------------------------------

    def calibration(self, mode: str, threads: int = 1) -> Calibration:
        """The calibration of ``mode`` measured on instances of ``threads`` threads, else the mode's 1-thread
        one (GPU instances, and CPU thread counts never calibrated); the identity (no serving-path terms)
        when none was measured."""
        mine = [c for c in self.calibrations if c.mode == mode]
        return next((c for c in mine if c.threads == threads), None) or \
            next((c for c in mine if c.threads == 1), Calibration.identity(mode))

    def with_calibration(self, cal: Calibration) -> "Profile":
        """This profile with ``cal`` in place of the calibration of its mode and thread count."""
        others = tuple(c for c in self.calibrations if (c.mode, c.threads) != (cal.mode, cal.threads))
        return dataclasses.replace(self, calibrations=others + (cal,))

    def costs(self, tensor_parallel: int, threads: int = 1) -> InstanceCosts:
        for c in self.instances:
            if c.shape == (tensor_parallel, threads):
                return c
        have = sorted(c.shape for c in self.instances)
        raise ProfileError(f"profile has no costs for tensor_parallel={tensor_parallel}, threads={threads} "
                           f"(it has (tp, threads) in {have})")

    def prefill_model(self, tp: int, threads: int = 1) -> FittedModel:
        c = self.costs(tp, threads)
        if c.prefill is None:
            raise ProfileError(f"profile has no prefill costs for {describe_shape(tp, threads)}")
        return c.prefill

    def target_model(self, tp: int, threads: int = 1) -> FittedModel:
        c = self.costs(tp, threads)
        if c.target_pass is None:
            raise ProfileError(f"profile has no decode (target pass) costs for {describe_shape(tp, threads)}")
        return c.target_pass

    def draft_model(self, drafter: str, tp: int, threads: int = 1) -> FittedModel:
        c = self.costs(tp, threads)
        if drafter not in c.draft_pass:
            raise ProfileError(f"profile has no draft-pass costs for drafter {drafter!r} at "
                               f"{describe_shape(tp, threads)} (it has {sorted(c.draft_pass)})")
        return c.draft_pass[drafter]

    def kv_capacity(self, role: str, tp: int, threads: int = 1) -> int:
        """KV tokens one ``role`` ("prefill" | "decode") instance of shape (tp, threads) holds."""
        if role not in ("prefill", "decode"):
            raise ProfileError(f"role: must be 'prefill' or 'decode', got {role!r}")
        c = self.costs(tp, threads)
        tokens = c.kv_capacity_tokens if role == "decode" else c.prefill_kv_capacity_tokens
        if tokens <= 0:
            raise ProfileError(f"profile has no {role} KV capacity for {describe_shape(tp, threads)}")
        return tokens

    def acceptance_rate(self, drafter: str, budget: int, context: int) -> float:
        """Measured rate of (drafter, budget) at ``context`` tokens; between measured budgets the
        nearest smaller budget is used (conservative: acceptance grows with budget)."""
        entries = [e for e in self.acceptance if e.drafter == drafter and e.budget <= budget]
        if not entries:
            have = sorted({(e.drafter, e.budget) for e in self.acceptance})
            raise ProfileError(f"profile has no acceptance rate for drafter {drafter!r} with budget <= {budget} "
                               f"(it has (drafter, budget) in {have}); run `magicserve profile` with that setting")
        best_budget = max(e.budget for e in entries)
        rows = sorted((e for e in entries if e.budget == best_budget), key=lambda e: e.context_lo)
        for e in rows:
            if e.context_lo <= context < e.context_hi:
                return e.rate
        # outside the measured contexts: the closest measured range
        return min(rows, key=lambda e: min(abs(context - e.context_lo), abs(context - e.context_hi))).rate

    # -- files -------------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    @staticmethod
    def from_dict(d: dict) -> "Profile":
        try:
            version = d.get("version")
            if version not in (1, PROFILE_VERSION):
                raise ProfileError(f"version: expected {PROFILE_VERSION} (or 1), got {version!r}")
            # version 1 wrote a CPU instance of t threads as tensor_parallel t: one process on t threads
            threads_as_tp = version == 1 and d.get("device_type") == "cpu"

            def fitted(m: dict | None) -> FittedModel | None:
                if m is None:
                    return None
                fm = FittedModel(tuple(m["features"]), tuple(float(c) for c in m["coefficients"]),
                                 float(m["fit_error"]), int(m["points"]))
                if len(fm.features) != len(fm.coefficients) or any(not math.isfinite(c) for c in fm.coefficients):
                    raise ProfileError(f"malformed cost model {m}")
                return fm

            instances = tuple(InstanceCosts(1 if threads_as_tp else int(c["tensor_parallel"]),
                                            fitted(c["prefill"]), fitted(c["target_pass"]),
                                            {k: fitted(v) for k, v in c.get("draft_pass", {}).items()},
                                            int(c["kv_capacity_tokens"]),
                                            int(c["prefill_kv_capacity_tokens"]),
                                            int(c["tensor_parallel"]) if threads_as_tp else int(c.get("threads", 1)))
                              for c in d["instances"])
            if d["kv_transfer"] is None:
                raise ProfileError("kv_transfer: missing cost model")
            samples = d.get("samples", {})
            if not isinstance(samples, dict) or not all(isinstance(v, list) for v in samples.values()):
                raise ProfileError("samples: expected a mapping of model name -> list of rows")
            if threads_as_tp:  # version 1's "tp{t}/..." samples were measured on t threads
                samples = {re.sub(r"^tp(\d+)/", r"threads\1/", k): v for k, v in samples.items()}
            return Profile(
                hardware=str(d["hardware"]), device_type=str(d["device_type"]),
                devices_per_node=int(d["devices_per_node"]), model=str(d["model"]),
                model_params=int(d["model_params"]), kv_bytes_per_token=int(d["kv_bytes_per_token"]),
                source=str(d["source"]), instances=instances, kv_transfer=fitted(d["kv_transfer"]),
                acceptance=tuple(AcceptanceEntry(**a) for a in d.get("acceptance", [])),
                notes=str(d.get("notes", "")),
                calibrations=tuple(Calibration(**c) for c in d.get("calibrations", [])),
                samples={str(k): [{str(f): float(x) for f, x in row.items()} for row in v]
                         for k, v in samples.items()},
            )
        except KeyError as e:
            raise ProfileError(f"profile: missing field {e}") from None
        except (TypeError, ValueError, AttributeError) as e:
            if isinstance(e, ProfileError):
                raise
            raise ProfileError(f"profile: malformed ({e})") from None

    @staticmethod
    def load(path: str) -> "Profile":
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except FileNotFoundError:
            raise ProfileError(f"{path}: no such profile file (make one with `magicserve profile`)") from None
        except json.JSONDecodeError as e:
            raise ProfileError(f"{path}: not JSON ({e})") from None
        try:
            return Profile.from_dict(d)
        except ProfileError as e:
            raise ProfileError(f"{path}: {e}") from None


def prefill_features(chunks: list[tuple[int, int]]) -> dict[str, float]:
    """Features of one prefill step from its chunks as (start, length) pairs."""
    return {"passes": 1.0, "seqs": float(len(chunks)), "tokens": float(sum(n for _, n in chunks)),
            "attn_pairs": float(sum(n * (s + n) for s, n in chunks)), "kv_tokens": float(sum(s + n for s, n in chunks))}


def shared_pass_s(*models: FittedModel | None) -> float:
    """The fixed per-pass cost two models' work shares when it runs in one pass: the smaller of their
    ``passes`` coefficients (0 where a model has none)."""
    return min(dict(zip(m.features, m.coefficients)).get("passes", 0.0) for m in models if m is not None)


def mixed_pass_seconds(prefill_cost: FittedModel, decode_cost: FittedModel, prefill: dict[str, float] | None,
                       decode_seqs: int, decode_kv_tokens: int, prefill_scale: float = 1.0,
                       decode_scale: float = 1.0) -> float:
    """One pass of the colocated engine over prefill chunks (their ``prefill_features``; None or no tokens:
    none) and ``decode_seqs`` decode tokens reading ``decode_kv_tokens`` KV positions: the decode part priced
    by the target-pass model, the prefill part by the prefill model (each times its scale), the fixed
    per-pass cost counted once."""
    has_prefill = prefill is not None and prefill.get("tokens", 0.0) > 0
    seconds = 0.0
    if decode_seqs:
        seconds += decode_cost.predict_pass(PassShape(decode_seqs, decode_kv_tokens, decode_seqs)) * decode_scale
    if has_prefill:
        seconds += prefill_cost.predict(prefill) * prefill_scale
    if decode_seqs and has_prefill:
        seconds -= shared_pass_s(decode_cost, prefill_cost) * min(decode_scale, prefill_scale)
    return seconds


def transfer_features(tokens: int) -> dict[str, float]:
    return {"passes": 1.0, "tokens": float(tokens)}
