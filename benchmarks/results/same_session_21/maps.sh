# The 1.5x question at 3 s / 50 ms on every draw of long_doc so far (seeds 0-3), pooled per system rate by rate
# (README section 2). 1000 bootstrap resamples of each rate's requests, independently per system. Seeds 1-3 at
# 0.1-0.3 req/s and again at 0.45 and 0.6 (the *_top sweeps: the same requests, so they extend their draw).
#   bash benchmarks/results/same_session_21/maps.sh
set -u
cd "$(dirname "$0")/../../.."
O=benchmarks/results/same_session_21
T=benchmarks/results/same_session_20
S=benchmarks/results/same_session_19
sh=slo_long_doc_disagg_spec_prefill2
seeds_shared=$T/${sh}_run_seed1.json,$O/${sh}_run_seed1_top.json,$O/${sh}_run_seed2.json,$O/${sh}_run_seed2_top.json,$O/${sh}_run_seed3.json,$O/${sh}_run_seed3_top.json
seeds_colocated=$T/slo_long_doc_colocated_seed1.json,$O/slo_long_doc_colocated_seed1_top.json,$O/slo_long_doc_colocated_seed2.json,$O/slo_long_doc_colocated_seed2_top.json,$O/slo_long_doc_colocated_seed3.json,$O/slo_long_doc_colocated_seed3_top.json
map() { out=$1; shift; python benchmarks/slo_map.py "$@" --bootstrap 1000 --out $O/$out > /dev/null || echo "FAILED $out"; }
# every run: seed 0 as all its repeats (4 shared, 3 colocated), seeds 1-3 once each
map slo_map_all_runs $S/${sh}_run3.json,$S/${sh}_run4.json,$T/${sh}_run5.json,$T/${sh}_run6.json,$seeds_shared \
    $S/slo_long_doc_colocated.json,$T/slo_long_doc_colocated_2.json,$T/slo_long_doc_colocated_3.json,$seeds_colocated
# one run per draw (seed 0: each system's first run, session 19's): every draw weighs the same, and no
# repeat of a trace counts as independent requests
map slo_map_one_run_per_draw $S/${sh}_run3.json,$seeds_shared $S/slo_long_doc_colocated.json,$seeds_colocated
# the draws other than seed 0 (seeds 1-3, 0.1-0.6 req/s)
map slo_map_seeds_1_3 $seeds_shared $seeds_colocated
for f in slo_map_all_runs slo_map_one_run_per_draw slo_map_seeds_1_3; do
  python - $O/$f.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
c = next(c for c in d["cells"] if c["ttft_slo_s"] == 3.0 and abs(c["tpot_slo_s"] - 0.05) < 1e-9)
b = c["bootstrap"]
print(f"{sys.argv[1].rsplit('/', 1)[-1]}: shared {2 * c['candidate']['value']:.3f} req/s, colocated "
      f"{2 * c['baseline']['value']:.3f} req/s, ratio {c['ratio']:.2f} [{c['ratio_lo']:.2f}, {c['ratio_hi']:.2f}], "
      f"bootstrap 5-95 % {float(b['q05']):.2f}-{float(b['q95']):.2f}, >= 1.5x in {b['share_at_target']:.1%}: {c['verdict']}")
PY
done
