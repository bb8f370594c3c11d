# The simulator against this session's sweeps (seeds 2 and 3), as the planner sees them (--speed none):
#   s20  the profiles as they stood before these sweeps: session 20's profile_s20.json for both systems (its
#        colocated 2 x 1 calibration from a long_doc-shaped burst; the shared pair's from session 19's morning)
#   s21  profile_s21.json: the same with the disaggregated calibration redone on a long_doc-shaped burst
#        (calibrate.sh), which moves the shared pair's isolated terms
# then every draw so far pooled per system rate by rate (seeds 0-3; seed 0 as all its repeats; seeds 1-3 with
# their 0.45 / 0.6 req/s top-ups).
# bash benchmarks/results/same_session_21/sims.sh
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH=.
O=benchmarks/results/same_session_21
T=benchmarks/results/same_session_20
S=benchmarks/results/same_session_19
declare -A prof=([s20]=$T/profile_s20.json [s21]=$O/profile_s21.json)
val() { python benchmarks/sim_validate.py "$@" > /dev/null 2>&1 || echo "FAILED $*"; }
shared_runs="$S/slo_long_doc_disagg_spec_prefill2_run3 $S/slo_long_doc_disagg_spec_prefill2_run4
  $T/slo_long_doc_disagg_spec_prefill2_run5 $T/slo_long_doc_disagg_spec_prefill2_run6
  $T/slo_long_doc_disagg_spec_prefill2_run_seed1 $O/slo_long_doc_disagg_spec_prefill2_run_seed1_top
  $O/slo_long_doc_disagg_spec_prefill2_run_seed2 $O/slo_long_doc_disagg_spec_prefill2_run_seed2_top
  $O/slo_long_doc_disagg_spec_prefill2_run_seed3 $O/slo_long_doc_disagg_spec_prefill2_run_seed3_top"
colocated_runs="$S/slo_long_doc_colocated $T/slo_long_doc_colocated_2 $T/slo_long_doc_colocated_3
  $T/slo_long_doc_colocated_seed1 $O/slo_long_doc_colocated_seed1_top $O/slo_long_doc_colocated_seed2
  $O/slo_long_doc_colocated_seed2_top $O/slo_long_doc_colocated_seed3 $O/slo_long_doc_colocated_seed3_top"
for P in s20 s21; do
  for s in 2 3; do  # each new draw, 0.1-0.6 req/s
    val --sweep $O/slo_long_doc_disagg_spec_prefill2_run_seed$s.json --sweep $O/slo_long_doc_disagg_spec_prefill2_run_seed${s}_top.json \
        --profile ${prof[$P]} --config cluster_configs/local-prefill2.yaml --speed none --out $O/sim_validation_run_seed${s}_${P}_none
    val --sweep $O/slo_long_doc_colocated_seed$s.json --sweep $O/slo_long_doc_colocated_seed${s}_top.json --profile ${prof[$P]} \
        --config cluster_configs/local-colocated.yaml --speed none --out $O/sim_validation_colocated_seed${s}_${P}_none
  done
  val $(for r in $shared_runs; do echo --sweep $r.json; done) --profile ${prof[$P]} \
      --config cluster_configs/local-prefill2.yaml --speed none --out $O/sim_validation_shared_all_${P}_none
  val $(for r in $colocated_runs; do echo --sweep $r.json; done) --profile ${prof[$P]} \
      --config cluster_configs/local-colocated.yaml --speed none --out $O/sim_validation_colocated_all_${P}_none
done
# the same pools with each rate simulated on the profile rescaled by the workers' own timed passes during it
# (--speed load, the sweeps' pass logs): model error apart from the machine's speed
for P in s20 s21; do
  val $(for r in $shared_runs; do echo --sweep $r.json; done) --profile ${prof[$P]} \
      --config cluster_configs/local-prefill2.yaml --speed load --out $O/sim_validation_shared_all_${P}_load
done
val $(for r in $colocated_runs; do echo --sweep $r.json; done) --profile ${prof[s20]} \
    --config cluster_configs/local-colocated.yaml --speed load --out $O/sim_validation_colocated_all_s20_load
# the sweep run after the calibrations (sweep.sh, last lines), on both profiles, with its load speed
for P in s20 s21; do
  val --sweep $O/slo_long_doc_disagg_spec_prefill2_run_seed2_after_cal.json --profile ${prof[$P]} \
      --config cluster_configs/local-prefill2.yaml --speed load --out $O/sim_validation_run_seed2_after_cal_${P}_load
done
for f in $O/sim_validation_*.md; do echo "$(basename $f .md): $(grep -o 'Largest difference on both SLOs: \*\*[0-9.]* points' $f | grep -o '[0-9.]* points'), $(grep -o 'at [0-9] of [0-9] rates' $f)"; done
