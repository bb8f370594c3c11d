"""``magicserve profile``: measure what a cluster config's workers cost on this machine and write a
:class:`~planner.profile.Profile`.

Everything runs with the config's model, dtype, block size, drafter and per-worker thread counts
(``torch.set_num_threads(threads)``, as the actors do). Each point is the median of ``repeats`` timed
runs after one warm-up run (3 runs, the first included, for points slower than 0.25 s). KV content is
irrelevant to timing, so passes run over synthetic KV:

1. prefill steps: chunks of several lengths at several start offsets (up to the longest admissible
   prompt), and steps batching several prompts, on a PrefillWorker's runner -> ``prefill`` over
   PREFILL_FEATURES;
2. decode passes on a DecodeWorker's runner, over a batch x context grid: the plain decode step and
   verify passes of k = 1..max_k new tokens per sequence -> ``target_pass``; one draft step of each
   drafter (``self_sparse``: the target over the sink + window view, at several budgets so the KV term
   is identified; ``draft_model`` when configured) -> ``draft_pass``;
3. KV transfer: a PrefillWorker in this process sends prompts' KV (after their prefill: nothing
   overlaps it, so this is the most a transfer can add to TTFT) to a DecodeWorker's cache through a
   KVReceiver in a second process over the configured channel (gloo), timed from ``begin`` (the
   descriptor) to the receiver's DONE, sizes interleaved over 3 x ``repeats`` rounds (a transfer takes
   milliseconds and jitters with thread wake-ups) -> ``kv_transfer`` over TRANSFER_FEATURES;
4. acceptance: real speculative steps (greedy, fixed k = max_k) of the configured drafter at several
   budgets on held-out text (standard-library files the bundled model never trained on) at contexts
   in a few ranges -> AcceptanceEntry rows. The rate is the per-token acceptance probability of the
   geometric model behind ``decode_worker.policy.expected_tokens``: accepted / (accepted + rejections);
5. KV capacity of a decode and a prefill instance: the config's ``kv_cache_tokens`` (on a CPU the
   cache size is a setting, not a hardware limit).

The same speculative steps also check the fitted pass models end to end: the median ratio of measured
step time to the sum of predicted pass times goes into the profile's notes.

A profile measures single-process instances of the config's thread count (equal for both roles);
``--add-threads`` (``add_threads``) adds other thread counts, and ``--add-tensor-parallel``
(``planner.tp_profile``) tensor-parallel instances of t rank processes, measured as served (rank
0 a worker whose runner broadcasts each pass, the other ranks following over gloo). A CPU device is a core:
an instance takes ranks x threads of them. GPU clusters are profiled analytically
(``planner.analytical``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import platform
import queue
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.multiprocessing as mp
from tqdm import tqdm

from controller.config import ClusterConfig
from controller.defaults import REPO_ROOT
from decode_worker.config import SpeculationConfig
from decode_worker.drafters import SelfSparseDrafter, window_start
from decode_worker.policy import FEATURES as PASS_FEATURES
from decode_worker.policy import PassShape
from decode_worker.worker import DecodeWorker
from kv_transfer.channel import Rendezvous
from kv_transfer.descriptors import KVFingerprint
from kv_transfer.receiver import KVReceiver, PoolReserver
from kv_transfer.sender import LegTarget
from modeling.block_pool import BlockTable
from modeling.checkpoint import load_model
from modeling.heads import HeadRange
from modeling.instance_config import TIERS_OFF
from modeling.runner import StepInput
from modeling.sampling import SamplingParams
from planner.profile import (
    CONTEXT_UNBOUNDED, PREFILL_FEATURES, TRANSFER_FEATURES, AcceptanceEntry, FittedModel, InstanceCosts, Profile,
    ProfileError, describe_shape, prefill_features, transfer_features)
from planner.replay import rewind
from prefill_worker.worker import PrefillWorker

# Must match scripts/train_default_model.py TrainConfig.holdout_permille (the held-out file split).
HOLDOUT_PERMILLE = 40
PREFILL_ID, DECODE_ID = "profile-prefill", "profile-decode"
_transfer_ids = itertools.count()
TRANSFER_ROUNDS_PER_REPEAT = 3


@dataclass(frozen=True)
class Grid:
    """What to measure. Points beyond the model's context, the config's limits or its KV caches are
    skipped; lengths are capped at what the config admits."""

    # prefill: single chunks (length, start); starts are capped at the longest prompt minus the length
    # (the longest prompt's last chunk is always measured too); lengths may exceed prefill.token_budget
    # so plans can weigh other chunk sizes
    prefill_lengths: tuple[int, ...]
    prefill_starts: tuple[int, ...]
    # prefill steps batching several prompts: (prompts, tokens each, start of each)
    prefill_batches: tuple[tuple[int, int, int], ...]
    # decode passes: batch x context cells holding at most max_kv_tokens of KV
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    max_kv_tokens: int
    draft_budgets: tuple[int, ...]  # self_sparse draft passes are timed at these and the configured budget
    transfer_tokens: tuple[int, ...]
    # acceptance: (context_lo, context_hi or None for open, prompt length measured at)
    acceptance_ranges: tuple[tuple[int, int | None, int], ...]
    acceptance_budgets: tuple[int, ...]  # besides the configured budget
    acceptance_batch: int
    acceptance_steps: int
    repeats: int


DEFAULT_GRID = Grid(
    prefill_lengths=(32, 128, 512, 1024, 2048),
    prefill_starts=(0, 1024, 3072, 6144),
    prefill_batches=((4, 128, 0), (8, 32, 0), (2, 256, 2048)),
    batches=(1, 2, 4, 8, 16, 32, 64),
    contexts=(128, 512, 1024, 2048, 4096, 8192),
    max_kv_tokens=131072,
    draft_budgets=(128, 256, 512),
    transfer_tokens=(128, 512, 1024, 2048, 4096, 8192),
    acceptance_ranges=((0, 1024, 512), (1024, 3072, 2048), (3072, 6144, 4096), (6144, None, 7168)),
    acceptance_budgets=(128, 256, 512),
    acceptance_batch=4,
    acceptance_steps=24,
    repeats=5,
)

QUICK_GRID = Grid(
    prefill_lengths=(16, 64, 128),
    prefill_starts=(0, 128, 384),
    prefill_batches=((2, 32, 0), (4, 16, 64)),
    batches=(1, 4),
    contexts=(32, 256),
    max_kv_tokens=4096,
    draft_budgets=(64, 128),
    transfer_tokens=(64, 256, 512),
    acceptance_ranges=((0, 256, 128), (256, None, 320)),
    acceptance_budgets=(64,),
    acceptance_batch=2,
    acceptance_steps=4,
    repeats=2,
)


@dataclass(frozen=True)
class Limits:
    """What the config admits, derived once."""

    max_prompt: int  # longest prompt a request may have
    max_context: int  # longest sequence a decode pass may see
    max_k: int
    block_size: int


# -- entry point -------------------------------------------------------------------------------------

def profile_cluster(config: ClusterConfig, grid: Grid = DEFAULT_GRID, progress: bool = True,
                    log: Callable[[str], None] = print) -> Profile:
    """Measure ``config``'s costs on this machine (see the module docstring). Raises ProfileError for a
    config it cannot profile."""
    check_config(config)
    start = time.perf_counter()
    loaded = load_model(config.model_path, config.dtype_choice.dtype, "cpu")
    limits = _limits(config, loaded.config.max_position_embeddings)
    fits, samples, decode = measure_costs(loaded, config, grid, limits, progress)
    for name, fm in fits.items():
        log(f"fit {name:<24} {_describe(fm)}")
    with _threads(config.decode.threads):
        acceptance, step_check = measure_acceptance(decode, config, grid, limits, fits, progress, log)
    return _assemble(config, loaded, decode.cache.spec.bytes_per_token, grid, limits, fits, samples, acceptance,
                     f"{step_check}; profiled in {time.perf_counter() - start:.0f} s")


def measure_costs(loaded, config: ClusterConfig, grid: Grid, limits: Limits, progress: bool, transfer: bool = True):
    """Sections 1-3 (``transfer``: 3 too): fitted models and their samples by name, and the DecodeWorker
    (reused for acceptance)."""
    fits: dict[str, FittedModel] = {}
    samples: dict[str, list[dict[str, float]]] = {}
    with _threads(config.prefill.threads):
        steps, need = prefill_cache_tokens(config, grid, limits)
        prefill = _prefill_worker(loaded, config, need)
        fits["prefill"], samples["prefill"] = measure_prefill(prefill, steps, grid.repeats, progress)
    with _threads(config.decode.threads):
        decode = _decode_worker(loaded, config, grid, limits)
        target, drafts = measure_decode(decode, grid, limits, progress)
        fit_passes(target, drafts, fits, samples)
    if transfer:
        with _threads(config.prefill.threads):
            fits["kv_transfer"], samples["kv_transfer"] = measure_transfer(prefill, config, grid, limits, progress)
    return fits, samples, decode


def fit_passes(target: list[dict], drafts: dict[str, list[dict]], fits: dict, samples: dict) -> None:
    """Fit the target-pass and each drafter's draft-pass model into ``fits`` / ``samples``."""
    for name, rows in [("target_pass", target)] + [(f"draft_pass/{d}", r) for d, r in drafts.items()]:
        fits[name], samples[name] = _fit(PASS_FEATURES, rows, name)


