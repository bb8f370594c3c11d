"""The hardware profile the simulator and the placement search read: fitted latency models per role and
parallel degree, KV transfer cost, decode KV capacity and drafter acceptance rates.

A profile comes from ``magicserve profile`` (measured on the hardware it describes) or from the
analytical model (``controller.planner.analytical``: bytes / bandwidth and FLOPs / peak for a named GPU
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
import json
import math
import os
from dataclasses import asdict, dataclass, field

from decode_worker.policy import FEATURES as PASS_FEATURES
from decode_worker.policy import PassShape, fit_nonnegative_relative

PROFILE_VERSION = 1
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
        return self.predict(dict(zip(PASS_FEATURES, shape.features())))

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
    """Serving-path terms of one mode (``disaggregated`` or ``colocated``), fitted by ``calibrate.py``: the
    first seven on isolated requests; the contention terms on bursts of overlapping ones; the pass scales on
    the workers' own pass logs.

    verify_pass_scale, draft_pass_scale: the profile times passes in a loop on an idle machine; served, the
    decode worker's passes run at other speeds, and not the same for each kind (plain decode passes slower
    against the profile than verify passes: ``benchmarks/results/serving_interference_spec.md``). ``decode_scale`` covers plain decode steps (the
    isolated requests run without speculation); these two put a speculative step's verify and draft passes
    in the same units, for its duration and for the simulated policy's choice of k (the real policy learns
    the in-place costs online).

    Contention (``sim_instances._Instance._contention``), how much longer a step takes while other instances
    of the cluster are busy (workers sharing cores, memory bandwidth and the server's CPU):
    contention_scale: a factor interpolated linearly in the share of the other instances busy as a step starts;
    contention_step_s: seconds a busy instance loses per step completed by itself or by the other busy
    instances (each step's outputs are polled, streamed and received by processes on the same cores): with
    it, many short decode steps interfere more than fewer, longer speculative ones at the same busy share;
    contention_output_s: the same per sequence output (a decode step over many sequences streams many).
    A calibration fits all three, non-negative, to the workers' passes during its bursts
    (``interference.fit_contention_terms``); which of them carries the slowdown is what the bursts show
    (``benchmarks/serving_interference.py`` measured it both ways in different runs).
    1.0 and 0.0 = no contention (unmeasured, or instances on separate devices)."""

    mode: str
    ttft_overhead_s: float
    prefill_scale: float
    decode_start_s: float
    decode_scale: float
    requests: int
    ttft_fit_error: float  # relative RMS
    decode_fit_error: float
    contention_scale: float = 1.0
    contention_step_s: float = 0.0  # seconds each busy instance loses per step completed while no core is idle
    contention_output_s: float = 0.0  # seconds each busy instance loses per sequence output while no core is idle
    contention_requests: int = 0  # requests of the burst behind the contention term
    # fitted on pass logs: time-weighted RMS of the passes' slowdowns about the fit; else (profiles
    # calibrated before the workers, then the colocated instances, logged passes): RMS of
    # log(simulated / measured) latency over the burst
    contention_fit_error: float = 0.0
    # the prefill worker's passes in place, measured / profiled (0.0: unmeasured, the worker is charged the
    # whole prefill_scale). The rest of prefill_scale is TTFT latency that does not hold the worker: the
    # prefill throughput measured under saturating load agrees with this scale, not with prefill_scale
    # (benchmarks/sim_validate.py's prefill tok/s column)
    prefill_pass_scale: float = 0.0
    # speculative steps in place, relative to plain decode passes (1.0: unmeasured): a verify pass's and a draft
    # pass's measured / profiled time over a plain decode pass's, medians of the decode workers' timed passes
    verify_pass_scale: float = 1.0
    draft_pass_scale: float = 1.0
    speculative_passes: int = 0  # verify passes behind the two scales
    # per role ("prefill", "decode", "colocated"), how a step's time varies about the fitted time: equal-
    # probability quantiles of the burst's passes' measured / fitted time, mean 1 (``interference.step_noise``).
    # The simulator draws one per step (``sim_instances._Instance._noise``): near capacity a queue grows with the
    # service times' variance, not only their mean. Empty: every step takes its fitted time (unmeasured, or a
    # profile calibrated before the spread was kept)
    step_noise: dict[str, tuple[float, ...]] = field(default_factory=dict)
    # CPU: the torch threads per instance of the config it was measured on. A 2-thread instance serves at
    # another in-place speed than a 1-thread one (its parallel regions wait for a thread the serving path
    # preempted), so each count has its own calibration; ``Profile.calibration`` falls back to the 1-thread one
    threads: int = 1
    # the workload shape the contention burst's lengths were drawn from (``calibrate.burst_lengths``); "": the
    # calibration's generic lengths and output burst. The contention a step meets depends on what both
    # instances run (prefill-heavy steps contend less than decode-heavy ones), so plan notes a mismatch
    contention_workload: str = ""

    def __post_init__(self) -> None:
        from controller.planner.workload import WORKLOADS

        if self.contention_workload not in ("", *WORKLOADS):
            raise ProfileError(f"calibrations.contention_workload: must be one of {['', *sorted(WORKLOADS)]}, "
                               f"got {self.contention_workload!r}")

    @staticmethod
    def identity(mode: str) -> "Calibration":
        return Calibration(mode, 0.0, 1.0, 0.0, 1.0, 0, 0.0, 0.0)

    @property
    def prefill_busy_scale(self) -> float:
        """The factor on a prefill step's profiled time for the time it holds the prefill worker."""
        return self.prefill_pass_scale or self.prefill_scale

    def without_contention(self) -> "Calibration":
        """The isolated terms alone (no contention term, no spread of step times)."""
        return dataclasses.replace(self, contention_scale=1.0, contention_step_s=0.0, contention_output_s=0.0,
                                   step_noise={})

    def contention_summary(self) -> str:
        """The contention terms in words, e.g. '1.30x + 2.4 ms per step' (for reports)."""
        parts = ([f"{self.contention_scale:.2f}x"] if self.contention_scale != 1.0 else []) + \
                ([f"{1e3 * self.contention_step_s:.1f} ms per step"] if self.contention_step_s else []) + \
                ([f"{1e3 * self.contention_output_s:.2f} ms per output"] if self.contention_output_s else [])
        return " + ".join(parts) or "none"


@dataclass(frozen=True)
class InstanceCosts:
    """Costs of one instance shape: a role on ``tensor_parallel`` x ``pipeline_parallel`` devices."""

    tensor_parallel: int
    pipeline_parallel: int
    prefill: FittedModel | None
    target_pass: FittedModel | None
    draft_pass: dict[str, FittedModel] = field(default_factory=dict)  # drafter name -> model
    kv_capacity_tokens: int = 0  # KV tokens one decode instance can hold (all layers); 0 = unknown
    prefill_kv_capacity_tokens: int = 0  # the same for a prefill instance; 0 = unknown


def instance_tps(mode: str, threads: int) -> dict[str, int]:
    """Each role's instance shape (CPU: threads) of a config of ``mode`` with ``threads`` per instance."""
    return {"colocated": threads} if mode == "colocated" else {"prefill": threads, "decode": threads}


def calibration_threads(tps: dict[str, int]) -> int:
    """The calibration's thread count for instance shapes ``tps`` (role -> tensor parallel; CPU: threads):
    a colocated instance's, or the prefill and decode instances' when equal. A pair of unequal counts (sharing
    cores) takes the 1-thread calibration: its ``CoreSharing`` entry is stated over that one."""
    if "colocated" in tps:
        return tps["colocated"]
    return tps["prefill"] if tps.get("prefill") == tps.get("decode") else 1


SHARING_SOURCES = ("served", "burst", "processes")  # in the order ``Profile.sharing`` prefers them


@dataclass(frozen=True)
class CoreSharing:
    """A prefill and a decode instance whose threads outnumber the cores they run on (CPU only): each
    role's step time while the other role is busy, over its time alone (``core_sharing.measure``).

    On a 2-core machine a 2-thread prefill instance and a 1-thread decode instance run a lone long prompt
    on both cores while decode is idle, and the OS time-slices three threads over two cores when both are
    busy: ``prefill_factor`` and ``decode_factor`` say how much slower each role's steps run then. The
    simulator applies them for the part of each step the other role is busy (``sim_instances``)."""

    prefill_threads: int
    decode_threads: int
    cores: int
    prefill_factor: float  # a prefill step's time while the decode instance is busy / alone
    decode_factor: float  # a decode step's time while the prefill instance is busy / alone
    prefill_units: int = 0  # timed units behind the prefill factor (contended)
    decode_units: int = 0
    prefill_alone_s: float = 0.0  # the measured units alone (median seconds; 0: not recorded)
    decode_alone_s: float = 0.0
    # "processes": two plain processes (``core_sharing.measure``); "served": a served cluster's own passes
    # during an SLO sweep (``core_sharing.in_place``), which also measures ``prefill_scale``: the prefill steps
    # with decode idle, in place, over what the simulator charges for them (the profile x the calibration's
    # prefill pass scale); "burst": the same, read from a calibration burst (``calibrate_sharing``)
    source: str = "processes"
    prefill_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("prefill_threads", "decode_threads", "cores"):
            if getattr(self, name) < 1:
                raise ProfileError(f"core_sharing.{name}: must be >= 1, got {getattr(self, name)}")
        if self.prefill_threads + self.decode_threads <= self.cores:
            raise ProfileError(f"core_sharing: {self.prefill_threads} + {self.decode_threads} threads fit on "
                               f"{self.cores} cores; sharing needs more threads than cores")
        for name in ("prefill_factor", "decode_factor", "prefill_scale"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ProfileError(f"core_sharing.{name}: must be a positive finite number, got {value!r}")
        if self.source not in SHARING_SOURCES:
            raise ProfileError(f"core_sharing.source: must be one of {list(SHARING_SOURCES)}, got {self.source!r}")

    @property
    def measured_in_place(self) -> bool:
        """Measured on the served cluster (a sweep's or a burst's passes): the factors then hold everything
        else the cluster runs meanwhile, so the calibration's contention terms do not apply on top."""
        return self.source != "processes"

    def factor(self, role: str) -> float:
        """The slowdown of ``role`` ("prefill" | "decode") while the other role is busy."""
        return {"prefill": self.prefill_factor, "decode": self.decode_factor}[role]


@dataclass(frozen=True)
class Profile:
    """Everything the simulator and planner need to know about (hardware, model)."""

    hardware: str  # e.g. "cpu: 2 x Intel Xeon ... (1 thread per worker)" or "gpu: H100-SXM-80GB"
    device_type: str  # "cpu" or a GPU type key of controller.planner.analytical.GPUS
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
    # CPU: measured slowdowns of a prefill and a decode instance sharing cores (``magicserve profile --add-threads``)
    core_sharing: tuple[CoreSharing, ...] = ()

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

    def without_contention(self) -> "Profile":
        """Every calibration's isolated terms alone (``Calibration.without_contention``): how a request
        alone on the cluster is served."""
        return dataclasses.replace(self, calibrations=tuple(c.without_contention() for c in self.calibrations))

    def at_speed(self, factor: float) -> "Profile":
        """This profile on a machine ``factor`` times as slow (2.0: every pass takes twice as long; 0.8:
        faster): every cost model and every time term of the calibrations multiplied by ``factor``; what
        is a ratio (pass scales, contention factors, the spread of step times, acceptance, KV capacity)
        is unchanged. Invariant: simulating ``at_speed(f)`` on a trace whose arrival times are all
        multiplied by ``f`` gives the same run with every time multiplied by ``f`` (the per-step
        contention terms are seconds per step and scale with the steps). ``benchmarks/_speed_probe.py``
        measures the factor of a machine whose speed drifted since it was profiled."""
        return self.at_role_speeds(factor, factor, factor)

    def at_role_speeds(self, prefill: float, decode: float, shared: float) -> "Profile":
        """``at_speed`` with a factor per role (``controller/planner/load_speed.py`` measures them under
        load): the prefill model, the KV transfer and the TTFT overhead times ``prefill``; the target and
        draft models and the decode start times ``decode``; the per-step contention terms (time every busy
        instance loses, whatever its role) times ``shared``."""
        for name, factor in (("prefill", prefill), ("decode", decode), ("shared", shared)):
            if not (factor > 0 and math.isfinite(factor)):
                raise ValueError(f"speed factor ({name}): expected a positive finite number, got {factor!r}")

        def scaled(m: FittedModel | None, factor: float) -> FittedModel | None:
            return None if m is None else dataclasses.replace(m, coefficients=tuple(factor * c for c in m.coefficients))

        instances = tuple(dataclasses.replace(c, prefill=scaled(c.prefill, prefill),
                                              target_pass=scaled(c.target_pass, decode),
                                              draft_pass={k: scaled(v, decode) for k, v in c.draft_pass.items()})
                          for c in self.instances)
        calibrations = tuple(dataclasses.replace(c, ttft_overhead_s=prefill * c.ttft_overhead_s,
                                                 decode_start_s=decode * c.decode_start_s,
                                                 contention_step_s=shared * c.contention_step_s,
                                                 contention_output_s=shared * c.contention_output_s)
                             for c in self.calibrations)
        return dataclasses.replace(self, instances=instances, kv_transfer=scaled(self.kv_transfer, prefill),
                                   calibrations=calibrations)

    def costs(self, tensor_parallel: int, pipeline_parallel: int = 1) -> InstanceCosts:
        for c in self.instances:
            if c.tensor_parallel == tensor_parallel and c.pipeline_parallel == pipeline_parallel:
                return c
        have = sorted((c.tensor_parallel, c.pipeline_parallel) for c in self.instances)
        raise ProfileError(f"profile has no costs for tensor_parallel={tensor_parallel}, "
                           f"pipeline_parallel={pipeline_parallel} (it has (tp, pp) in {have})")

    def prefill_model(self, tp: int, pp: int = 1) -> FittedModel:
        c = self.costs(tp, pp)
        if c.prefill is None:
            raise ProfileError(f"profile has no prefill costs for tp={tp}, pp={pp}")
        return c.prefill

    def target_model(self, tp: int, pp: int = 1) -> FittedModel:
        c = self.costs(tp, pp)
        if c.target_pass is None:
            raise ProfileError(f"profile has no decode (target pass) costs for tp={tp}, pp={pp}")
        return c.target_pass

    def draft_model(self, drafter: str, tp: int, pp: int = 1) -> FittedModel:
        c = self.costs(tp, pp)
        if drafter not in c.draft_pass:
            raise ProfileError(f"profile has no draft-pass costs for drafter {drafter!r} at tp={tp}, pp={pp} "
                               f"(it has {sorted(c.draft_pass)})")
        return c.draft_pass[drafter]

    def kv_capacity(self, role: str, tp: int, pp: int = 1) -> int:
        """KV tokens one ``role`` ("prefill" | "decode") instance of shape (tp, pp) holds."""
        if role not in ("prefill", "decode"):
            raise ProfileError(f"role: must be 'prefill' or 'decode', got {role!r}")
        c = self.costs(tp, pp)
        tokens = c.kv_capacity_tokens if role == "decode" else c.prefill_kv_capacity_tokens
        if tokens <= 0:
            raise ProfileError(f"profile has no {role} KV capacity for tp={tp}, pp={pp}")
        return tokens

    def sharing(self, prefill_threads: int, decode_threads: int) -> CoreSharing:
        """The measured core sharing of a ``prefill_threads`` prefill and a ``decode_threads`` decode instance:
        measured on a served cluster where the profile has that (an SLO sweep's passes, else a calibration
        burst's), else between two plain processes."""
        mine = [c for c in self.core_sharing if (c.prefill_threads, c.decode_threads) == (prefill_threads, decode_threads)]
        if mine:
            return min(mine, key=lambda c: SHARING_SOURCES.index(c.source))
        have = sorted((c.prefill_threads, c.decode_threads) for c in self.core_sharing)
        raise ProfileError(f"profile has no core-sharing measurement for a {prefill_threads}-thread prefill and a "
                           f"{decode_threads}-thread decode instance (it has (prefill, decode) threads in {have}); "
                           f"run `magicserve profile --add-threads` for it")

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
            if d.get("version") != PROFILE_VERSION:
                raise ProfileError(f"version: expected {PROFILE_VERSION}, got {d.get('version')!r}")

            def fitted(m: dict | None) -> FittedModel | None:
                if m is None:
                    return None
                fm = FittedModel(tuple(m["features"]), tuple(float(c) for c in m["coefficients"]),
                                 float(m["fit_error"]), int(m["points"]))
                if len(fm.features) != len(fm.coefficients) or any(not math.isfinite(c) for c in fm.coefficients):
                    raise ProfileError(f"malformed cost model {m}")
                return fm

            instances = tuple(InstanceCosts(int(c["tensor_parallel"]), int(c["pipeline_parallel"]),
                                            fitted(c["prefill"]), fitted(c["target_pass"]),
                                            {k: fitted(v) for k, v in c.get("draft_pass", {}).items()},
                                            int(c["kv_capacity_tokens"]),
                                            int(c.get("prefill_kv_capacity_tokens", 0)))
                              for c in d["instances"])
            if d["kv_transfer"] is None:
                raise ProfileError("kv_transfer: missing cost model")
            samples = d.get("samples", {})
            if not isinstance(samples, dict) or not all(isinstance(v, list) for v in samples.values()):
                raise ProfileError("samples: expected a mapping of model name -> list of rows")
            return Profile(
                hardware=str(d["hardware"]), device_type=str(d["device_type"]),
                devices_per_node=int(d["devices_per_node"]), model=str(d["model"]),
                model_params=int(d["model_params"]), kv_bytes_per_token=int(d["kv_bytes_per_token"]),
                source=str(d["source"]), instances=instances, kv_transfer=fitted(d["kv_transfer"]),
                acceptance=tuple(AcceptanceEntry(**a) for a in d.get("acceptance", [])),
                notes=str(d.get("notes", "")), version=int(d["version"]),
                calibrations=tuple(Calibration(**{**c, "step_noise": {str(role): tuple(float(q) for q in qs)
                                                                      for role, qs in c.get("step_noise", {}).items()}})
                                   for c in d.get("calibrations", [])),
                samples={str(k): [{str(f): float(x) for f, x in row.items()} for row in v]
                         for k, v in samples.items()},
                core_sharing=tuple(CoreSharing(**c) for c in d.get("core_sharing", [])),
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
        fixed = [dict(zip(m.features, m.coefficients)).get("passes", 0.0) for m in (decode_cost, prefill_cost)]
        seconds -= min(fixed) * min(decode_scale, prefill_scale)
    return seconds


def transfer_features(tokens: int) -> dict[str, float]:
    return {"passes": 1.0, "tokens": float(tokens)}
