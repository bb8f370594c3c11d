# The colocated reference engine's calibration with its contention burst shaped like long_doc, added to a copy of
# session 19's profile (profile_today.json, calibrated that morning) after this session's sweeps, nothing else running:
#   bash benchmarks/results/same_session_20/calibrate.sh
set -u
cd "$(dirname "$0")/../../.."
O=benchmarks/results/same_session_20
cp benchmarks/results/same_session_19/profile_today.json $O/profile_s20.json
magicserve profile --config cluster_configs/local-colocated.yaml --out $O/profile_s20.json --calibrate-only \
    --burst-workload long_doc 2>&1 | tee $O/calibrate_colocated_long_doc.log
