"""Core sharing calibrated on the served cluster, without an SLO sweep.

A prefill and a decode instance whose threads outnumber the cores (``cluster_configs/local-prefill2.yaml``
on 2 cores) slow each other down. ``magicserve profile --add-threads`` times that between two plain
processes (``core_sharing.measure``), which leaves out everything else the cores run while serving (the KV
transfer, the router, gRPC, the load generator): on the 2-core VM it put the prefill's slowdown at 2.6-3.0x
where the served cluster's own passes said about 1.7x (benchmarks/results/same_session_18, _19). Until a
sweep of the arrangement had run (``benchmarks/core_sharing_in_place.py``), the planner had only the
two-process figure.

``magicserve profile --calibrate-only --config SHARED.yaml`` serves the shared config for real, with its
speculation, and sends a burst of overlapping requests of its own (Poisson arrivals at the rate the
simulator, with the two-process sharing, says keeps the instances busy ``BURST_UTILISATION`` of the time;
lengths drawn from the workload to be planned, ``--burst-workload``, else prompts log-uniform up to 4096
tokens with short outputs). The workers' timed passes during the burst give the
same in-place figures a sweep gives (``core_sharing.in_place``): each role's slowdown while the other is
busy, and the prefill's in-place scale with decode idle. They are stored as the pair's ``burst`` core
sharing, with the passes they were read from (``--refit-calibration`` reads them again).

The isolated terms of the disaggregated mode (``magicserve profile --calibrate`` with one core per thread)
must be in the profile first: the in-place scale is stated over the prefill pass scale they fit.

Measured (benchmarks/results/same_session_19): a long_doc-shaped burst read prefill 1.64-1.72x, decode
1.09-1.15x, where a same-morning long_doc sweep's own passes read 1.68x and 1.08x; with that calibration the
simulator predicted the sweep within 4 points at every rate, without the load speed.
"""

from __future__ import annotations

import dataclasses

from controller.planner.calibrate import (burst_lengths, burst_rows, burst_trace, calibration_config, measure_burst,
                                          pass_rows)
from controller.planner.profile import CoreSharing, Profile, ProfileError

SHARING_BURST_REQUESTS = 40  # the default of --burst-requests too
PASS_KINDS = ("prefill", "step", "decode", "verify")  # what ``core_sharing.in_place`` reads


def shared_pair(config, cores: int) -> tuple[int, int] | None:
    """(prefill threads, decode threads) when ``config`` runs one prefill and one decode CPU instance whose
    threads outnumber ``cores``; None when its instances have a core per thread."""
    if config.mode != "disaggregated":
        return None
    p, d = config.prefill, config.decode
    cpu = not p.devices_per_instance and not d.devices_per_instance
    if not cpu or p.instances * p.threads + d.instances * d.threads <= cores:
        return None
    if (p.instances, d.instances) != (1, 1):
        raise ProfileError(f"prefill.instances / decode.instances: core sharing is measured for one prefill and one "
                           f"decode instance, got {p.instances} and {d.instances} whose threads outnumber the "
                           f"{cores} cores")
    return p.threads, d.threads


def samples_prefix(prefill_threads: int, decode_threads: int) -> str:
    return f"core_sharing/P{prefill_threads}+D{decode_threads}/"


def _drafter(config) -> str | None:
    spec = config.decode.speculation
    return spec.drafter if spec.enabled else None


def _check_profile(profile: Profile, pair: tuple[int, int]) -> None:
    if not any(c.mode == "disaggregated" and c.threads == 1 for c in profile.calibrations):
        raise ProfileError("profile has no calibration of the disaggregated mode, which the core sharing's in-place "
                           "scale is stated over: run `magicserve profile --calibrate-only --config "
                           "cluster_configs/local.yaml` (one core per thread) first")
    profile.sharing(*pair)  # the two-process entry prices the burst's rate (raises, naming --add-threads)
    for role, tp in zip(("prefill", "decode"), pair):
        if not any(c.tensor_parallel == tp and c.pipeline_parallel == 1 for c in profile.instances):
            raise ProfileError(f"profile has no {tp}-thread cost models for the {role} instance: run "
                               f"`magicserve profile --add-threads {tp}` first")


