"""Measured against simulated TTFT request by request: session 16's long_doc disaggregated + speculation sweep
at 0.3 req/s, simulated (seed 0) on session 14's profile rescaled by the rate's load speed, with one factor
for the rate and with 10 s windows. Run from the repository root:
python benchmarks/results/same_session_17/per_request_ttft.py"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)
from benchmarks import _pass_logs  # noqa: E402
from benchmarks.sim_validate import arrival_of, pass_log_origin  # noqa: E402
from controller.config import load_config  # noqa: E402
from controller.planner.load_speed import load_speed, speed_timeline  # noqa: E402
from controller.planner.profile import Profile  # noqa: E402
from controller.planner.simulator import SimConfig, simulate  # noqa: E402
from controller.planner.workload import RequestSpec  # noqa: E402

SWEEP = os.path.join(ROOT, "benchmarks/results/same_session_16/slo_long_doc_disagg_spec.json")
RATE_INDEX = 2  # 0.3 req/s
WINDOW_S = 10.0

sweep = json.load(open(SWEEP))
profile = Profile.load(os.path.join(ROOT, "benchmarks/results/same_session_14/profile_local_cpu.json"))
config = SimConfig.from_cluster_config(load_config(os.path.join(ROOT, "cluster_configs/local.yaml")))
row = sweep["rates"][RATE_INDEX]
rows = _pass_logs.rows_of(_pass_logs.load(SWEEP, sweep)[RATE_INDEX]["instances"])
drafter = config.speculation.drafter
est = load_speed(profile, config.mode, rows, drafter)
timeline = speed_timeline(profile, config.mode, rows, WINDOW_S, pass_log_origin(row, rows, "sent")[0], drafter, est)
records = sorted(row["records"], key=lambda r: arrival_of(r, "sent"))
trace = [RequestSpec(arrival_of(r, "sent"), r["prompt_tokens"], r["output_tokens"]) for r in records]
per_rate = simulate(est.apply(profile), config, trace, seed=0).records
windowed = simulate(est.apply(profile), config, trace, seed=0, speed=timeline).records
slo = sweep["settings"]["ttft_slo_ms"] / 1e3
print(f"{row['rate']:g} req/s, TTFT SLO {slo:g} s; simulated minus measured first-token time, s")
print("  sent s  prompt  measured  sim (rate)  sim (10 s windows)")
for r, a, b in zip(records, per_rate, windowed):
    print(f"{arrival_of(r, 'sent'):8.1f} {r['prompt_tokens']:7d} {r['ttft_s']:9.2f} {a.ttft_s - r['ttft_s']:+11.2f} "
          f"{b.ttft_s - r['ttft_s']:+19.2f}")
for name, sims in (("one factor", per_rate), ("10 s windows", windowed)):
    met = sum(s.ttft_s <= slo for s in sims)
    print(f"TTFT SLO met: measured {sum(r['ttft_s'] <= slo for r in records)}, simulated ({name}, seed 0) {met} of {len(records)}")
