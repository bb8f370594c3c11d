# Run 3 of the long_doc sweep of the shared arrangement (session 16's trace and command; sweeps_repeat.sh of
# session 17), right after this session's calibrations of the same profile (README section 2), with nothing
# else running: bash benchmarks/results/same_session_19/sweep_run3.sh
set -u
cd "$(dirname "$0")/../../.."
O=benchmarks/results/same_session_19
ld="--workload long_doc --num-requests 50 --rates 0.1,0.2,0.3,0.45,0.6,0.8,1.0 --ttft-slo-ms 3000 --tpot-slo-ms 50 --cores 2"
echo "run3 start $(date +%T)" >> $O/sweeps.times
python benchmarks/slo_sweep.py $ld --target grpc --launch cluster_configs/local-prefill2.yaml --label 'disaggregated + speculation (prefill 2 threads)' --out $O/slo_long_doc_disagg_spec_prefill2_run3 > $O/slo_long_doc_disagg_spec_prefill2_run3.log 2>&1
echo "run3 end $(date +%T) rc=$?" >> $O/sweeps.times
