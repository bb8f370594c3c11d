"""Pooling recorded SLO sweeps (``benchmarks/slo_sweep.py`` results) rate by rate: the checks that they may be
pooled, shared by ``benchmarks/sim_validate.py`` and ``benchmarks/slo_map.py``.

Sweeps pool when they draw the same workload: the same workload (or recorded trace), arrival process, SLOs
and cores. A sweep with an earlier sweep's seed (or of the same recorded trace) sends that sweep's requests
(a trace's lengths depend on the seed alone, its arrivals on the seed and the rate:
``planner.workload.make_trace``), so at the rates both ran they must match request by request;
a sweep with a seed not seen before is another draw (other lengths and arrivals), at any rates.
"""

from __future__ import annotations

TRACE_FIELDS = ("arrival_s", "prompt_tokens", "output_tokens")
# what every sweep pooled rate by rate must share with the first: the same workload, arrival process and SLOs
SAME_DRAW_SETTINGS = ("workload", "trace", "cv", "ttft_slo_ms", "tpot_slo_ms", "cores")
# what a sweep must share with an earlier one of its draw (the same requests) to repeat or extend it
SAME_TRACE_SETTINGS = ("workload", "trace", "seed", "num_requests", "cv", "ttft_slo_ms", "tpot_slo_ms")


class SweepMismatch(ValueError):
    """Sweeps that may not be pooled; the message names the sweep and the field or rate."""


def trace_of(row: dict) -> list[tuple]:
    """The requests of one recorded rate (arrival, prompt and output length), sorted."""
    return sorted(tuple(r[f] for f in TRACE_FIELDS) for r in row["records"])


def check_pool(sweeps: list[dict], names: list[str]) -> list[bool]:
    """Check that ``sweeps`` may be pooled rate by rate (the module docstring), raising SweepMismatch naming the
    sweep (its entry in ``names``) and the field otherwise. Per sweep: True where it repeats or extends an
    earlier sweep's draw, False where it starts one."""
    first = sweeps[0].get("settings", {})
    out = [False]
    for k in range(1, len(sweeps)):
        mine = sweeps[k].get("settings", {})
        for field in SAME_DRAW_SETTINGS:
            if mine.get(field) != first.get(field):
                raise SweepMismatch(f"{names[k]}: settings.{field} is {mine.get(field)!r}, the first sweep's is "
                                    f"{first.get(field)!r} (pooled sweeps must draw the same workload)")
        same = next((j for j in range(k) if first.get("trace")
                     or sweeps[j].get("settings", {}).get("seed") == mine.get("seed")), None)
        if same is not None:
            check_same_requests(sweeps[same], sweeps[k], names[k], SAME_TRACE_SETTINGS,
                                f"the first sweep's with seed {sweeps[same]['settings'].get('seed')}",
                                " (a sweep with an earlier sweep's seed must repeat its trace)")
        out.append(same is not None)
    return out


def check_same_requests(earlier: dict, other: dict, name: str, fields: tuple[str, ...] = SAME_TRACE_SETTINGS,
                        whose: str = "the first sweep's", why: str = "") -> None:
    """Raise SweepMismatch naming the field, or the rate, where ``other`` does not send ``earlier``'s requests:
    ``fields`` of the settings differ, or the requests at a rate both ran do. ``whose`` names ``earlier``,
    ``why`` ends the message."""
    a, b = earlier["settings"], other["settings"]
    for field in fields:
        if a.get(field) != b.get(field):
            raise SweepMismatch(f"{name}: settings.{field} is {b.get(field)!r}, {whose} is {a.get(field)!r}{why}")
    rows = {row["rate"]: row for row in earlier["rates"]}
    for row in other["rates"]:
        if row["rate"] in rows and trace_of(rows[row["rate"]]) != trace_of(row):
            raise SweepMismatch(f"{name}: the requests at rate {row['rate']} differ from {whose}{why}")
