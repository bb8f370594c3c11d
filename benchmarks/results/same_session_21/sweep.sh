# Session 21: two more draws of the long_doc workload (seeds 2 and 3: other prompt lengths and arrivals) at the
# three rates where both systems cross 90 % at 3 s / 50 ms, one sweep at a time with nothing else running,
# in the order A B B A:
#   bash sweep.sh run_seed2 && bash sweep.sh colocated_seed2 && bash sweep.sh colocated_seed3 && bash sweep.sh run_seed3
#   run_seed*        the shared arrangement, local-prefill2.yaml (disaggregated + speculation, 2 + 1 threads)
#   colocated_seed*  the colocated reference engine, 2 instances x 1 thread
# Same command as session 20's seed-1 sweeps but the seed, so slo_map.py pools them rate by rate.
# Seed 2 met 90 % at 0.3 req/s on both systems, so seeds 1-3 are then sent again at 0.45 and 0.6 req/s (the same
# requests: a draw's lengths depend on its seed alone, its arrivals on the seed and the rate), order A B B A A B:
#   for s in run_seed1_top colocated_seed1_top colocated_seed2_top run_seed2_top run_seed3_top colocated_seed3_top; do
#     bash sweep.sh $s; done
set -u
cd "$(dirname "$0")/../../.."
O=benchmarks/results/same_session_21
case $1 in
  run_seed[123]*) cfg=cluster_configs/local-prefill2.yaml; label='disaggregated + speculation (prefill 2 threads)'; out=slo_long_doc_disagg_spec_prefill2_$1;;
  colocated_seed[123]*) cfg=cluster_configs/local-colocated.yaml; label='colocated reference engine'; out=slo_long_doc_$1;;
  *) echo "usage: sweep.sh run_seed2|run_seed3|colocated_seed2|colocated_seed3|{run,colocated}_seed{1,2,3}_top" >&2; exit 2;;
esac
seed=${1##*seed}; seed=${seed%_top}
rates=0.1,0.2,0.3; case $1 in *_top) rates=0.45,0.6;; esac
ld="--workload long_doc --num-requests 50 --rates $rates --seed $seed --ttft-slo-ms 3000 --tpot-slo-ms 50 --cores 2"
echo "$1 start $(date +%T)" >> $O/sweeps.times
python benchmarks/slo_sweep.py $ld --target grpc --launch $cfg --label "$label" --out $O/$out > $O/$out.log 2>&1
echo "$1 end $(date +%T) rc=$?" >> $O/sweeps.times
# After the calibrations (calibrate.sh), one more sweep of seed 2 at 0.3 req/s, to tell a slower machine from a
# calibration that runs slower than serving (README section 4); run by hand at 14:08:
#   python benchmarks/slo_sweep.py --workload long_doc --num-requests 50 --rates 0.3 --seed 2 --ttft-slo-ms 3000 \
#     --tpot-slo-ms 50 --cores 2 --target grpc --launch cluster_configs/local-prefill2.yaml \
#     --label 'disaggregated + speculation (prefill 2 threads)' --out $O/slo_long_doc_disagg_spec_prefill2_run_seed2_after_cal
