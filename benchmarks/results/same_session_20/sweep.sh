# This session's long_doc sweeps, repeats of session 19's (same trace, same command but the output name), one at a
# time with nothing else running, in the order A B A B:
#   bash sweep.sh colocated_2 && bash sweep.sh run5 && bash sweep.sh colocated_3 && bash sweep.sh run6
# then another draw of the workload (seed 1: other lengths and arrivals) at the three rates where 90 % is crossed:
#   bash sweep.sh run_seed1 && bash sweep.sh colocated_seed1
#   run5, run6              the shared arrangement, local-prefill2.yaml (disaggregated + speculation, 2 + 1 threads)
#   colocated_2, colocated_3 the colocated reference engine, 2 instances x 1 thread
# Pooled with session 19's run3 / run4 / colocated (comma-separated sweeps in slo_map.py) they give 150-200 requests
# per rate for the 1.5x question; each is also a forward-in-time check of session 19's calibrated profile.
set -u
cd "$(dirname "$0")/../../.."
O=benchmarks/results/same_session_20
case $1 in
  run5|run6|run_seed1) cfg=cluster_configs/local-prefill2.yaml; label='disaggregated + speculation (prefill 2 threads)'; out=slo_long_doc_disagg_spec_prefill2_$1;;
  colocated_2|colocated_3|colocated_seed1) cfg=cluster_configs/local-colocated.yaml; label='colocated reference engine'; out=slo_long_doc_$1;;
  *) echo "usage: sweep.sh run5|run6|colocated_2|colocated_3|run_seed1|colocated_seed1" >&2; exit 2;;
esac
ld="--workload long_doc --num-requests 50 --rates 0.1,0.2,0.3,0.45,0.6,0.8,1.0 --ttft-slo-ms 3000 --tpot-slo-ms 50 --cores 2"
case $1 in *seed1) ld="--workload long_doc --num-requests 50 --rates 0.1,0.2,0.3 --seed 1 --ttft-slo-ms 3000 --tpot-slo-ms 50 --cores 2";; esac
echo "$1 start $(date +%T)" >> $O/sweeps.times
python benchmarks/slo_sweep.py $ld --target grpc --launch $cfg --label "$label" --out $O/$out > $O/$out.log 2>&1
echo "$1 end $(date +%T) rc=$?" >> $O/sweeps.times
