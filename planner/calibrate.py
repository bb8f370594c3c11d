"""Calibration of a measured profile against the real serving path.

The profile times forward passes in isolation. A request through the running cluster also pays for
what those timings cannot see: Ray calls and polling between router and workers, the worker loops
around each pass (scheduling, sampling, KV hand-off) and gRPC delivery. ``magicserve profile --calibrate``
measures that once per mode: it serves the config for real (Ray + gRPC on localhost), sends isolated
requests one at a time (no queueing, speculation off so the decode steps are countable), and fits

    TTFT                      = ttft_overhead_s + prefill_scale * (predicted prefill steps)
    first -> last token time  = decode_start_s  + decode_scale  * (predicted decode steps) + (KV tail)

by non-negative least squares of the relative error (``Calibration``).

The workers also hand over the passes they timed meanwhile (``modeling/pass_log.py``): the prefill
worker's own passes give ``prefill_pass_scale``, the share of the TTFT scale that holds the worker (the rest
is latency of the request path); and when the config speculates, a few isolated requests served with its
speculation give the in-place speed of verify and draft passes relative to plain decode passes
(``verify_pass_scale``, ``draft_pass_scale``), the costs the real policy learns online.

The measurements are kept in the profile's ``samples`` so ``refit`` can fit them again without serving.
Serving is the caller's: ``serve(config)`` is a context manager that serves a config and yields a client
connected to it (``frontend.server.serve_with_client``, passed in by ``magicserve profile``).
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time

from tqdm import tqdm

from controller.config import parse_config, to_dict
from decode_worker.policy import PassShape, fit_nonnegative_relative
from modeling.checkpoint import load_config as load_model_config
from planner.profile import (Calibration, Profile, ProfileError, mixed_pass_seconds, prefill_features,
                             transfer_features)


def config_threads(config) -> int:
    """Torch threads per instance of a config the calibration serves (prefill and decode alike). It serves
    single-process instances; a tensor-parallel instance's simulation takes the calibration of its ranks'
    thread count (the serving path around a pass is the driver's, the same as a single process's)."""
    pools = {"colocated": config.colocated} if config.mode == "colocated" else \
        {"prefill": config.prefill, "decode": config.decode}
    for role, pool in pools.items():
        if pool.tensor_parallel != 1:
            raise ProfileError(f"{role}.tensor_parallel: the calibration serves instances of tensor_parallel 1, "
                               f"got {pool.tensor_parallel}")
    if config.mode == "colocated":
        return config.colocated.threads
    if config.prefill.threads != config.decode.threads:
        raise ProfileError(f"prefill.threads / decode.threads: the calibration serves instances of one thread count, "
                           f"got {config.prefill.threads} and {config.decode.threads}")
    return config.prefill.threads


def predicted_prefill_s(profile: Profile, prompt: int, chunk: int, threads: int = 1) -> float:
    model = profile.prefill_model(1, threads)
    return sum(model.predict(prefill_features([(s, min(chunk, prompt - s))])) for s in range(0, prompt, chunk))


def predicted_decode_s(profile: Profile, prompt: int, tokens: int, threads: int = 1) -> float:
    """Plain decode steps of one sequence producing ``tokens`` tokens after the first."""
    model = profile.target_model(1, threads)
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
    vocab = load_model_config(config.model_path).vocab_size
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


def drain_passes(config) -> list[dict]:
    """The passes the workers of the cluster serving ``config`` timed since the last drain
    (``modeling/pass_log.py``), as ``pass_row`` rows whose ``worker`` is the worker's index."""
    import ray  # Ray: profile_cli (so `magicserve --help`) imports this module; only a served cluster needs it

    names = [f"{role}-{i}" for role, pool in config.pools.items() for i in range(pool.instances)]
    actors = [ray.get_actor(f"magicserve-{n}", namespace=config.ray.namespace) for n in names]
    logs = ray.get([a.pass_log.remote() for a in actors])
    return [pass_row(r, worker) for worker, log in enumerate(logs) for r in log]


ROLE_OF_KIND = {"prefill": "prefill", "decode": "decode", "draft": "decode", "verify": "decode", "step": "decode",
                "mixed": "colocated"}
DECODE_FIELDS = ("seqs", "kv_tokens", "new_tokens", "k")  # k: step records only
MIXED_DECODE_FIELDS = ("decode_seqs", "decode_kv_tokens")  # a mixed pass's decode part


