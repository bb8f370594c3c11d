"""benchmarks/sim_validate.py: the measurement-noise interval reported beside the 5-point criterion, the
replay of a recorded sweep through the simulator (send times, either clock), pooling sweeps rate by rate,
and the optional host-contention plug-in. Profiles and sweeps are built here, by hand."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import sim_validate
from benchmarks.host_contention import HostContention
from benchmarks.sim_validate import compare, prefill_throughput, simulate_rate, wilson_interval, within_tolerance
from controller.config import load_config
from planner.profile import (PREFILL_FEATURES, TRANSFER_FEATURES, AcceptanceEntry, FittedModel,
                                        InstanceCosts, Profile)
from planner.simulator import SimConfig
from decode_worker.policy import FEATURES as PASS_FEATURES

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "cluster_configs")
DISAGGREGATED = os.path.join(CONFIGS, "local.yaml")  # 1 prefill + 1 decode instance, adaptive speculation
COLOCATED = os.path.join(CONFIGS, "local-colocated.yaml")  # 2 colocated instances


def _fitted(features, coefficients) -> FittedModel:
    return FittedModel(tuple(features), tuple(coefficients), 0.0, 0)


def make_profile() -> Profile:
    """A 1-thread CPU profile whose costs are easy to reason about: a prefill step costs 5 ms + 1 ms per prompt
    token (a 100-token prompt: 105 ms), a decode pass 10 ms + 1 ms per sequence, a self-sparse draft pass
    2 ms; KV transfer 1 ms + 1 us per token; 70 % of draft tokens accepted. No calibration (the simulator then
    charges the profiled costs as they are)."""
    costs = InstanceCosts(1, _fitted(PREFILL_FEATURES, (5e-3, 0.0, 1e-3, 0.0, 0.0)),
                          _fitted(PASS_FEATURES, (1e-2, 1e-3, 0.0, 0.0, 0.0)),
                          {"self_sparse": _fitted(PASS_FEATURES, (2e-3, 0.0, 0.0, 0.0, 0.0))}, 1 << 20, 1 << 20)
    return Profile(hardware="cpu: test", device_type="cpu", devices_per_node=2, model="test-model", model_params=10,
                   kv_bytes_per_token=64, source="measured", instances=(costs,),
                   kv_transfer=_fitted(TRANSFER_FEATURES, (1e-3, 1e-6)),
                   acceptance=(AcceptanceEntry("self_sparse", 256, 0, 1 << 30, 0.7, 1000),))


def sim_config(path: str = DISAGGREGATED) -> SimConfig:
    return SimConfig.from_cluster_config(load_config(path))


def _sweep(ttfts_by_rate: dict[float, list[float]], seed: int = 0) -> dict:
    """A recorded sweep in slo_sweep.py's layout: one request per TTFT (100+ token prompts, 8 tokens out),
    all meeting the TPOT SLO; SLOs TTFT 1 s, TPOT 50 ms."""
    rates = []
    for rate, ttfts in ttfts_by_rate.items():
        records = [{"arrival_s": i / rate, "prompt_tokens": 100 + i, "output_tokens": 8, "ttft_s": t,
                    "tpot_s": 0.01, "finish_reason": "length", "error": None} for i, t in enumerate(ttfts)]
        rates.append({"rate": rate, "records": records})
    return {"benchmark": "slo_sweep",
            "settings": {"workload": "long_doc", "seed": seed, "num_requests": 4, "rates": list(ttfts_by_rate),
                         "cv": 1.0, "ttft_slo_ms": 1000.0, "tpot_slo_ms": 50.0, "label": "x", "cores": 2.0},
            "started": "2000-01-01 00:00:00", "rates": rates}


def _write(path, data: dict) -> str:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)
    return str(path)


# --------------------------------------------------------------------------------------------------
# the criterion and the measurement's own noise


def test_wilson_interval_of_a_measured_attainment():
    assert wilson_interval(0.5, 40) == pytest.approx((0.352, 0.648), abs=1e-3)
    lo, hi = wilson_interval(1.0, 40)
    assert hi == 1.0 and lo == pytest.approx(0.912, abs=1e-3)  # all 40 met: the truth may still be 91 %
    assert wilson_interval(0.0, 40)[0] == 0.0
    # four times the requests halve the interval
    assert (lambda a, b: (b[1] - b[0]) / (a[1] - a[0]))(wilson_interval(0.5, 40), wilson_interval(0.5, 160)) \
        == pytest.approx(0.5, abs=0.02)
    assert wilson_interval(0.3, 0) == (0.0, 1.0)


def test_a_difference_of_exactly_the_tolerance_counts_as_within():
    """4 of 80 requests is exactly 5 points, though 0.625 - 0.675 is 0.05000000000000004 in floating point;
    5 of 80 is outside."""
    assert abs(0.625 - 0.675) > 0.05  # the floating-point trap the criterion must not fall into
    assert within_tolerance(abs(0.625 - 0.675))
    assert within_tolerance(0.0) and within_tolerance(0.0375)
    assert not within_tolerance(abs(0.6125 - 0.675))


def test_prefill_throughput_spans_the_first_tokens():
    """Prompt tokens over the span from the first to the last first token; requests without one are
    counted in neither (None when fewer than two first tokens)."""
    assert prefill_throughput([0.0, 1.0, 2.0], [0.5, 0.5, None], [100, 200, 300]) == pytest.approx(300.0)
    assert prefill_throughput([0.0], [0.5], [100]) is None


# --------------------------------------------------------------------------------------------------
# replaying a sweep


def test_sim_validate_replays_send_times_and_reads_either_clock():
    profile, config = make_profile(), sim_config()
    sweep = _sweep({2.0: [0.3, 0.3, 0.3, 0.3]})
    row = sweep["rates"][0]
    for r in row["records"]:
        r["sent_s"] = 5.0  # a starved load generator sent all four at once, 5 s late
    burst = simulate_rate(profile, config, row, 1.0, 0.05, seeds=1, arrivals="sent")
    spaced = simulate_rate(profile, config, row, 1.0, 0.05, seeds=1, arrivals="trace")
    # four prompts at once share the prefill instance: the burst's median TTFT is the longer (one prompt alone:
    # 5 ms + 100 x 1 ms)
    assert spaced["latency_ms"]["ttft_p50"] == pytest.approx(105.0, rel=0.1)
    assert burst["latency_ms"]["ttft_p50"] > 2 * spaced["latency_ms"]["ttft_p50"]

    with pytest.raises(ValueError, match="--timing server"):
        compare(sweep, profile, config, seeds=1, timing="server")
    for r in row["records"]:
        r.update(server_ttft_s=2.0, server_tpot_s=0.01)  # every request late on the server's clock
    result = compare(sweep, profile, config, seeds=1, timing="server")
    (out,) = result["rows"]
    assert out["measured"]["both"] == 0.0 and out["measured_client_clock_both"] == 1.0
    assert result["timing"] == "server" and result["arrivals"] == "sent"
    assert out["diff"]["both"] == pytest.approx(out["simulated"]["both"] - 0.0)


def test_sim_validate_pools_repeats_of_one_trace(tmp_path):
    """Two repeats of one trace: measured attainment over the pooled requests, each repeat's beside it; the
    files are written; a sweep of another trace is refused naming it."""
    first, again = _sweep({2.0: [0.3, 0.3, 0.3, 0.3]}), _sweep({2.0: [0.3, 2.0, 2.0, 2.0]})
    paths = ["--sweep", _write(tmp_path / "a.json", first), "--sweep", _write(tmp_path / "b.json", again)]
    profile_path = str(tmp_path / "profile.json")
    make_profile().save(profile_path)
    common = ["--profile", profile_path, "--config", DISAGGREGATED, "--seeds", "1"]
    assert sim_validate.main(paths + common + ["--out", str(tmp_path / "v")]) == 0
    result = json.load(open(tmp_path / "v.json"))
    (row,) = result["rows"]
    assert result["repeats"] == 2 and row["requests"] == 8
    assert row["measured_per_repeat_both"] == [1.0, 0.25] and row["measured"]["both"] == pytest.approx(5 / 8)
    md = open(tmp_path / "v.md").read()
    assert "2 repeats of the trace" in md and "Host contention: none" in md and result["host_contention"] is None
    assert open(tmp_path / "v.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"

    other = _sweep({2.0: [0.3, 0.3, 0.3, 0.3]})  # the first's seed, another trace: not a repeat
    other["rates"][0]["records"][1]["prompt_tokens"] += 7
    with pytest.raises(SystemExit):
        sim_validate.main(["--sweep", str(tmp_path / "a.json"), "--sweep", _write(tmp_path / "c.json", other)]
                          + common + ["--out", str(tmp_path / "w")])
    assert not os.path.exists(tmp_path / "w.json")


def test_sim_validate_pools_other_draws_of_the_workload_rate_by_rate():
    """Sweeps of two draws (seeds 0 and 1) at overlapping rates, and seed 0's requests again at another rate:
    each rate pools the sweeps that ran it, its simulated attainment is the request-weighted mean of each
    sweep's own replay; another workload, or other requests under a seed already pooled, are refused."""
    profile, config = make_profile(), sim_config()
    a = _sweep({1.0: [0.3] * 4, 2.0: [0.3] * 4}, seed=0)
    b = _sweep({2.0: [0.3, 5.0], 3.0: [5.0] * 4}, seed=1)  # another draw, other rates, 2 requests at 2 req/s
    for r in b["rates"][0]["records"]:
        r["prompt_tokens"] *= 30  # 3000-token prompts (3 s of prefill): this draw's replay misses the TTFT SLO
    top_up = _sweep({3.0: [0.3, 0.3, 9.0, 9.0]}, seed=0)  # seed 0's requests at a rate its first sweep skipped
    assert sim_validate.check_pool([a, b, top_up], ["a", "b", "t"]) == [False, False, True]
    result = compare([a, b, top_up], profile, config, seeds=1)
    assert [r["rate"] for r in result["rows"]] == [1.0, 2.0, 3.0] and result["draws"] == [0, 1]
    assert [r["requests"] for r in result["rows"]] == [4, 6, 8]
    row = result["rows"][1]
    assert row["measured_per_repeat_both"] == [1.0, 0.5] and row["measured"]["both"] == pytest.approx(5 / 6)
    own = [simulate_rate(profile, config, sweep["rates"][i], 1.0, 0.05, seeds=1, arrivals="sent")["attainment"]["both"]
           for sweep, i in ((a, 1), (b, 0))]
    assert own == [1.0, 0.0]
    assert row["simulated"]["both"] == pytest.approx((4 * own[0] + 2 * own[1]) / 6)
    assert result["rows"][2]["measured_per_repeat_both"] == [0.0, 0.5]

    other = _sweep({1.0: [0.3]}, seed=2)
    other["settings"]["workload"] = "chat"
    with pytest.raises(sim_validate.SweepMismatch,
                       match="c.json: settings.workload is 'chat'.*must draw the same workload"):
        sim_validate.check_pool([a, other], ["a", "c.json"])
    again = _sweep({2.0: [0.3] * 4}, seed=1)  # seed 1 again, but 4 requests at 2 req/s where b sent 2
    with pytest.raises(sim_validate.SweepMismatch,
                       match="d.json: the requests at rate 2.0 differ .* seed 1 .*must repeat its trace"):
        sim_validate.check_pool([a, b, again], ["a", "b", "d.json"])


