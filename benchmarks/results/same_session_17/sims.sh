# Simulator vs measured with the load speed read per rate (window "rate") and window by window inside each
# rate (--speed-window W), over the nine recorded sweeps that kept pass logs (sessions 15 and 16).
set -u
cd /work/main
export PYTHONPATH=.
O=benchmarks/results/same_session_17  # (run with O=runs/s17, copied here)
P=benchmarks/results/same_session_14/profile_local_cpu.json
S15=benchmarks/results/same_session_15; S16=benchmarks/results/same_session_16
sweeps="$S15/slo_chat_colocated_1:local-colocated $S15/slo_chat_colocated_2:local-colocated $S15/slo_chat_colocated_3:local-colocated $S15/slo_chat_disagg_spec_1:local $S15/slo_chat_disagg_spec_2:local $S15/slo_chat_disagg_spec_3:local $S15/slo_long_doc_disagg_spec_low:local $S16/slo_long_doc_colocated:local-colocated $S16/slo_long_doc_disagg_spec:local"
for W in "$@"; do
  for s in $sweeps; do
    sw=${s%%:*}; cfg=${s##*:}; n=$(basename $sw); n=${n#slo_}
    win=""; [ "$W" != rate ] && win="--speed-window $W"
    nice -n 19 python benchmarks/sim_validate.py --sweep $sw.json --profile $P --config cluster_configs/$cfg.yaml --speed load $win --out $O/sim_validation_${n}_w$W > $O/sim_${n}_w$W.log 2>&1 || echo "FAILED $n $W"
  done
done