def pass_row(record: dict, worker: int | None = None) -> dict:
    """A pass-log record (``PassRecord`` as a dict) as a flat row: ``kind``, ``seconds``, ``end_s``, the
    ``worker`` that logged it (an index, when given) and its shape: a prefill pass its ``prefill_features``,
    decode-role records ``passes`` and ``DECODE_FIELDS``, a mixed pass the ``prefill_features`` of its
    chunks and ``MIXED_DECODE_FIELDS``."""
    shape = record["shape"]
    if record["kind"] in ("prefill", "mixed"):
        fields = prefill_features([tuple(c) for c in shape["chunks"]])
        if record["kind"] == "mixed":
            fields.update({f: shape[f] for f in MIXED_DECODE_FIELDS})
    else:
        fields = {"passes": shape.get("passes", 1), **{f: shape.get(f, 0) for f in DECODE_FIELDS}}
    row = {"kind": record["kind"], "seconds": record["seconds"], "end_s": record["end_s"], **fields}
    if worker is not None:
        row["worker"] = worker
    return row


def predicted_s(profile: Profile, row: dict, drafter: str | None = None, tps: dict[str, int] | None = None) -> float:
    """The profile's time for a logged pass on a single-process instance of ``tps[role]`` threads (default
    1, as on the CPU cluster)."""
    shape = (1, (tps or {}).get(ROLE_OF_KIND[row["kind"]], 1))
    if row["kind"] == "prefill":
        return profile.prefill_model(*shape).predict(row)
    if row["kind"] == "mixed":
        return mixed_pass_seconds(profile.prefill_model(*shape), profile.target_model(*shape), row,
                                  int(row["decode_seqs"]), int(row["decode_kv_tokens"]))
    pass_shape = PassShape(int(row["seqs"]), int(row["kv_tokens"]), int(row["new_tokens"]), int(row.get("passes", 1)))
    if row["kind"] == "draft":
        if drafter is None:
            raise ValueError("draft passes need the drafter's name")
        return profile.draft_model(drafter, *shape).predict_pass(pass_shape)
    return profile.target_model(*shape).predict_pass(pass_shape)


def measure(config, serve, lengths: list[int], output_tokens: tuple[int, ...], seed: int, progress: bool
            ) -> tuple[list[dict], list[dict]]:
    """Serve ``config`` for real (``serve``: see the module doc) and time isolated requests (one at a time)
    of the given prompt lengths; output lengths cycle through ``output_tokens`` so the decode slope is
    identifiable. Returns the requests' rows and the workers' timed passes."""
    prompts = random_prompts(config, [64, 64] + lengths, random.Random(seed))
    shift = 2 % len(output_tokens)  # the timed requests' outputs continue the warm-ups' cycle
    with serve(config) as client:
        time_isolated(client, prompts[:2], output_tokens)  # two warm-up requests (not recorded)
        drain_passes(config)
        rows = time_isolated(client, prompts[2:], output_tokens[shift:] + output_tokens[:shift])
        passes = drain_passes(config)
    if progress:
        tqdm.write(f"calibration: {len(rows)} isolated requests timed")
    return rows, passes


SPECULATIVE_REQUESTS = 8  # isolated requests served with speculation for the pass scales
SPECULATIVE_OUTPUT_TOKENS = 65
MIN_REFERENCE_PASSES = 10  # plain decode passes of the speculating run needed to serve as the reference


def measure_speculative_passes(config, serve, lengths: list[int], seed: int, progress: bool) -> list[dict]:
    """Serve ``config`` with its speculation for real (``serve``: see the module doc), isolated requests of
    the given prompt lengths (``SPECULATIVE_OUTPUT_TOKENS`` each); the workers' timed passes
    (``drain_passes``)."""
    prompts = random_prompts(config, [64] + lengths, random.Random(seed + 5))
    with serve(config) as client:
        time_isolated(client, prompts[:1], (8,))  # warm-up
        drain_passes(config)
        time_isolated(client, prompts[1:], (SPECULATIVE_OUTPUT_TOKENS,))
        passes = drain_passes(config)
    if progress:
        tqdm.write(f"calibration: {len(lengths)} isolated requests with speculation, "
                   f"{sum(p['kind'] == 'verify' for p in passes)} verify passes timed")
    return passes


def _median_ratio(profile: Profile, kind: str, passes: list[dict], drafter: str | None = None,
                  tps: dict[str, int] | None = None) -> float | None:
    """Median measured / profiled time of stored pass rows of ``kind`` (None: no rows)."""
    ratios = [p["seconds"] / predicted_s(profile, {"kind": kind, **p}, drafter, tps) for p in passes]
    return statistics.median(ratios) if ratios else None


def fit_prefill_pass_scale(profile: Profile, prefill_passes: list[dict], threads: int = 1) -> float:
    """Median measured / profiled time of the prefill worker's own passes in place (0.0: none logged)."""
    return _median_ratio(profile, "prefill", prefill_passes, tps={"prefill": threads}) or 0.0


