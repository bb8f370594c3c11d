set -u
cd .
export PYTHONPATH=.
O=runs/s15
P=$O/profile_local_cpu.json
sim() {  # name config speed sweeps...
  local name=$1 config=$2 speed=$3; shift 3
  local args=""
  for s in "$@"; do args="$args --sweep $O/$s.json"; done
  python benchmarks/sim_validate.py $args --profile $P --config cluster_configs/$config --speed $speed --out $O/sim_validation_${name}_$speed > $O/sim_${name}_$speed.log 2>&1
}
echo "sims $(date +%T)" >> $O/sweeps.times
for speed in load probe none; do
  for run in 1 2 3; do
    sim chat_colocated_$run local-colocated.yaml $speed slo_chat_colocated_$run &
    sim chat_disagg_spec_$run local.yaml $speed slo_chat_disagg_spec_$run
    wait
  done
  sim chat_colocated_pooled local-colocated.yaml $speed slo_chat_colocated_1 slo_chat_colocated_2 slo_chat_colocated_3 &
  sim chat_disagg_spec_pooled local.yaml $speed slo_chat_disagg_spec_1 slo_chat_disagg_spec_2 slo_chat_disagg_spec_3
  wait
  sim long_doc_disagg_spec_low local.yaml $speed slo_long_doc_disagg_spec_low
done
echo "sims done $(date +%T)" >> $O/sweeps.times
