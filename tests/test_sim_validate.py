"""The measurement-noise interval that benchmarks/sim_validate.py reports beside the 5-point criterion."""

from __future__ import annotations

import random

import pytest

from benchmarks.sim_validate import wilson_interval


def test_wilson_interval_of_a_measured_attainment():
    assert wilson_interval(0.5, 40) == pytest.approx((0.352, 0.648), abs=1e-3)
    lo, hi = wilson_interval(1.0, 40)
    assert hi == 1.0 and lo == pytest.approx(0.912, abs=1e-3)  # all 40 met: the truth may still be 91 %
    assert wilson_interval(0.0, 40)[0] == 0.0
    # four times the requests halve the interval
    assert (lambda a, b: (b[1] - b[0]) / (a[1] - a[0]))(wilson_interval(0.5, 40), wilson_interval(0.5, 160)) \
        == pytest.approx(0.5, abs=0.02)
    assert wilson_interval(0.3, 0) == (0.0, 1.0)


def _sweep(ttfts_by_rate: dict[float, list[float]], seed: int = 0) -> dict:
    """A recorded sweep in slo_sweep.py's layout: one request per TTFT, all meeting TPOT."""
    rates = []
    for rate, ttfts in ttfts_by_rate.items():
        records = [{"arrival_s": i / rate, "prompt_tokens": 100 + i, "output_tokens": 8, "ttft_s": t,
                    "tpot_s": 0.01, "finish_reason": "length", "error": None} for i, t in enumerate(ttfts)]
        rates.append({"rate": rate, "records": records})
    return {"settings": {"workload": "long_doc", "seed": seed, "num_requests": 4, "rates": list(ttfts_by_rate),
                         "cv": 1.0, "ttft_slo_ms": 1000.0, "tpot_slo_ms": 50.0, "label": "x"},
            "started": "today", "rates": rates}


def test_sweep_repeat_reports_the_attainment_gap_between_real_runs_of_one_trace():
    from benchmarks.sweep_repeat import compare

    first = _sweep({1.0: [0.5, 0.6, 0.7, 0.8], 2.0: [0.9, 1.1, 1.2, 0.4]})
    again = _sweep({1.0: [0.5, 0.6, 0.7, 1.5], 2.0: [0.9, 0.95, 1.2, 0.4]})
    result = compare([("a.json", first), ("b.json", again)])
    run1, run2 = result["runs"]
    assert [r["both"] for r in run1["rates"]] == [1.0, 0.5]
    assert [r["both"] for r in run2["rates"]] == [0.75, 0.75]
    assert [r["diff_both"] for r in run2["rates"]] == pytest.approx([-0.25, 0.25])
    assert result["max_abs_diff_both"] == pytest.approx(0.25)


def test_sweep_repeat_refuses_sweeps_of_different_traces():
    from benchmarks.sweep_repeat import SweepMismatch, compare

    first = _sweep({1.0: [0.5, 0.6, 0.7, 0.8]})
    with pytest.raises(SweepMismatch, match="settings.seed"):
        compare([("a.json", first), ("b.json", _sweep({1.0: [0.5, 0.6, 0.7, 0.8]}, seed=1))])
    other = _sweep({1.0: [0.5, 0.6, 0.7, 0.8]})
    other["rates"][0]["records"][2]["prompt_tokens"] += 1
    with pytest.raises(SweepMismatch, match="rate 1.0"):
        compare([("a.json", first), ("b.json", other)])


def test_serving_interference_divides_logged_passes_by_the_profile_and_splits_by_overlap():
    import os

    from benchmarks.serving_interference import summarise
    from controller.planner.interference import pass_row, predicted_s
    from controller.planner.profile import Profile

    profile = Profile.load(os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "profile_local_cpu.json"))

    def rec(kind: str, end: float, ratio: float, **shape) -> dict:
        r = pass_row({"kind": kind, "end_s": end, "seconds": 0.0, "shape": shape})
        r["seconds"] = ratio * predicted_s(profile, r)
        return r

    prefill = dict(chunks=[[0, 512]])
    decode = dict(seqs=2, kv_tokens=2048, new_tokens=2)
    isolated = [rec("prefill", 10.0 + i, 1.1, **prefill) for i in range(3)] + \
               [rec("decode", 20.0 + i, 1.2, **decode) for i in range(3)]
    # under the burst: one long prefill pass covers [100, 100 + its time]; decode passes inside it run
    # 1.5x, decode passes far from any prefill 1.2x (no interference)
    long_prefill = rec("prefill", 0.0, 1.1, **prefill)
    long_prefill["end_s"] = 100.0 + long_prefill["seconds"]
    d_inside = rec("decode", 0.0, 1.5, **decode)
    d_inside["end_s"] = 100.0 + d_inside["seconds"]  # starts at 100, well inside the prefill pass
    d_apart = [rec("decode", 200.0 + i, 1.2, **decode) for i in range(2)]
    rows = {r["kind"]: r for r in summarise(profile, None, isolated, [long_prefill, d_inside, *d_apart])}
    dec = rows["decode"]
    assert dec["passes"] == {"isolated": 3, "burst_other_busy": 1, "burst_other_idle": 2}
    assert dec["median_ratio"]["isolated"] == pytest.approx(1.2)
    assert dec["interference_other_busy"] == pytest.approx(1.5 / 1.2)
    assert dec["interference_other_idle"] == pytest.approx(1.0)
    assert rows["prefill"]["interference"] == pytest.approx(1.0)
    assert rows["prefill"]["passes"]["burst_other_busy"] == 0  # the short decode pass covers < half of it


