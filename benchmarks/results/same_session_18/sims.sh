# Simulator vs measured on the recorded sweeps of instances with 2 threads, with the profile extended by
# `magicserve profile --add-threads 2` (profile_local_cpu_threads.json: session 14's profile + tp 2 cost
# models + core sharing). MODE: none (the profile as it is: the planner's view), rate (load speed per rate),
# w10 (load speed in 10 s windows). "free" simulates the sharing sweeps with the sharing factors set to 1
# (the threads outnumber the cores at no cost): what the model would say without the measurement.
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH=.
O=benchmarks/results/same_session_18
P=$O/profile_local_cpu_threads.json
FREE=/tmp/profile_sharing_free.json
python - <<PY
import dataclasses
from controller.planner.profile import Profile
p = Profile.load("$P")
p = dataclasses.replace(p, core_sharing=tuple(dataclasses.replace(c, prefill_factor=1.0, decode_factor=1.0) for c in p.core_sharing))
p.save("$FREE")
PY
S16=benchmarks/results/same_session_16; S17=benchmarks/results/same_session_17
sweeps="$S16/slo_long_doc_disagg_spec_prefill2:local-prefill2 $S16/slo_long_doc_disagg_prefill2:local-prefill2-no-spec $S17/slo_long_doc_disagg_spec_prefill2_run2:local-prefill2 $S16/slo_long_doc_colocated_1x2:local-colocated-1x2 $S17/slo_long_doc_colocated_1x2_run3:local-colocated-1x2 $S16/slo_long_doc_disagg_spec:local"
for M in "$@"; do
  for s in $sweeps; do
    sw=${s%%:*}; cfg=${s##*:}; n=$(basename $sw); n=${n#slo_}
    prof=$P; speed="--speed none"; win=""
    case $M in
      rate) speed="--speed load";;
      w10) speed="--speed load"; win="--speed-window 10";;
      free) prof=$FREE; case $cfg in local-prefill2*) ;; *) continue;; esac;;
    esac
    python benchmarks/sim_validate.py --sweep $sw.json --profile $prof --config cluster_configs/$cfg.yaml $speed $win --out $O/sim_validation_${n}_$M > $O/sim_${n}_$M.log 2>&1 || echo "FAILED $n $M"
  done
done
