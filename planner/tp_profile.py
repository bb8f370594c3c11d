"""``magicserve profile --add-tensor-parallel T``: tensor-parallel CPU instances measured as they serve.

An instance of tensor_parallel t is t rank processes of the config's ``threads`` torch threads each (so it
takes t x threads cores). Rank 0 is a PrefillWorker, then a DecodeWorker, built with the instance's group
exactly as ``controller/actors.py`` builds them: its runner broadcasts each pass's step description and
every rank runs the pass on its shard, all-reduces over gloo included. Ranks 1.. are the workers'
followers. Rank 0 times the same prefill steps and decode passes as ``profiler.measure_costs`` (minus the
KV transfer, whose cost the profile already holds, and acceptance, which does not depend on the shape);
the parent fits them into an :class:`InstanceCosts` of (tp t, threads).
"""

from __future__ import annotations

import os
import traceback
from typing import Callable, Iterable

import torch
import torch.multiprocessing as mp

from controller.config import ClusterConfig
from decode_worker.worker import DecodeWorker
from decode_worker.worker import follower as decode_follower
from kv_transfer.channel import Rendezvous
from modeling.checkpoint import load_config
from modeling.tp import TPShard
from modeling.tp_group import TPGroup, TPGroupConfig
from planner.profile import PREFILL_FEATURES, Profile, ProfileError
from planner.profiler import (
    DEFAULT_GRID, PREFILL_ID, Grid, Limits, _describe, _fit, _limits, check_extension, extended_profile, fit_passes,
    instance_costs, measure_decode, measure_prefill, prefill_cache_tokens, profiled_decode_config,
    profiled_prefill_config)
from prefill_worker.worker import PrefillWorker
from prefill_worker.worker import follower as prefill_follower

RANKS_TIMEOUT_S = 3600.0  # one shape's measurement on a slow machine; a rank that dies ends it at once
_INSTANCE = "profile-tp"


def add_tensor_parallel(config: ClusterConfig, profile: Profile, degrees: Iterable[int], grid: Grid = DEFAULT_GRID,
                        progress: bool = True, log: Callable[[str], None] = print) -> Profile:
    """``profile`` with CPU instances of each tensor_parallel degree in ``degrees`` it lacks (t rank processes
    of the config's threads each), measured as served. A few minutes per degree."""
    threads = config.prefill.threads
    wanted = check_extension(config, profile, "--add-tensor-parallel", degrees)
    cores = os.cpu_count() or 1
    if wanted and max(wanted) * threads > cores:
        raise ProfileError(f"--add-tensor-parallel: {max(wanted)} ranks of {threads} threads (prefill.threads) "
                           f"need {max(wanted) * threads} cores; this machine has {cores}")
    model = load_config(config.model_path)
    have = {c.tensor_parallel for c in profile.instances if c.threads == threads}
    added = [t for t in wanted if t not in have and t > 1]
    new = []
    for t in added:
        try:
            TPShard(0, t).check(model, "--add-tensor-parallel")
        except ValueError as err:
            raise ProfileError(str(err)) from None
        limits = _limits(config, model.max_position_embeddings)
        rows = measure_ranks(config, t, grid, limits, progress)
        fits, samples = {}, {}
        fits["prefill"], samples["prefill"] = _fit(PREFILL_FEATURES, rows["prefill"], "prefill")
        fit_passes(rows["target"], rows["drafts"], fits, samples)
        for name, fm in fits.items():
            log(f"tp {t} x {threads} thread(s): fit {name:<20} {_describe(fm)}")
        new.append((instance_costs(config, fits, t, threads),
                    {f"tp{t}x{threads}/{name}": r for name, r in samples.items()}))
    return extended_profile(profile, new, f"--add-tensor-parallel {','.join(map(str, added))} "
                                          f"({threads} thread(s) per rank, gloo)")


def measure_ranks(config: ClusterConfig, size: int, grid: Grid, limits: Limits, progress: bool) -> dict:
    """Start ``size`` rank processes, let rank 0 measure; its rows: prefill, target, drafts."""
    store, rdv = Rendezvous.host_store(config.kv_transfer.rendezvous_host)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(rank, size, rdv, config, grid, limits, progress, results),
                         daemon=True) for rank in range(size)]
    for p in procs:
        p.start()
    try:
        outcomes = {}
        while len(outcomes) < size:
            try:
                rank, ok, value = results.get(timeout=RANKS_TIMEOUT_S)
            except Exception:
                raise ProfileError(f"--add-tensor-parallel: tp {size} ranks gave no result within "
                                   f"{RANKS_TIMEOUT_S:.0f} s") from None
            if not ok:
                raise ProfileError(f"--add-tensor-parallel: tp {size} rank {rank} failed:\n{value}")
            outcomes[rank] = value
        return outcomes[0]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        del store


def _rank_main(rank: int, size: int, rdv, config: ClusterConfig, grid: Grid, limits: Limits, progress: bool,
               results) -> None:
    """One rank process: form the instance's group, then measure (rank 0) or follow (the others)."""
    os.environ["OMP_NUM_THREADS"] = str(config.prefill.threads)
    torch.set_num_threads(config.prefill.threads)
    try:
        group = TPGroup.form(rdv.connect(), _INSTANCE, TPShard(rank, size), "cpu",
                             TPGroupConfig(interface_host=rdv.host))
        value = _measure(config, group, grid, limits, progress) if rank == 0 else _follow(config, group, grid, limits)
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, False, traceback.format_exc()))


def _measure(config: ClusterConfig, group, grid: Grid, limits: Limits, progress: bool) -> dict:
    steps, need = prefill_cache_tokens(config, grid, limits)
    prefill = PrefillWorker(config.model_path, profiled_prefill_config(config, need), PREFILL_ID, tp=group)
    try:
        _, prefill_rows = measure_prefill(prefill, steps, grid.repeats, progress)
    finally:
        prefill.close()  # the followers move on to the decode worker's shard
    decode = DecodeWorker(config.model_path, profiled_decode_config(config, grid, limits), tp=group)
    try:
        target, drafts = measure_decode(decode, grid, limits, progress)
    finally:
        decode.close()
    return {"prefill": prefill_rows, "target": target, "drafts": drafts}


def _follow(config: ClusterConfig, group, grid: Grid, limits: Limits) -> dict:
    _, need = prefill_cache_tokens(config, grid, limits)
    prefill_follower(config.model_path, profiled_prefill_config(config, need), group, PREFILL_ID).serve()
    decode_follower(config.model_path, profiled_decode_config(config, grid, limits), group).serve()
    return {}