def test_a_difference_of_exactly_the_tolerance_counts_as_within():
    """4 of 80 requests is exactly 5 points, though 0.625 - 0.675 is 0.05000000000000004 in floating point;
    5 of 80 is outside."""
    from benchmarks.sim_validate import within_tolerance

    assert abs(0.625 - 0.675) > 0.05  # the floating-point trap the criterion must not fall into
    assert within_tolerance(abs(0.625 - 0.675))
    assert within_tolerance(0.0) and within_tolerance(0.0375)
    assert not within_tolerance(abs(0.6125 - 0.675))


def test_prefill_throughput_spans_the_first_tokens():
    """Prompt tokens over the span from the first to the last first token; requests without one are
    counted in neither (None when fewer than two first tokens)."""
    from benchmarks.sim_validate import prefill_throughput

    assert prefill_throughput([0.0, 1.0, 2.0], [0.5, 0.5, None], [100, 200, 300]) == pytest.approx(300.0)
    assert prefill_throughput([0.0], [0.5], [100]) is None


def _profile():
    import os

    from controller.planner.profile import Profile

    return Profile.load(os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "profile_local_cpu.json"))


def test_sim_validate_replays_send_times_and_reads_either_clock():
    from benchmarks.sim_validate import compare, simulate_rate
    from controller.config import load_config
    from controller.planner.simulator import SimConfig

    import os

    config = SimConfig.from_cluster_config(load_config(os.path.join(os.path.dirname(__file__), "..", "cluster_configs",
                                                                    "local.yaml")))
    sweep = _sweep({2.0: [0.3, 0.3, 0.3, 0.3]})
    row = sweep["rates"][0]
    for r in row["records"]:
        r["sent_s"] = 5.0  # a starved load generator sent all four at once, 5 s late
    burst = simulate_rate(_profile(), config, row, 1.0, 0.05, seeds=1, arrivals="sent")
    spaced = simulate_rate(_profile(), config, row, 1.0, 0.05, seeds=1, arrivals="trace")
    # four prompts at once queue behind each other: the burst's median TTFT is the longer
    assert burst["latency_ms"]["ttft_p50"] > spaced["latency_ms"]["ttft_p50"]

    with pytest.raises(ValueError, match="--timing server"):
        compare(sweep, _profile(), config, seeds=1, timing="server")
    for r in row["records"]:
        r.update(server_ttft_s=2.0, server_tpot_s=0.01)  # every request late on the server's clock
    result = compare(sweep, _profile(), config, seeds=1, timing="server")
    (out,) = result["rows"]
    assert out["measured"]["both"] == 0.0 and out["measured_client_clock_both"] == 1.0
    assert result["timing"] == "server" and result["arrivals"] == "sent"


