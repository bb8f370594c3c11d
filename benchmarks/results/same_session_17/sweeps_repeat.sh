# Repeats of session 16's long_doc sweeps on the same trace: bash sweeps_repeat.sh RUN SYSTEM...
# Ran as `sweeps_repeat.sh run2 disagg_spec_prefill2 colocated colocated_1x2` (00:27-01:34; the colocated
# run 2 was perturbed, README section 4) and `sweeps_repeat.sh run3 colocated colocated_1x2` (02:03-02:43),
# from a git worktree of 3657043 plus session 16's three configs (W below), writing to /work/main/runs/s16.
set -u
run=$1; shift
W=${W:-/tmp/wt16}
O=${O:-$PWD/benchmarks/results/same_session_17}
cd $W
export PYTHONPATH=$W
ld="--workload long_doc --num-requests 50 --rates 0.1,0.2,0.3,0.45,0.6,0.8,1.0 --ttft-slo-ms 3000 --tpot-slo-ms 50 --cores 2"
declare -A config=([disagg_spec_prefill2]=local-prefill2.yaml [colocated]=local-colocated.yaml [colocated_1x2]=local-colocated-1x2.yaml)
declare -A label=([disagg_spec_prefill2]='disaggregated + speculation (prefill 2 threads)' [colocated]='colocated reference engine' [colocated_1x2]='colocated reference engine (1 x 2 threads)')
for system in "$@"; do
  name=${system}_$run
  echo "$name start $(date +%T)" >> $O/sweeps_long_doc.times
  python benchmarks/slo_sweep.py $ld --target grpc --launch cluster_configs/${config[$system]} --label "${label[$system]}" --out $O/slo_long_doc_$name > $O/slo_long_doc_$name.log 2>&1
  echo "$name end $(date +%T) rc=$?" >> $O/sweeps_long_doc.times
done