def fit_pass_scales(profile: Profile, drafter: str, decode_passes: list[dict], verify_passes: list[dict],
                    draft_passes: list[dict], threads: int = 1) -> tuple[float, float, int]:
    """(verify_pass_scale, draft_pass_scale, verify passes used): the median measured / profiled time of
    verify and of draft passes over that of plain decode passes (one device per instance, as the local
    cluster runs). (1.0, 1.0, 0) when a kind is missing (e.g. the policy never speculated).

    Served, a speculating worker's verify pass may cost less relative to its plain decode pass than the
    profile says; the real policy learns its costs in place, so the simulated one must weigh the same ratios."""
    tps = {"decode": threads}
    plain = _median_ratio(profile, "decode", decode_passes, tps=tps)
    verify = _median_ratio(profile, "verify", verify_passes, tps=tps)
    draft = _median_ratio(profile, "draft", draft_passes, drafter, tps)
    if not plain or not verify or not draft:
        return 1.0, 1.0, 0
    return verify / plain, draft / plain, len(verify_passes)


def _fit_offset_and_scale(predicted: list[float], measured: list[float]) -> tuple[float, float, float]:
    """measured = offset + scale * predicted (both >= 0, relative error). A zero scale would tell the
    simulator that the work is free, so when the data cannot separate the two terms (e.g. too little
    spread in the predictions) the scale is fitted alone."""
    (offset, scale), err = fit_nonnegative_relative([[1.0, p] for p in predicted], measured)
    if scale <= 0:
        (scale,), err = fit_nonnegative_relative([[p] for p in predicted], measured)
        offset = 0.0
    return offset, scale, err


def fit(profile: Profile, mode: str, rows: list[dict], chunk: int, prefill_passes: list[dict] | None = None,
        threads: int = 1) -> Calibration:
    """The isolated terms of ``mode`` from isolated requests' rows (prompt, tokens, ttft_s, decode_s), and
    the prefill worker's in-place pass scale from its timed passes during them (``prefill_passes``: rows of
    ``prefill_features`` and ``seconds``; none: the simulator charges the whole TTFT scale to the worker)."""
    rows = [{**r, "prompt": int(r["prompt"]), "tokens": int(r["tokens"])} for r in rows]  # stored as floats
    overhead, pscale, ttft_err = _fit_offset_and_scale(
        [predicted_prefill_s(profile, r["prompt"], chunk, threads) for r in rows], [r["ttft_s"] for r in rows])
    tail = [kv_tail_s(profile, r["prompt"], chunk) if mode == "disaggregated" else 0.0 for r in rows]
    start, dscale, dec_err = _fit_offset_and_scale(
        [predicted_decode_s(profile, r["prompt"], r["tokens"] - 1, threads) for r in rows],
        [max(1e-6, r["decode_s"] - t) for r, t in zip(rows, tail)])
    pass_scale = fit_prefill_pass_scale(profile, prefill_passes or [], threads)
    return Calibration(mode, overhead, pscale, start, dscale, len(rows), ttft_err, dec_err,
                       prefill_pass_scale=min(pass_scale, pscale), threads=threads)


OUTPUT_TOKENS = (17, 33, 65)  # output lengths the calibration's requests cycle through


def max_calibration_prompt(config) -> int:
    """The longest prompt the calibration sends: the config's limit, at most 4096 tokens."""
    return min(config.limits.max_prompt_tokens, 4096)


def calibration_config(config, keep_speculation: bool = False):
    """``config`` as calibration serves it: a free port, speculation off (decode steps countable) unless
    ``keep_speculation``."""
    raw = to_dict(config)
    raw["model"]["path"] = config.model_path
    raw["server"]["port"], raw["server"]["http_port"] = 0, None
    if not keep_speculation:
        raw["decode"]["speculation"] = {"drafter": "none"}
    return dataclasses.replace(parse_config(raw), source=config.source)


@dataclasses.dataclass(frozen=True)
class CalibrationRun:
    """A calibration and the measurements it was fitted to (kept in the profile, so a changed fit can be
    re-applied to the same measurements: ``refit``).

    isolated: one row per isolated request: prompt, tokens (received), ttft_s, decode_s (first -> last token)."""

    calibration: Calibration
    isolated: list[dict[str, float]]
    passes: dict[str, list[dict[str, float]]] = dataclasses.field(default_factory=dict)  # kind -> drain_passes rows

    def samples(self) -> dict[str, list[dict[str, float]]]:
        """The measurements under the profile's ``samples`` keys of this mode and thread count."""
        mode, t = self.calibration.mode, self.calibration.threads
        return {isolated_key(mode, t): self.isolated,
                **{passes_key(mode, kind, t): rows for kind, rows in self.passes.items()}}


