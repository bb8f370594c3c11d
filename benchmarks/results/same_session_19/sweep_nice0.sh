# The niceness A/B (README section 4): run 3's sweep (sweep_run3.sh) with the workers at niceness 0
# (local-prefill2-nice0.yaml: ray.worker_niceness 0) instead of Ray's 15, nothing else running:
#   bash benchmarks/results/same_session_19/sweep_nice0.sh
set -u
cd "$(dirname "$0")/../../.."
O=benchmarks/results/same_session_19
ld="--workload long_doc --num-requests 50 --rates 0.1,0.2,0.3,0.45,0.6,0.8,1.0 --ttft-slo-ms 3000 --tpot-slo-ms 50 --cores 2"
echo "nice0 start $(date +%T)" >> $O/sweeps.times
python benchmarks/slo_sweep.py $ld --target grpc --launch $O/local-prefill2-nice0.yaml --label 'disaggregated + speculation (prefill 2 threads), workers at niceness 0' --out $O/slo_long_doc_disagg_spec_prefill2_nice0 > $O/slo_long_doc_disagg_spec_prefill2_nice0.log 2>&1
echo "nice0 end $(date +%T) rc=$?" >> $O/sweeps.times