# --------------------------------------------------------------------------------------------------
# the host-contention plug-in


def test_host_contention_slows_every_replay():
    """With the plug-in, a step runs 3x as long while the other instance is busy: the same requests come out
    later than without it, at every rate; without it the replay is the profile's."""
    profile, config = make_profile(), sim_config(COLOCATED)
    sweep = _sweep({8.0: [0.3] * 8, 16.0: [0.3] * 8})
    plain = compare(sweep, profile, config, seeds=1)
    busy = compare(sweep, profile, config, seeds=1, host_contention=HostContention("colocated", 1, scale=3.0))
    for p, b in zip(plain["rows"], busy["rows"]):  # 8 req/s: a request every 125 ms, each ~200 ms long
        assert b["simulated_latency_ms"]["ttft_p90"] > 2 * p["simulated_latency_ms"]["ttft_p90"]
        assert b["simulated"]["both"] < p["simulated"]["both"]
    none = compare(sweep, profile, config, seeds=1, host_contention=HostContention("colocated", 1))  # no terms
    assert [r["simulated_latency_ms"] for r in none["rows"]] == [r["simulated_latency_ms"] for r in plain["rows"]]


def test_host_contention_file_is_applied_and_named_in_the_report(tmp_path, capsys):
    sweep = _write(tmp_path / "s.json", _sweep({8.0: [0.3] * 8, 16.0: [0.3] * 8}))
    profile_path = str(tmp_path / "profile.json")
    make_profile().save(profile_path)
    contention = str(tmp_path / "host_contention_colocated.json")
    HostContention("colocated", 1, scale=3.0, step_s=0.002).save(contention)
    common = ["--sweep", sweep, "--profile", profile_path, "--config", COLOCATED, "--seeds", "1"]
    assert sim_validate.main(common + ["--out", str(tmp_path / "plain")]) == 0
    assert sim_validate.main(common + ["--host-contention", contention, "--out", str(tmp_path / "busy")]) == 0
    plain, busy = (json.load(open(tmp_path / f"{name}.json")) for name in ("plain", "busy"))
    assert busy["host_contention"]["summary"] == "3.00x + 2.0 ms per step"
    assert busy["host_contention"]["mode"] == "colocated" and plain["host_contention"] is None
    assert busy["host_contention"]["file"].endswith("host_contention_colocated.json")
    assert [r["simulated_latency_ms"]["ttft_p50"] for r in busy["rows"]] != \
        [r["simulated_latency_ms"]["ttft_p50"] for r in plain["rows"]]
    (line,) = [line for line in open(tmp_path / "busy.md") if line.startswith("Host contention:")]
    assert "host_contention_colocated.json" in line and "3.00x + 2.0 ms per step" in line
    capsys.readouterr()

    # measured for another mode than the config's, or not a host-contention file: refused, naming the flag
    HostContention("disaggregated", 1, scale=3.0).save(str(tmp_path / "disagg.json"))
    with pytest.raises(SystemExit):
        sim_validate.main(common + ["--host-contention", str(tmp_path / "disagg.json"), "--out", str(tmp_path / "x")])
    assert "--host-contention" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sim_validate.main(common + ["--host-contention", sweep, "--out", str(tmp_path / "y")])
    assert "not a host contention file" in capsys.readouterr().err
