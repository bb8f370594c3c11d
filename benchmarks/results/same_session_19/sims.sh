# The simulator against this morning's sweeps, as the planner sees them (--speed none) and given the load
# speed in 10 s windows (w10), on this session's profiles (README sections 1-3):
#   long_doc     profile_today.json: session 18's profile + this morning's calibrations + the core sharing of
#                a long_doc-shaped burst (`magicserve profile --calibrate-only --burst-workload long_doc`)
#   generic      the same with the generic burst's core sharing (core_sharing_burst.json, run 3)
#   processes    the same with the two-process core sharing only (what the planner had before)
#   run3_served  the same with run 3's own in-place core sharing (in sample: a check of the model)
# bash benchmarks/results/same_session_19/sims.sh
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH=.
O=benchmarks/results/same_session_19
python - <<PY
import dataclasses, json
from controller.planner.profile import CoreSharing, Profile
p = Profile.load("$O/profile_today.json")
base = tuple(c for c in p.core_sharing if c.source == "processes")
dataclasses.replace(p, core_sharing=base, samples={}).save("/tmp/s19_processes.json")
run3 = next(c for name, c in json.load(open("$O/core_sharing_in_place.json"))["served"].items() if "run3" in name)
dataclasses.replace(p, core_sharing=base + (CoreSharing(**run3),), samples={}).save("/tmp/s19_run3_served.json")
generic = {k: v for k, v in json.load(open("$O/core_sharing_burst.json"))["runs"][-1].items() if k not in ("run", "seconds")}
dataclasses.replace(p, core_sharing=base + (CoreSharing(**generic),), samples={}).save("/tmp/s19_generic.json")
PY
declare -A prof=([long_doc]=$O/profile_today.json [generic]=/tmp/s19_generic.json [processes]=/tmp/s19_processes.json [run3_served]=/tmp/s19_run3_served.json)
for P in generic long_doc processes run3_served; do
  for s in run3:cluster_configs/local-prefill2.yaml nice0:$O/local-prefill2-nice0.yaml; do
    sw=${s%%:*}; cfg=${s##*:}
    python benchmarks/sim_validate.py --sweep $O/slo_long_doc_disagg_spec_prefill2_$sw.json --profile ${prof[$P]} --config $cfg --speed none --out $O/sim_validation_${sw}_${P}_none > /dev/null 2>&1 || echo "FAILED $sw $P"
  done
done
for s in run3:cluster_configs/local-prefill2.yaml nice0:$O/local-prefill2-nice0.yaml; do
  sw=${s%%:*}; cfg=${s##*:}
  python benchmarks/sim_validate.py --sweep $O/slo_long_doc_disagg_spec_prefill2_$sw.json --profile $O/profile_today.json --config $cfg --speed load --speed-window 10 --out $O/sim_validation_${sw}_long_doc_w10 > /dev/null 2>&1 || echo "FAILED $sw w10"
done
# run 4 (08:42-09:02) came after every calibration of the profile: a prediction in time
python benchmarks/sim_validate.py --sweep $O/slo_long_doc_disagg_spec_prefill2_run4.json --profile $O/profile_today.json --config cluster_configs/local-prefill2.yaml --speed none --out $O/sim_validation_run4_long_doc_none > /dev/null 2>&1 || echo "FAILED run4"
for M in none w10; do
  speed="--speed none"; [ $M = w10 ] && speed="--speed load --speed-window 10"
  python benchmarks/sim_validate.py --sweep $O/slo_long_doc_colocated.json --profile $O/profile_today.json --config cluster_configs/local-colocated.yaml $speed --out $O/sim_validation_colocated_$M > /dev/null 2>&1 || echo "FAILED colocated $M"
done
for f in $O/sim_validation_*.md; do echo "$(basename $f .md): $(grep -o 'Largest difference on both SLOs: \*\*[0-9.]* points' $f | grep -o '[0-9.]* points'), $(grep -o 'at [0-9] of [0-9] rates' $f)"; done