def add_threads(config: ClusterConfig, profile: Profile, threads: Iterable[int], grid: Grid = DEFAULT_GRID,
                progress: bool = True, log: Callable[[str], None] = print) -> Profile:
    """``profile`` (measured on this machine with ``config``'s model) with single-process CPU instances of more
    thread counts: for each count t it lacks, the prefill, target-pass and draft-pass models measured at t
    threads (the KV transfer, acceptance and calibrations stay those of the profile). A few minutes per count."""
    wanted = check_extension(config, profile, "--add-threads", threads)
    have = {c.threads for c in profile.instances if c.tensor_parallel == 1}
    added = [t for t in wanted if t not in have]
    loaded = load_model(config.model_path, config.dtype_choice.dtype, "cpu") if added else None
    new = []
    for t in added:
        cfg = with_threads(config, t)
        limits = _limits(cfg, loaded.config.max_position_embeddings)
        fits, measured, _ = measure_costs(loaded, cfg, grid, limits, progress, transfer=False)
        for name, fm in fits.items():
            log(f"{t} threads: fit {name:<20} {_describe(fm)}")
        new.append((instance_costs(cfg, fits, 1, t), {f"threads{t}/{name}": rows for name, rows in measured.items()}))
    return extended_profile(profile, new, f"--add-threads {','.join(map(str, added))}")


