set -u
cd .
export PYTHONPATH=.
O=runs/s15
chat="--workload chat --num-requests 300 --rates 2,3,4,5,6 --ttft-slo-ms 1000 --tpot-slo-ms 50 --cores 2"
for run in 1 2 3; do
  echo "run $run colocated $(date +%T)" >> $O/sweeps.times
  python benchmarks/slo_sweep.py --target grpc $chat --launch cluster_configs/local-colocated.yaml --label 'colocated reference engine' --out $O/slo_chat_colocated_$run > $O/slo_chat_colocated_$run.log 2>&1
  echo "run $run disagg $(date +%T)" >> $O/sweeps.times
  python benchmarks/slo_sweep.py --target grpc $chat --launch cluster_configs/local.yaml --label 'disaggregated + speculation' --out $O/slo_chat_disagg_spec_$run > $O/slo_chat_disagg_spec_$run.log 2>&1
done
echo "long_doc $(date +%T)" >> $O/sweeps.times
python benchmarks/slo_sweep.py --target grpc --workload long_doc --num-requests 48 --rates 0.15,0.2,0.25,0.3 --ttft-slo-ms 3000 --tpot-slo-ms 50 --cores 2 --launch cluster_configs/local.yaml --label 'disaggregated + speculation' --out $O/slo_long_doc_disagg_spec_low > $O/slo_long_doc_disagg_spec_low.log 2>&1
echo "done $(date +%T)" >> $O/sweeps.times
