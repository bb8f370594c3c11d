"""benchmarks/slo_map.py: goodput per SLO cell recounted from sweep records, the bounds the swept rates put on
a goodput and on a ratio, bootstrap verdicts, and the files the command writes."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import slo_map
from planner.slo import goodput

RATES = [0.2, 0.4, 0.6, 0.8]


def _record(i: int, ttft_s: float, tpot_s: float, ok: bool = True) -> dict:
    return {"index": i, "ttft_s": ttft_s, "tpot_s": tpot_s, "completion_tokens": 32,
            "finish_reason": "length" if ok else None, "error": None if ok else "TargetError: broken"}


def _sweep(path, label: str, per_rate: dict[float, list[tuple[float, float]]], cores: float = 2.0,
           workload: str = "long_doc") -> str:
    """A minimal slo_sweep JSON: per rate, (ttft_s, tpot_s) of each request."""
    sweep = {"benchmark": "slo_sweep",
             "settings": {"label": label, "cores": cores, "workload": workload, "attainment_target": 0.9,
                          "ttft_slo_ms": 3000.0, "tpot_slo_ms": 50.0},
             "rates": [{"rate": r, "records": [_record(i, a, b) for i, (a, b) in enumerate(reqs)]}
                       for r, reqs in per_rate.items()]}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(sweep, f)
    return str(path)


def _colocated_like(tmp_path) -> str:
    """TTFT always short; TPOT rises with load (prefill chunks share the decode steps): 20 requests a rate,
    every one at 32 ms + 50 ms x rate (42 / 52 / 62 / 72 ms)."""
    return _sweep(tmp_path / "base.json", "colocated", {r: [(1.0, 0.032 + 0.050 * r)] * 20 for r in RATES})


def _disaggregated_like(tmp_path) -> str:
    """TPOT flat at 15 ms; TTFT rises with load (one prefill core): 1 s + 4 s x rate."""
    return _sweep(tmp_path / "cand.json", "disaggregated", {r: [(1.0 + 4.0 * r, 0.015)] * 20 for r in RATES})


def test_goodput_is_recounted_per_cell_with_the_bounds_of_the_swept_rates(tmp_path):
    base = slo_map.load_sweep(_colocated_like(tmp_path))
    # TPOT 55 ms: met at 0.2 and 0.4, missed from 0.6 on: interpolated to the 90 % crossing, 0.42
    g = slo_map.goodput_of(base, 10.0, 0.055, 0.9)  # per core: the sweep ran on 2
    assert 2 * g.value == goodput(RATES, [1.0, 1.0, 0.0, 0.0], 0.9) == pytest.approx(0.42)
    assert g.lo == g.hi == g.value
    # loose TPOT: met at every swept rate -> at least the highest rate, no upper bound
    assert slo_map.goodput_of(base, 10.0, 1.0, 0.9) == slo_map.Goodput(0.4, 0.4, math.inf)
    # too tight: missed even at the lowest rate -> below it
    assert slo_map.goodput_of(base, 10.0, 0.010, 0.9) == slo_map.Goodput(0.0, 0.0, 0.1)


def test_interpolation_between_the_passing_and_failing_rate(tmp_path):
    # 0.2: all 10 meet; 0.4: 5 of 10 meet -> goodput interpolated at the 90 % crossing
    path = _sweep(tmp_path / "s.json", "s", {0.2: [(1.0, 0.01)] * 10, 0.4: [(1.0, 0.01)] * 5 + [(9.0, 0.01)] * 5})
    g = slo_map.goodput_of(slo_map.load_sweep(path), 3.0, 0.05, 0.9)
    assert 2 * g.value == pytest.approx(0.2 + 0.2 * (1.0 - 0.9) / (1.0 - 0.5))
    assert g.lo == g.hi == g.value


def test_ratio_bounds_follow_the_goodput_intervals():
    exact, at_least, below = slo_map.Goodput(0.4, 0.4, 0.4), slo_map.Goodput(0.8, 0.8, math.inf), slo_map.Goodput(0.0, 0.0, 0.2)
    assert slo_map.ratio_bounds(exact, exact) == (1.0, 1.0)
    assert slo_map.ratio_bounds(at_least, exact) == (2.0, math.inf)
    assert slo_map.ratio_bounds(exact, at_least) == (0.0, 0.5)
    assert slo_map.ratio_bounds(exact, below) == (2.0, math.inf)  # the baseline is below 0.2
    assert slo_map.ratio_bounds(below, exact) == (0.0, 0.5)
    assert slo_map.ratio_bounds(at_least, at_least) == (0.0, math.inf)
    assert slo_map.ratio(0.0, 0.0) != slo_map.ratio(0.0, 0.0)  # nan: no ratio between two zeros


def test_best_of_several_baselines_takes_each_cells_best(tmp_path):
    # a second baseline with the opposite trade-off: TPOT flat, TTFT rising (like the candidate, but slower)
    other = _sweep(tmp_path / "other.json", "other", {r: [(1.0 + 8.0 * r, 0.015)] * 20 for r in RATES})
    cand = slo_map.load_sweep(_disaggregated_like(tmp_path))
    bases = [slo_map.load_sweep(_colocated_like(tmp_path)), slo_map.load_sweep(other)]
    cells = slo_map.slo_map(cand, bases, [5.0], [0.045, 0.2], 0.9, 1.5)
    by = {c["tpot_slo_s"]: c for c in cells}
    # TPOT 45 ms: the first baseline makes it at 0.2 only (0.22); the second up to 0.4 (1 + 3.2 = 4.2 s):
    # 0.42 beats 0.22, and the ratio is taken against it
    tight = by[0.045]
    assert tight["baseline_index"] == 1 and 2 * tight["baseline"]["value"] == pytest.approx(0.42)
    assert tight["ratio_lo"] == pytest.approx(0.8 / 0.42) and tight["verdict"] == "met"
    # TPOT 200 ms: the first baseline meets it at every rate, so no ratio bound beyond "?"
    assert by[0.2]["baseline_index"] == 0 and slo_map._fmt_ratio(by[0.2]) == "?"


def test_map_says_where_the_ratio_target_holds_and_where_it_does_not(tmp_path):
    cand = slo_map.load_sweep(_disaggregated_like(tmp_path))
    base = slo_map.load_sweep(_colocated_like(tmp_path))
    cells = slo_map.slo_map(cand, [base], [3.0, 5.0], [0.055, 0.2], 0.9, 1.5, bootstrap=50)
    by = {(c["ttft_slo_s"], c["tpot_slo_s"]): c for c in cells}
    # TTFT 3 s: the candidate meets it up to 0.4 req/s (1 + 1.6 = 2.6 s; 0.6 -> 3.4 s): 0.42
    # TPOT 55 ms: the baseline up to 0.4 as well -> ratio 1, the target does not hold
    assert by[(3.0, 0.055)]["ratio"] == pytest.approx(1.0) and by[(3.0, 0.055)]["verdict"] == "not met"
    # TTFT 5 s lets the candidate reach 0.8 (at least); the baseline stays at 0.42 -> >= 1.9
    c = by[(5.0, 0.055)]
    assert (c["ratio_lo"], c["ratio_hi"]) == (pytest.approx(0.8 / 0.42), math.inf) and c["verdict"] == "met"
    assert c["bootstrap"]["share_at_target"] == 1.0  # identical requests: every resample agrees
    # a loose TPOT SLO: the baseline meets it at every rate, so the ratio has no lower bound above 0
    assert by[(5.0, 0.2)]["verdict"] == "uncertain" and slo_map._fmt_ratio(by[(5.0, 0.2)]) == "?"
    assert by[(3.0, 0.2)]["verdict"] == "not met" and by[(3.0, 0.2)]["ratio_hi"] == pytest.approx(0.42 / 0.8)
    assert slo_map._fmt_ratio(by[(3.0, 0.2)]).startswith("<= ")


def test_bootstrap_marks_a_ratio_resting_on_a_few_requests_as_uncertain(tmp_path):
    # the candidate's 0.4 req/s rate has 9 of 10 requests meeting the SLO: exactly the 90 % target, so
    # resamples fall on either side of it
    cand = _sweep(tmp_path / "c.json", "c", {0.2: [(1.0, 0.01)] * 10, 0.4: [(1.0, 0.01)] * 9 + [(9.0, 0.01)],
                                           0.6: [(9.0, 0.01)] * 10})
    base = _sweep(tmp_path / "b.json", "b", {0.2: [(1.0, 0.01)] * 10, 0.4: [(9.0, 0.01)] * 10, 0.6: [(9.0, 0.01)] * 10})
    cells = slo_map.slo_map(slo_map.load_sweep(cand), [slo_map.load_sweep(base)], [3.0], [0.05], 0.9, 1.5, bootstrap=200)
    (cell,) = cells
    assert cell["ratio"] == pytest.approx(0.4 / 0.22)  # on the recorded requests
    # a resample keeps the 0.4 req/s rate at >= 90 % with probability 0.9^10 + 10 x 0.1 x 0.9^9 = 0.74
    assert 0.5 < cell["bootstrap"]["share_at_target"] < 0.9
    assert cell["verdict"] == "uncertain"
    # without resampling only the bounds decide, and they are exact here
    (plain,) = slo_map.slo_map(slo_map.load_sweep(cand), [slo_map.load_sweep(base)], [3.0], [0.05], 0.9, 1.5)
    assert plain["verdict"] == "met" and plain["bootstrap"] is None


def test_failed_requests_never_attain(tmp_path):
    path = tmp_path / "f.json"
    sweep = {"benchmark": "slo_sweep", "settings": {"label": "f", "cores": 1, "workload": "w"},
             "rates": [{"rate": 0.5, "records": [_record(0, 0.1, 0.01), _record(1, 0.1, 0.01, ok=False)]}]}
    path.write_text(json.dumps(sweep))
    s = slo_map.load_sweep(str(path))
    assert slo_map.attained(s.outcomes[0], 10.0, 10.0) == 0.5


def test_command_writes_strict_json_markdown_and_figure(tmp_path, capsys):
    cand, base = _disaggregated_like(tmp_path), _colocated_like(tmp_path)
    out = str(tmp_path / "map")
    assert slo_map.main([cand, base, "--ttft-slos-s", "2,5", "--tpot-slos-ms", "40,200", "--bootstrap", "20",
                         "--out", out]) == 0
    def no_constants(name):
        raise AssertionError(f"non-standard JSON constant {name}")
    data = json.loads((tmp_path / "map.json").read_text(), parse_constant=no_constants)
    # the sweeps' own SLO (3 s, 50 ms) joins the grid
    assert {(c["ttft_slo_s"], c["tpot_slo_s"]) for c in data["cells"]} == {(t, p) for t in (2.0, 3.0, 5.0)
                                                                        for p in (0.04, 0.05, 0.2)}
    at_least = next(c for c in data["cells"] if (c["ttft_slo_s"], c["tpot_slo_s"]) == (5.0, 0.05))
    assert at_least["ratio_hi"] == "inf" and at_least["candidate"]["hi"] == "inf"
    md = (tmp_path / "map.md").read_text()
    # at TPOT 50 ms the baseline meets it only at 0.2 req/s (goodput 0.22); the candidate at every rate
    assert "At the sweeps' own SLO (TTFT 3 s, TPOT 50 ms)" in md and f"**>= {0.8 / 0.22:.2f}**" in md
    assert (tmp_path / "map.png").stat().st_size > 10_000


@pytest.mark.parametrize("argv, message", [
    (["--ratio-target", "0"], "--ratio-target"),
    (["--tpot-slos-ms", "a,b"], "--tpot-slos-ms"),
    (["--confidence", "1"], "--confidence"),
    (["--bootstrap", "-1"], "--bootstrap"),
])
def test_bad_arguments_name_the_flag(tmp_path, capsys, argv, message):
    cand, base = _disaggregated_like(tmp_path), _colocated_like(tmp_path)
    with pytest.raises(SystemExit):
        slo_map.main([cand, base, "--out", str(tmp_path / "m"), *argv])
    assert message in capsys.readouterr().err


def test_different_workloads_have_no_ratio(tmp_path, capsys):
    cand = _disaggregated_like(tmp_path)
    base = _sweep(tmp_path / "chat.json", "chat", {0.2: [(1.0, 0.01)]}, workload="chat")
    with pytest.raises(SystemExit):
        slo_map.main([cand, base, "--out", str(tmp_path / "m")])
    assert "different workloads (long_doc and chat)" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text(json.dumps({"benchmark": "slo_sweep", "rates": [{"rate": 1, "records": []}]}))
    with pytest.raises(slo_map.MapError, match="no per-request records"):
        slo_map.load_sweep(str(tmp_path / "bad.json"))


def test_compare_recounts_at_other_slos(tmp_path, capsys):
    from benchmarks import slo_compare

    cand, base = _disaggregated_like(tmp_path), _colocated_like(tmp_path)
    out = str(tmp_path / "cmp")
    # the recorded attainment is absent from these files: only a recount can produce the table
    assert slo_compare.main([cand, base, "--ttft-slo-ms", "3000", "--tpot-slo-ms", "55", "--out", out]) == 0
    md = (tmp_path / "cmp.md").read_text()
    assert "TTFT 3000 ms, TPOT 55 ms (recounted from the per-request records)" in md
    assert "| disaggregated | 2 | 0.2, 0.4, 0.6, 0.8 | 0.42 |" in md and "| colocated | 2 | 0.2, 0.4, 0.6, 0.8 | 0.42 |" in md
    assert slo_compare.main([cand, base, "--ttft-slo-ms", "5000", "--tpot-slo-ms", "50", "--out", out]) == 0
    md = (tmp_path / "cmp.md").read_text()
    assert "| disaggregated | 2 | 0.2, 0.4, 0.6, 0.8 | >= 0.8 |" in md and "| colocated | 2 | 0.2, 0.4, 0.6, 0.8 | 0.22 |" in md
    with pytest.raises(SystemExit):
        slo_compare.main([cand, base, "--ttft-slo-ms", "3000", "--out", out])
    assert "give both" in capsys.readouterr().err


def test_bootstrap_summary_ignores_resamples_without_a_ratio():
    nan = math.nan
    summary = slo_map.bootstrap_summary([3.0, nan, 1.0, nan, 2.0, math.inf, 0.5, nan], 1.5)
    assert summary["undefined"] == 3 and summary["resamples"] == 8
    assert (summary["q05"], summary["q50"], summary["q95"]) == (0.5, 2.0, math.inf)
    assert summary["share_at_target"] == 3 / 8  # 3.0, 2.0 and inf of all eight


def test_repeats_of_one_trace_are_pooled_and_other_traces_refused(tmp_path):
    def run(name, ttfts):  # one rate of 4 requests with the same trace fields, these TTFTs
        sweep = {"benchmark": "slo_sweep",
                 "settings": {"label": "s", "cores": 2, "workload": "w", "seed": 0, "num_requests": 4, "rates": [0.5],
                              "cv": 1.0, "ttft_slo_ms": 3000.0, "tpot_slo_ms": 50.0},
                 "rates": [{"rate": 0.5, "records": [{**_record(i, t, 0.01), "arrival_s": float(i), "prompt_tokens": 100,
                                                       "output_tokens": 8} for i, t in enumerate(ttfts)]}]}
        (tmp_path / name).write_text(json.dumps(sweep))
        return str(tmp_path / name)

    a, b = run("a.json", [1, 1, 1, 9]), run("b.json", [1, 9, 9, 9])
    pooled = slo_map.load_sweep(f"{a},{b}")
    assert pooled.label == "s (2 runs pooled)" and len(pooled.outcomes[0]) == 8
    assert slo_map.attained(pooled.outcomes[0], 3.0, 0.05) == 4 / 8
    other = json.loads((tmp_path / "b.json").read_text())
    other["rates"][0]["records"][0]["prompt_tokens"] = 101
    (tmp_path / "c.json").write_text(json.dumps(other))
    with pytest.raises(slo_map.MapError, match="differ from the first sweep's"):
        slo_map.load_sweep(f"{a},{tmp_path / 'c.json'}")


def test_other_draws_of_the_workload_are_pooled_rate_by_rate_and_other_workloads_refused(tmp_path):
    def run(name, seed, per_rate, **settings):  # per rate, the TTFTs of its requests
        sweep = {"benchmark": "slo_sweep",
                 "settings": {"label": "s", "cores": 2, "workload": "long_doc", "seed": seed, "cv": 1.0,
                              "ttft_slo_ms": 3000.0, "tpot_slo_ms": 50.0, **settings},
                 "rates": [{"rate": r, "records": [{**_record(i, t, 0.01), "arrival_s": float(i) + seed,
                                                     "prompt_tokens": 100 + seed, "output_tokens": 8}
                                                    for i, t in enumerate(ttfts)]} for r, ttfts in per_rate.items()]}
        (tmp_path / name).write_text(json.dumps(sweep))
        return str(tmp_path / name)

    a = run("a.json", 0, {0.1: [1, 1, 1, 1], 0.3: [1, 9, 9, 9], 0.5: [9, 9, 9, 9]})
    b = run("b.json", 1, {0.1: [1, 1, 9], 0.2: [1, 1, 9]})  # another draw, at other rates
    pooled = slo_map.load_sweep(f"{a},{b}")
    assert pooled.rates == [0.1, 0.2, 0.3, 0.5] and [len(o) for o in pooled.outcomes] == [7, 3, 4, 4]
    assert [slo_map.attained(o, 3.0, 0.05) for o in pooled.outcomes] == [6 / 7, 2 / 3, 1 / 4, 0.0]
    assert pooled.label == "s (2 runs pooled)"
    for field, value in (("workload", "chat"), ("cv", 2.0), ("tpot_slo_ms", 60.0), ("cores", 4)):
        c = run("c.json", 2, {0.1: [1]}, **{field: value})
        with pytest.raises(slo_map.MapError, match=f"settings.{field} is .*must draw the same workload"):
            slo_map.load_sweep(f"{a},{c}")
    d = run("d.json", 0, {0.1: [1, 1, 1]})  # the first's seed, another trace: not a repeat
    with pytest.raises(slo_map.MapError, match="must repeat its trace"):
        slo_map.load_sweep(f"{a},{d}")
