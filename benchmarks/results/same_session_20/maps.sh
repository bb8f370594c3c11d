# The 1.5x question on every sweep of session 19's trace so far, pooled per system (README section 2):
#   bash benchmarks/results/same_session_20/maps.sh
set -u
cd "$(dirname "$0")/../../.."
O=benchmarks/results/same_session_20
S=benchmarks/results/same_session_19
shared=$S/slo_long_doc_disagg_spec_prefill2_run3.json,$S/slo_long_doc_disagg_spec_prefill2_run4.json,$O/slo_long_doc_disagg_spec_prefill2_run5.json,$O/slo_long_doc_disagg_spec_prefill2_run6.json
colocated=$S/slo_long_doc_colocated.json,$O/slo_long_doc_colocated_2.json,$O/slo_long_doc_colocated_3.json
python benchmarks/slo_map.py $shared $colocated --bootstrap 1000 --out $O/slo_map_pooled
# with another draw of the workload (seed 1, 0.1-0.3 req/s) pooled in rate by rate
python benchmarks/slo_map.py $shared,$O/slo_long_doc_disagg_spec_prefill2_run_seed1.json \
    $colocated,$O/slo_long_doc_colocated_seed1.json --bootstrap 1000 --out $O/slo_map_pooled_seeds
# this session's sweeps alone (09:30-10:49)
python benchmarks/slo_map.py $O/slo_long_doc_disagg_spec_prefill2_run5.json,$O/slo_long_doc_disagg_spec_prefill2_run6.json \
    $O/slo_long_doc_colocated_2.json,$O/slo_long_doc_colocated_3.json --bootstrap 1000 --out $O/slo_map_session20
