# Plans on this morning's profile (README section 6) and the 1.5x map of this morning's sweeps (section 5):
#   bash benchmarks/results/same_session_19/plans.sh
set -u
cd "$(dirname "$0")/../../.."
O=benchmarks/results/same_session_19
for slo in "3000 50" "6000 25"; do
  set -- $slo
  magicserve plan --profile $O/profile_today.json --ttft-ms $1 --tpot-ms $2 --workload long_doc --out $O/plan_long_doc_$(($1/1000))s_${2}ms.yaml 2>&1 | tail -2
done
python benchmarks/slo_map.py $O/slo_long_doc_disagg_spec_prefill2_run3.json $O/slo_long_doc_colocated.json --bootstrap 400 --out $O/slo_map_run3_vs_colocated
