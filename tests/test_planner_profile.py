"""The planner's hardware profile: schema round trip and errors, the fit, a quick measured profile of a
tiny checkpoint through the CLI, and the analytical GPU profiles."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest

from controller.config import load_config
from decode_worker.policy import FEATURES as PASS_FEATURES
from decode_worker.policy import PassShape
from frontend.cli import main as cli_main
from planner import analytical
from planner.profile import (
    CONTEXT_UNBOUNDED, PREFILL_FEATURES, TRANSFER_FEATURES, AcceptanceEntry, FittedModel, InstanceCosts, Profile,
    ProfileError, prefill_features)
from planner.profiler import check_config

H100 = analytical.GPUS["H100-80GB-SXM"]


def _model(features, coefficients, err=0.05, points=10) -> FittedModel:
    return FittedModel(tuple(features), tuple(coefficients), err, points)


def _profile(**changes) -> Profile:
    costs = InstanceCosts(1, _model(PREFILL_FEATURES, (1e-3, 1e-5, 2e-6, 1e-10, 1e-9)),
                          _model(PASS_FEATURES, (2e-3, 1e-5, 1e-8, 3e-6, 1e-9)),
                          {"self_sparse": _model(PASS_FEATURES, (1e-3, 1e-5, 1e-8, 3e-6, 0.0))}, 4096, 2048)
    p = Profile(hardware="cpu: test", device_type="cpu", devices_per_node=2, model="m", model_params=10,
                kv_bytes_per_token=64, source="measured", instances=(costs,),
                kv_transfer=_model(TRANSFER_FEATURES, (1e-3, 1e-6)),
                acceptance=(AcceptanceEntry("self_sparse", 256, 0, 1024, 0.8, 100),
                            AcceptanceEntry("self_sparse", 256, 1024, CONTEXT_UNBOUNDED, 0.6, 100)),
                notes="n", samples={"kv_transfer": [{"passes": 1.0, "tokens": 8.0, "seconds": 0.001}]})
    return dataclasses.replace(p, **changes)


# -- schema --------------------------------------------------------------------------------------

def test_profile_round_trip(tmp_path):
    p = _profile()
    path = str(tmp_path / "sub" / "p.json")
    p.save(path)
    assert Profile.load(path) == p
    assert p.kv_capacity("decode", 1) == 4096 and p.kv_capacity("prefill", 1) == 2048
    assert p.acceptance_rate("self_sparse", 300, 100) == 0.8
    assert p.acceptance_rate("self_sparse", 256, 5000) == 0.6
    # a calibration comes back as it went
    from planner.profile import Calibration

    cal = dataclasses.replace(Calibration.identity("colocated"), prefill_scale=1.2, verify_pass_scale=0.8, threads=2)
    p.with_calibration(cal).save(path)
    assert Profile.load(path).calibration("colocated", 2) == cal
    assert Profile.load(path).calibration("colocated") == Calibration.identity("colocated")  # no 1-thread one


def test_profile_lookups_name_what_is_missing():
    p = _profile()
    with pytest.raises(ProfileError, match="tensor_parallel=2"):
        p.target_model(2)
    with pytest.raises(ProfileError, match="draft_model"):
        p.draft_model("draft_model", 1)
    with pytest.raises(ProfileError, match="budget <= 128"):
        p.acceptance_rate("self_sparse", 128, 10)
    no_cap = _profile(instances=(dataclasses.replace(p.instances[0], prefill_kv_capacity_tokens=0),))
    with pytest.raises(ProfileError, match="prefill KV capacity"):
        no_cap.kv_capacity("prefill", 1)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(version=99), "version"),
    (lambda d: d.pop("kv_transfer"), "missing field 'kv_transfer'"),
    (lambda d: d.update(kv_transfer=None), "kv_transfer"),
    (lambda d: d["instances"][0]["target_pass"].update(coefficients=[1.0]), "malformed cost model"),
    (lambda d: d["instances"][0]["target_pass"].update(coefficients=[float("nan")] * 4), "malformed cost model"),
    (lambda d: d["acceptance"][0].update(colour="blue"), "malformed"),
    (lambda d: d.update(samples=[1, 2]), "samples"),
    (lambda d: d.update(instances="x"), "malformed"),
])
def test_malformed_profile_files(tmp_path, mutate, message):
    d = _profile().to_dict()
    mutate(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=message):
        Profile.load(str(path))


def test_unreadable_profile_files(tmp_path):
    with pytest.raises(ProfileError, match="no such profile"):
        Profile.load(str(tmp_path / "missing.json"))
    (tmp_path / "text.json").write_text("not json {")
    with pytest.raises(ProfileError, match="not JSON"):
        Profile.load(str(tmp_path / "text.json"))
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ProfileError, match="malformed"):
        Profile.load(str(tmp_path / "list.json"))


# -- fitting -------------------------------------------------------------------------------------

def _rows(n: int, seed: int = 0) -> list[dict[str, float]]:
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        b, ctx, k = rnd.choice([1, 2, 4, 8, 16, 32]), rnd.choice([128, 1024, 4096]), rnd.randint(0, 5)
        out.append(dict(zip(PASS_FEATURES, PassShape(b, b * (ctx + k + 1), b * (k + 1)).features())))
    return out


def test_fit_recovers_known_coefficients():
    true = (2e-3, 5e-5, 3e-8, 4e-6, 5e-9)
    rows = _rows(40)
    seconds = [sum(c * r[f] for f, c in zip(PASS_FEATURES, true)) for r in rows]
    fm = FittedModel.fit(PASS_FEATURES, rows, seconds)
    assert fm.points == 40 and fm.fit_error < 1e-9
    for got, want in zip(fm.coefficients, true):
        assert got == pytest.approx(want, rel=1e-6)


def test_fit_reports_noise_and_keeps_coefficients_non_negative():
    rnd = random.Random(1)
    rows = _rows(60, seed=2)
    true = (1e-3, 0.0, 2e-8, 3e-6, 0.0)
    seconds = [sum(c * r[f] for f, c in zip(PASS_FEATURES, true)) * rnd.uniform(0.9, 1.1) for r in rows]
    fm = FittedModel.fit(PASS_FEATURES, rows, seconds)
    assert all(c >= 0 for c in fm.coefficients)
    assert 0.01 < fm.fit_error < 0.1  # uniform +-10 % noise: about 5.8 % relative RMS
    assert fm.coefficients[0] == pytest.approx(1e-3, rel=0.1)
    assert fm.coefficients[2] == pytest.approx(2e-8, rel=0.1)


def test_fit_needs_enough_positive_points():
    rows = _rows(4)
    with pytest.raises(ProfileError, match="at least 5 points"):
        FittedModel.fit(PASS_FEATURES, rows, [1.0] * 4)
    with pytest.raises(ProfileError, match="positive"):
        FittedModel.fit(PASS_FEATURES, _rows(5), [1.0, 1.0, 0.0, 1.0, 1.0])


# -- a measured profile (quick grid, tiny checkpoint) --------------------------------------------

TINY_CLUSTER = """
model: {{path: {model}, dtype: bfloat16}}
prefill: {{threads: 1, token_budget: 128, kv_cache_tokens: 4096}}
decode:
  threads: 1
  kv_cache_tokens: 8192
  max_num_seqs: 8
  speculation: {{drafter: self_sparse, budget: 64, sink_tokens: 8, max_k: 3}}