def samples_prefix(mode: str, threads: int = 1) -> str:
    """Where a calibration's measurements sit in a profile's ``samples``."""
    return f"calibration/{mode}/" if threads == 1 else f"calibration/{mode}@{threads}t/"


def isolated_key(mode: str, threads: int = 1) -> str:
    return samples_prefix(mode, threads) + "isolated"


PASS_SAMPLE_KINDS = ("decode", "verify", "draft")  # the speculative pass scales' inputs (``with_pass_scales``)


def passes_key(mode: str, kind: str, threads: int = 1) -> str:
    return samples_prefix(mode, threads) + f"passes/{kind}"


def pass_rows(passes: list[dict], kind: str) -> list[dict[str, float]]:
    """The ``drain_passes`` rows of ``kind`` as stored in a profile's samples (floats, without the kind)."""
    return [{f: float(v) for f, v in p.items() if f != "kind"} for p in passes if p["kind"] == kind]


def with_pass_scales(profile: Profile, cal: Calibration, spec, passes: dict[str, list[dict]]) -> Calibration:
    """``cal`` with the speculative pass scales fitted to ``passes`` (kind -> rows), for drafter ``spec``."""
    if not spec.enabled or not all(passes.get(k) for k in PASS_SAMPLE_KINDS):
        return cal
    verify, draft, n = fit_pass_scales(profile, spec.drafter, passes["decode"], passes["verify"], passes["draft"],
                                       cal.threads)
    return dataclasses.replace(cal, verify_pass_scale=verify, draft_pass_scale=draft, speculative_passes=n)


def _chunk_of(run_config) -> int:
    return run_config.colocated.token_budget if run_config.mode == "colocated" else run_config.prefill.token_budget


def calibrate(config, profile: Profile, serve, requests: int = 16, output_tokens: tuple[int, ...] = OUTPUT_TOKENS,
              seed: int = 0, progress: bool = True) -> CalibrationRun:
    """Fit the serving-path terms of ``config``'s mode on isolated requests served by ``serve`` (see the
    module doc; speculation is switched off for the run; a speculating config's verify and draft pass scales
    come from a second run with it on)."""
    run_config = calibration_config(config)
    mode, threads = run_config.mode, config_threads(run_config)
    max_prompt = max_calibration_prompt(run_config)
    rows, plain_passes = measure(run_config, serve, calibration_lengths(max_prompt, requests, seed), output_tokens,
                                 seed, progress)
    passes: dict[str, list[dict[str, float]]] = {"prefill": pass_rows(plain_passes, "prefill")} if plain_passes else {}
    cal = fit(profile, mode, rows, _chunk_of(run_config), passes.get("prefill", []), threads)
    spec = config.decode.speculation if mode == "disaggregated" else None
    if spec is not None and spec.enabled:
        spec_passes = measure_speculative_passes(calibration_config(config, keep_speculation=True), serve,
                                                 calibration_lengths(max_prompt, SPECULATIVE_REQUESTS, seed + 7),
                                                 seed, progress)
        # the reference: plain decode passes of the speculating worker itself (its k = 0 steps), the costs
        # its policy weighs against each other; the speculation-off run's when it hardly ever took k = 0
        reference = pass_rows(spec_passes, "decode")
        passes.update({"decode": reference if len(reference) >= MIN_REFERENCE_PASSES else pass_rows(plain_passes, "decode"),
                       **{k: pass_rows(spec_passes, k) for k in ("verify", "draft")}})
        cal = with_pass_scales(profile, cal, spec, passes)
    return CalibrationRun(cal, rows, {k: v for k, v in passes.items() if v})


def refit(config, profile: Profile) -> Calibration:
    """The calibration of ``config``'s mode fitted afresh, by this module's current fit, to the
    measurements stored in ``profile`` (by ``calibrate``; a profile without them is an error)."""
    run_config = calibration_config(config)
    mode, t = run_config.mode, config_threads(run_config)
    rows = profile.samples.get(isolated_key(mode, t))
    if not rows:
        raise ProfileError(f"profile has no stored calibration measurements for mode {mode!r} at {t} thread(s) "
                           f"(samples[{isolated_key(mode, t)!r}]); run `magicserve profile --calibrate-only` first")
    cal = fit(profile, mode, rows, _chunk_of(run_config), profile.samples.get(passes_key(mode, "prefill", t), []), t)
    if mode == "disaggregated":
        passes = {k: profile.samples.get(passes_key(mode, k, t), []) for k in PASS_SAMPLE_KINDS}
        cal = with_pass_scales(profile, cal, config.decode.speculation, passes)
    return cal
