"""Analytical profiles of GPU clusters: cost models from a GPU type's public specs and a model's shape,
so plans for GPU clusters can be made on a machine without those GPUs.

Per forward pass on a tensor-parallel group of ``tp`` GPUs, each GPU moves bytes and does FLOPs:

* weights: every weight is read once per pass (the lm_head too; the input embedding only as gathered
  rows, so an untied input table is not counted): ``weight_bytes / tp`` per GPU;
* KV cache: each KV token read costs ``kv_bytes_per_token / min(tp, kv_heads)`` per GPU (KV heads are
  sharded; beyond ``kv_heads`` GPUs they are replicated); each new token writes as much;
* matmuls: ``2 x (non-embedding params + lm_head) / tp`` FLOPs per new token (decode and verify need
  logits for every new token; prefill only for the last token of each prompt, a per-sequence term);
* prefill attention: ``4 x heads x head_dim x layers / tp`` FLOPs per (query, key) pair (QK^T and PV);
  decode attention reads each KV token for at most (k + 1) x (query heads / KV heads) queries, far below
  any of these GPUs' FLOP/byte ridge, so it is memory-bound and counted as KV bytes only;
* tensor parallelism: two all-reduces per layer (attention out, MLP out) of ``hidden x 2`` bytes per new
  token, ring algorithm (each GPU sends ``2 (tp - 1) / tp`` of the data over its link), plus a fixed
  latency per collective.

A pass takes about ``max(bytes / (bandwidth x eff), flops / (peak x eff))``. ``max`` is not linear in
the features, so the profile uses the SUM of the memory-bound terms (weights and KV) and the
compute-bound per-token terms, which is what the linear model can express. The sum equals the max when
one side dominates (decode at small batch: weights; prefill of long chunks: FLOPs) and overestimates by at
most 2x where both are equal: at about ``peak x eff_matmul / (bandwidth x eff_memory)`` new tokens per pass
(~240 on H100, ~165 on H200, ~120 on A100, ~335 on L40S). Real kernels are not perfectly overlapped near
that point either (skinny GEMMs run below peak), so the sum is a pessimistic but sane bound there. Valid
for: decode / verify batches of up to a few hundred new tokens per pass and prefill chunks of hundreds
to thousands of tokens; attn_pairs counts the full n x (start + n) rectangle of a chunk, so the chunk's
own causal triangle is counted twice (pessimistic for the first chunk of a prompt, negligible later).

Efficiency factors (``Efficiency``) turn peaks into achievable rates; the defaults are mid-range of what
serving kernels reach: HBM 0.75 (decode GEMV / paged-attention kernels reach 70-85 % of peak bandwidth),
dense matmul 0.6 (50-70 % at serving shapes), flash attention 0.45 (FlashAttention-2 reaches 35-50 %
of peak on H100, FA-3 up to 75 %), interconnect 0.7 (NCCL bus bandwidth vs link peak).

KV capacity of an instance: ``(memory x tp x utilization(0.9) - weight bytes) / kv_bytes_per_token``.
TP degrees with less than ``min_kv_tokens`` of KV are not listed.

KV transfer (prefill -> decode): ``kv_bytes_per_token / (link x eff_link)`` per token plus a fixed
per-request latency (handshake), over a configurable link: an inter-node network (25 GB/s = 200 Gb/s
InfiniBand / RoCE, the default) or NVLink when both instances share a node (~450 GB/s per direction).

Acceptance rates cannot be derived from specs: they come from a measured profile (``acceptance_from``)
or explicit values, and ``Profile.notes`` says which.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from planner.gpu_catalog import CatalogError, GPUSpec, default_catalog
from planner.profile import (
    CONTEXT_UNBOUNDED, PREFILL_FEATURES, TRANSFER_FEATURES, AcceptanceEntry, FittedModel, InstanceCosts, Profile,
    ProfileError)
from decode_worker.policy import FEATURES as PASS_FEATURES
from modeling.config import ModelConfig

GiB = 2**30


# the GPU types' specs: the default catalogue (``gpu_catalog.yaml``; prices and availability live there too)
GPUS: dict[str, GPUSpec] = default_catalog().specs()


@dataclass(frozen=True)
class Efficiency:
    """Achievable fractions of the peaks (see the module docstring for the ranges behind them)."""

    memory: float = 0.75
    matmul: float = 0.6
    attention: float = 0.45
    link: float = 0.7
    pass_overhead_s: float = 3e-4  # per forward pass: launch, scheduling and sampling not hidden by the GPU

    def __post_init__(self) -> None:
        for name in ("memory", "matmul", "attention", "link"):
            if not 0 < getattr(self, name) <= 1:
                raise ProfileError(f"efficiency.{name}: must be in (0, 1], got {getattr(self, name)}")


@dataclass(frozen=True)
class AnalyticalOptions:
    efficiency: Efficiency = field(default_factory=Efficiency)
    tensor_parallel: tuple[int, ...] = (1, 2, 4, 8)
    memory_utilization: float = 0.9  # share of device memory for weights + KV (vLLM's default)
    min_kv_tokens: int = 16384  # a shape must hold at least this much KV to be listed
    transfer_bandwidth: float = 25e9  # bytes/s, prefill -> decode KV link (peak; eff.link applies)
    transfer_latency_s: float = 1e-3  # per request: descriptor, accept, done
    devices_per_node: int = 8
    dtype_bytes: int = 2  # bf16 weights and KV


# -- model shapes ----------------------------------------------------------------------------------

LLAMA_31_8B = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
}
LLAMA_31_70B = {**LLAMA_31_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                "num_attention_heads": 64}
MODELS: dict[str, dict] = {"llama-3.1-8b": LLAMA_31_8B, "llama-3.1-70b": LLAMA_31_70B}


def model_shape(name_or_dir: str) -> tuple[str, ModelConfig]:
    """(name, config) of a built-in shape (``MODELS``) or of an HF checkpoint directory's config.json."""
    if name_or_dir in MODELS:
        return name_or_dir, ModelConfig.from_hf_dict(MODELS[name_or_dir])
    if os.path.isdir(name_or_dir):
        from modeling.checkpoint import load_config  # torch: the cost search's spawned workers run without it

        return os.path.basename(os.path.normpath(name_or_dir)), load_config(name_or_dir)
    raise ProfileError(f"model: {name_or_dir!r} is neither a built-in shape ({', '.join(MODELS)}) nor a directory "
                       f"with a config.json")


