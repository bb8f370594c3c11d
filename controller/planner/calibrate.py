"""Calibration of a measured profile against the real serving path.

The profile times forward passes in isolation. A request through the running cluster also pays for
what those timings cannot see: Ray calls and polling between router and workers, the worker loops
around each pass (scheduling, sampling, KV hand-off), gRPC delivery, and the two workers sharing the
machine's memory bandwidth and caches. ``magicserve profile --calibrate`` measures that once per mode:
it serves the config for real (Ray + gRPC on localhost), sends isolated requests one at a time
(no queueing, speculation off so the decode steps are countable), and fits

    TTFT                      = ttft_overhead_s + prefill_scale * (predicted prefill steps)
    first -> last token time  = decode_start_s  + decode_scale  * (predicted decode steps) + (KV tail)

by non-negative least squares of the relative error. The simulator applies the fitted terms.

Isolated requests leave the rest of the machine idle. When several instances share one machine (the
CPU cluster: workers, router, gRPC server and clients on the same cores), a step runs slower while the
other instances are busy. A second phase measures that: a burst of overlapping requests (Poisson
arrivals at the rate the simulator, with the isolated terms, says keeps the instances busy about
``BURST_UTILISATION`` of the time) is served for real, then replayed through the simulator for a grid
of contention factors; the factor whose simulated TTFT and decode-time distributions match the measured
ones best (least squares of the log ratio of sorted values) is kept as ``contention_scale``.

The calibration never uses the SLO sweeps it is validated against (``benchmarks/sim_validate.py``):
its prompts, lengths and arrivals are its own.
"""

from __future__ import annotations

import dataclasses
import math
import random
import threading
import time

from tqdm import tqdm

from controller.planner.profile import Calibration, Profile, prefill_features, transfer_features
from controller.planner.workload import RequestSpec
from decode_worker.policy import PassShape, fit_nonnegative_relative


def predicted_prefill_s(profile: Profile, prompt: int, chunk: int) -> float:
    model = profile.prefill_model(1)
    return sum(model.predict(prefill_features([(s, min(chunk, prompt - s))])) for s in range(0, prompt, chunk))


def predicted_decode_s(profile: Profile, prompt: int, tokens: int) -> float:
    """Plain decode steps of one sequence producing ``tokens`` tokens after the first."""
    model = profile.target_model(1)
    return sum(model.predict_pass(PassShape(1, prompt + j + 1, 1)) for j in range(tokens))


def kv_tail_s(profile: Profile, prompt: int, chunk: int) -> float:
    """KV transfer left after the last prefill chunk (the simulator models it; not part of the fit)."""
    last = prompt - (prompt - 1) // chunk * chunk
    return profile.kv_transfer.predict(transfer_features(last))


def calibration_lengths(max_prompt: int, count: int, seed: int) -> list[int]:
    """Prompt lengths spread log-uniformly over [64, max_prompt], shuffled."""
    rng = random.Random(seed)
    lo, hi = 64, max(65, max_prompt)
    lengths = [int(lo * (hi / lo) ** (i / max(1, count - 1))) for i in range(count)]
    rng.shuffle(lengths)
    return lengths


def timed_stream(client, prompt: list[int], max_tokens: int) -> dict:
    """Stream one request to the end: prompt length, tokens received, TTFT and first -> last token time."""
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    for chunk in client.generate_stream(prompt, max_tokens=max_tokens, ignore_eos=True):
        if chunk.token_ids:
            now = time.perf_counter()
            first = first or now
            last = now
            tokens += len(chunk.token_ids)
    return {"prompt": len(prompt), "tokens": tokens, "ttft_s": first - t0, "decode_s": last - first}


def time_isolated(client, prompts: list[list[int]], output_tokens: tuple[int, ...]) -> list[dict]:
    """Send ``prompts`` one at a time (no overlap); output lengths cycle through ``output_tokens``."""
    return [timed_stream(client, p, output_tokens[i % len(output_tokens)]) for i, p in enumerate(prompts)]