kv_transfer: {{backend: gloo, timeout_s: 30}}
limits: {{max_prompt_tokens: 512, max_tokens: 256}}
"""


def test_quick_measured_profile(tmp_path, llama_dir, capsys):
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(TINY_CLUSTER.format(model=llama_dir))
    out = tmp_path / "profile.json"
    assert cli_main(["profile", "--config", str(cfg), "--out", str(out), "--quick", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "fit target_pass" in printed and "fit error" in printed
    p = Profile.load(str(out))
    assert p.source == "measured" and p.device_type == "cpu" and p.hardware.startswith("cpu: ")
    assert "1 thread(s) per prefill worker" in p.hardware
    c = p.costs(1)
    models = {"prefill": c.prefill, "target_pass": c.target_pass, "draft_pass/self_sparse": c.draft_pass["self_sparse"],
              "kv_transfer": p.kv_transfer}
    for name, fm in models.items():
        assert fm.points >= len(fm.features) and math.isfinite(fm.fit_error), name
        assert any(x > 0 for x in fm.coefficients), name
        assert len(p.samples[name]) == fm.points, name
    assert c.prefill.features == PREFILL_FEATURES and c.target_pass.features == PASS_FEATURES
    assert p.kv_capacity("decode", 1) == 8192 and p.kv_capacity("prefill", 1) == 4096
    assert p.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2  # K and V x 2 layers x 2 KV heads x head_dim 16 x bf16
    budgets = {e.budget for e in p.acceptance}
    assert budgets == {64}  # the quick grid's extra budget is the configured one
    assert all(0 <= e.rate <= 1 and e.proposed > 0 for e in p.acceptance)
    assert max(e.context_hi for e in p.acceptance) == CONTEXT_UNBOUNDED
    assert p.acceptance_rate("self_sparse", 64, 10_000) >= 0
    assert "measured / predicted" in p.notes


def test_added_shapes_threads_and_tensor_parallel_ranks(tmp_path, llama_dir, capsys):
    """`--add-threads 2` adds one 2-thread process, `--add-tensor-parallel 2` two 1-thread rank processes over
    gloo (measured as served), beside the 1-thread instance; run again they measure nothing; counts beyond
    the machine's cores are refused by name; a version-1 profile reads its t-thread instances as such."""
    import os

    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 cores")
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(TINY_CLUSTER.format(model=llama_dir))
    out = tmp_path / "profile.json"
    assert cli_main(["profile", "--config", str(cfg), "--out", str(out), "--quick", "--no-progress"]) == 0
    args = ["profile", "--config", str(cfg), "--out", str(out), "--quick", "--no-progress", "--add-threads", "2",
            "--add-tensor-parallel", "2"]
    assert cli_main(args) == 0
    printed = capsys.readouterr().out
    assert "2 threads: fit prefill" in printed and "tp 2 x 1 thread(s): fit prefill" in printed
    p = Profile.load(str(out))
    assert [c.shape for c in p.instances] == [(1, 1), (1, 2), (2, 1)]
    for shape, prefix in (((1, 2), "threads2"), ((2, 1), "tp2x1")):
        c = p.costs(*shape)
        for name, fm in (("prefill", c.prefill), ("target_pass", c.target_pass),
                         ("draft_pass/self_sparse", c.draft_pass["self_sparse"])):
            assert any(x > 0 for x in fm.coefficients) and len(p.samples[f"{prefix}/{name}"]) == fm.points, name
        assert p.kv_capacity("decode", *shape) == 8192
    assert p.devices_per_node == os.cpu_count()
    assert "instances of tp1, tp1 x 2 threads, tp2" in p.hardware
    assert cli_main(args) == 0 and "fit" not in capsys.readouterr().out  # nothing left to measure
    assert Profile.load(str(out)).instances == p.instances
    # what it refuses, by name
    assert cli_main(args[:-3] + [str(os.cpu_count() + 1)]) == 2
    assert f"--add-threads: values must be in [1, {os.cpu_count()}]" in capsys.readouterr().err
    assert cli_main(args[:-4] + ["--add-tensor-parallel", str(os.cpu_count() + 1)]) == 2
    assert "--add-tensor-parallel: values must be in" in capsys.readouterr().err
    mixed = load_config(str(cfg))
    mixed = dataclasses.replace(mixed, decode=dataclasses.replace(mixed.decode, threads=2))
    with pytest.raises(ProfileError, match="decode.threads"):
        check_config(mixed)
    # version 1 wrote a 2-thread process as tensor_parallel 2
    old = p.to_dict()
    old["version"] = 1
    old["instances"] = [{k: v for k, v in c.items() if k != "threads"} | {"tensor_parallel": c["threads"]}
                        for c in old["instances"] if c["tensor_parallel"] == 1]
    old["samples"] = {k.replace("threads2/", "tp2/"): v for k, v in old["samples"].items() if not k.startswith("tp2x1")}
    v1 = Profile.from_dict(old)
    assert [c.shape for c in v1.instances] == [(1, 1), (1, 2)] and "threads2/prefill" in v1.samples