def test_sim_validate_pools_repeats_of_one_trace(tmp_path):
    """Two repeats of one trace: measured attainment over the pooled requests, each repeat's beside it; a
    sweep of another trace is refused naming it."""
    import json
    import os

    from benchmarks import sim_validate

    root = os.path.join(os.path.dirname(__file__), "..")
    first, again = _sweep({2.0: [0.3, 0.3, 0.3, 0.3]}), _sweep({2.0: [0.3, 2.0, 2.0, 2.0]})
    paths = []
    for name, sweep in (("a", first), ("b", again)):
        paths += ["--sweep", str(tmp_path / f"{name}.json")]
        json.dump(sweep, open(tmp_path / f"{name}.json", "w"))
    common = ["--profile", os.path.join(root, "benchmarks", "results", "profile_local_cpu.json"),
              "--config", os.path.join(root, "cluster_configs", "local.yaml"), "--seeds", "1"]
    assert sim_validate.main(paths + common + ["--out", str(tmp_path / "v")]) == 0
    result = json.load(open(tmp_path / "v.json"))
    (row,) = result["rows"]
    assert result["repeats"] == 2 and row["requests"] == 8
    assert row["measured_per_repeat_both"] == [1.0, 0.25] and row["measured"]["both"] == pytest.approx(5 / 8)
    assert "2 repeats of the trace" in open(tmp_path / "v.md").read()

    other = _sweep({2.0: [0.3, 0.3, 0.3, 0.3]})  # the first's seed, another trace: not a repeat
    other["rates"][0]["records"][1]["prompt_tokens"] += 7
    json.dump(other, open(tmp_path / "c.json", "w"))
    with pytest.raises(SystemExit):
        sim_validate.main(["--sweep", str(tmp_path / "a.json"), "--sweep", str(tmp_path / "c.json")] + common
                          + ["--out", str(tmp_path / "w")])


def test_sim_validate_pools_other_draws_of_the_workload_rate_by_rate(tmp_path):
    """Sweeps of two draws (seeds 0 and 1) at overlapping rates, and seed 0's requests again at another rate:
    each rate pools the sweeps that ran it, its simulated attainment is the request-weighted mean of each
    sweep's own replay; another workload, or other requests under a seed already pooled, are refused."""
    import os

    from benchmarks.sim_validate import compare, simulate_rate
    from benchmarks.sweep_repeat import SweepMismatch, check_pool
    from controller.config import load_config
    from controller.planner.simulator import SimConfig

    config = SimConfig.from_cluster_config(load_config(os.path.join(os.path.dirname(__file__), "..", "cluster_configs",
                                                                    "local.yaml")))
    a = _sweep({1.0: [0.3] * 4, 2.0: [0.3] * 4}, seed=0)
    b = _sweep({2.0: [0.3, 5.0], 3.0: [5.0] * 4}, seed=1)  # another draw, other rates, 2 requests at 2 req/s
    for r in b["rates"][0]["records"]:
        r["prompt_tokens"] *= 30  # long prompts: this draw's own replay attains less than the first's
    top_up = _sweep({3.0: [0.3, 0.3, 9.0, 9.0]}, seed=0)  # seed 0's requests at a rate its first sweep skipped
    assert check_pool([a, b, top_up], ["a", "b", "t"]) == [False, False, True]
    result = compare([a, b, top_up], _profile(), config, seeds=1)
    assert [r["rate"] for r in result["rows"]] == [1.0, 2.0, 3.0] and result["draws"] == [0, 1]
    assert [r["requests"] for r in result["rows"]] == [4, 6, 8]
    row = result["rows"][1]
    assert row["measured_per_repeat_both"] == [1.0, 0.5] and row["measured"]["both"] == pytest.approx(5 / 6)
    own = [simulate_rate(_profile(), config, sweep["rates"][i], 1.0, 0.05, seeds=1, arrivals="sent")["attainment"]["both"]
           for sweep, i in ((a, 1), (b, 0))]
    assert own[1] < own[0]
    assert row["simulated"]["both"] == pytest.approx((4 * own[0] + 2 * own[1]) / 6)
    assert result["rows"][2]["measured_per_repeat_both"] == [0.0, 0.5]

    other = _sweep({1.0: [0.3]}, seed=2)
    other["settings"]["workload"] = "chat"
    with pytest.raises(SweepMismatch, match="c.json: settings.workload is 'chat'.*must draw the same workload"):
        check_pool([a, other], ["a", "c.json"])
    again = _sweep({2.0: [0.3] * 4}, seed=1)  # seed 1 again, but 4 requests at 2 req/s where b sent 2
    with pytest.raises(SweepMismatch, match="d.json: the requests at rate 2.0 differ .* seed 1 .*must repeat its trace"):
        check_pool([a, b, again], ["a", "b", "d.json"])


def _probe_records(profile, config, factor: float, prompts=(512, 512, 512)) -> list[dict]:
    """Probe records as slo_sweep.py writes them, each TTFT ``factor`` x what the simulator gives the lone
    request under ``profile`` (a machine that slowed by ``factor`` since it was profiled)."""
    from controller.planner.simulator import simulate
    from controller.planner.workload import RequestSpec

    quiet = profile.without_contention()
    out = []
    for n in prompts:
        sim = simulate(quiet, config, [RequestSpec(0.0, n, 16)]).records[0]
        out.append({"prompt_tokens": n, "output_tokens": 16, "ttft_s": factor * sim.ttft_s, "tpot_s": 0.02,
                    "finish_reason": "length", "error": None})
    return out


