"""The experiment behind README.md's "Two factors instead of one": each rate simulated with the prefill side of
the profile rescaled by the probes' TTFT ratio and the decode side by their TPOT ratio (instead of one factor,
the TTFT ratio, on everything, as sim_validate.py --speed probe does). Run from the repository root:

    PYTHONPATH=. python benchmarks/results/same_session_14/split_factors.py \
        benchmarks/results/same_session_14/profile_local_cpu.json cluster_configs/local-colocated.yaml \
        benchmarks/results/same_session_14/slo_chat_colocated_{1,2,3}.json

Its output for both configurations is in split_factors.txt: worst gaps 15.7 / 15.2 / 23.5 (colocated) and 10.9 / 6.9 / 9.1 (disaggregated + speculation,
with cluster_configs/local.yaml), against 10.4 / 13.7 / 11.3 and 11.2 / 8.3 / 7.9 with one factor."""
import dataclasses, json, sys
from benchmarks._speed_probe import speed_of, probes_around
from benchmarks.sim_validate import simulate_rate
from benchmarks.slo_sweep import attainment_of
from controller.config import load_config
from controller.planner.profile import Profile
from controller.planner.simulator import SimConfig

def split(p, fp, fd):
    s = lambda m, f: None if m is None else dataclasses.replace(m, coefficients=tuple(f * c for c in m.coefficients))
    inst = tuple(dataclasses.replace(c, prefill=s(c.prefill, fp), target_pass=s(c.target_pass, fd),
                                     draft_pass={k: s(v, fd) for k, v in c.draft_pass.items()}) for c in p.instances)
    cals = tuple(dataclasses.replace(c, ttft_overhead_s=fp * c.ttft_overhead_s, decode_start_s=fd * c.decode_start_s,
                                     contention_step_s=fp * c.contention_step_s, contention_output_s=fd * c.contention_output_s) for c in p.calibrations)
    return dataclasses.replace(p, instances=inst, kv_transfer=s(p.kv_transfer, fp), calibrations=cals)

p = Profile.load(sys.argv[1]); c = SimConfig.from_cluster_config(load_config(sys.argv[2]))
for path in sys.argv[3:]:
    d = json.load(open(path)); s = d["settings"]; gaps = []
    for i, row in enumerate(d["rates"]):
        e = speed_of(p, c, probes_around(d, i))
        sim = simulate_rate(split(p, e.factor, e.tpot_ratio), c, row, s["ttft_slo_ms"] / 1e3, s["tpot_slo_ms"] / 1e3, 5)
        gaps.append(100 * (sim["attainment"]["both"] - attainment_of(row["records"], s["ttft_slo_ms"] / 1e3, s["tpot_slo_ms"] / 1e3)["both"]))
    print(path.split("/")[-1], "worst %.1f" % max(map(abs, gaps)), ", ".join("%+.1f" % g for g in gaps))
