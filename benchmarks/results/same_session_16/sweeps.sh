set -u
cd /tmp/wt16
export PYTHONPATH=.
O=/work/main/runs/s16
ld="--workload long_doc --num-requests 50 --rates 0.1,0.2,0.3,0.45,0.6,0.8,1.0 --ttft-slo-ms 3000 --tpot-slo-ms 50 --cores 2"
sweep() { name=$1; shift
  echo "$name start $(date +%T)" >> $O/sweeps.times
  python benchmarks/slo_sweep.py $ld "$@" --out $O/slo_long_doc_$name > $O/slo_long_doc_$name.log 2>&1
  echo "$name end $(date +%T) rc=$?" >> $O/sweeps.times
}
sweep colocated --target grpc --launch cluster_configs/local-colocated.yaml --label 'colocated reference engine'
sweep disagg_spec_prefill2 --target grpc --launch cluster_configs/local-prefill2.yaml --label 'disaggregated + speculation (prefill 2 threads)'
sweep vllm --target openai --launch-vllm models/stdlib-llama-15m --max-model-len 8192 --vllm-kv-space-gib 2 --label 'vLLM (CPU build)'
sweep disagg_spec --target grpc --launch cluster_configs/local.yaml --label 'disaggregated + speculation'
sweep disagg_prefill2 --target grpc --launch cluster_configs/local-prefill2-no-spec.yaml --label 'disaggregated (prefill 2 threads)'
sweep colocated_1x2 --target grpc --launch cluster_configs/local-colocated-1x2.yaml --label 'colocated reference engine (1 x 2 threads)'
echo "done $(date +%T)" >> $O/sweeps.times