def test_measured_profile_rejects_what_it_cannot_run(tmp_path, llama_dir):
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(TINY_CLUSTER.format(model=llama_dir))
    base = load_config(str(cfg))
    tp2 = dataclasses.replace(base, decode=dataclasses.replace(base.decode, tensor_parallel=2, devices_per_instance=2))
    with pytest.raises(ProfileError, match="decode.tensor_parallel"):
        check_config(tp2)
    missing = dataclasses.replace(base, model=dataclasses.replace(base.model, path=str(tmp_path / "nope")))
    with pytest.raises(ProfileError, match="model.path"):
        check_config(missing)
    assert cli_main(["profile", "--config", str(cfg), "--out", str(tmp_path / "x.json"), "--model", "m"]) == 2
    assert cli_main(["profile", "--config", str(tmp_path / "none.yaml"), "--out", str(tmp_path / "x.json")]) == 2


# -- analytical profiles -------------------------------------------------------------------------

def test_analytical_decode_step_is_the_weight_read():
    p = analytical.analytical_profile("H100-80GB-SXM", "llama-3.1-8b")
    eff = analytical.Efficiency()
    floor = 16.06e9 / (H100.hbm_bandwidth * eff.memory)  # bf16 weights over achievable HBM bandwidth
    step = p.target_model(1).predict_pass(PassShape(1, 1024, 1))
    assert floor / 1.25 < step < floor * 1.25
    assert p.model_params == pytest.approx(8.03e9, rel=0.01) and p.kv_bytes_per_token == 131072
    assert p.source == "analytical" and all(fm.fit_error == 0 and fm.points == 0
                                           for fm in (p.target_model(1), p.prefill_model(1), p.kv_transfer))