def random_prompts(config, lengths: list[int], rng: random.Random) -> list[list[int]]:
    """Prompts of random token ids of the served model's vocabulary, of the given lengths."""
    from modeling.checkpoint import load_config as load_model_config

    vocab = load_model_config(config.model_path).vocab_size
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


def measure(config, lengths: list[int], output_tokens: tuple[int, ...], seed: int, progress: bool) -> list[dict]:
    """Serve ``config`` for real and time isolated requests (one at a time) of the given prompt lengths;
    output lengths cycle through ``output_tokens`` so the decode slope is identifiable."""
    from controller.client import Client
    from controller.server import serve_in_thread

    prompts = random_prompts(config, [64, 64] + lengths, random.Random(seed))
    with serve_in_thread(config) as address, Client(address) as client:
        rows = time_isolated(client, prompts, output_tokens)[2:]  # two warm-up requests first (not recorded)
    if progress:
        tqdm.write(f"calibration: {len(rows)} isolated requests timed")
    return rows


BURST_UTILISATION = 0.6  # mean busy share of the instances the burst's rate aims at (simulated)
CONTENTION_GRID = tuple(round(1.0 + 0.02 * i, 2) for i in range(101))  # 1.00 .. 3.00


def burst_trace(profile: Profile, sim_config, lengths: list[int], output_tokens: tuple[int, ...],
                seed: int) -> list[RequestSpec]:
    """Poisson arrivals of the given prompt lengths at the lowest rate of a geometric grid whose simulated
    mean instance utilisation (isolated terms, no contention) reaches BURST_UTILISATION; if no rate does,
    the rate of the highest utilisation."""
    from controller.planner.simulator import simulate

    rng = random.Random(seed)
    gaps = [rng.expovariate(1.0) for _ in lengths]  # unit-rate gaps, scaled per candidate rate
    outputs = [output_tokens[i % len(output_tokens)] for i in range(len(lengths))]

    def trace_at(rate: float) -> list[RequestSpec]:
        t, out = 0.0, []
        for gap, n, o in zip(gaps, lengths, outputs):
            out.append(RequestSpec(t, n, o))
            t += gap / rate
        return out

    rate, best = 0.05, (0.0, None)
    while rate < 1e3:
        trace = trace_at(rate)
        util = simulate(profile, sim_config, trace, seed=0).instance_utilisation
        mean = sum(util.values()) / max(1, len(util))
        if mean >= BURST_UTILISATION:
            return trace
        best = max(best, (mean, trace), key=lambda b: b[0])
        rate *= 1.25
    # A short burst of small requests can fall short of the target at any rate (all arrive at once and
    # one role idles while the other works through them): the busiest rate overlaps them the most.
    if best[1] is None or best[0] <= 0.0:
        raise RuntimeError("calibration burst: no request rate keeps the simulated instances busy")
    return best[1]


def send_burst(client, trace: list[RequestSpec], prompts: list[list[int]]) -> list[dict]:
    """Send ``trace`` (one thread per request, started at its arrival); every request must succeed."""
    rows: list[dict | None] = [None] * len(trace)
    errors: list[BaseException] = []
    t0 = time.perf_counter()

    def send(i: int) -> None:
        try:
            time.sleep(max(0.0, t0 + trace[i].arrival_s - time.perf_counter()))
            rows[i] = timed_stream(client, prompts[i], trace[i].output_tokens)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after every thread ends
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(len(trace))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"calibration burst: {len(errors)} of {len(trace)} requests failed: {errors[0]!r}")
    return rows


def measure_burst(config, trace: list[RequestSpec], seed: int, progress: bool) -> list[dict]:
    """Serve ``config`` for real and send ``trace`` (one thread per request, started at its arrival)."""
    from controller.client import Client
    from controller.server import serve_in_thread

    prompts = random_prompts(config, [r.prompt_tokens for r in trace], random.Random(seed + 1))
    with serve_in_thread(config) as address, Client(address) as client:
        for _ in client.generate_stream(prompts[0][:64], max_tokens=4, ignore_eos=True):
            pass  # warm-up
        rows = send_burst(client, trace, prompts)
    if progress:
        tqdm.write(f"calibration burst: {len(trace)} overlapping requests over {trace[-1].arrival_s:.1f} s timed")
    return rows


