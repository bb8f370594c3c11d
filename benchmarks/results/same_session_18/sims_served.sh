# The served core sharing (benchmarks/core_sharing_in_place.py) fitted on run 1 of the 2-thread prefill sweep
# (session 16) and tested on the other sweeps of the arrangement, as the planner sees them (--speed none);
# then the plans on that profile. The profile copy drops the stored measurement samples (refits only).
set -eu
cd "$(dirname "$0")/../../.."
export PYTHONPATH=.
O=benchmarks/results/same_session_18; S16=benchmarks/results/same_session_16; S17=benchmarks/results/same_session_17
P=$O/profile_local_cpu_threads_served.json
python -c "
import dataclasses
from controller.planner.profile import Profile
dataclasses.replace(Profile.load('$O/profile_local_cpu_threads.json'), samples={}).save('$P')"
python benchmarks/core_sharing_in_place.py --sweep $S16/slo_long_doc_disagg_spec_prefill2.json --profile $P --config cluster_configs/local-prefill2.yaml --out $O/core_sharing_in_place_run1 --update-profile
for s in $S16/slo_long_doc_disagg_spec_prefill2:local-prefill2 $S17/slo_long_doc_disagg_spec_prefill2_run2:local-prefill2 $O/slo_long_doc_disagg_spec_prefill2_yield:local-prefill2-yield $S16/slo_long_doc_disagg_prefill2:local-prefill2-no-spec; do
  sw=${s%%:*}; cfg=${s##*:}; n=$(basename $sw); n=${n#slo_}
  python benchmarks/sim_validate.py --sweep $sw.json --profile $P --config cluster_configs/$cfg.yaml --speed none --out $O/sim_validation_${n}_served_none > /dev/null
done
# given the load speed (per rate, and in 10 s windows); the yield sweep cannot be read this way (its prefill
# passes ran on two thread counts the pass log does not tell apart)
for s in $S16/slo_long_doc_disagg_spec_prefill2:local-prefill2 $S17/slo_long_doc_disagg_spec_prefill2_run2:local-prefill2 $S16/slo_long_doc_disagg_prefill2:local-prefill2-no-spec; do
  sw=${s%%:*}; cfg=${s##*:}; n=$(basename $sw); n=${n#slo_}
  python benchmarks/sim_validate.py --sweep $sw.json --profile $P --config cluster_configs/$cfg.yaml --speed load --out $O/sim_validation_${n}_served_rate > /dev/null
  python benchmarks/sim_validate.py --sweep $sw.json --profile $P --config cluster_configs/$cfg.yaml --speed load --speed-window 10 --out $O/sim_validation_${n}_served_w10 > /dev/null
done
for slo in "3000 50" "6000 25"; do
  set -- $slo
  magicserve plan --profile $P --ttft-ms $1 --tpot-ms $2 --workload long_doc --out $O/plan_served_long_doc_$(($1/1000))s_${2}ms.yaml 2>/dev/null
done
