# The colocated reference engine (2 instances x 1 thread) on run 3's trace, the same morning (README
# section 5), nothing else running: bash benchmarks/results/same_session_19/sweep_colocated.sh
set -u
cd "$(dirname "$0")/../../.."
O=benchmarks/results/same_session_19
ld="--workload long_doc --num-requests 50 --rates 0.1,0.2,0.3,0.45,0.6,0.8,1.0 --ttft-slo-ms 3000 --tpot-slo-ms 50 --cores 2"
echo "colocated start $(date +%T)" >> $O/sweeps.times
python benchmarks/slo_sweep.py $ld --target grpc --launch cluster_configs/local-colocated.yaml --label 'colocated reference engine' --out $O/slo_long_doc_colocated > $O/slo_long_doc_colocated.log 2>&1
echo "colocated end $(date +%T) rc=$?" >> $O/sweeps.times