def fit_contention(profile: Profile, sim_config, trace: list[RequestSpec], rows: list[dict],
                   seeds: int = 3) -> tuple[float, float]:
    """(contention_scale, RMS of log(simulated / measured)) over the burst's TTFTs and decode times;
    ``profile`` carries the isolated terms of the mode.

    The distributions are compared, not request by request (the i-th shortest simulated TTFT against
    the i-th shortest measured one, and so on): which instance a request lands on when two have equally
    many requests is a tie the simulator and the real router may break differently, and one such flip
    swaps a short and a long wait between two requests without changing the distribution that SLO
    attainment depends on."""
    from controller.planner.simulator import simulate

    def quantile_sq(simulated: list[float], measured: list[float]) -> float:
        return sum(math.log(max(a, 1e-6) / max(b, 1e-6)) ** 2 for a, b in zip(sorted(simulated), sorted(measured)))

    base = profile.calibration(sim_config.mode)
    decoding = [i for i, row in enumerate(rows) if row["tokens"] > 1]
    best = (math.inf, 1.0)
    for scale in CONTENTION_GRID:
        trial = profile.with_calibration(dataclasses.replace(base, contention_scale=scale))
        sq, n = 0.0, 0
        for seed in range(seeds):
            recs = simulate(trial, sim_config, trace, seed=seed).records
            if not all(r.finished for r in recs):
                sq, n = math.inf, 1
                break
            sq += quantile_sq([r.ttft_s for r in recs], [row["ttft_s"] for row in rows])
            sq += quantile_sq([recs[i].finish_s - recs[i].first_token_s for i in decoding],
                              [rows[i]["decode_s"] for i in decoding])
            n += len(recs) + len(decoding)
        best = min(best, (sq / max(1, n), scale))
    return best[1], math.sqrt(best[0])


def _fit_offset_and_scale(predicted: list[float], measured: list[float]) -> tuple[float, float, float]:
    """measured = offset + scale * predicted (both >= 0, relative error). A zero scale would tell the
    simulator that the work is free, so when the data cannot separate the two terms (e.g. too little
    spread in the predictions) the scale is fitted alone."""
    (offset, scale), err = fit_nonnegative_relative([[1.0, p] for p in predicted], measured)
    if scale <= 0:
        (scale,), err = fit_nonnegative_relative([[p] for p in predicted], measured)
        offset = 0.0
    return offset, scale, err


def fit(profile: Profile, mode: str, rows: list[dict], chunk: int) -> Calibration:
    """The isolated terms of ``mode`` from isolated requests' rows (prompt, tokens, ttft_s, decode_s)."""
    rows = [{**r, "prompt": int(r["prompt"]), "tokens": int(r["tokens"])} for r in rows]  # stored as floats
    overhead, pscale, ttft_err = _fit_offset_and_scale(
        [predicted_prefill_s(profile, r["prompt"], chunk) for r in rows], [r["ttft_s"] for r in rows])
    tail = [kv_tail_s(profile, r["prompt"], chunk) if mode == "disaggregated" else 0.0 for r in rows]
    start, dscale, dec_err = _fit_offset_and_scale(
        [predicted_decode_s(profile, r["prompt"], r["tokens"] - 1) for r in rows],
        [max(1e-6, r["decode_s"] - t) for r, t in zip(rows, tail)])
    return Calibration(mode, overhead, pscale, start, dscale, len(rows), ttft_err, dec_err)


OUTPUT_TOKENS = (17, 33, 65)  # output lengths the calibration's requests cycle through


def max_calibration_prompt(config) -> int:
    """The longest prompt the calibration sends: the config's limit, at most 4096 tokens."""
    return min(config.limits.max_prompt_tokens, 4096)


def calibration_config(config):
    """``config`` as calibration serves it: a free port, speculation off (decode steps countable)."""
    from controller.config import parse_config, to_dict

    raw = to_dict(config)
    raw["model"]["path"] = config.model_path
    raw["server"]["port"] = 0
    raw["decode"]["speculation"] = {"drafter": "none"}
    return dataclasses.replace(parse_config(raw), source=config.source)


