"""Several SLO sweeps (benchmarks/slo_sweep.py JSON files, one per system) on one figure, and their
goodput per core at the target attainment as a markdown table.

    python benchmarks/slo_compare.py runs/sweep_chat_magicserve.json runs/sweep_chat_vllm.json --per-core \\
        --out runs/slo_compare_chat

Labels and core counts come from each sweep's settings (--label / --cores there); ``--labels`` and
``--cores`` here override them, comma-separated in file order. Goodput is re-derived from the recorded
attainment with ``planner.slo.goodput`` at ``--attainment-target`` (default: the sweeps').
``--ttft-slo-ms`` / ``--tpot-slo-ms`` compare at other SLOs than the sweeps ran with: attainment is then
recounted from every request's recorded TTFT and TPOT (``benchmarks/slo_map.py`` does it for a whole grid).
Writes PREFIX.png and PREFIX.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._slo_plots import plot_compare  # noqa: E402
from benchmarks.slo_map import MapError, attained, sweep_outcomes  # noqa: E402
from planner.slo import goodput  # noqa: E402


def _split(text: str | None, n: int, flag: str, cast) -> list | None:
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != n:
        raise SystemExit(f"slo_compare: error: {flag}: need {n} comma-separated values (one per file), got {text!r}")
    try:
        return [cast(p) for p in parts]
    except ValueError:
        raise SystemExit(f"slo_compare: error: {flag}: bad value in {text!r}") from None


def load_systems(paths: list[str], labels: list[str] | None, cores: list[float] | None,
                 slo_ms: tuple[float, float] | None = None) -> list[dict]:
    """One dict per sweep file. ``slo_ms`` (TTFT, TPOT): recount each rate's attainment of both SLOs at these
    from the per-request records (and report them as the sweep's SLOs) instead of reading the recorded one."""
    systems = []
    for i, path in enumerate(paths):
        try:
            with open(path, encoding="utf-8") as f:
                sweep = json.load(f)
        except (OSError, ValueError) as err:
            raise SystemExit(f"slo_compare: error: {path}: cannot read a sweep JSON ({err})") from None
        if sweep.get("benchmark") != "slo_sweep" or not sweep.get("rates"):
            raise SystemExit(f"slo_compare: error: {path}: not an slo_sweep result with rates")
        s = sweep["settings"]
        c = cores[i] if cores else s["cores"]
        if c <= 0:
            raise SystemExit(f"slo_compare: error: --cores: must be > 0, got {c:g}")
        if slo_ms is None:
            both = [r["attainment"]["both"] for r in sweep["rates"]]
        else:
            try:
                outcomes = sweep_outcomes(sweep, path).outcomes
            except MapError as err:
                raise SystemExit(f"slo_compare: error: {err}") from None
            both = [attained(o, slo_ms[0] / 1e3, slo_ms[1] / 1e3) for o in outcomes]
            s = {**s, "ttft_slo_ms": slo_ms[0], "tpot_slo_ms": slo_ms[1], "recounted": True}
        systems.append({"label": labels[i] if labels else s["label"], "cores": c, "path": path, "settings": s,
                        "rates": [r["rate"] for r in sweep["rates"]], "both": both})
    return systems


def compare(systems: list[dict], target: float, per_core: bool, prefix: str, command: str) -> str:
    """Figure + markdown table; returns the markdown."""
    for s in systems:
        s["goodput"] = goodput(s["rates"], s["both"], target)
        s["x"] = [r / s["cores"] for r in s["rates"]] if per_core else s["rates"]
    first = systems[0]["settings"]
    slo = f"TTFT {first['ttft_slo_ms']:g} ms, TPOT {first['tpot_slo_ms']:g} ms"
    xlabel = "request rate per core (req/s/core)" if per_core else "request rate (req/s)"
    plot_compare(prefix + ".png", systems, target, f"{first['workload']}: attainment of both SLOs ({slo})", xlabel)
    recounted = " (recounted from the per-request records)" if first.get("recounted") else ""
    lines = [f"# SLO attainment: {', '.join(s['label'] for s in systems)} on {first['workload']}", "",
             f"`{command}`", "", f"SLOs: {slo}{recounted}; goodput = highest rate with >= {target:.0%} of requests "
             "meeting both (interpolated between swept rates).", ""]
    differing = [k for k in ("workload", "ttft_slo_ms", "tpot_slo_ms", "num_requests", "seed", "cv")
                 if len({str(s["settings"].get(k)) for s in systems}) > 1]
    if differing:
        lines += [f"**Not like for like**: the sweeps differ in {', '.join(differing)}.", ""]
    base = systems[0]["goodput"] / systems[0]["cores"]
    lines += ["| system | cores | rates swept (req/s) | goodput (req/s) | goodput per core (req/s/core) | vs first |",
              "|---|---:|---|---:|---:|---:|"]
    for s in systems:
        pc = s["goodput"] / s["cores"]
        ratio = f"{pc / base:.2f}" if base > 0 else "-"
        if s["both"][0] < target:  # even the lowest swept rate missed: the goodput is below it
            shown, shown_pc, ratio = f"< {s['rates'][0]:g}", f"< {s['rates'][0] / s['cores']:.3g}", "-"
        else:
            at_least = ">= " if s["both"][-1] >= target else ""  # the highest swept rate still met the target
            shown, shown_pc = f"{at_least}{s['goodput']:.3g}", f"{at_least}{pc:.3g}"
        lines.append(f"| {s['label']} | {s['cores']:g} | {', '.join(f'{r:g}' for r in s['rates'])} "
                     f"| {shown} | {shown_pc} | {ratio} |")
    if any(s["both"][-1] >= target for s in systems):
        lines += ["", "`>=`: the highest swept rate still met the target; sweep higher rates for the goodput itself."]
    if any(s["both"][0] < target for s in systems):
        lines += ["", "`<`: even the lowest swept rate missed the target; sweep lower rates for the goodput itself."]
    lines += ["", f"![attainment vs rate]({os.path.basename(prefix)}.png)", ""]
    md = "\n".join(lines)
    with open(prefix + ".md", "w", encoding="utf-8") as f:
        f.write(md)
    return md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweeps", nargs="+", help="slo_sweep JSON files, one per system")
    ap.add_argument("--labels", default=None, help="comma-separated labels, one per file")
    ap.add_argument("--cores", default=None, help="comma-separated core counts, one per file")
    ap.add_argument("--attainment-target", type=float, default=None, help="default: the first sweep's")
    ap.add_argument("--per-core", action="store_true", help="x axis: request rate per core")
    ap.add_argument("--ttft-slo-ms", type=float, default=None,
                    help="compare at this TTFT SLO (recounted from the records; default: the sweeps' own)")
    ap.add_argument("--tpot-slo-ms", type=float, default=None,
                    help="compare at this TPOT SLO (recounted from the records; default: the sweeps' own)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "slo_compare"), help="output prefix")
    args = ap.parse_args(argv)
    labels = _split(args.labels, len(args.sweeps), "--labels", str)
    cores = _split(args.cores, len(args.sweeps), "--cores", float)
    slo_ms = None
    if args.ttft_slo_ms is not None or args.tpot_slo_ms is not None:
        if args.ttft_slo_ms is None or args.tpot_slo_ms is None:
            ap.error("--ttft-slo-ms and --tpot-slo-ms: give both to recount at other SLOs")
        if args.ttft_slo_ms <= 0 or args.tpot_slo_ms <= 0:
            ap.error(f"--ttft-slo-ms / --tpot-slo-ms: must be > 0, got {args.ttft_slo_ms:g} / {args.tpot_slo_ms:g}")
        slo_ms = (args.ttft_slo_ms, args.tpot_slo_ms)
    systems = load_systems(args.sweeps, labels, cores, slo_ms)
    target = args.attainment_target or systems[0]["settings"]["attainment_target"]
    if not 0 < target <= 1:
        ap.error(f"--attainment-target: must be in (0, 1], got {target:g}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    print(compare(systems, target, args.per_core, args.out, f"python benchmarks/slo_compare.py {argv_text}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
