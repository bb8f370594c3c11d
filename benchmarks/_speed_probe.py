"""The speed probe: a few lone requests of one fixed shape that the SLO sweep sends while the server is
idle (before every rate and once after the last), and how the simulator reads them.

Why: a profile describes the machine when it was taken. On a shared 2-core VM the same passes ran 15-26 %
slower 90 minutes after profiling (``benchmarks/results/same_session_13/README.md``), and near capacity a
few per cent of speed move attainment by tens of points. The probe measures the machine at the time of each
rate, through the serving path itself (the server's workers, with their threads and niceness), at almost no
cost (a few hundred milliseconds a probe).

Reading it (``speed_of``): each probe's measured TTFT over the TTFT the simulator gives the same lone request
under the profile is the machine's slowness relative to the profile then; the median of the probes around a
rate (its own set and the next one) is the rate's **speed factor**, and ``Profile.at_speed`` multiplies every
time term of the profile by it. One factor, from TTFT: a lone prompt's prefill is compute bound like the
prefill and batched decode passes under load, and free of speculation's acceptance luck. The TPOT ratio of
the same probes is reported beside it but not applied: a lone request decodes at batch 1, the pass whose
speed drifted most (1.26x where a batch of 32 drifted 1.15x, in session 13), and with speculation its TPOT
turns on how well the probe's few tokens were drafted.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

from benchmarks._slo_targets import RequestRecord, finished_normally
from controller.planner.profile import Profile
from controller.planner.simulator import SimConfig, simulate
from controller.planner.workload import RequestSpec

PROBE_PROMPT_TOKENS = 512  # capped at the trace's longest prompt (the server is sized for those)
PROBE_OUTPUT_TOKENS = 16
TPOT_SEEDS = 8  # simulations of a probe's TPOT (acceptance is random); its TTFT needs one


def probe_prompt_tokens(longest_prompt: int) -> int:
    """The probes' prompt length for a trace whose longest prompt is ``longest_prompt`` tokens."""
    return max(1, min(PROBE_PROMPT_TOKENS, longest_prompt))


async def run_probe(target, prompts: list[list[int]], tag: str) -> list[dict]:
    """Send ``prompts`` one after another (each alone on the server), greedy, ``PROBE_OUTPUT_TOKENS`` each;
    returns their records (as ``RequestRecord.to_json``, plus ``wall_time``: the Unix time each was sent).
    A failed probe is recorded with its error, like a swept request, and left out when read."""
    records = []
    for i, ids in enumerate(prompts):
        rec = RequestRecord(i, 0.0, len(ids), PROBE_OUTPUT_TOKENS)
        wall = time.time()
        try:
            await target.generate(ids, PROBE_OUTPUT_TOKENS, {"temperature": 0.0}, rec, time.perf_counter,
                                  request_id=f"{tag}-probe-{i}")
        except Exception as err:  # a probe's failure is data, like a swept request's
            rec.error = f"{type(err).__name__}: {err}"
            print(f"speed probe request failed: {rec.error}", file=sys.stderr)
        records.append({**rec.to_json(), "wall_time": wall})
    return records


def probe_latency_ms(records: list[dict]) -> dict:
    """Median TTFT and TPOT (ms, client clock) of a probe set's successful requests (None when none)."""
    ok = _usable(records, "client")
    return {"requests": len(ok),
            "ttft_p50": 1e3 * statistics.median(r["ttft_s"] for r in ok) if ok else None,
            "tpot_p50": 1e3 * statistics.median(r["tpot_s"] for r in ok if r.get("tpot_s") is not None)
            if any(r.get("tpot_s") is not None for r in ok) else None}


def probes_around(sweep: dict, index: int) -> list[dict]:
    """The probe records that bracket rate ``index`` of a recorded sweep: the set sent before it and the
    set sent after it (before the next rate, or after the last). Empty if the sweep has no probes."""
    rows = sweep["rates"]
    after = rows[index + 1].get("speed_probe") if index + 1 < len(rows) else sweep.get("speed_probe_after")
    return list(rows[index].get("speed_probe") or []) + list(after or [])


def has_probes(sweep: dict, timing: str = "client") -> bool:
    """Whether every rate of a recorded sweep is bracketed by successful probes timed on ``timing``'s clock."""
    return all(_usable(probes_around(sweep, i), timing) for i in range(len(sweep["rates"])))


def _usable(records: list[dict], timing: str) -> list[dict]:
    """The probes that finished normally and carry a TTFT on ``timing``'s clock ("client" or "server")."""
    prefix = "" if timing == "client" else "server_"
    return [r for r in records if finished_normally(r) and r.get(prefix + "ttft_s") is not None]


@dataclass(frozen=True)
class SpeedEstimate:
    """How slow the machine ran around one rate, relative to the profile (1.0: as profiled; 1.2: 20 %
    slower). ``factor`` is the median TTFT ratio; ``tpot_ratio`` the median TPOT ratio (reported only)."""

    factor: float
    ttft_ratios: tuple[float, ...]
    tpot_ratio: float | None
    probes: int


def speed_of(profile: Profile, config: SimConfig, records: list[dict], timing: str = "client") -> SpeedEstimate:
    """The speed factor of the machine when ``records`` (probe requests, each alone on the server) ran:
    median of measured / simulated TTFT, each probe simulated alone under ``profile`` without contention
    or step-time spread (a lone request has no contention; the spread has mean 1)."""
    usable = _usable(records, timing)
    if not usable:
        raise ValueError("speed probe: no successful probe requests to read")
    prefix = "" if timing == "client" else "server_"
    quiet = profile.without_contention()
    # (prompt, output) -> simulated (TTFT, mean TPOT): the probes share one shape, simulated once
    simulated: dict[tuple[int, int], tuple[float, float]] = {}
    ttft, tpot = [], []
    for rec in usable:
        shape = (rec["prompt_tokens"], rec["output_tokens"])
        if shape not in simulated:
            sims = [simulate(quiet, config, [RequestSpec(0.0, *shape)], seed=seed).records[0]
                    for seed in range(TPOT_SEEDS)]
            simulated[shape] = (sims[0].ttft_s, statistics.fmean(s.tpot_s for s in sims))
        sim_ttft, sim_tpot = simulated[shape]
        ttft.append(rec[prefix + "ttft_s"] / sim_ttft)
        if rec.get(prefix + "tpot_s") is not None and sim_tpot > 0:
            tpot.append(rec[prefix + "tpot_s"] / sim_tpot)
    return SpeedEstimate(statistics.median(ttft), tuple(ttft), statistics.median(tpot) if tpot else None, len(usable))
