# Plans on profile_s21.json (the machine as calibrated at 13:42-13:50, README section 4), as session 20's
# plans.sh did on profile_s20.json: bash benchmarks/results/same_session_21/plans.sh
set -u
cd "$(dirname "$0")/../../.."
O=benchmarks/results/same_session_21
for slo in "3000 50" "6000 25"; do
  set -- $slo
  magicserve plan --profile $O/profile_s21.json --ttft-ms $1 --tpot-ms $2 --workload long_doc \
      --out $O/plan_long_doc_$(($1/1000))s_${2}ms.yaml 2>&1 | grep -v "^planning\|screening\|verifying" | tail -6
done
