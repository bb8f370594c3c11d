set -u
cd /tmp/wt16
export PYTHONPATH=.
O=/work/main/runs/s16
P=/work/main/benchmarks/results/same_session_14/profile_local_cpu.json
sim() {  # name config speed sweep
  python benchmarks/sim_validate.py --sweep $O/slo_long_doc_$4.json --profile $P --config cluster_configs/$2 --speed $3 --out $O/sim_validation_long_doc_${1}_$3 > $O/sim_${1}_$3.log 2>&1
}
echo "sims $(date +%T)" >> $O/sweeps.times
for speed in load probe none; do
  sim colocated local-colocated.yaml $speed colocated
  sim disagg_spec local.yaml $speed disagg_spec
done
echo "sims done $(date +%T)" >> $O/sweeps.times
