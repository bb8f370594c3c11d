# A/B of the step gate on chat: old = the worktree at 3657043 (plain lock in the actors), new = this tree.
# Order old, new, new, old (drift-balanced). Same trace (seed) for all.
set -u
O=$PWD/benchmarks/results/same_session_17  # run from the repository root (ran with O=/work/main/runs/s17, copied here)
chat="--workload chat --num-requests 300 --rates 2,4,5 --ttft-slo-ms 1000 --tpot-slo-ms 50 --cores 2"
sweep() { name=$1 dir=$2
  echo "$name start $(date +%T)" >> $O/sweeps.times
  (cd $dir && PYTHONPATH=$dir python benchmarks/slo_sweep.py --target grpc $chat --launch cluster_configs/local.yaml --label "disaggregated + speculation ($name)" --out $O/slo_chat_disagg_spec_$name > $O/slo_chat_disagg_spec_$name.log 2>&1)
  echo "$name end $(date +%T) rc=$?" >> $O/sweeps.times
}
sweep old_1 /tmp/wt16
sweep gate_1 /work/main
sweep gate_2 /work/main
sweep old_2 /tmp/wt16
echo "ab done $(date +%T)" >> $O/sweeps.times