@dataclass(frozen=True)
class Shape:
    """What the cost formulas need from a model config (bf16 unless dtype_bytes says otherwise)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: int
    layer_params: int  # weights inside the decoder layers (matmuls)
    weight_bytes: float  # every weight, as stored
    read_bytes: float  # weights read by one pass (an untied input embedding is only gathered)
    kv_bytes_per_token: int

    @staticmethod
    def of(mc: ModelConfig, dtype_bytes: int = 2) -> "Shape":
        params = mc.num_parameters()
        emb = mc.vocab_size * mc.hidden_size
        embeddings = emb if mc.tie_word_embeddings else 2 * emb
        layer_params = params - embeddings - mc.hidden_size  # minus the final norm
        unread = 0 if mc.tie_word_embeddings else emb
        kv = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * dtype_bytes
        return Shape(mc.num_hidden_layers, mc.hidden_size, mc.num_attention_heads, mc.num_key_value_heads,
                     mc.head_dim, mc.vocab_size, params, layer_params, params * dtype_bytes,
                     (params - unread) * dtype_bytes, kv)


# -- cost coefficients -----------------------------------------------------------------------------

@dataclass(frozen=True)
class _PerGPU:
    """Seconds per unit of each quantity on one GPU of a tensor-parallel instance of ``tp`` GPUs."""

    weights_s: float  # one pass's weight reads
    kv_token_s: float  # one KV token read (or written)
    matmul_token_s: float  # decoder-layer matmuls of one new token
    lm_head_token_s: float  # lm_head of one token
    attn_pair_s: float  # one prefill (query, key) pair
    comm_token_s: float  # TP all-reduces of one token's activations
    comm_pass_s: float  # fixed latency of a pass's collectives

    @staticmethod
    def of(s: Shape, gpu: GPUSpec, tp: int, eff: Efficiency, dtype_bytes: int) -> "_PerGPU":
        bw = gpu.hbm_bandwidth * eff.memory
        flops = gpu.bf16_flops * eff.matmul
        link = gpu.link_bandwidth * eff.link
        act = s.hidden * dtype_bytes  # one token's activations
        allreduces = 2 * s.layers if tp > 1 else 0
        return _PerGPU(
            weights_s=s.read_bytes / tp / bw,
            kv_token_s=s.kv_bytes_per_token / min(tp, s.kv_heads) / bw,
            matmul_token_s=2 * s.layer_params / tp / flops,
            lm_head_token_s=2 * s.vocab * s.hidden / tp / flops,
            attn_pair_s=4 * s.heads * s.head_dim * s.layers / tp / (gpu.bf16_flops * eff.attention),
            comm_token_s=allreduces * 2 * (tp - 1) / tp * act / link,
            comm_pass_s=allreduces * gpu.collective_latency_s,
        )


def pass_model(s: Shape, gpu: GPUSpec, tp: int, eff: Efficiency, dtype_bytes: int = 2) -> FittedModel:
    """Target (or self-sparse draft) pass over decode_worker.policy FEATURES."""
    g = _PerGPU.of(s, gpu, tp, eff, dtype_bytes)
    coef = {
        "passes": g.weights_s + g.comm_pass_s + eff.pass_overhead_s,
        "seqs": 0.0,
        "kv_tokens": g.kv_token_s,
        # matmuls + logits of every new token, its KV write, its share of the all-reduces
        "new_tokens": g.matmul_token_s + g.lm_head_token_s + g.kv_token_s + g.comm_token_s,
        "kv_queries": g.attn_pair_s,  # attention arithmetic: every query against its sequence's KV
    }
    return FittedModel(PASS_FEATURES, tuple(coef[f] for f in PASS_FEATURES), 0.0, 0)


def prefill_model(s: Shape, gpu: GPUSpec, tp: int, eff: Efficiency, dtype_bytes: int = 2) -> FittedModel:
    """One chunked-prefill step over PREFILL_FEATURES."""
    g = _PerGPU.of(s, gpu, tp, eff, dtype_bytes)
    coef = {
        "passes": g.weights_s + g.comm_pass_s + eff.pass_overhead_s,
        "seqs": g.lm_head_token_s,  # logits of each prompt's last token
        "tokens": g.matmul_token_s + g.kv_token_s + g.comm_token_s,
        "attn_pairs": g.attn_pair_s,
        "kv_tokens": g.kv_token_s,  # each chunk reads its context's KV once
    }
    return FittedModel(PREFILL_FEATURES, tuple(coef[f] for f in PREFILL_FEATURES), 0.0, 0)


def transfer_model(s: Shape, opts: AnalyticalOptions) -> FittedModel:
    per_token = s.kv_bytes_per_token / (opts.transfer_bandwidth * opts.efficiency.link)
    coef = {"passes": opts.transfer_latency_s, "tokens": per_token}
    return FittedModel(TRANSFER_FEATURES, tuple(coef[f] for f in TRANSFER_FEATURES), 0.0, 0)


def kv_capacity(s: Shape, gpu: GPUSpec, tp: int, utilization: float) -> int:
    """KV tokens one instance holds: memory left after the weights, over the per-token KV bytes (more
    than kv_bytes_per_token per token when tp > kv_heads replicates heads)."""
    free = gpu.memory_bytes * tp * utilization - s.weight_bytes
    per_token = s.kv_bytes_per_token * max(1.0, tp / s.kv_heads)
    return max(0, int(free // per_token))


# -- the profile -----------------------------------------------------------------------------------

def analytical_profile(gpu_name: str | GPUSpec, model: str, opts: AnalyticalOptions = AnalyticalOptions(),
                       acceptance: tuple[AcceptanceEntry, ...] = (), acceptance_note: str = "",
                       draft_model: str | None = None) -> Profile:
    """Profile of ``model`` (built-in name or HF dir) on GPUs of type ``gpu_name`` (a catalogue name or alias,
    or a spec), one InstanceCosts per TP degree that fits."""
    gpu = gpu_name if isinstance(gpu_name, GPUSpec) else gpu_spec(gpu_name)
    name, mc = model_shape(model)
    shape = Shape.of(mc, opts.dtype_bytes)
    draft = Shape.of(model_shape(draft_model)[1], opts.dtype_bytes) if draft_model else None
    instances = []
    for tp in opts.tensor_parallel:
        if tp < 1 or tp > opts.devices_per_node:
            raise ProfileError(f"tensor_parallel: {tp} must be in [1, devices_per_node={opts.devices_per_node}]")
        cap = kv_capacity(shape, gpu, tp, opts.memory_utilization)
        if cap >= opts.min_kv_tokens:
            instances.append(_instance(shape, draft, gpu, tp, cap, opts))
    if not instances:
        raise ProfileError(f"{name} does not fit {gpu.name} x {max(opts.tensor_parallel)} with "
                           f"{opts.min_kv_tokens} KV tokens to spare")
    eff = opts.efficiency
    notes = (f"analytical ({gpu.source}); efficiency: memory {eff.memory}, matmul {eff.matmul}, attention "
             f"{eff.attention}, link {eff.link}, pass overhead {eff.pass_overhead_s * 1e3:.2f} ms; pass time = "
             f"memory terms + compute terms (sum, not max: up to 2x pessimistic near the ridge, see "
             f"planner/analytical.py); KV capacity at {opts.memory_utilization:.0%} memory; kv_transfer "
             f"over {opts.transfer_bandwidth / 1e9:g} GB/s x {eff.link} + {opts.transfer_latency_s * 1e3:g} ms per "
             f"request. {acceptance_note or 'No acceptance rates (pass --acceptance-from or --acceptance).'}")
    return Profile(
        hardware=f"gpu: {gpu.name} ({gpu.hbm_bandwidth / 1e12:g} TB/s, {gpu.bf16_flops / 1e12:g} TFLOP/s bf16, "
                 f"{gpu.memory_bytes / GiB:.0f} GiB, {gpu.link}); analytical",
        device_type=gpu.name, devices_per_node=opts.devices_per_node, model=name, model_params=shape.params,
        kv_bytes_per_token=shape.kv_bytes_per_token, source="analytical", instances=tuple(instances),
        kv_transfer=transfer_model(shape, opts), acceptance=tuple(acceptance), notes=notes,
    )


def _instance(shape: Shape, draft: Shape | None, gpu: GPUSpec, tp: int, cap: int,
              opts: AnalyticalOptions) -> InstanceCosts:
    eff, nbytes = opts.efficiency, opts.dtype_bytes
    target = pass_model(shape, gpu, tp, eff, nbytes)
    drafts = {"self_sparse": target}  # the target itself over a sparse KV view: same costs per KV token read
    if draft is not None:
        drafts["draft_model"] = pass_model(draft, gpu, tp, eff, nbytes)
    return InstanceCosts(tp, prefill_model(shape, gpu, tp, eff, nbytes), target, drafts, cap, cap)


def gpu_spec(name: str) -> GPUSpec:
    """The default catalogue's spec of GPU type ``name`` (full name or alias)."""
    try:
        return default_catalog().get(name).spec
    except CatalogError as err:
        raise ProfileError(str(err)) from None


