"""Core sharing calibrated on the served cluster (``magicserve profile --calibrate-only`` with a config whose
prefill and decode threads outnumber the cores): a real Ray cluster and gRPC on localhost serve a burst of a
tiny checkpoint, and the workers' own passes give the pair's ``burst`` entry."""

from __future__ import annotations

import dataclasses
import math

import pytest

from controller.cli import main as cli_main
from controller.config import load_config
from controller.planner.calibrate import OUTPUT_TOKENS, burst_lengths, calibration_lengths
from controller.planner.calibrate_sharing import refit_sharing, shared_pair, with_sharing
from controller.planner.profile import Calibration, CoreSharing, Profile, ProfileError
from tests.test_planner_profile import TINY_CLUSTER

# the profile tests' tiny cluster with a 2-thread prefill instance beside the 1-thread decode one
SHARED_CLUSTER = TINY_CLUSTER.replace("prefill: {{threads: 1,", "prefill: {{threads: 2,") + "ray: {{num_cpus: 4}}\n"


def _planted(profile: Profile) -> Profile:
    """A quick 1-thread profile posing as a 2-core one with 2-thread instances (the 1-thread costs halved:
    what the burst is priced at, not what it measures), a two-process entry for P2 + D1 and the mode's
    isolated calibration (the in-place scale's reference)."""
    one = profile.costs(1)
    half = lambda fm: dataclasses.replace(fm, coefficients=tuple(c / 2 for c in fm.coefficients))  # noqa: E731
    two = dataclasses.replace(one, tensor_parallel=2, prefill=half(one.prefill), target_pass=half(one.target_pass),
                              draft_pass={k: half(v) for k, v in one.draft_pass.items()})
    cal = dataclasses.replace(Calibration.identity("disaggregated"), prefill_scale=1.2, prefill_pass_scale=1.1,
                              requests=4)
    return dataclasses.replace(profile, instances=(one, two), devices_per_node=2, calibrations=(cal,),
                               core_sharing=(CoreSharing(2, 1, 2, 3.0, 1.3),))


def test_core_sharing_calibrated_by_a_served_burst(tmp_path, llama_dir, capsys):
    cfg = tmp_path / "shared.yaml"
    cfg.write_text(SHARED_CLUSTER.format(model=llama_dir))
    unshared = tmp_path / "unshared.yaml"
    unshared.write_text(SHARED_CLUSTER.format(model=llama_dir).replace("threads: 2", "threads: 1"))
    out = tmp_path / "profile.json"
    assert cli_main(["profile", "--config", str(unshared), "--out", str(out), "--quick", "--no-progress"]) == 0
    base = Profile.load(str(out))
    planted = _planted(base)
    assert shared_pair(load_config(str(cfg)), 2) == (2, 1) and shared_pair(load_config(str(unshared)), 2) is None

    # what it needs first, by name
    dataclasses.replace(planted, calibrations=()).save(str(out))
    args = ["profile", "--config", str(cfg), "--out", str(out), "--calibrate-only", "--no-progress",
            "--burst-requests", "24"]
    assert cli_main(args) == 2 and "--calibrate-only --config cluster_configs/local.yaml" in capsys.readouterr().err
    dataclasses.replace(planted, core_sharing=()).save(str(out))
    assert cli_main(args) == 2 and "--add-threads" in capsys.readouterr().err
    planted.save(str(out))
    assert cli_main(args[:-1] + ["4"]) == 2 and ">= 8 requests" in capsys.readouterr().err
    assert cli_main(["profile", "--config", str(cfg), "--out", str(out), "--refit-calibration"]) == 2
    assert "no stored core-sharing burst for P2 + D1" in capsys.readouterr().err
    for misuse in ([], ["--calibrate-only", "--burst-requests", "0"]):  # no burst to shape
        assert cli_main(["profile", "--config", str(unshared), "--out", str(out), "--burst-workload", "chat",
                         *misuse]) == 2
        assert "--burst-workload: shapes the burst of a calibration" in capsys.readouterr().err

    # served for real: the burst's passes give the pair's burst entry, stored with what it was read from
    assert cli_main(args) == 0
    assert "core sharing P2 + D1 threads on 2 cores, served (burst)" in capsys.readouterr().out
    stored = Profile.load(str(out))
    entry = stored.sharing(2, 1)
    assert entry.source == "burst" and (entry.prefill_threads, entry.decode_threads, entry.cores) == (2, 1, 2)
    assert entry.prefill_units >= 1 and entry.decode_units >= 1
    for value in (entry.prefill_factor, entry.decode_factor, entry.prefill_scale):
        assert 0 < value < math.inf
    assert {c.source for c in stored.core_sharing} == {"processes", "burst"}  # the two-process entry stays
    burst = stored.samples["core_sharing/P2+D1/burst"]
    assert len(burst) == 24 and all(r["ttft_s"] > 0 for r in burst)
    prefill = stored.samples["core_sharing/P2+D1/passes/prefill"]
    steps = stored.samples["core_sharing/P2+D1/passes/step"]
    assert sum(p["tokens"] for p in prefill) == sum(r["prompt"] for r in burst) and steps  # every prompt prefilled
    assert stored.calibrations == planted.calibrations  # the mode's terms are not touched

    # read again from the stored passes: the same entry; once more served: the entry is replaced, not added
    assert refit_sharing(load_config(str(cfg)), stored) == entry
    assert cli_main(["profile", "--config", str(cfg), "--out", str(out), "--refit-calibration"]) == 0
    assert Profile.load(str(out)).sharing(2, 1) == entry

    # a sweep's served entry is preferred to a burst's, a burst's to two processes'
    served = dataclasses.replace(entry, source="served", prefill_factor=1.4)
    assert with_sharing(stored, served).sharing(2, 1) == served
    assert len(with_sharing(with_sharing(stored, served), entry).core_sharing) == 3
    with pytest.raises(ProfileError, match="core_sharing.source: must be one of"):
        dataclasses.replace(entry, source="guess")


def test_burst_lengths_follow_the_workload_within_the_config_limits(tmp_path, llama_dir):
    cfg = tmp_path / "shared.yaml"
    cfg.write_text(SHARED_CLUSTER.format(model=llama_dir))
    config = load_config(str(cfg))  # prompts <= 512 tokens, outputs <= 256
    prompts, outputs = burst_lengths(config, 40, 0, None)
    assert prompts == calibration_lengths(512, 40, 1) and outputs == OUTPUT_TOKENS
    prompts, outputs = burst_lengths(config, 40, 0, "chat")
    assert len(prompts) == len(outputs) == 40 and len(set(prompts)) > 10
    assert all(1 <= p <= 512 for p in prompts) and all(2 <= o <= 256 for o in outputs)
    assert burst_lengths(config, 40, 0, "chat") == (prompts, outputs) != burst_lengths(config, 40, 1, "chat")
    prompts, _ = burst_lengths(config, 40, 0, "long_doc")  # 1K-4K-token prompts, capped at the limit
    assert set(prompts) == {512}
