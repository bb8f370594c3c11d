"""Calibration of a measured profile against the real serving path.

The profile times forward passes in isolation. A request through the running cluster also pays for
what those timings cannot see: Ray calls and polling between router and workers, the worker loops
around each pass (scheduling, sampling, KV hand-off), gRPC delivery, and the two workers sharing the
machine's memory bandwidth and caches. ``magicserve profile --calibrate`` measures that once per mode:
it serves the config for real (Ray + gRPC on localhost), sends isolated requests one at a time
(no queueing, speculation off so the decode steps are countable), and fits

    TTFT                      = ttft_overhead_s + prefill_scale * (predicted prefill steps)
    first -> last token time  = decode_start_s  + decode_scale  * (predicted decode steps) + (KV tail)

by non-negative least squares of the relative error. The simulator applies the fitted terms. The
calibration uses only isolated requests, never the loaded sweeps it is validated against.
"""

from __future__ import annotations

import dataclasses
import random
import time

from tqdm import tqdm

from controller.planner.profile import Calibration, Profile, prefill_features, transfer_features
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


def measure(config, lengths: list[int], output_tokens: tuple[int, ...], seed: int, progress: bool) -> list[dict]:
    """Serve ``config`` for real and time isolated requests (one at a time) of the given prompt lengths;
    output lengths cycle through ``output_tokens`` so the decode slope is identifiable."""
    from controller.client import Client
    from controller.server import serve_in_thread
    from modeling.checkpoint import load_config as load_model_config

    vocab = load_model_config(config.model_path).vocab_size
    rng = random.Random(seed)
    rows = []
    with serve_in_thread(config) as address, Client(address) as client:
        for i, n in enumerate([64, 64] + lengths):  # two warm-up requests first (not recorded)
            prompt = [rng.randrange(1, vocab) for _ in range(n)]
            t0 = time.perf_counter()
            first = last = None
            tokens = 0
            for chunk in client.generate_stream(prompt, max_tokens=output_tokens[i % len(output_tokens)], ignore_eos=True):
                if chunk.token_ids:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    tokens += len(chunk.token_ids)
            rows.append({"prompt": n, "tokens": tokens, "ttft_s": first - t0, "decode_s": last - first})
        rows = rows[2:]
    if progress:
        tqdm.write(f"calibration: {len(rows)} isolated requests timed")
    return rows


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
    overhead, pscale, ttft_err = _fit_offset_and_scale(
        [predicted_prefill_s(profile, r["prompt"], chunk) for r in rows], [r["ttft_s"] for r in rows])
    tail = [kv_tail_s(profile, r["prompt"], chunk) if mode == "disaggregated" else 0.0 for r in rows]
    start, dscale, dec_err = _fit_offset_and_scale(
        [predicted_decode_s(profile, r["prompt"], r["tokens"] - 1) for r in rows],
        [max(1e-6, r["decode_s"] - t) for r, t in zip(rows, tail)])
    return Calibration(mode, overhead, pscale, start, dscale, len(rows), ttft_err, dec_err)


def calibrate(config, profile: Profile, requests: int = 16, output_tokens: tuple[int, ...] = (17, 33, 65), seed: int = 0,
              progress: bool = True) -> Calibration:
    """Fit the serving-path terms of ``config``'s mode (speculation is switched off for the run)."""
    from controller.config import parse_config, to_dict

    raw = to_dict(config)
    raw["model"]["path"] = config.model_path
    raw["server"]["port"] = 0
    raw["decode"]["speculation"] = {"drafter": "none"}
    run_config = dataclasses.replace(parse_config(raw), source=config.source)
    mode = run_config.mode
    chunk = run_config.colocated.chunk_tokens if mode == "colocated" else run_config.prefill.chunk_tokens
    max_prompt = min(run_config.limits.max_prompt_tokens, 4096)
    rows = measure(run_config, calibration_lengths(max_prompt, requests, seed), output_tokens, seed, progress)
    return fit(profile, mode, rows, chunk)