def test_analytical_tensor_parallel_is_faster_and_holds_more_kv():
    p = analytical.analytical_profile("H100-80GB-SXM", "llama-3.1-8b")
    assert [c.tensor_parallel for c in p.instances] == [1, 2, 4, 8]
    shapes = [PassShape(1, 1024, 1), PassShape(32, 32 * 4096, 32 * 4), PassShape(128, 128 * 2048, 128)]
    for shape in shapes:
        assert p.target_model(2).predict_pass(shape) < p.target_model(1).predict_pass(shape)
    chunk = prefill_features([(2048, 2048)])
    assert p.prefill_model(2).predict(chunk) < p.prefill_model(1).predict(chunk)
    assert 0 < p.kv_capacity("decode", 1) < p.kv_capacity("decode", 2)
    # (80 GiB-ish x 0.9 - 16 GB) / 128 KiB per token
    assert p.kv_capacity("decode", 1) == pytest.approx((H100.memory_bytes * 0.9 - 16.06e9) / 131072, rel=0.01)
    # prefill of a long chunk is compute-bound: far more than one weight read
    assert p.prefill_model(1).predict(chunk) > 5 * p.target_model(1).predict_pass(shapes[0])


def test_analytical_lists_only_tensor_parallel_degrees_that_fit(tmp_path):
    p = analytical.analytical_profile("H200-141GB", "llama-3.1-70b", draft_model="llama-3.1-8b")
    assert [c.tensor_parallel for c in p.instances] == [2, 4, 8]  # 70B bf16 weights exceed one H200
    shape = PassShape(8, 8 * 4096, 8)
    assert p.draft_model("draft_model", 4).predict_pass(shape) < p.target_model(4).predict_pass(shape) / 4
    for gpu in analytical.GPUS:
        prof = analytical.analytical_profile(gpu, "llama-3.1-8b")
        assert prof.kv_capacity("prefill", 1) > 0 and prof.kv_transfer.predict({"passes": 1, "tokens": 1000}) > 0