def calibrate_sharing(config, profile: Profile, requests: int = SHARING_BURST_REQUESTS, seed: int = 0,
                      progress: bool = True, workload: str | None = None
                      ) -> tuple[CoreSharing, dict[str, list[dict[str, float]]]]:
    """Serve ``config`` (a shared pair, ``shared_pair``) for real, send a burst of ``requests`` overlapping
    requests (lengths: ``burst_lengths``), and read the pair's core sharing from the workers' passes
    meanwhile. Returns the entry (source "burst") and the samples to keep in the profile (the burst's
    requests and passes)."""
    from controller.planner.core_sharing import in_place
    from controller.planner.simulator import SimConfig

    cores = profile.devices_per_node
    pair = shared_pair(config, cores)
    if pair is None:
        raise ProfileError(f"--config: calibrating core sharing needs one prefill and one decode CPU instance whose "
                           f"threads outnumber the profile's {cores} cores (e.g. cluster_configs/local-prefill2.yaml)")
    if requests < 8:
        raise ProfileError(f"--burst-requests: a core-sharing burst needs >= 8 requests, got {requests}")
    _check_profile(profile, pair)
    run_config = calibration_config(config, keep_speculation=True)
    sim_config = SimConfig.from_cluster_config(run_config, cores=cores)
    lengths, outputs = burst_lengths(run_config, requests, seed, workload)
    trace = burst_trace(profile, sim_config, lengths, outputs, seed)
    rows, passes = measure_burst(run_config, trace, seed, progress)
    entry = in_place(profile, passes, *pair, cores, _drafter(config), source="burst")
    prefix = samples_prefix(*pair)
    samples = {prefix + "burst": burst_rows(trace, rows),
               **{prefix + "passes/" + kind: pass_rows(passes, kind) for kind in PASS_KINDS}}
    return entry, samples


def refit_sharing(config, profile: Profile) -> CoreSharing:
    """The pair's burst core sharing read again (``core_sharing.in_place``) from the passes stored by
    ``calibrate_sharing``; a profile without them is an error."""
    from controller.planner.core_sharing import in_place

    cores = profile.devices_per_node
    pair = shared_pair(config, cores)
    if pair is None:
        raise ProfileError("--refit-calibration: the config's instances have a core per thread; no core sharing")
    prefix = samples_prefix(*pair)
    passes = [{"kind": kind, **row} for kind in PASS_KINDS for row in profile.samples.get(prefix + "passes/" + kind, [])]
    if not passes:
        raise ProfileError(f"profile has no stored core-sharing burst for P{pair[0]} + D{pair[1]} "
                           f"(samples[{prefix + 'passes/...'!r}]); run `magicserve profile --calibrate-only` with "
                           "the shared config first")
    return in_place(profile, passes, *pair, cores, _drafter(config), source="burst")


def with_sharing(profile: Profile, entry: CoreSharing, samples: dict[str, list[dict[str, float]]] | None = None
                 ) -> Profile:
    """``profile`` with ``entry`` in place of an earlier entry of the same pair and source (and, given, its
    samples in place of the earlier burst's)."""
    pair = (entry.prefill_threads, entry.decode_threads)
    kept = tuple(c for c in profile.core_sharing
                 if not ((c.prefill_threads, c.decode_threads) == pair and c.source == entry.source))
    new_samples = profile.samples
    if samples is not None:
        prefix = samples_prefix(*pair)
        new_samples = {**{k: v for k, v in profile.samples.items() if not k.startswith(prefix)}, **samples}
    return dataclasses.replace(profile, core_sharing=kept + (entry,), samples=new_samples)