# -- acceptance sources ----------------------------------------------------------------------------

def acceptance_from_profile(path: str) -> tuple[tuple[AcceptanceEntry, ...], str]:
    """A measured profile's acceptance entries and a note naming where they came from."""
    src = Profile.load(path)
    if not src.acceptance:
        raise ProfileError(f"{path}: has no acceptance rates to take")
    note = (f"Acceptance rates taken from {os.path.basename(path)} (source {src.source}, model {src.model}, "
            f"{src.hardware}); they were measured on that model, not on this one: an assumption.")
    return src.acceptance, note


def parse_acceptance(values: list[str]) -> tuple[tuple[AcceptanceEntry, ...], str]:
    """``DRAFTER:BUDGET:RATE`` strings -> entries for all contexts."""
    entries = []
    for v in values:
        parts = v.split(":")
        try:
            drafter, budget, rate = parts[0], int(parts[1]), float(parts[2])
            if len(parts) != 3:
                raise ValueError
        except (IndexError, ValueError):
            raise ProfileError(f"acceptance: expected DRAFTER:BUDGET:RATE, got {v!r}") from None
        if drafter not in ("self_sparse", "draft_model") or budget < 1 or not 0 <= rate < 1 or not math.isfinite(rate):
            raise ProfileError(f"acceptance: {v!r}: drafter must be self_sparse or draft_model, budget >= 1, "
                               f"rate in [0, 1)")
        entries.append(AcceptanceEntry(drafter, budget, 0, CONTEXT_UNBOUNDED, rate, 0))
    return tuple(entries), f"Acceptance rates given explicitly: {', '.join(values)} (assumed, all contexts)."


def profile_from_args(args) -> Profile:
    """The ``--analytical`` path of ``magicserve profile``."""
    if not args.gpu or not args.model:
        raise ProfileError("--analytical needs --gpu and --model")
    if args.acceptance_from and args.acceptance:
        raise ProfileError("give --acceptance-from or --acceptance, not both")
    acceptance, note = (), ""
    if args.acceptance_from:
        acceptance, note = acceptance_from_profile(args.acceptance_from)
    elif args.acceptance:
        acceptance, note = parse_acceptance(args.acceptance)
    if args.transfer_gbps <= 0:
        raise ProfileError(f"--transfer-gbps: must be > 0, got {args.transfer_gbps}")
    opts = AnalyticalOptions(tensor_parallel=tuple(args.tp), transfer_bandwidth=args.transfer_gbps * 1e9)
    return analytical_profile(args.gpu, args.model, opts, acceptance, note, args.draft_model)
