"""Goodput ratio of two systems over a grid of SLOs, from their recorded SLO sweeps: where one system beats
the other by a target factor, and where it cannot.

    python benchmarks/slo_map.py CANDIDATE.json BASELINE.json [BASELINE2.json ...] --ratio-target 1.5 \\
        --out benchmarks/results/slo_map_long_doc

A sweep (``benchmarks/slo_sweep.py``) keeps every request's TTFT and TPOT, so the attainment of any other
SLO pair is a recount of the same records at every swept rate, and the goodput (highest rate with attainment
>= the target, ``planner.slo.goodput``) follows without another run. This script does that for
each (TTFT SLO, TPOT SLO) cell of a grid and divides the candidate's goodput per core by the baseline's.
Given several baseline sweeps (say, two splits of the colocated engine over the same cores), each cell
compares with the best of them there: the candidate has to beat every configuration, not a chosen one.
Any system may be given as several sweeps (``A1.json,A2.json``), pooled rate by rate: repeats of one trace
(checked request by request), or other draws of the same workload (another ``--seed``: other lengths and
arrivals, the same workload, arrival process and SLOs, checked), whose rates may differ: each rate pools
the sweeps that ran it. Repeats of one trace share its lengths, so their pooled requests vary less than the
workload does; other draws add that variation to the bootstrap.

Two things make a cell's ratio uncertain, and both are reported:

* the swept rates bound what a sweep can say: a system still meeting the target at its highest rate has a
  goodput of *at least* that rate; one missing it at its lowest rate has a goodput *below* it. Each goodput
  is an interval, so each ratio is an interval ``[lo, hi]``;
* attainment at each rate is a share of a few dozen requests. ``--bootstrap N`` resamples the requests of
  every rate (with replacement, independently per system) N times and recomputes the ratio; the share of
  resamples at or above the ratio target is the confidence that the target holds there.

A cell's verdict: ``met`` when the ratio's lower bound reaches the target and at least ``--confidence`` of
the resamples do; ``not met`` when the upper bound is below the target and at least ``--confidence`` of the
resamples are; ``undefined`` when neither system meets the attainment target at any swept rate;
``uncertain`` otherwise. Writes PREFIX.json (every cell), PREFIX.md (the ratio grid, the
verdicts, the cell of the sweeps' own SLO) and PREFIX.png (both systems' goodput maps and the ratio map).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import textwrap
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._sweeps import SweepMismatch, check_pool  # noqa: E402
from benchmarks.slo_sweep import TIMINGS, outcome_of  # noqa: E402
from planner.slo import RequestOutcome, attainment, goodput  # noqa: E402

DEFAULT_TTFT_SLOS_S = "1,1.5,2,3,4,5,6,8,10,15"
DEFAULT_TPOT_SLOS_MS = "15,20,25,30,40,50,75,100,150"
VERDICTS = ("met", "not met", "uncertain", "undefined")


class MapError(ValueError):
    """A sweep file or a setting this script cannot use; the message names it."""


@dataclass(frozen=True)
class SweepOutcomes:
    """One system's recorded sweep as the SLO definition sees it: per swept rate, every request's outcome."""

    label: str
    cores: float
    workload: str
    rates: list[float]  # ascending
    outcomes: list[list[RequestOutcome]]  # per rate
    settings: dict  # the sweep's recorded settings (SLOs, attainment target, ...)


@dataclass(frozen=True)
class Goodput:
    """A goodput per core (req/s/core) and the interval the swept rates allow: ``[value, inf)`` when even the
    highest rate met the target, ``[0, lowest rate)`` (value 0) when even the lowest rate missed it."""

    value: float
    lo: float
    hi: float


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise MapError(f"{path}: cannot read a sweep JSON ({err})") from None


def load_sweep(spec: str, timing: str = "client") -> SweepOutcomes:
    """Read a ``slo_sweep.py`` JSON file, or several as comma-separated files pooled rate by rate (the module
    docstring; ``benchmarks/_sweeps.py``): every sweep must draw the first's workload, and a sweep with an
    earlier one's seed must send its requests (at the rates both ran, request by request). ``timing``: whose
    clock the TTFT / TPOT come from."""
    paths = [p for p in spec.split(",") if p]
    sweeps = [_read_json(p) for p in paths]
    parts = [sweep_outcomes(sweep, path, timing) for sweep, path in zip(sweeps, paths)]
    try:
        check_pool(sweeps, paths)
    except SweepMismatch as err:
        raise MapError(str(err)) from None
    if len(parts) == 1:
        return parts[0]
    rates = sorted({r for part in parts for r in part.rates})
    pooled = [[o for part in parts if r in part.rates for o in part.outcomes[part.rates.index(r)]] for r in rates]
    return dataclasses.replace(parts[0], label=f"{parts[0].label} ({len(parts)} runs pooled)", rates=rates,
                               outcomes=pooled)


def sweep_outcomes(sweep: dict, source: str, timing: str = "client") -> SweepOutcomes:
    """A parsed ``slo_sweep.py`` result as the SLO definition sees it; ``source`` names it in errors."""
    if not isinstance(sweep, dict) or sweep.get("benchmark") != "slo_sweep" or not sweep.get("rates"):
        raise MapError(f"{source}: not an slo_sweep result with rates")
    rows = sorted(sweep["rates"], key=lambda r: r["rate"])
    rates = [float(r["rate"]) for r in rows]
    if any(b <= a for a, b in zip(rates, rates[1:])):
        raise MapError(f"{source}: a rate appears twice ({rates})")
    if any(not r.get("records") for r in rows):
        raise MapError(f"{source}: a rate has no per-request records")
    settings = sweep.get("settings", {})
    cores = settings.get("cores")
    if cores is None or not cores > 0:
        raise MapError(f"{source}: settings.cores: must be > 0 (the sweep's --cores), got {cores}")
    return SweepOutcomes(settings.get("label") or os.path.basename(source), float(cores),
                         str(settings.get("workload")), rates,
                         [[outcome_of(rec, timing) for rec in r["records"]] for r in rows], settings)


def attained(outcomes: list[RequestOutcome], ttft_s: float, tpot_s: float) -> float:
    return attainment(outcomes, ttft_s, tpot_s).both


def goodput_of(sweep: SweepOutcomes, ttft_s: float, tpot_s: float, target: float,
               outcomes: list[list[RequestOutcome]] | None = None) -> Goodput:
    """Goodput per core of ``sweep`` (or of ``outcomes``, a resample of its requests) at one SLO pair."""
    shares = [attained(o, ttft_s, tpot_s) for o in (outcomes if outcomes is not None else sweep.outcomes)]
    value = goodput(sweep.rates, shares, target) / sweep.cores
    if shares[-1] >= target:
        return Goodput(value, value, math.inf)
    if shares[0] < target:
        return Goodput(0.0, 0.0, sweep.rates[0] / sweep.cores)
    return Goodput(value, value, value)


def best_of(goodputs: list[Goodput]) -> tuple[int, Goodput]:
    """The baseline with the highest goodput (the first of equals), and the interval of the best goodput:
    at least the highest lower bound, at most the highest upper bound."""
    best = max(range(len(goodputs)), key=lambda i: goodputs[i].value)
    return best, Goodput(goodputs[best].value, max(g.lo for g in goodputs), max(g.hi for g in goodputs))


def ratio(cand: float, base: float) -> float:
    """cand / base; inf when only the baseline is 0, nan when both are."""
    if base <= 0:
        return math.inf if cand > 0 else math.nan
    return cand / base


def ratio_bounds(gc: Goodput, gb: Goodput) -> tuple[float, float]:
    """The ratio interval the two goodput intervals allow."""
    lo = ratio(gc.lo, gb.hi) if math.isfinite(gb.hi) else 0.0
    hi = ratio(gc.hi, gb.lo)
    return (0.0 if math.isnan(lo) else lo), (math.inf if math.isnan(hi) else hi)


def resample(sweep: SweepOutcomes, rng: random.Random) -> list[list[RequestOutcome]]:
    """The requests of every rate drawn again with replacement (same count per rate)."""
    return [[o[rng.randrange(len(o))] for _ in o] for o in sweep.outcomes]


def bootstrap_summary(ratios: list[float], ratio_target: float) -> dict:
    """The resampled ratios' 5 / 50 / 95 % quantiles (over those with a ratio: nan, both goodputs 0, has none and
    would break the sort), how many had none, and the share of all resamples at or above ``ratio_target``."""
    defined = sorted(r for r in ratios if not math.isnan(r))
    q = lambda p: defined[min(len(defined) - 1, int(p * len(defined)))] if defined else math.nan  # noqa: E731
    return {"resamples": len(ratios), "q05": q(0.05), "q50": q(0.5), "q95": q(0.95),
            "share_at_target": sum(r >= ratio_target for r in defined) / len(ratios),
            "undefined": len(ratios) - len(defined)}


def verdict(lo: float, hi: float, share_at_target: float | None, ratio_target: float, confidence: float) -> str:
    """``met`` / ``not met`` / ``uncertain`` (module docstring); without a bootstrap only the bounds decide."""
    if lo >= ratio_target and (share_at_target is None or share_at_target >= confidence):
        return "met"
    if hi < ratio_target and (share_at_target is None or 1.0 - share_at_target >= confidence):
        return "not met"
    return "uncertain"


def slo_map(cand: SweepOutcomes, bases: list[SweepOutcomes], ttft_slos_s: list[float], tpot_slos_s: list[float],
            target: float, ratio_target: float, bootstrap: int = 0, confidence: float = 0.95,
            seed: int = 0) -> list[dict]:
    """One dict per (TTFT, TPOT) cell, TTFT-major: the candidate's goodput per core and the best baseline's
    (which one, and every baseline's), with their intervals; the point ratio and its bounds; the bootstrap's
    5 / 50 / 95 % quantiles and share at or above ``ratio_target``; the verdict."""
    rng = random.Random(seed)
    draws = [(resample(cand, rng), [resample(b, rng) for b in bases]) for _ in range(bootstrap)]
    cells = []
    for ttft in ttft_slos_s:
        for tpot in tpot_slos_s:
            gc = goodput_of(cand, ttft, tpot, target)
            each = [goodput_of(b, ttft, tpot, target) for b in bases]
            best, gb = best_of(each)
            lo, hi = ratio_bounds(gc, gb)
            cell = {"ttft_slo_s": ttft, "tpot_slo_s": tpot, "candidate": vars(gc), "baseline": vars(gb),
                    "baseline_index": best, "baselines": [vars(g) for g in each],
                    "ratio": ratio(gc.value, gb.value), "ratio_lo": lo, "ratio_hi": hi, "bootstrap": None}
            if draws:
                cell["bootstrap"] = bootstrap_summary(
                    [ratio(goodput_of(cand, ttft, tpot, target, dc).value,
                           max(goodput_of(b, ttft, tpot, target, d).value for b, d in zip(bases, dbs)))
                     for dc, dbs in draws], ratio_target)
            share = cell["bootstrap"]["share_at_target"] if draws else None
            cell["verdict"] = ("undefined" if math.isnan(cell["ratio"])
                               else verdict(lo, hi, share, ratio_target, confidence))
            cells.append(cell)
    return cells


# --------------------------------------------------------------------------------------------------
# output


def _fmt_ratio(cell: dict) -> str:
    """The ratio as far as the swept rates determine it: exact, a bound, ``?`` (no bound), ``-`` (no goodput)."""
    r, lo, hi = cell["ratio"], cell["ratio_lo"], cell["ratio_hi"]
    if math.isnan(r):
        return "-"
    if lo == hi:
        return f"{r:.2f}"
    if math.isinf(hi) and lo > 0:
        return f">= {lo:.2f}"
    if lo == 0 and math.isfinite(hi):
        return f"<= {hi:.2f}"
    return "?"


def _shown_ratio(cell: dict) -> float:
    """The ratio a map cell is coloured by: the exact value or the bound shown, clipped to [1/8, 8]; nan
    where there is neither (``-`` / ``?``)."""
    if _fmt_ratio(cell) in ("-", "?"):
        return math.nan
    value = cell["ratio_lo"] if cell["ratio_lo"] > 0 else cell["ratio_hi"]
    return min(8.0, max(1 / 8, value))


_MARK = {"met": "**", "not met": "", "uncertain": "_", "undefined": ""}


def _grid_rows(ttft_slos_s: list[float], tpot_slos_s: list[float], cell_text) -> list[str]:
    """A markdown table: a row per TTFT SLO, a column per TPOT SLO, ``cell_text(ttft, tpot)`` in each cell."""
    lines = ["| TTFT SLO \\ TPOT SLO | " + " | ".join(f"{1e3 * t:g} ms" for t in tpot_slos_s) + " |",
             "|---|" + "---:|" * len(tpot_slos_s)]
    for ttft in ttft_slos_s:
        lines.append(f"| {ttft:g} s | " + " | ".join(cell_text(ttft, tpot) for tpot in tpot_slos_s) + " |")
    return lines


def markdown(cand: SweepOutcomes, bases: list[SweepOutcomes], cells: list[dict], ttft_slos_s: list[float],
             tpot_slos_s: list[float], target: float, ratio_target: float, confidence: float, bootstrap: int,
             own_slo: tuple[float, float] | None, prefix: str, command: str, timing: str) -> str:
    by = {(c["ttft_slo_s"], c["tpot_slo_s"]): c for c in cells}
    base_name = bases[0].label if len(bases) == 1 else "the best of " + ", ".join(b.label for b in bases)
    rates = lambda s: ", ".join(f"{r:g}" for r in s.rates)  # noqa: E731
    lines = [f"# Goodput per core, {cand.label} over {base_name}, across SLOs ({cand.workload})", "",
             f"`{command}`", "",
             f"Goodput = highest swept rate with >= {target:.0%} of requests meeting both SLOs ({timing} clock), "
             "recounted from the sweeps' per-request records for every cell, per core; ratio = candidate / baseline"
             + (" (in each cell the baseline with the highest goodput there)" if len(bases) > 1 else "") + ". "
             f"Rates swept (req/s): {cand.label} ({cand.cores:g} cores) {rates(cand)}; "
             + "; ".join(f"{b.label} ({b.cores:g} cores) {rates(b)}" for b in bases) + ".", "",
             f"**bold**: ratio >= {ratio_target:g} holds (its lower bound reaches it"
             + (f" and {confidence:.0%} of {bootstrap} bootstrap resamples do" if bootstrap else "") + "); "
             "_italic_: uncertain; plain: it does not hold. `>=` / `<=`: bounded by the swept rates; `?`: both "
             "systems met the target at every swept rate (no bound); `-`: neither met it at any swept rate.", ""]
    counts = {v: sum(c["verdict"] == v for c in cells) for v in VERDICTS}
    lines += [f"Cells: {counts['met']} met, {counts['not met']} not met, {counts['uncertain']} uncertain, "
              f"{counts['undefined']} with no goodput for either side, of {len(cells)}.", ""]

    def ratio_text(ttft: float, tpot: float) -> str:
        c = by[(ttft, tpot)]
        return f"{_MARK[c['verdict']]}{_fmt_ratio(c)}{_MARK[c['verdict']]}"

    lines += _grid_rows(ttft_slos_s, tpot_slos_s, ratio_text)
    if own_slo is not None and own_slo in by:
        c = by[own_slo]
        lines += ["", f"At the sweeps' own SLO (TTFT {own_slo[0]:g} s, TPOT {1e3 * own_slo[1]:g} ms): candidate "
                  f"{_fmt_goodput(c['candidate'])}, baseline {_fmt_goodput(c['baseline'])} req/s/core"
                  + (f" ({bases[c['baseline_index']].label})" if len(bases) > 1 else "")
                  + f", ratio {_fmt_ratio(c)}, verdict **{c['verdict']}**" + _fmt_boot(c) + "."]
    lines += ["", "Goodput per core (req/s/core) of each system:", ""]
    systems = [(cand.label, lambda c: c["candidate"])] + [(b.label, lambda c, i=i: c["baselines"][i]) for i, b in enumerate(bases)]
    for label, pick in systems:
        lines += [f"{label}:", ""]
        lines += _grid_rows(ttft_slos_s, tpot_slos_s, lambda ttft, tpot, pick=pick: _fmt_goodput(pick(by[(ttft, tpot)])))
        lines.append("")
    lines += [f"![goodput and ratio maps]({os.path.basename(prefix)}.png)", ""]
    return "\n".join(lines)


def _fmt_goodput(g: dict) -> str:
    if math.isinf(g["hi"]):
        return f">= {g['value']:.3g}"
    if g["value"] == 0:
        return f"< {g['hi']:g}"
    return f"{g['value']:.3g}"


def _fmt_boot(cell: dict) -> str:
    b = cell["bootstrap"]
    if not b:
        return ""
    undefined = f" ({b['undefined']} with no goodput for either side)" if b["undefined"] else ""
    return (f"; bootstrap ratio 5-95 %: {b['q05']:.2f}-{b['q95']:.2f} over the resamples with a ratio; "
            f"{b['share_at_target']:.0%} of {b['resamples']} resamples at or above the target{undefined}")


def plot(path: str, cand: SweepOutcomes, bases: list[SweepOutcomes], cells: list[dict], ttft_slos_s: list[float],
         tpot_slos_s: list[float], ratio_target: float, own_slo: tuple[float, float] | None) -> None:
    """Three heat maps over (TPOT SLO, TTFT SLO): the (best) baseline's goodput per core, the candidate's, and
    the ratio (log colour scale centred on 1), with the cells where the ratio target is met outlined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm

    by = {(c["ttft_slo_s"], c["tpot_slo_s"]): c for c in cells}
    at = lambda i, j: by[(ttft_slos_s[i], tpot_slos_s[j])]  # noqa: E731
    grid = lambda f: np.array([[f(by[(y, x)]) for x in tpot_slos_s] for y in ttft_slos_s], dtype=float)  # noqa: E731
    base_name = bases[0].label if len(bases) == 1 else "best of " + " / ".join(b.label for b in bases)
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.6))
    vmax = max(1e-9, max(max(c["candidate"]["value"], c["baseline"]["value"]) for c in cells))
    for ax, name, label in ((axes[0], "baseline", f"baseline: {base_name}"), (axes[1], "candidate", f"candidate: {cand.label}")):
        g = grid(lambda c, n=name: c[n]["value"])
        im = ax.imshow(g, origin="lower", cmap="viridis", vmin=0, vmax=vmax, aspect="auto")
        for (i, j), v in np.ndenumerate(g):
            text = ("≥" if math.isinf(at(i, j)[name]["hi"]) else "") + (f"{v:.2f}" if v > 0 else "0")
            ax.text(j, i, text, ha="center", va="center", fontsize=7, color="white" if v < 0.6 * vmax else "black")
        ax.set_title(textwrap.fill(label, 60) + "\ngoodput per core (req/s/core)", fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.046)
    im = axes[2].imshow(grid(_shown_ratio), origin="lower", cmap="RdBu", norm=LogNorm(1 / 8, 8), aspect="auto")
    for i in range(len(ttft_slos_s)):
        for j in range(len(tpot_slos_s)):
            cell = at(i, j)
            axes[2].text(j, i, _fmt_ratio(cell).replace(">= ", "≥").replace("<= ", "≤"), ha="center", va="center",
                         fontsize=7)
            if cell["verdict"] == "met":
                axes[2].add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=2))
    axes[2].set_title(f"ratio per core, candidate / baseline\n(outlined: >= {ratio_target:g} holds)", fontsize=9)
    fig.colorbar(im, ax=axes[2], fraction=0.046)
    for ax in axes:
        ax.set_xticks(range(len(tpot_slos_s)), [f"{1e3 * t:g}" for t in tpot_slos_s], fontsize=8)
        ax.set_yticks(range(len(ttft_slos_s)), [f"{t:g}" for t in ttft_slos_s], fontsize=8)
        ax.set_xlabel("TPOT SLO (ms)")
        ax.set_ylabel("TTFT SLO (s)")
        if own_slo is not None and own_slo[0] in ttft_slos_s and own_slo[1] in tpot_slos_s:
            ax.plot(tpot_slos_s.index(own_slo[1]), ttft_slos_s.index(own_slo[0]), marker="*", markersize=16,
                    markerfacecolor="none", markeredgecolor="orange", markeredgewidth=1.8)
    fig.suptitle(f"{cand.workload}: goodput at the attainment target across SLOs (star: the sweeps' own SLO)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _json_safe(value):
    """``value`` with every non-finite float written as the string "inf", "-inf" or "nan" (JSON has none)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _numbers(text: str, flag: str, scale: float = 1.0) -> list[float]:
    try:
        values = sorted({float(v) * scale for v in text.split(",") if v.strip()})
    except ValueError:
        raise MapError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if not values or values[0] <= 0:
        raise MapError(f"{flag}: need at least one value, all > 0, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("candidate", help="slo_sweep JSON of the system whose advantage is measured (for this and each "
                    "baseline: repeats of one trace as comma-separated files, pooled)")
    ap.add_argument("baselines", nargs="+", metavar="baseline",
                    help="slo_sweep JSON of the system it is compared with; with several, each cell compares with "
                         "the one of highest goodput there (e.g. several configurations of the baseline system)")
    ap.add_argument("--ttft-slos-s", default=DEFAULT_TTFT_SLOS_S, help="TTFT SLOs of the grid (seconds)")
    ap.add_argument("--tpot-slos-ms", default=DEFAULT_TPOT_SLOS_MS, help="TPOT SLOs of the grid (milliseconds)")
    ap.add_argument("--attainment-target", type=float, default=None, help="default: the candidate sweep's")
    ap.add_argument("--ratio-target", type=float, default=1.5, help="the per-core goodput ratio to test for")
    ap.add_argument("--bootstrap", type=int, default=400, help="resamples of each rate's requests (0 = none)")
    ap.add_argument("--confidence", type=float, default=0.95, help="share of resamples a verdict needs")
    ap.add_argument("--timing", default="client", choices=TIMINGS, help="whose clock times the requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="output prefix (PREFIX.json, .md, .png)")
    args = ap.parse_args(argv)
    try:
        ttft_grid = _numbers(args.ttft_slos_s, "--ttft-slos-s")
        tpot_grid = _numbers(args.tpot_slos_ms, "--tpot-slos-ms", 1e-3)
        if args.ratio_target <= 0:
            raise MapError(f"--ratio-target: must be > 0, got {args.ratio_target:g}")
        if args.bootstrap < 0:
            raise MapError(f"--bootstrap: must be >= 0, got {args.bootstrap}")
        if not 0.5 <= args.confidence < 1:
            raise MapError(f"--confidence: must be in [0.5, 1), got {args.confidence:g}")
        cand = load_sweep(args.candidate, args.timing)
        bases = [load_sweep(path, args.timing) for path in args.baselines]
        for base in bases:
            if base.workload != cand.workload:
                raise MapError(f"the sweeps ran different workloads ({cand.workload} and {base.workload}): no ratio")
        settings = cand.settings
        target = args.attainment_target if args.attainment_target is not None else settings["attainment_target"]
        if not 0 < target <= 1:
            raise MapError(f"--attainment-target: must be in (0, 1], got {target:g}")
    except MapError as err:
        ap.error(str(err))
    own = (settings["ttft_slo_ms"] / 1e3, settings["tpot_slo_ms"] / 1e3)
    ttft_grid, tpot_grid = sorted(set(ttft_grid) | {own[0]}), sorted(set(tpot_grid) | {own[1]})
    cells = slo_map(cand, bases, ttft_grid, tpot_grid, target, args.ratio_target, args.bootstrap, args.confidence, args.seed)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    command = "python benchmarks/slo_map.py " + " ".join(sys.argv[1:] if argv is None else argv)
    md = markdown(cand, bases, cells, ttft_grid, tpot_grid, target, args.ratio_target, args.confidence, args.bootstrap,
                  own, args.out, command, args.timing)
    with open(args.out + ".md", "w", encoding="utf-8") as f:
        f.write(md)
    with open(args.out + ".json", "w", encoding="utf-8") as f:
        json.dump({"benchmark": "slo_map", "command": command, "candidate": args.candidate, "baselines": args.baselines,
                   "labels": [cand.label] + [b.label for b in bases], "cores": [cand.cores] + [b.cores for b in bases],
                   "workload": cand.workload, "goodput_unit": "req/s/core",
                   "attainment_target": target, "ratio_target": args.ratio_target, "timing": args.timing,
                   "bootstrap": args.bootstrap, "confidence": args.confidence, "own_slo_s": list(own),
                   "cells": _json_safe(cells)}, f, indent=1)
    plot(args.out + ".png", cand, bases, cells, ttft_grid, tpot_grid, args.ratio_target, own)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
