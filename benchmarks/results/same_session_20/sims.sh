# The simulator against this session's sweeps (and session 19's), as the planner sees them (--speed none):
#   s19        session 19's profile_today.json as it was (calibrated 06:35-08:42 that morning; its colocated
#              contention from the generic burst)
#   s20        the same with the colocated calibration's contention burst shaped like long_doc (calibrate.sh)
# bash benchmarks/results/same_session_20/sims.sh
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH=.
O=benchmarks/results/same_session_20
S=benchmarks/results/same_session_19
declare -A prof=([s19]=$S/profile_today.json [s20]=$O/profile_s20.json)
val() { python benchmarks/sim_validate.py "$@" > /dev/null 2>&1 || echo "FAILED $*"; }
for P in s19 s20; do
  for c in $S/slo_long_doc_colocated $O/slo_long_doc_colocated_2 $O/slo_long_doc_colocated_3; do
    val --sweep $c.json --profile ${prof[$P]} --config cluster_configs/local-colocated.yaml --speed none \
        --out $O/sim_validation_$(basename $c | sed 's/slo_long_doc_//')_${P}_none
  done
  val --sweep $S/slo_long_doc_colocated.json --sweep $O/slo_long_doc_colocated_2.json --sweep $O/slo_long_doc_colocated_3.json \
      --profile ${prof[$P]} --config cluster_configs/local-colocated.yaml --speed none --out $O/sim_validation_colocated_pooled_${P}_none
done
# the shared arrangement (its calibration unchanged: the morning's): forward in time, 2-3 hours after it
for r in run5 run6; do
  val --sweep $O/slo_long_doc_disagg_spec_prefill2_$r.json --profile $S/profile_today.json \
      --config cluster_configs/local-prefill2.yaml --speed none --out $O/sim_validation_${r}_s19_none
done
val --sweep $S/slo_long_doc_disagg_spec_prefill2_run3.json --sweep $S/slo_long_doc_disagg_spec_prefill2_run4.json \
    --sweep $O/slo_long_doc_disagg_spec_prefill2_run5.json --sweep $O/slo_long_doc_disagg_spec_prefill2_run6.json \
    --profile $S/profile_today.json --config cluster_configs/local-prefill2.yaml --speed none \
    --out $O/sim_validation_shared_pooled_s19_none
# another draw of the workload (seed 1: other lengths and arrivals), 0.1-0.3 req/s, swept after everything above
val --sweep $O/slo_long_doc_disagg_spec_prefill2_run_seed1.json --profile $S/profile_today.json \
    --config cluster_configs/local-prefill2.yaml --speed none --out $O/sim_validation_run_seed1_s19_none
for P in s19 s20; do
  val --sweep $O/slo_long_doc_colocated_seed1.json --profile ${prof[$P]} --config cluster_configs/local-colocated.yaml \
      --speed none --out $O/sim_validation_colocated_seed1_${P}_none
done
for f in $O/sim_validation_*.md; do echo "$(basename $f .md): $(grep -o 'Largest difference on both SLOs: \*\*[0-9.]* points' $f | grep -o '[0-9.]* points'), $(grep -o 'at [0-9] of [0-9] rates' $f)"; done