def with_threads(config: ClusterConfig, threads: int) -> ClusterConfig:
    """``config`` with ``threads`` torch threads per worker in both pools."""
    return dataclasses.replace(config, prefill=dataclasses.replace(config.prefill, threads=threads),
                               decode=dataclasses.replace(config.decode, threads=threads))


def check_extension(config: ClusterConfig, profile: Profile, flag: str, counts: Iterable[int]) -> list[int]:
    """Refuse to extend ``profile`` with ``counts`` (threads or ranks: each a core here) unless it is a
    measured CPU profile of the config's model and every count fits this machine; the counts sorted."""
    check_config(config)
    if profile.device_type != "cpu" or profile.source != "measured":
        raise ProfileError(f"{flag}: extends a measured CPU profile, got a {profile.source} {profile.device_type} one")
    model = os.path.basename(os.path.normpath(config.model_path))
    if profile.model != model:
        raise ProfileError(f"{flag}: the profile is of model {profile.model!r}, the config's is {model!r}")
    cores = os.cpu_count() or 1
    wanted = sorted(set(counts))
    bad = [t for t in wanted if not 1 <= t <= cores]
    if bad:
        raise ProfileError(f"{flag}: values must be in [1, {cores}] (this machine's cores), got {bad}")
    return wanted


def extended_profile(profile: Profile, new: list[tuple[InstanceCosts, dict]], what: str) -> Profile:
    """``profile`` with the measured instance shapes ``new`` (costs, samples) added."""
    if not new:
        return profile
    instances = sorted(list(profile.instances) + [c for c, _ in new], key=lambda c: c.shape)
    samples = dict(profile.samples)
    for _, rows in new:
        samples.update(rows)
    cores = os.cpu_count() or 1
    shapes = ", ".join(describe_shape(*c.shape) for c in instances)
    hardware = f"cpu: {cpu_model_name()} ({cores} cores); instances of {shapes}; torch {torch.__version__}"
    return dataclasses.replace(profile, instances=tuple(instances), samples=samples, devices_per_node=cores,
                               notes=profile.notes + f"; {what}: cost models", hardware=hardware)


def instance_costs(config: ClusterConfig, fits: dict[str, FittedModel], tensor_parallel: int = 1,
                   threads: int = 1) -> InstanceCosts:
    return InstanceCosts(
        tensor_parallel=tensor_parallel, prefill=fits["prefill"], target_pass=fits["target_pass"],
        draft_pass={name.split("/", 1)[1]: fm for name, fm in fits.items() if name.startswith("draft_pass/")},
        kv_capacity_tokens=config.decode.kv_cache_tokens, prefill_kv_capacity_tokens=config.prefill.kv_cache_tokens,
        threads=threads)


def _assemble(config: ClusterConfig, loaded, kv_bytes_per_token: int, grid: Grid, limits: Limits,
              fits: dict[str, FittedModel], samples: dict, acceptance: list[AcceptanceEntry], check: str) -> Profile:
    spec = config.decode.speculation
    costs = instance_costs(config, fits, 1, config.prefill.threads)
    notes = (f"measured by `magicserve profile` on {config.source or 'a config'} (median of up to {grid.repeats} "
             f"runs per point; 1-min load {os.getloadavg()[0]:.1f} at the end); drafter {spec.drafter}, budget "
             f"{spec.budget}, sink {spec.sink_tokens}, max_k {spec.max_k}; prefill chunks up to "
             f"{max(grid.prefill_lengths)} tokens, decode contexts up to {limits.max_context}; kv_transfer: "
             f"begin -> DONE of a prompt whose prefill is over (no overlap with compute), "
             f"{config.kv_transfer.backend}; acceptance: greedy, fixed k = {limits.max_k}, held-out stdlib text, "
             f"rate = accepted / (accepted + rejections); {check}")
    return Profile(
        hardware=hardware_string(config), device_type="cpu",
        devices_per_node=os.cpu_count() or 1,  # a CPU device is a core (an instance takes ranks x threads)
        model=os.path.basename(os.path.normpath(config.model_path)), model_params=loaded.config.num_parameters(),
        kv_bytes_per_token=kv_bytes_per_token, source="measured", instances=(costs,),
        kv_transfer=fits["kv_transfer"], acceptance=tuple(acceptance), notes=notes, samples=samples,
    )