def test_speed_probes_rescale_the_profile_rate_by_rate():
    """A sweep whose probes say the machine ran 25 % slow around its second rate: that rate is simulated on
    the profile at 1.25x (measured / simulated lone TTFT, median), the first at 1.0; a failed probe is left
    out; --speed probe on a sweep without probes is refused, auto falls back to the profile as it is."""
    import os

    from benchmarks._speed_probe import speed_of
    from benchmarks.sim_validate import compare
    from controller.config import load_config
    from controller.planner.simulator import SimConfig

    config = SimConfig.from_cluster_config(load_config(os.path.join(os.path.dirname(__file__), "..", "cluster_configs",
                                                                    "local-colocated.yaml")))
    profile = _profile()
    est = speed_of(profile, config, _probe_records(profile, config, 1.25, (512, 300, 512)))
    assert est.factor == pytest.approx(1.25) and est.probes == 3 and est.tpot_ratio > 0
    failed = {"prompt_tokens": 512, "output_tokens": 16, "ttft_s": None, "tpot_s": None, "finish_reason": None,
              "error": "TargetError: boom"}
    assert speed_of(profile, config, _probe_records(profile, config, 0.9) + [failed]).probes == 3
    with pytest.raises(ValueError, match="no successful probe"):
        speed_of(profile, config, [failed])

    sweep = _sweep({2.0: [0.3] * 8, 3.0: [0.3] * 8})
    with pytest.raises(ValueError, match="--speed probe"):
        compare(sweep, profile, config, seeds=1, speed="probe")
    assert compare(sweep, profile, config, seeds=1, speed="auto")["speed"] == "none"
    sweep["rates"][0]["speed_probe"] = _probe_records(profile, config, 1.0)
    sweep["rates"][1]["speed_probe"] = _probe_records(profile, config, 1.0)[:1] + _probe_records(profile, config, 1.25)
    sweep["speed_probe_after"] = _probe_records(profile, config, 1.25)
    result = compare(sweep, profile, config, seeds=1, speed="auto")
    assert result["speed"] == "probe"
    first, second = ([e["factor"] for e in row["speed"]] for row in result["rows"])
    # rate 1: its own set (1.0 x3) and the next (1.0, 1.25 x3) -> median of seven: 1.0
    assert first == pytest.approx([1.0]) and second == pytest.approx([1.25])
    # the slower machine serves the same requests later
    assert result["rows"][1]["simulated_latency_ms"]["ttft_p50"] > \
        compare(sweep, profile, config, seeds=1, speed="none")["rows"][1]["simulated_latency_ms"]["ttft_p50"]


def _mixed_log(factor: float, seed: int = 0) -> list[dict]:
    """A colocated rate's drained pass logs (two instances, ``modeling/pass_log.py`` records): mixed steps
    of prompt chunks and decode tokens; ``factor`` stretches every duration and gap (a slower machine)."""
    rng = random.Random(seed)
    instances = []
    for k in range(2):
        t, records = 1.8e9 + factor * 0.01 * k, []
        for _ in range(200):
            chunks = [[0, rng.randrange(16, 256)]] if rng.random() < 0.3 else []
            seqs = rng.randrange(0 if chunks else 1, 6)
            seconds = factor * rng.uniform(0.01, 0.05)
            records.append({"kind": "mixed", "end_s": t + seconds, "seconds": seconds,
                            "shape": {"chunks": chunks, "decode_seqs": seqs, "decode_kv_tokens": 300 * seqs}})
            t += seconds + factor * rng.uniform(0.0, 0.01)
        instances.append({"name": f"colocated-{k}", "role": "colocated", "dropped": 0, "records": records})
    return instances


