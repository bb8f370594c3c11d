set -u
cd .
export PYTHONPATH=.
O=runs/s15
P=$O/profile_local_cpu.json
sim() {
  local name=$1 config=$2; shift 2
  local args=""
  for s in "$@"; do args="$args --sweep $O/$s.json"; done
  python $O/exp/sim_priced.py $args --profile $P --config cluster_configs/$config --speed load $EXTRA --out $O/exp/sim_validation_${name}_$TAG > $O/exp/sim_${name}.log 2>&1
}
for run in 1 2 3; do
  sim chat_colocated_$run local-colocated.yaml slo_chat_colocated_$run &
  sim chat_disagg_spec_$run local.yaml slo_chat_disagg_spec_$run
  wait
done
sim chat_colocated_pooled local-colocated.yaml slo_chat_colocated_1 slo_chat_colocated_2 slo_chat_colocated_3 &
sim chat_disagg_spec_pooled local.yaml slo_chat_disagg_spec_1 slo_chat_disagg_spec_2 slo_chat_disagg_spec_3
wait
sim long_doc_disagg_spec_low local.yaml slo_long_doc_disagg_spec_low
