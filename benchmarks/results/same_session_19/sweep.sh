# This morning's long_doc sweeps on session 16's trace (sweeps_repeat.sh of session 17), one at a time with
# nothing else running; ran in this order as `bash sweep.sh run3`, `bash sweep.sh nice0`, `bash sweep.sh colocated`,
# then `bash sweep.sh nice0_2 && bash sweep.sh run4` (the niceness A/B repeated in the other order: ABBA):
#   run3, run4       the shared arrangement, local-prefill2.yaml (README sections 3-4)
#   nice0, nice0_2   the same with the workers at niceness 0, local-prefill2-nice0.yaml (section 4)
#   colocated        the colocated reference engine, 2 instances x 1 thread (section 5)
set -u
cd "$(dirname "$0")/../../.."
O=benchmarks/results/same_session_19
case $1 in
  run3|run4) cfg=cluster_configs/local-prefill2.yaml; label='disaggregated + speculation (prefill 2 threads)'; out=slo_long_doc_disagg_spec_prefill2_$1;;
  nice0|nice0_2) cfg=$O/local-prefill2-nice0.yaml; label='disaggregated + speculation (prefill 2 threads), workers at niceness 0'; out=slo_long_doc_disagg_spec_prefill2_$1;;
  colocated) cfg=cluster_configs/local-colocated.yaml; label='colocated reference engine'; out=slo_long_doc_colocated;;
  *) echo "usage: sweep.sh run3|run4|nice0|nice0_2|colocated" >&2; exit 2;;
esac
ld="--workload long_doc --num-requests 50 --rates 0.1,0.2,0.3,0.45,0.6,0.8,1.0 --ttft-slo-ms 3000 --tpot-slo-ms 50 --cores 2"
echo "$1 start $(date +%T)" >> $O/sweeps.times
python benchmarks/slo_sweep.py $ld --target grpc --launch $cfg --label "$label" --out $O/$out > $O/$out.log 2>&1
echo "$1 end $(date +%T) rc=$?" >> $O/sweeps.times
