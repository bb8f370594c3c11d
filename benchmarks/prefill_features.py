"""What each feature of the prefill cost model buys: refit a profile's measured prefill points (the
``samples["prefill"]`` a measured profile keeps) with every feature set that drops one feature of
PREFILL_FEATURES, and report the relative RMS fit error of each beside the full set's.

    python benchmarks/prefill_features.py --profile benchmarks/results/same_session_9/profile_local_cpu.json \\
        --out benchmarks/results/prefill_features

Points must carry every feature (profiles measured before a feature existed do not; they are an error).
Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._record import record, write_lines  # noqa: E402
from controller.planner.profile import PREFILL_FEATURES, FittedModel, Profile, ProfileError  # noqa: E402


def feature_sets_errors(rows: list[dict[str, float]]) -> list[dict]:
    """Fit error and coefficients of the full feature set and of each set with one feature dropped."""
    missing = sorted({f for r in rows for f in PREFILL_FEATURES if f not in r})
    if missing:
        raise ProfileError(f"prefill samples lack features {missing}: re-measure the profile")
    seconds = [r["seconds"] for r in rows]
    sets = [("all", PREFILL_FEATURES)] + [(f"without {f}", tuple(g for g in PREFILL_FEATURES if g != f))
                                         for f in PREFILL_FEATURES]
    out = []
    for name, features in sets:
        fm = FittedModel.fit(features, [{f: r[f] for f in features} for r in rows], seconds)
        out.append({"set": name, "features": list(features), "fit_error": fm.fit_error,
                    "coefficients": dict(zip(features, fm.coefficients))})
    return out


def write_markdown(result: dict, path: str) -> None:
    lines = ["# Prefill cost model: fit error by feature set", "", f"`{result['command']}`", "",
             f"Profile `{result['profile']}` ({result['hardware']}): {result['points']} measured prefill steps, "
             "refitted with each feature set (non-negative least squares of the relative error, as the profiler "
             "fits). Fit error: relative RMS over the points.", "",
             "| feature set | fit error |", "|---|---:|"]
    lines += [f"| {r['set']} | {r['fit_error']:.1%} |" for r in result["sets"]]
    write_lines(path, lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True, help="a measured profile JSON (keeps its prefill samples)")
    ap.add_argument("--out", required=True, help="output prefix (.json, .md)")
    args = ap.parse_args(argv)
    profile = Profile.load(args.profile)
    rows = profile.samples.get("prefill", [])
    if not rows:
        ap.error(f"--profile: {args.profile} keeps no prefill samples (an analytical profile?)")
    result = {"command": "python benchmarks/prefill_features.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "profile": os.path.relpath(os.path.abspath(args.profile), ROOT), "hardware": profile.hardware,
              "points": len(rows)}
    try:
        result["sets"] = feature_sets_errors(rows)
    except ProfileError as err:
        ap.error(f"--profile: {args.profile}: {err}")
    record(result, args.out, write_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
