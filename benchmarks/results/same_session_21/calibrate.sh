# The two calibrations session 20 left with a generic contention burst, redone with the burst shaped like long_doc,
# on a copy of session 20's profile (profile_s20.json), after this session's sweeps, nothing else running:
#   bash benchmarks/results/same_session_21/calibrate.sh
#   local.yaml                 the disaggregated calibration (1 + 1 threads; the shared pair's isolated terms too)
#   local-colocated-1x2.yaml   the colocated engine as 1 instance x 2 threads (its burst sets its step noise)
#   local-prefill2.yaml        then the shared pair's core sharing again: it is fitted on top of the disaggregated
#                              calibration's isolated terms, so it must follow them (README's order)
set -u
cd "$(dirname "$0")/../../.."
O=benchmarks/results/same_session_21
cp benchmarks/results/same_session_20/profile_s20.json $O/profile_s21.json
for c in local local-colocated-1x2 local-prefill2; do
  echo "$c start $(date +%T)"
  magicserve profile --config cluster_configs/$c.yaml --out $O/profile_s21.json --calibrate-only \
      --burst-workload long_doc > $O/calibrate_${c}_long_doc.log 2>&1 || echo "FAILED $c"
  echo "$c end $(date +%T)"; grep "^calibration (" $O/calibrate_${c}_long_doc.log
done
# A repeat of the last two (13:52-13:56), on a copy of profile_s21.json; the profile is not kept (2 MB), its
# logs (calibrate_repeat_*.log) and the simulator on it (sim_validation_shared_all_s21_repeat_none) are:
#   cp $O/profile_s21.json $O/profile_s21_repeat.json
#   for c in local local-prefill2; do magicserve profile --config cluster_configs/$c.yaml \
#       --out $O/profile_s21_repeat.json --calibrate-only --burst-workload long_doc > $O/calibrate_repeat_${c}_long_doc.log 2>&1; done
