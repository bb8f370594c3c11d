# Plans on the s20 profile (session 19's, with the colocated calibration's burst shaped like long_doc), README
# section 4: bash benchmarks/results/same_session_20/plans.sh
set -u
cd "$(dirname "$0")/../../.."
O=benchmarks/results/same_session_20
for slo in "3000 50" "6000 25"; do
  set -- $slo
  magicserve plan --profile $O/profile_s20.json --ttft-ms $1 --tpot-ms $2 --workload long_doc \
      --out $O/plan_long_doc_$(($1/1000))s_${2}ms.yaml 2>&1 | grep -v "^planning\|screening\|verifying" | tail -6
done