def test_load_speed_rescales_the_profile_rate_by_rate(tmp_path):
    """A sweep whose workers' passes ran 25 % slower at its second rate than at its first: the second rate
    is simulated on a profile 1.25x as slow as the first's (``--speed load``, chosen by auto); the logs
    travel beside the sweep (``PREFIX.passes.json.gz``); --speed load without them is refused."""
    import json
    import os

    from benchmarks import _pass_logs, sim_validate

    root = os.path.join(os.path.dirname(__file__), "..")
    sweep = _sweep({2.0: [0.3] * 8, 3.0: [0.3] * 8})
    json.dump(sweep, open(tmp_path / "s.json", "w"))
    common = ["--sweep", str(tmp_path / "s.json"), "--config", os.path.join(root, "cluster_configs", "local-colocated.yaml"),
              "--profile", os.path.join(root, "benchmarks", "results", "same_session_14", "profile_local_cpu.json"),
              "--seeds", "1"]
    with pytest.raises(SystemExit):
        sim_validate.main(common + ["--speed", "load", "--out", str(tmp_path / "v0")])
    _pass_logs.write(str(tmp_path / "s.passes.json.gz"), [{"rate": 2.0, "instances": _mixed_log(1.0)},
                                                          {"rate": 3.0, "instances": _mixed_log(1.25)}])
    sweep["pass_log_file"] = "s.passes.json.gz"
    json.dump(sweep, open(tmp_path / "s.json", "w"))
    assert sim_validate.main(common + ["--out", str(tmp_path / "v")]) == 0
    result = json.load(open(tmp_path / "v.json"))
    assert result["speed"] == "load"
    (first,), (second,) = (row["speed"] for row in result["rows"])
    assert first["source"] == "load" and first["passes"] == 400 and first["complete"]
    assert second["factor"] / first["factor"] == pytest.approx(1.25, rel=1e-6)
    assert set(first["by_role"]) == {"colocated"}
    assert "load speed factor" in open(tmp_path / "v.md").read()
    assert sim_validate.main(common + ["--speed-window", "2", "--out", str(tmp_path / "vw")]) == 0
    assert "2-s window" in open(tmp_path / "vw.md").read()
    assert json.load(open(tmp_path / "vw.json"))["rows"][0]["speed"][0]["timeline"]["window_s"] == 2.0
    for bad in ("0", "nan"):
        with pytest.raises(SystemExit):
            sim_validate.main(common + ["--speed-window", bad, "--out", str(tmp_path / "vbad")])
    # probes still selectable by name; a log whose rates differ from the sweep's is refused
    _pass_logs.write(str(tmp_path / "s.passes.json.gz"), [{"rate": 2.0, "instances": _mixed_log(1.0)}])
    with pytest.raises(SystemExit):
        sim_validate.main(common + ["--out", str(tmp_path / "v1")])


def test_speed_window_reads_the_drift_within_a_rate_and_aligns_the_log_with_the_trace():
    """A colocated rate whose passes from the middle of its log on took twice as long: ``--speed-window``
    gives the later window a factor about twice the earlier one's, starting at the first request's send (no
    recorded wall-clock start) or where the rate's wall-clock start puts the first pass; it needs load speed."""
    import os

    from benchmarks.sim_validate import compare
    from controller.config import load_config
    from controller.planner.simulator import SimConfig

    config = SimConfig.from_cluster_config(load_config(os.path.join(os.path.dirname(__file__), "..", "cluster_configs",
                                                                    "local-colocated.yaml")))
    instances = _mixed_log(1.0)
    starts = [r["end_s"] - r["seconds"] for inst in instances for r in inst["records"]]
    first, mid = min(starts), (min(starts) + max(starts)) / 2
    for inst in instances:
        for r in inst["records"]:
            if r["end_s"] - r["seconds"] >= mid:
                r["end_s"] += r["seconds"]  # same start, twice as long
                r["seconds"] *= 2
    sweep = _sweep({2.0: [0.3] * 8})
    logs = [[{"rate": 2.0, "instances": instances}]]
    result = compare(sweep, _profile(), config, seeds=1, speed="load", pass_logs=logs, speed_window_s=mid - first)
    (record,) = result["rows"][0]["speed"]
    timeline = record["timeline"]
    assert timeline["aligned_by"] == "first request" and timeline["starts_s"][:2] == pytest.approx([0.0, mid - first])
    early, late = timeline["factors"][:2]
    assert early["colocated"] < 1.0 < late["colocated"] and late["colocated"] / early["colocated"] > 1.6
    assert result["speed_window_s"] == mid - first
    sweep["rates"][0]["wall_start_s"] = first - 1.5  # the first pass began 1.5 s into the rate
    timeline = compare(sweep, _profile(), config, seeds=1, speed="load", pass_logs=logs,
                       speed_window_s=10.0)["rows"][0]["speed"][0]["timeline"]
    assert timeline["aligned_by"] == "wall clock" and timeline["starts_s"][0] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="--speed-window"):
        compare(sweep, _profile(), config, seeds=1, speed="none", speed_window_s=10.0)