def test_analytical_from_a_checkpoint_dir_with_acceptance_from_a_profile(tmp_path, llama_dir):
    measured = _profile()
    src = tmp_path / "measured.json"
    measured.save(str(src))
    out = tmp_path / "gpu.json"
    args = ["profile", "--analytical", "--gpu", "L40S", "--model", llama_dir, "--acceptance-from", str(src),
            "--tp", "1", "2", "--out", str(out)]
    assert cli_main(args) == 0
    p = Profile.load(str(out))
    assert p.acceptance == measured.acceptance and "measured.json" in p.notes and "assumption" in p.notes
    assert [c.tensor_parallel for c in p.instances] == [1, 2]
    assert p.device_type == "L40S" and "analytical" in p.hardware


def test_analytical_errors_and_explicit_acceptance():
    entries, note = analytical.parse_acceptance(["self_sparse:256:0.75"])
    assert entries[0].rate == 0.75 and entries[0].context_hi == CONTEXT_UNBOUNDED and "explicitly" in note
    for bad in ("self_sparse:256", "other:256:0.5", "self_sparse:x:0.5", "self_sparse:256:1.5"):
        with pytest.raises(ProfileError, match="acceptance"):
            analytical.parse_acceptance([bad])
    with pytest.raises(ProfileError, match="unknown GPU type .B200.; known: "):
        analytical.analytical_profile("B200", "llama-3.1-8b")
    with pytest.raises(ProfileError, match="built-in shape"):
        analytical.analytical_profile("L40S", "no-such-model")
    assert cli_main(["profile", "--analytical", "--gpu", "L40S", "--out", "/tmp/never.json"]) == 2