def check_config(config: ClusterConfig) -> None:
    """Reject configs this profiler cannot measure, naming the field."""
    if getattr(config, "mode", "disaggregated") != "disaggregated":
        raise ProfileError(f"mode: profiles measure the disaggregated pools (prefill, decode, kv_transfer); "
                           f"got {config.mode!r}")
    if config.prefill.threads != config.decode.threads:
        raise ProfileError(f"decode.threads: a profile measures instances of one thread count, got prefill "
                           f"{config.prefill.threads} and decode {config.decode.threads}; profile with equal counts "
                           f"and add others with --add-threads")
    for role in ("prefill", "decode"):
        pool = getattr(config, role)
        if pool.tensor_parallel != 1:
            raise ProfileError(f"{role}.tensor_parallel: a profile starts from single-process instances (1), got "
                               f"{pool.tensor_parallel}; add tensor-parallel instances with --add-tensor-parallel")
        if pool.devices_per_instance:
            raise ProfileError(f"{role}.devices_per_instance: measured profiles are CPU only; profile GPU "
                               f"clusters with `magicserve profile --analytical`")
    if config.prefill.block_size != config.decode.block_size:
        raise ProfileError("decode.block_size: must equal prefill.block_size (KV moves block by block)")
    if not os.path.isdir(config.model_path):
        raise ProfileError(f"model.path: {config.model_path!r} is not a directory (a local Hugging Face checkpoint)")
    if config.kv_transfer.backend == "nccl":
        raise ProfileError("kv_transfer.backend: nccl needs GPUs; measured profiles use gloo")


def hardware_string(config: ClusterConfig) -> str:
    return (f"cpu: {cpu_model_name()} ({os.cpu_count()} cores); {config.prefill.threads} thread(s) per prefill "
            f"worker, {config.decode.threads} per decode worker; torch {torch.__version__}")


def cpu_model_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows of the machine."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _limits(config: ClusterConfig, max_model_len: int) -> Limits:
    max_k = config.decode.speculation.max_k
    max_prompt = min(config.limits.max_prompt_tokens, max_model_len - 1, config.prefill.kv_cache_tokens,
                     config.decode.kv_cache_tokens)
    max_context = min(max_model_len, config.limits.max_prompt_tokens + config.limits.max_tokens) - max_k - 2
    return Limits(max_prompt, max(1, max_context), max_k, config.prefill.block_size)


# -- workers ---------------------------------------------------------------------------------------

def prefill_cache_tokens(config: ClusterConfig, grid: Grid, limits: Limits) -> tuple[list, int]:
    """The prefill steps to time and the KV tokens their worker's cache needs."""
    steps = prefill_steps(grid, limits, config.prefill.max_num_seqs)
    bs = limits.block_size
    return steps, max([sum(s + n + bs for s, n in chunks) for chunks in steps] + [limits.max_prompt + bs])


def profiled_prefill_config(config: ClusterConfig, tokens: int):
    """The config's PrefillWorkerConfig with a cache of ``tokens`` (at most the configured size), no KV tiers."""
    cfg = config.prefill
    return dataclasses.replace(cfg, kv_cache_tokens=max(cfg.block_size, min(cfg.kv_cache_tokens, tokens)),
                               kv_tiers=TIERS_OFF)


def profiled_decode_config(config: ClusterConfig, grid: Grid, limits: Limits):
    """The config's DecodeWorkerConfig with a cache for the grid's decode cells and the acceptance runs, no KV
    tiers."""
    cfg = config.decode
    steps = grid.acceptance_steps + 4
    acceptance = grid.acceptance_batch * (limits.max_prompt + steps * (limits.max_k + 1) + 2 * cfg.block_size)
    tokens = min(cfg.kv_cache_tokens, max(grid.max_kv_tokens + 64 * (limits.max_k + 2) * cfg.block_size, acceptance))
    return dataclasses.replace(cfg, kv_cache_tokens=tokens, profile_on_start=False, kv_tiers=TIERS_OFF)


def _prefill_worker(loaded, config: ClusterConfig, tokens: int):
    """A PrefillWorker of the config whose cache holds ``tokens`` (at most the configured size)."""
    return PrefillWorker(loaded, profiled_prefill_config(config, tokens), PREFILL_ID)


def _decode_worker(loaded, config: ClusterConfig, grid: Grid, limits: Limits):
    return DecodeWorker(loaded, profiled_decode_config(config, grid, limits))


# -- 1. prefill ------------------------------------------------------------------------------------

