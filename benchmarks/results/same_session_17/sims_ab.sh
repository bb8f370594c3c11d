# The simulator (reservation answered at the decode step's end; load speed per rate and per 10 / 20 s) on
# the four chat A/B sweeps of this session.
set -u
cd /work/main
export PYTHONPATH=.
O=benchmarks/results/same_session_17  # (run with O=runs/s17, copied here)
P=benchmarks/results/same_session_14/profile_local_cpu.json
for n in old_1 gate_1 gate_2 old_2; do
  for W in rate 10 20; do
    win=""; [ "$W" != rate ] && win="--speed-window $W"
    python benchmarks/sim_validate.py --sweep $O/slo_chat_disagg_spec_$n.json --profile $P --config cluster_configs/local.yaml --speed load $win --out $O/sim_validation_chat_disagg_spec_${n}_w$W > $O/sim_chat_disagg_spec_${n}_w$W.log 2>&1 || echo "FAILED $n $W"
  done
done