def test_calibration_through_the_real_cluster(tmp_path, llama_dir, capsys):
    """--calibrate-only serves the config for real, times isolated requests and stores the fitted terms."""
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(TINY_CLUSTER.format(model=llama_dir) + "ray: {num_cpus: 4}\n")
    out = tmp_path / "profile.json"
    assert cli_main(["profile", "--config", str(cfg), "--out", str(out), "--quick", "--no-progress"]) == 0
    assert Profile.load(str(out)).calibration("disaggregated").requests == 0  # identity until calibrated
    assert cli_main(["profile", "--config", str(cfg), "--out", str(out), "--calibrate-only", "--no-progress",
                     "--calibration-requests", "5"]) == 0
    assert "calibration (disaggregated)" in capsys.readouterr().out
    cal = Profile.load(str(out)).calibration("disaggregated")
    assert cal.requests == 5
    assert cal.prefill_scale > 0 and cal.decode_scale > 0 and cal.ttft_overhead_s >= 0 and cal.decode_start_s >= 0
    assert math.isfinite(cal.ttft_fit_error) and math.isfinite(cal.decode_fit_error)
    # the measurements behind the fit are kept, and refitting them reproduces the stored calibration
    stored = Profile.load(str(out))
    isolated = stored.samples["calibration/disaggregated/isolated"]
    assert len(isolated) == 5 and all(r["ttft_s"] > 0 and r["tokens"] >= 1 for r in isolated)
    assert not [k for k in stored.samples if "burst" in k]  # no burst: the calibration serves isolated requests
    # the decode workers' own timings: plain decode passes of the isolated requests, and (the config
    # speculates) the passes of isolated requests served with speculation
    plain = stored.samples["calibration/disaggregated/passes/decode"]
    assert len(plain) >= sum(r["tokens"] - 1 for r in isolated) and all(p["new_tokens"] == p["seqs"] for p in plain)
    verify = stored.samples["calibration/disaggregated/passes/verify"]
    draft = stored.samples["calibration/disaggregated/passes/draft"]
    assert len(verify) == len(draft) and all(p["new_tokens"] > p["seqs"] for p in verify)
    if verify:
        assert cal.speculative_passes == len(verify) and cal.verify_pass_scale > 0 and cal.draft_pass_scale > 0
    else:  # the policy never speculated on this model: nothing to scale
        assert (cal.verify_pass_scale, cal.draft_pass_scale, cal.speculative_passes) == (1.0, 1.0, 0)
    capsys.readouterr()
    assert cli_main(["profile", "--config", str(cfg), "--out", str(out), "--refit-calibration"]) == 0
    assert "calibration (disaggregated)" in capsys.readouterr().out
    refitted = Profile.load(str(out)).calibration("disaggregated")
    assert (refitted.prefill_scale, refitted.decode_scale) == pytest.approx((cal.prefill_scale, cal.decode_scale))
    assert (refitted.verify_pass_scale, refitted.draft_pass_scale) == pytest.approx((cal.verify_pass_scale, cal.draft_pass_scale))
    # a mode never calibrated has nothing to refit: an error naming the mode
    colocated = tmp_path / "colocated.yaml"
    colocated.write_text(f"mode: colocated\nmodel: {{path: {llama_dir}, dtype: bfloat16}}\n"
                         "colocated: {instances: 2, threads: 1, token_budget: 128, kv_cache_tokens: 4096}\n"
                         "limits: {max_prompt_tokens: 512, max_tokens: 256}\nray: {num_cpus: 4}\n")
    assert cli_main(["profile", "--config", str(colocated), "--out", str(out), "--refit-calibration"]) == 2
    assert "'colocated'" in capsys.readouterr().err
    # the colocated mode's calibration goes beside the disaggregated one, each its own
    disaggregated = Profile.load(str(out)).calibration("disaggregated")
    assert cli_main(["profile", "--config", str(colocated), "--out", str(out), "--calibrate-only", "--no-progress",
                     "--calibration-requests", "4"]) == 0
    assert "calibration (colocated)" in capsys.readouterr().out
    stored = Profile.load(str(out))
    assert stored.calibration("colocated").requests == 4
    assert stored.calibration("disaggregated") == disaggregated
    assert cli_main(["profile", "--config", str(colocated), "--out", str(out), "--refit-calibration"]) == 0
    assert Profile.load(str(out)).calibration("colocated").prefill_scale == \
        pytest.approx(stored.calibration("colocated").prefill_scale)
    capsys.readouterr()
    assert cli_main(["profile", "--config", str(cfg), "--out", str(out), "--refit-calibration", "--calibrate-only"]) == 2
    assert "does not combine" in capsys.readouterr().err
    assert cli_main(["profile", "--config", str(cfg), "--out", str(out), "--calibrate-only",
                     "--calibration-requests", "2"]) == 2


def test_calibrations_are_kept_per_mode_and_thread_count():
    """A 2-thread instance serves at another in-place speed than a 1-thread one: each count has its own
    calibration, a count never calibrated takes the 1-thread one, and the simulator picks by the instances'."""
    from planner.profile import Calibration, calibration_threads
    from planner.simulator import PoolPlan, SimConfig

    one = dataclasses.replace(Calibration.identity("colocated"), prefill_scale=0.9, requests=16)
    two = dataclasses.replace(one, prefill_scale=1.5, threads=2)
    p = _profile().with_calibration(one).with_calibration(two)
    assert p.calibration("colocated") == one and p.calibration("colocated", 2) == two
    assert p.calibration("colocated", 4) == one  # never calibrated at 4: the 1-thread terms
    assert p.calibration("disaggregated", 2) == Calibration.identity("disaggregated")
    again = dataclasses.replace(two, prefill_scale=1.6)
    assert p.with_calibration(again).calibrations == (one, again)  # replaced, the 1-thread one kept
    assert Profile.from_dict(json.loads(json.dumps(p.to_dict()))).calibration("colocated", 2) == two
    assert calibration_threads({"colocated": 2}) == 2 and calibration_threads({"prefill": 2, "decode": 2}) == 2
    assert calibration_threads({"prefill": 2, "decode": 1}) == 1  # unequal counts: the 1-thread calibration
    colocated = SimConfig("colocated", colocated=PoolPlan(1, 1, 4096, 256, 8, threads=2))
    assert colocated.calibration_threads() == 2