def prefill_steps(grid: Grid, limits: Limits, max_prompts: int) -> list[list[tuple[int, int]]]:
    """The steps to time, each a list of (start, length) chunks."""
    steps: list[list[tuple[int, int]]] = []
    lengths = sorted({min(n, limits.max_prompt) for n in grid.prefill_lengths})
    for n in lengths:
        last = limits.max_prompt - n
        for s in sorted({min(s, last) for s in grid.prefill_starts} | {last}):
            steps.append([(s, n)])
    for prompts, n, s in grid.prefill_batches:
        if prompts <= max_prompts and s + n <= limits.max_prompt:
            steps.append([(s, n)] * prompts)
    return steps


def measure_prefill(worker, steps: list[list[tuple[int, int]]], repeats: int,
                    progress: bool) -> tuple[FittedModel, list[dict]]:
    """Time each step (chunks as (start, length)) on the worker's runner; skip steps its cache can't hold."""
    vocab = worker.loaded.config.vocab_size
    pool = worker.pool
    rows = []
    for chunks in tqdm(steps, desc="prefill steps", disable=not progress):
        if sum(pool.blocks_for_tokens(s + n) for s, n in chunks) > pool.num_free:
            continue
        tables = [BlockTable(worker.pool.block_size) for _ in chunks]
        try:
            for t, (s, n) in zip(tables, chunks):
                t.ensure_capacity(worker.pool, s + n)
            inputs = [StepInput(_tokens(n, vocab, s), s, t.blocks, num_logits=1) for t, (s, n) in zip(tables, chunks)]
            seconds = _median_time(lambda: worker.runner.run(inputs), repeats)
        finally:
            for t in tables:
                t.release(worker.pool)
        rows.append({**prefill_features(chunks), "seconds": seconds})
    return _fit(PREFILL_FEATURES, rows, "prefill")


# -- 2. decode passes ------------------------------------------------------------------------------

def decode_cells(grid: Grid, limits: Limits, max_num_seqs: int, pool_tokens: int) -> list[tuple[int, int]]:
    """(batch, context) cells that fit the config and the grid's KV cap."""
    cells = []
    for b in grid.batches:
        for ctx in grid.contexts:
            ctx = min(ctx, limits.max_context)
            need = b * (ctx + limits.max_k + 1 + limits.block_size)
            if b <= max_num_seqs and b * ctx <= grid.max_kv_tokens and need <= pool_tokens and (b, ctx) not in cells:
                cells.append((b, ctx))
    return cells


def measure_decode(worker, grid: Grid, limits: Limits, progress: bool) -> tuple[list[dict], dict[str, list[dict]]]:
    """Target passes (k = 0..max_k) and draft passes per cell; rows of PassShape features + seconds."""
    spec = worker.config.speculation
    pool = worker.pool
    cells = decode_cells(grid, limits, worker.config.max_num_seqs, pool.num_blocks * pool.block_size)
    if not cells:
        raise ProfileError("decode: no batch x context cell of the grid fits the config (decode.kv_cache_tokens, "
                           "decode.max_num_seqs, limits)")
    budgets = sorted({b for b in grid.draft_budgets + (spec.budget,) if b > spec.sink_tokens})
    target: list[dict] = []
    drafts: dict[str, list[dict]] = {"self_sparse": []}
    draft_model = _draft_model_timer(worker, limits) if spec.drafter == "draft_model" else None
    if draft_model:
        drafts["draft_model"] = []
    for b, ctx in tqdm(cells, desc="decode cells", disable=not progress):
        tables = [BlockTable(pool.block_size) for _ in range(b)]
        try:
            for t in tables:
                t.ensure_capacity(pool, ctx + limits.max_k + 1)
            target += _time_target(worker, tables, ctx, limits.max_k, grid.repeats)
            for budget in budgets:
                drafts["self_sparse"].append(_time_self_sparse(worker, tables, ctx, budget, spec, grid.repeats))
        finally:
            for t in tables:
                t.release(pool)
        if draft_model:
            drafts["draft_model"].append(draft_model(b, ctx, grid.repeats))
    return target, drafts


def _time_target(worker, tables, ctx: int, max_k: int, repeats: int) -> list[dict]:
    """Plain decode step (k = 0) and verify passes (k + 1 new tokens per sequence) at context ``ctx``."""
    rows = []
    b = len(tables)
    for k in range(max_k + 1):
        inputs = [StepInput([1] * (k + 1), ctx, t.blocks, num_logits=k + 1) for t in tables]
        seconds = _median_time(lambda: worker.runner.run(inputs), repeats)
        rows.append(_pass_row(PassShape(b, b * (ctx + k + 1), b * (k + 1)), seconds))
    return rows


def _time_self_sparse(worker, tables, ctx: int, budget: int, spec: SpeculationConfig, repeats: int) -> dict:
    """One self-speculative draft step: the query at position ``ctx`` over the sink + window view."""
    view = dataclasses.replace(spec, budget=budget, drafter="self_sparse")
    starts = [window_start(view, ctx)] * len(tables)
    inputs = [StepInput([1], ctx, t.blocks) for t in tables]
    seconds = _median_time(lambda: worker.runner.run(inputs, sink_len=view.sink_tokens, window_starts=starts), repeats)
    kv = len(tables) * SelfSparseDrafter(worker.runner, view).kv_tokens_read(ctx + 1, 0)
    return _pass_row(PassShape(len(tables), kv, len(tables)), seconds)