@dataclasses.dataclass(frozen=True)
class CalibrationRun:
    """A calibration and the measurements it was fitted to (kept in the profile, so a changed fit can be
    re-applied to the same measurements: ``refit``).

    isolated: one row per isolated request: prompt, tokens (received), ttft_s, decode_s (first -> last token);
    burst: the same per burst request, plus arrival_s and output_tokens (the trace replayed by the fit)."""

    calibration: Calibration
    isolated: list[dict[str, float]]
    burst: list[dict[str, float]]

    def samples(self) -> dict[str, list[dict[str, float]]]:
        """The measurements under the profile's ``samples`` keys of this mode."""
        mode = self.calibration.mode
        return {isolated_key(mode): self.isolated, burst_key(mode): self.burst}


def isolated_key(mode: str) -> str:
    return f"calibration/{mode}/isolated"


def burst_key(mode: str) -> str:
    return f"calibration/{mode}/burst"


def _chunk_of(run_config) -> int:
    return run_config.colocated.chunk_tokens if run_config.mode == "colocated" else run_config.prefill.chunk_tokens


def _burst_rows(trace: list[RequestSpec], rows: list[dict]) -> list[dict[str, float]]:
    return [{"arrival_s": float(t.arrival_s), "output_tokens": float(t.output_tokens),
             **{k: float(v) for k, v in r.items()}} for t, r in zip(trace, rows)]


def calibrate(config, profile: Profile, requests: int = 16, output_tokens: tuple[int, ...] = OUTPUT_TOKENS, seed: int = 0,
              progress: bool = True, burst_requests: int = 40) -> CalibrationRun:
    """Fit the serving-path terms of ``config``'s mode (speculation is switched off for the run): the
    isolated terms, then (``burst_requests`` > 0) the contention factor on a burst."""
    run_config = calibration_config(config)
    mode = run_config.mode
    chunk = _chunk_of(run_config)
    max_prompt = max_calibration_prompt(run_config)
    rows = measure(run_config, calibration_lengths(max_prompt, requests, seed), output_tokens, seed, progress)
    cal = fit(profile, mode, rows, chunk)
    if burst_requests <= 0:
        return CalibrationRun(cal, rows, [])
    from controller.planner.simulator import SimConfig

    isolated = profile.with_calibration(cal)
    sim_config = SimConfig.from_cluster_config(run_config)
    trace = burst_trace(isolated, sim_config, calibration_lengths(max_prompt, burst_requests, seed + 1),
                        output_tokens, seed)
    burst = measure_burst(run_config, trace, seed, progress)
    return CalibrationRun(with_contention(profile, cal, sim_config, trace, burst), rows, _burst_rows(trace, burst))


def with_contention(profile: Profile, cal: Calibration, sim_config, trace: list[RequestSpec],
                    burst: list[dict]) -> Calibration:
    """``cal`` (isolated terms) completed by the contention factor fitted to the burst ``trace`` measured as ``burst``."""
    scale, err = fit_contention(profile.with_calibration(cal), sim_config, trace, burst)
    return dataclasses.replace(cal, contention_scale=scale, contention_requests=len(burst), contention_fit_error=err)


def refit(config, profile: Profile) -> Calibration:
    """The calibration of ``config``'s mode fitted afresh, by this module's current fit, to the
    measurements stored in ``profile`` (by ``calibrate``; a profile without them is an error)."""
    from controller.planner.profile import ProfileError
    from controller.planner.simulator import SimConfig

    run_config = calibration_config(config)
    mode = run_config.mode
    rows = profile.samples.get(isolated_key(mode))
    if not rows:
        raise ProfileError(f"profile has no stored calibration measurements for mode {mode!r} "
                           f"(samples[{isolated_key(mode)!r}]); run `magicserve profile --calibrate-only` first")
    cal = fit(profile, mode, rows, _chunk_of(run_config))
    burst = profile.samples.get(burst_key(mode), [])
    if not burst:
        return cal
    trace = [RequestSpec(r["arrival_s"], int(r["prompt"]), int(r["output_tokens"])) for r in burst]
    return with_contention(profile, cal, SimConfig.from_cluster_config(run_config), trace, burst)