def _draft_model_timer(worker, limits: Limits):
    """A timer of one draft-model step at (batch, context): the draft cache holds only the sink and
    the window (evicted table entries point at a sentinel block, as in DraftModelDrafter)."""
    drafter = worker.drafter
    spec = worker.config.speculation
    pool, bs = drafter.pool, drafter.pool.block_size

    def time_cell(b: int, ctx: int, repeats: int) -> dict:
        b = min(b, pool.num_blocks // (2 * (-(-spec.budget // bs)) + 2))
        start = window_start(spec, ctx)
        keep = [i for i in range(ctx // bs + 1) if i * bs < spec.sink_tokens or (i + 1) * bs > start]
        owned = []
        try:
            tables = []
            for _ in range(b):
                table = [drafter._EVICTED] * (ctx // bs + 1)
                for i, blk in zip(keep, pool.allocate(len(keep))):
                    table[i] = blk
                    owned.append(blk)
                tables.append(table)
            inputs = [StepInput([1], ctx, t) for t in tables]
            seconds = _median_time(lambda: drafter.runner.run(inputs, sink_len=spec.sink_tokens,
                                                              window_starts=[start] * b), repeats)
        finally:
            pool.free(owned)
        return _pass_row(PassShape(b, b * drafter.kv_tokens_read(ctx + 1, 0), b), seconds)

    return time_cell


# -- 3. KV transfer --------------------------------------------------------------------------------

def measure_transfer(prefill, config: ClusterConfig, grid: Grid, limits: Limits,
                     progress: bool) -> tuple[FittedModel, list[dict]]:
    """Send prompts' KV from ``prefill`` (this process) to a DecodeWorker in a spawned process."""
    sizes = sorted({min(n, limits.max_prompt) for n in grid.transfer_tokens})
    store, rdv = Rendezvous.host_store(config.kv_transfer.rendezvous_host)
    ctx = mp.get_context("spawn")
    cmds, replies = ctx.Queue(), ctx.Queue()
    dcfg = dataclasses.replace(config.decode, profile_on_start=False,
                               kv_cache_tokens=min(config.decode.kv_cache_tokens,
                                                   2 * (max(sizes) + 4 * limits.block_size)))
    args = (config.model_path, dcfg, config.decode.threads, config.kv_transfer, rdv, cmds, replies)
    child = ctx.Process(target=_decode_side, args=args, daemon=True)
    child.start()
    try:
        _reply(replies, child)  # the decode side is up (a child that dies starting up fails here, not in connect)
        prefill.connect(DECODE_ID, rdv)
        _reply(replies, child)
        # transfers take milliseconds and jitter with thread wake-ups: many rounds, sizes interleaved
        # within each round (round 0 is the warm-up)
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for i in tqdm(range(TRANSFER_ROUNDS_PER_REPEAT * grid.repeats + 1), desc="kv transfers", disable=not progress):
            for n in sizes:
                t = _transfer_once(prefill, n, cmds, replies, child)
                if i:
                    times[n].append(t)
        rows = [{**transfer_features(n), "seconds": statistics.median(times[n])} for n in sizes]
    finally:
        cmds.put(("stop",))
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
        prefill.sender.close()
        del store
    return _fit(TRANSFER_FEATURES, rows, "kv_transfer")


def _transfer_once(prefill, n: int, cmds, replies, child) -> float:
    """begin -> DONE of one prompt of ``n`` tokens whose KV is complete in the prefill cache."""
    rid = f"profile-{next(_transfer_ids)}"
    cmds.put(("reserve", rid, n))
    dst = _reply(replies, child)
    if dst is None:
        raise ProfileError(f"kv_transfer: the decode side has no room for {n} tokens")
    table = BlockTable(prefill.pool.block_size)
    table.ensure_capacity(prefill.pool, n)
    nblocks = prefill.pool.blocks_for_tokens(n)
    sender = prefill.sender
    try:
        cmds.put(("serve", rid))
        t0 = time.perf_counter()
        sender.begin(rid, n, table.blocks, [LegTarget(DECODE_ID, sender.heads, reserved=True)])
        group = sender.open_group({rid: nblocks})
        for layer in range(prefill.loaded.config.num_hidden_layers):
            group.send_layer(layer)
        group.close()
        sender.finish_prompt(rid, None)
        while True:
            events = sender.poll()
            if events.failed:
                raise ProfileError(f"kv_transfer: {events.failed[0].error}")
            if rid in events.done:
                seconds = time.perf_counter() - t0
                break
            time.sleep(0.0002)
        _reply(replies, child)  # the decode side freed the blocks
        return seconds
    finally:
        table.release(prefill.pool)


def _decode_side(model_path: str, config, threads: int, transfer, rdv, cmds, replies) -> None:
    """Child process: a DecodeWorker's cache behind a KVReceiver over its block pool. Polls the receiver
    every millisecond while a transfer is pending (a decode worker polls once per step)."""
    try:
        torch.set_num_threads(threads)
        worker = DecodeWorker(model_path, config)
        mc = worker.loaded.config
        fingerprint = KVFingerprint.of(mc, config.block_size, worker.loaded.dtype)
        reserver = PoolReserver(worker.pool)
        receiver = KVReceiver(worker.cache, reserver, DECODE_ID, fingerprint, HeadRange(0, mc.num_key_value_heads),
                              transfer)
        replies.put(("ok", "loaded"))  # the parent connects now: both ends of the pair wait for each other
        receiver.connect(PREFILL_ID, rdv)
        replies.put(("ok", "connected"))
        while True:
            cmd = cmds.get()
            if cmd[0] == "reserve":
                replies.put(("ok", receiver.reserve(cmd[1], cmd[2])))
            elif cmd[0] == "serve":
                replies.put(("ok", _serve(receiver, reserver, cmd[1])))
            else:
                break
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        replies.put(("error", traceback.format_exc()))
    finally:
        replies.close()
        replies.join_thread()
        os._exit(0)


def _serve(receiver, reserver, rid: str) -> None:
    while True:
        events = receiver.poll()
        if events.failed:
            raise RuntimeError(f"receiving {rid}: {events.failed[0].error}")
        if any(kv.request_id == rid for kv in events.completed):
            reserver.release_reservation(rid)
            return None
        time.sleep(0.001)


def _reply(replies, child, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status, value = replies.get(timeout=1.0)
            break
        except queue.Empty:
            if not child.is_alive() or time.monotonic() > deadline:
                raise ProfileError("kv_transfer: the decode-side process died or stopped answering") from None
    if status != "ok":
        raise ProfileError(f"kv_transfer: the decode side failed:\n{value}")
    return value


# -- 4. acceptance ---------------------------------------------------------------------------------

def acceptance_ranges(grid: Grid, limits: Limits) -> list[tuple[int, int, int]]:
    """(context_lo, context_hi, prompt length) of the ranges the config reaches; the last reachable
    range is open at the top."""
    room = limits.max_context - grid.acceptance_steps * (limits.max_k + 1) - 1
    longest = min(limits.max_prompt, room)
    out = []
    for lo, hi, length in grid.acceptance_ranges:
        length = min(length, longest)
        if length >= max(lo, 1):
            out.append((lo, CONTEXT_UNBOUNDED if hi is None else hi, length))
    if not out:
        raise ProfileError(f"acceptance: no context range of the grid fits prompts of up to {longest} tokens")
    lo, _, length = out[-1]
    out[-1] = (lo, CONTEXT_UNBOUNDED, length)
    return out


def measure_acceptance(worker, config: ClusterConfig, grid: Grid, limits: Limits, fits: dict[str, FittedModel],
                       progress: bool, log: Callable[[str], None]) -> tuple[list[AcceptanceEntry], str]:
    """Acceptance entries of every (drafter, budget) over the context ranges, and a note comparing
    the measured speculative step times with the fitted pass models."""
    if worker.tokenizer is None:
        log("acceptance: the checkpoint has no tokenizer, so there is no real text to measure on; skipped")
        return [], "acceptance not measured (no tokenizer)"
    spec = config.decode.speculation
    drafters = ["self_sparse"] + (["draft_model"] if spec.drafter == "draft_model" else [])
    budgets = sorted({b for b in grid.acceptance_budgets + (spec.budget,) if b > spec.sink_tokens})
    ranges = acceptance_ranges(grid, limits)
    corpus = heldout_tokens(worker.tokenizer, grid.acceptance_batch * max(n for _, _, n in ranges) + 1)
    entries, ratios = [], []
    cells = [(r, d, b) for r in ranges for d in drafters for b in budgets]
    bar = tqdm(total=len(cells), desc="acceptance", disable=not progress)
    for lo, hi, length in ranges:
        ids = _add_prompts(worker, corpus, grid.acceptance_batch, length)
        try:
            for drafter in drafters:
                for budget in budgets:
                    view = dataclasses.replace(spec, drafter=drafter, budget=budget, k_policy="fixed",
                                               k=limits.max_k, max_k=limits.max_k, tpot_slo_ms=None)
                    worker.set_speculation(view)
                    accepted, rejected, proposed, r = _speculate(worker, ids, length + 1, grid.acceptance_steps,
                                                                 limits.max_k, fits, drafter)
                    ratios += r
                    if accepted + rejected:
                        entries.append(AcceptanceEntry(drafter, budget, lo, hi, accepted / (accepted + rejected),
                                                       proposed))
                    bar.update()
        finally:
            for rid in ids:
                worker.abort(rid)
    bar.close()
    for e in entries:
        hi = "inf" if e.context_hi == CONTEXT_UNBOUNDED else e.context_hi
        log(f"acceptance {e.drafter} budget {e.budget:>4} context [{e.context_lo}, {hi}): {e.rate:.3f} "
            f"({e.proposed} drafts)")
    check = (f"speculative steps (k = {limits.max_k}) measured / predicted by the fitted passes: median "
             f"{statistics.median(ratios):.2f} over {len(ratios)} steps" if ratios else "no step-time check")
    return entries, check


def _add_prompts(worker, corpus: list[int], batch: int, length: int) -> list[str]:
    params = SamplingParams(max_tokens=10**6, ignore_eos=True)
    stride = max(1, (len(corpus) - length) // max(1, batch))
    ids = []
    for i in range(batch):
        rid = f"acceptance-{length}-{i}"
        worker.add_local(rid, corpus[i * stride: i * stride + length], params)
        ids.append(rid)
    return ids


def _speculate(worker, ids: list[str], start_len: int, steps: int, k: int, fits: dict[str, FittedModel],
               drafter: str) -> tuple[int, int, int, list[float]]:
    """Rewind to ``start_len`` tokens, run ``steps`` speculative steps of k drafts; (accepted,
    rejections, proposed, measured / predicted step time per step)."""
    for rid in ids:
        rewind(worker, rid, start_len)
    lens = {rid: start_len for rid in ids}  # tokens per running sequence
    accepted = rejected = proposed = 0
    ratios = []
    draft_fit = fits.get(f"draft_pass/{drafter}")
    for _ in range(steps):
        deltas = worker.step(k)
        if not deltas:
            break
        if draft_fit is not None and all(d.draft_tokens == k for d in deltas):
            ratios.append(worker.metrics.step_times[-1] / _predicted_step(worker, [lens[d.request_id] for d in deltas],
                                                                          k, draft_fit, fits["target_pass"]))
        for d in deltas:
            lens[d.request_id] += len(d.token_ids)
            if d.draft_tokens:
                proposed += d.draft_tokens
                accepted += d.accepted_tokens
                rejected += d.accepted_tokens < d.draft_tokens
    return accepted, rejected, proposed, ratios


def _predicted_step(worker, lens: list[int], k: int, draft: FittedModel, target: FittedModel) -> float:
    """k draft passes plus one verify pass over sequences of ``lens`` tokens, as the policy sees them."""
    b = len(lens)
    drafts = sum(draft.predict_pass(PassShape(b, sum(worker.drafter.kv_tokens_read(n, j) for n in lens), b))
                 for j in range(k))
    return drafts + target.predict_pass(PassShape(b, sum(lens) + b * k, b * (k + 1)))


def heldout_tokens(tokenizer, need: int) -> list[int]:
    """Token ids of the held-out standard-library files (never trained on by the bundled model),
    concatenated, each followed by the end-of-text marker; at least ``need`` (repeated if short)."""
    corpus = _corpus_module()
    _, heldout = corpus.split_documents(corpus.load_documents(), HOLDOUT_PERMILLE)
    ids: list[int] = []
    for doc in heldout:
        ids.extend(tokenizer.encode(doc.text + corpus.EOS_TOKEN))
        if len(ids) >= need:
            break
    if not ids:
        raise ProfileError("acceptance: the held-out corpus is empty")
    while len(ids) < need:
        ids = ids + ids
    return ids


def _corpus_module():
    try:
        from scripts import _corpus  # scripts/ is not installed (setup.py): found in the checkout, on use
    except ImportError:  # run from outside the repository: its root holds scripts/
        sys.path.insert(0, REPO_ROOT)
        from scripts import _corpus
    return _corpus


# -- helpers ---------------------------------------------------------------------------------------

@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _median_time(fn: Callable[[], object], repeats: int, long_s: float = 0.25) -> float:
    """Median of ``repeats`` timed runs after a warm-up run. A point whose first run takes over
    ``long_s`` keeps that run (first-call effects are negligible next to it) and stops at 3 runs: the
    grid's longest points would otherwise dominate the profiling time."""
    first = _timed(fn)
    times, want = ([first], min(3, repeats)) if first > long_s else ([], repeats)
    while len(times) < max(1, want):
        times.append(_timed(fn))
    return statistics.median(times)


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _tokens(n: int, vocab: int, salt: int) -> list[int]:
    return [(salt + 7 * i) % vocab for i in range(n)]


def _pass_row(shape: PassShape, seconds: float) -> dict:
    return {**dict(zip(PASS_FEATURES, shape.features())), "seconds": seconds}


def _fit(features: tuple[str, ...], rows: list[dict], name: str) -> tuple[FittedModel, list[dict]]:
    if len(rows) < len(features):
        raise ProfileError(f"{name}: {len(rows)} measured points, need at least {len(features)}; widen the grid "
                           f"or the config's limits")
    return FittedModel.fit(features, [{f: r[f] for f in features} for r in rows], [r["seconds"] for r in rows]), rows


def _describe(fm: FittedModel) -> str:
    coef = ", ".join(f"{f} {c:.3g}" for f, c in zip(fm.features, fm.coefficients))
    return f"fit error {fm.fit_error:.1%} over {fm.points} points; seconds = {coef}"
