"""CUDA paths: the Triton and flash-attn backends against the torch oracle, speculative decoding, the engine
and the decode worker end to end, and KV transfer between processes.

Every test here is marked ``gpu`` (conftest skips them without CUDA). Tests of the flash backend skip when
the ``flash_attn`` package is absent; tests that put two NCCL ranks in two processes need two GPUs (NCCL
refuses two ranks of one communicator on the same device) and skip on a one-GPU machine.

Oracles, by precision:

* float32 (torch backend): CUDA must reproduce the reference path exactly where the CPU tests demand it
  (greedy tokens identical, attention within 1e-4 of the dense float32 oracle);
* bfloat16 / float16 (flash-attn supports only these): flash and Triton are compared with the dense float32
  oracle within tolerances set by the dtype's rounding, and with the torch backend run in the same dtype:
  they must be no less accurate and pick the same argmax almost everywhere. Triton also runs float32.

Run them all with ``python -m pytest -m gpu -q -rs`` (``scripts/gpu_suite.py`` does, and records it).
"""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
import torch

from decode_worker.config import DecodeWorkerConfig, SpeculationConfig
from decode_worker.worker import DecodeWorker
from kv_transfer import HeadRange, KVFingerprint, KVReceiver, KVSender, LegTarget, PoolReserver, Rendezvous, TransferConfig
from kv_transfer.errors import TransferError
from modeling.attention import AttentionMetadata, TorchAttentionBackend, make_backend
from modeling.attention.torch_backend import dense_reference_attention
from modeling.block_pool import BlockPool
from modeling.checkpoint import load_model
from modeling.engine import EngineConfig, ReferenceEngine
from modeling.kv_cache import KVCacheSpec, PagedKVCache
from modeling.runner import ModelRunner, StepInput
from modeling.sampling import SamplingParams
from tests.checkpoints import VOCAB
from tests.test_decode_worker import run_worker
from tests.kv_procs import context, run_procs

pytestmark = pytest.mark.gpu

CUDA = "cuda"
FLASH_BLOCK = 256  # flash-attn's paged KV needs a block size that is a multiple of 256

two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA devices (NCCL puts each rank of a pair on its own GPU)",
)


def needs_flash() -> None:
    pytest.importorskip("flash_attn")


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def agreement(outs: list[list[int]], refs: list[list[int]]) -> float:
    """Share of reference tokens reproduced before the first divergence (greedy outputs diverge for good
    after one differing token, so only the common prefix counts)."""
    return sum(common_prefix(o, r) for o, r in zip(outs, refs)) / max(1, sum(len(r) for r in refs))


# -- 1. attention kernels: flash and torch on CUDA against the dense oracle -------------------------------

# Absolute tolerances against the dense float32 oracle (values are O(1)). bf16 / fp16: rounding of the
# output (half an ulp: 4e-3 / 5e-4) plus flash's rounding of the softmax probabilities before P @ V.
KERNEL_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3}

# name -> (seq_lens after the step's write, new tokens per sequence)
KERNEL_CASES = {
    # prefill chunks at nonzero offsets (260, 400, 872) and one from position 0
    "prefill_chunks": ([300, 700, 1000, 128], [40, 300, 128, 128]),
    # decode: one new token per sequence, contexts across block boundaries
    "decode": ([1, 17, 255, 256, 257, 1000, 3001], [1] * 7),
    # verification passes: k + 1 query tokens per sequence (k = 3, 5)
    "verify": ([5, 300, 513, 2000], [4, 4, 6, 6]),
    # a mixed step: decode, verify and a prefill chunk together
    "mixed": ([700, 333, 1000, 45, 1], [1, 4, 40, 6, 1]),
}


def make_step(seq_lens, q_lens, hkv=2, g=4, d=64, dtype=torch.bfloat16, block_size=FLASH_BLOCK, sink_len=0,
              windows=None, seed=0):
    """A random paged cache on CUDA with shuffled (fragmented) block tables, and a step whose new tokens
    are the last ``q_len`` of each sequence; their keys/values are the cache's own slots (as after the
    cache write). Returns (q, k_new, v_new, k_cache, v_cache, meta)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    n_blocks = [-(-n // block_size) for n in seq_lens]
    total = sum(n_blocks) + 3  # a few blocks nobody owns
    ids = list(range(total))
    rng.shuffle(ids)
    tables, at = [], 0
    for nb in n_blocks:
        tables.append(ids[at : at + nb])
        at += nb
    k_cache = torch.randn(total, block_size, hkv, d, generator=gen).to(device=CUDA, dtype=dtype)
    v_cache = torch.randn(total, block_size, hkv, d, generator=gen).to(device=CUDA, dtype=dtype)
    qs = [0]
    for ql in q_lens:
        qs.append(qs[-1] + ql)
    q = (torch.randn(qs[-1], hkv * g, d, generator=gen) * 1.5).to(device=CUDA, dtype=dtype)
    slots = [tables[b][p // block_size] * block_size + p % block_size
             for b, (n, ql) in enumerate(zip(seq_lens, q_lens)) for p in range(n - ql, n)]
    meta = AttentionMetadata(
        query_start=qs, seq_lens=list(seq_lens), block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=CUDA), block_size=block_size,
        sink_len=sink_len, window_starts=windows,
    )
    k_new = k_cache.view(-1, hkv, d)[meta.slot_mapping]
    v_new = v_cache.view(-1, hkv, d)[meta.slot_mapping]
    return q, k_new, v_new, k_cache, v_cache, meta


def dense_oracle(q, k_cache, v_cache, meta, sliding_window=None) -> torch.Tensor:
    """The visibility rule evaluated densely in float32 (inputs upcast, output not rounded)."""
    return dense_reference_attention(q.float(), k_cache.float(), v_cache.float(), meta, sliding_window)


def max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref).abs().max().item()


@pytest.mark.parametrize("case", list(KERNEL_CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("g,d", [(1, 64), (4, 64), (2, 16), (4, 128)])
def test_flash_kernel_matches_dense_oracle(case, dtype, g, d):
    needs_flash()
    q, k, v, kc, vc, meta = make_step(*KERNEL_CASES[case], g=g, d=d, dtype=dtype)
    ref = dense_oracle(q, kc, vc, meta)
    out = make_backend("flash", CUDA, FLASH_BLOCK).forward(q, k, v, kc, vc, meta)
    assert out.dtype == dtype and out.shape == q.shape and out.is_cuda
    err = max_err(out, ref)
    assert err <= KERNEL_TOL[dtype], f"flash {case} {dtype}: max abs err {err}"
    # close to the torch backend in the same dtype, which rounds only its output: flash also rounds the
    # softmax probabilities (a CPU emulation of that adds up to a fifth of the tolerance)
    torch_err = max_err(TorchAttentionBackend().forward(q, k, v, kc, vc, meta), ref)
    assert err <= torch_err + KERNEL_TOL[dtype] / 2, f"flash {err} vs torch {torch_err}"


@pytest.mark.parametrize("case", list(KERNEL_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_backend_on_cuda_matches_dense_oracle(case, dtype):
    q, k, v, kc, vc, meta = make_step(*KERNEL_CASES[case], dtype=dtype, block_size=16)
    out = TorchAttentionBackend().forward(q, k, v, kc, vc, meta)
    assert out.is_cuda and out.dtype == dtype
    assert max_err(out, dense_oracle(q, kc, vc, meta)) <= KERNEL_TOL[dtype]


# The sparse sink + window draft view, block-aligned as flash needs: (sink_len, window starts). A window
# start at or below the sink means the whole prefix is visible.
SPARSE_SEQS = ([1000, 700, 300, 2000], [1, 4, 1, 6])
SPARSE_VIEWS = [(256, [512, 512, 0, 1792]), (0, [768, 256, 0, 1536]), (256, [256, 512, 256, 1024])]


@pytest.mark.parametrize("sink_len,windows", SPARSE_VIEWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_sparse_view_matches_dense_oracle(sink_len, windows, dtype):
    needs_flash()
    q, k, v, kc, vc, meta = make_step(*SPARSE_SEQS, dtype=dtype, sink_len=sink_len, windows=windows)
    ref = dense_oracle(q, kc, vc, meta)
    err = max_err(make_backend("flash", CUDA, FLASH_BLOCK).forward(q, k, v, kc, vc, meta), ref)
    assert err <= KERNEL_TOL[dtype], f"sparse view sink {sink_len} windows {windows}: max abs err {err}"
    assert max_err(TorchAttentionBackend().forward(q, k, v, kc, vc, meta), ref) <= KERNEL_TOL[dtype]


def test_flash_gathers_an_unaligned_sparse_view():
    """flash reads an aligned view through a virtual block table; a sink or window that is not block-aligned
    (the drafter's default 16-token sink, any window start) is gathered by the torch path instead, with the
    same result as the dense oracle."""
    needs_flash()
    flash = make_backend("flash", CUDA, FLASH_BLOCK)
    for sink_len, windows in ((16, [600]), (256, [600])):
        q, k, v, kc, vc, meta = make_step([1000], [1], sink_len=sink_len, windows=windows, dtype=torch.bfloat16)
        err = max_err(flash.forward(q, k, v, kc, vc, meta), dense_oracle(q, kc, vc, meta))
        assert err <= KERNEL_TOL[torch.bfloat16], f"sink {sink_len} window {windows}: max abs err {err}"


# A layer's sliding window W (query p sees keys p - W + 1 .. p): flash's window_size=(W - 1, 0). Windows
# shorter than a query block (1, 3), between block sizes (100, 300) and longer than every sequence.
SLIDING_WINDOWS = [1, 3, 100, 300, 5000]


@pytest.mark.parametrize("case", list(KERNEL_CASES))
@pytest.mark.parametrize("window", SLIDING_WINDOWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_sliding_window_matches_dense_oracle(case, window, dtype):
    needs_flash()
    q, k, v, kc, vc, meta = make_step(*KERNEL_CASES[case], dtype=dtype)
    ref = dense_oracle(q, kc, vc, meta, window)
    err = max_err(make_backend("flash", CUDA, FLASH_BLOCK).forward(q, k, v, kc, vc, meta, window), ref)
    assert err <= KERNEL_TOL[dtype], f"flash {case} window {window} {dtype}: max abs err {err}"
    torch_err = max_err(TorchAttentionBackend().forward(q, k, v, kc, vc, meta, window), ref)
    assert torch_err <= KERNEL_TOL[dtype], f"torch {case} window {window} {dtype}: max abs err {torch_err}"
    assert err <= torch_err + KERNEL_TOL[dtype] / 2, f"flash {err} vs torch {torch_err}"


@pytest.mark.parametrize("case", list(KERNEL_CASES))
@pytest.mark.parametrize("window", SLIDING_WINDOWS)
def test_torch_backend_on_cuda_with_sliding_window_matches_dense_oracle(case, window):
    q, k, v, kc, vc, meta = make_step(*KERNEL_CASES[case], dtype=torch.float32, block_size=16)
    out = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, window)
    assert max_err(out, dense_oracle(q, kc, vc, meta, window)) <= KERNEL_TOL[torch.float32]


@pytest.mark.parametrize("sink_len,windows", SPARSE_VIEWS)
@pytest.mark.parametrize("window", [3, 300, 700, 1500])
def test_flash_sparse_view_with_sliding_window_matches_dense_oracle(sink_len, windows, window):
    """A draft's sink + window view on a sliding-window layer: the view intersected with the layer's
    window, through flash's virtual block table where that is exact and the torch gather otherwise."""
    needs_flash()
    q, k, v, kc, vc, meta = make_step(*SPARSE_SEQS, dtype=torch.bfloat16, sink_len=sink_len, windows=windows)
    ref = dense_oracle(q, kc, vc, meta, window)
    err = max_err(make_backend("flash", CUDA, FLASH_BLOCK).forward(q, k, v, kc, vc, meta, window), ref)
    assert err <= KERNEL_TOL[torch.bfloat16], f"sink {sink_len} views {windows} window {window}: max abs err {err}"


# -- 1a. the Triton kernel (no flash-attn needed): every step shape, any alignment ----------------------

@pytest.mark.parametrize("case", list(KERNEL_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("g,d", [(1, 64), (4, 128), (3, 80)])
def test_triton_kernel_matches_dense_oracle(case, dtype, g, d):
    q, k, v, kc, vc, meta = make_step(*KERNEL_CASES[case], g=g, d=d, dtype=dtype, block_size=16)
    ref = dense_oracle(q, kc, vc, meta)
    out = make_backend("triton", CUDA, 16).forward(q, k, v, kc, vc, meta)
    assert out.dtype == dtype and out.shape == q.shape and out.is_cuda
    err = max_err(out, ref)
    assert err <= KERNEL_TOL[dtype], f"triton {case} {dtype}: max abs err {err}"
    torch_err = max_err(TorchAttentionBackend().forward(q, k, v, kc, vc, meta), ref)
    assert err <= torch_err + KERNEL_TOL[dtype] / 2, f"triton {err} vs torch {torch_err}"


# unaligned sink + window views (the drafter's defaults: 16 sink tokens, any window start; a window start
# never past a sequence's cached context: 1990 of 2000 - 6)
TRITON_VIEWS = [(16, [600, 512, 5, 1990]), (0, [768, 3, 0, 1536]), (4, [990, 650, 299, 100])]


@pytest.mark.parametrize("sink_len,windows", TRITON_VIEWS)
@pytest.mark.parametrize("window", [None, 3, 300, 1500])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_sparse_view_and_sliding_window_match_dense_oracle(sink_len, windows, window, dtype):
    q, k, v, kc, vc, meta = make_step(*SPARSE_SEQS, dtype=dtype, block_size=16, sink_len=sink_len, windows=windows)
    ref = dense_oracle(q, kc, vc, meta, window)
    err = max_err(make_backend("triton", CUDA, 16).forward(q, k, v, kc, vc, meta, window), ref)
    assert err <= KERNEL_TOL[dtype], f"sink {sink_len} views {windows} window {window}: max abs err {err}"


@pytest.mark.parametrize("split_keys", [64, 512, 4096, 1 << 16])
def test_triton_key_splits_match_dense_oracle(split_keys):
    from modeling.attention.triton_backend import TritonAttentionBackend

    q, k, v, kc, vc, meta = make_step([16000, 3001, 40], [1, 4, 1], dtype=torch.bfloat16, block_size=16)
    ref = dense_oracle(q, kc, vc, meta)
    err = max_err(TritonAttentionBackend(split_keys).forward(q, k, v, kc, vc, meta), ref)
    assert err <= KERNEL_TOL[torch.bfloat16], f"{split_keys} keys a split: max abs err {err}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split_keys", [512, 1 << 16])
def test_triton_verification_rows_equal_decode_steps_bit_for_bit(dtype, split_keys):
    from modeling.attention.triton_backend import TritonAttentionBackend

    q, _, _, kc, vc, meta = make_step([3000], [6], dtype=dtype, block_size=16)
    backend = TritonAttentionBackend(split_keys)
    verify = backend.forward(q, None, None, kc, vc, meta)
    for i in range(6):
        step = AttentionMetadata(query_start=[0, 1], seq_lens=[3000 - 5 + i], block_tables=meta.block_tables,
                                 slot_mapping=meta.slot_mapping[i : i + 1], block_size=16)
        assert torch.equal(backend.forward(q[i : i + 1], None, None, kc, vc, step)[0], verify[i]), f"row {i}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_rows_are_alike_whatever_the_batch_and_split_count(dtype):
    """A decode row alone (one split, written directly), beside a 16K sequence (32 splits, merged) and in a
    step with a captured step's fixed split count is the same bit for bit, in bf16 tensor-core dots too."""
    from modeling.attention.triton_backend import TritonAttentionBackend

    q, _, _, kc, vc, meta = make_step([300, 3000, 16000], [1, 1, 1], dtype=dtype, block_size=16)
    batched = TritonAttentionBackend().forward(q, None, None, kc, vc, meta)
    fixed = TritonAttentionBackend(num_splits=40).forward(q, None, None, kc, vc, meta)
    for b in range(3):
        alone = AttentionMetadata(query_start=[0, 1], seq_lens=[meta.seq_lens[b]], block_tables=[meta.block_tables[b]],
                                  slot_mapping=meta.slot_mapping[b : b + 1], block_size=16)
        single = TritonAttentionBackend().forward(q[b : b + 1], None, None, kc, vc, alone)[0]
        assert torch.equal(single, batched[b]) and torch.equal(fixed[b], batched[b]), f"sequence {b}"


# -- 1b. the model over the paged cache: flash and Triton vs torch on the tiny checkpoint -----------------

def cuda_runner(directory: str, dtype: str, backend: str, block_size: int = FLASH_BLOCK, blocks: int = 16):
    loaded = load_model(directory, dtype, CUDA)
    c = loaded.config
    spec = KVCacheSpec(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, block_size, loaded.dtype)
    return ModelRunner(loaded.model, PagedKVCache(spec, blocks, CUDA), make_backend(backend, CUDA, block_size))


RUNNER_LENS = [300, 520, 700]  # prompt lengths: 2 to 3 blocks of 256
RUNNER_TABLES = [[0, 1, 2], [5, 3, 4], [8, 9, 10, 11]]  # fragmented on purpose
CHUNK = 128


def runner_scenario(runner: ModelRunner) -> list[tuple[str, torch.Tensor]]:
    """Teacher-forced steps over three sequences (every backend sees the same tokens): chunked prefill
    with logits for every position (chunks at nonzero offsets, several sequences per step), four batched
    decode steps, one verification pass of 4 tokens each, one draft step over a block-aligned sink + window
    view. Returns (step kind, float32 logits) per step."""
    toks = prompts_of([n + 12 for n in RUNNER_LENS], seed=21)
    lens, tables = RUNNER_LENS, RUNNER_TABLES
    out = []
    pos = [0] * len(lens)
    while any(p < n for p, n in zip(pos, lens)):
        inputs = []
        for b, n in enumerate(lens):
            if pos[b] < n:
                m = min(CHUNK, n - pos[b])
                inputs.append(StepInput(toks[b][pos[b] : pos[b] + m], pos[b], tables[b], num_logits=m))
                pos[b] += m
        out.append(("prefill", runner.run(inputs)))
    for s in range(4):
        out.append(("decode", runner.run([StepInput([toks[b][n + s]], n + s, tables[b]) for b, n in enumerate(lens)])))
    out.append(("verify", runner.run([StepInput(toks[b][n + 4 : n + 8], n + 4, tables[b], num_logits=4)
                                      for b, n in enumerate(lens)])))
    out.append(("draft", runner.run([StepInput([toks[b][n + 8]], n + 8, tables[b]) for b, n in enumerate(lens)],
                                    sink_len=256, window_starts=[256, 256, 512])))
    return out


def test_torch_backend_on_cuda_matches_cpu_through_the_model(llama_dir):
    """float32: the model over the paged cache on CUDA gives the CPU's logits (1e-4) for every step kind."""
    cpu = load_model(llama_dir, "float32", "cpu")
    c = cpu.config
    spec = KVCacheSpec(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, FLASH_BLOCK, cpu.dtype)
    cpu_runner = ModelRunner(cpu.model, PagedKVCache(spec, 16), make_backend("torch", "cpu", FLASH_BLOCK))
    want = runner_scenario(cpu_runner)
    got = runner_scenario(cuda_runner(llama_dir, "float32", "torch"))
    for (kind, a), (_, b) in zip(got, want):
        assert a.is_cuda
        assert (a.cpu() - b).abs().max().item() < 1e-4, kind


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_flash_runner_matches_torch_runner_in_the_same_dtype(llama_dir, dtype):
    """Every step kind through the model, flash against the torch backend in the same (half) dtype, both
    against the float32 torch run. Measured on the CPU with two different exact-math attention paths in
    bf16, the runs differ by at most 1 % of the logit scale and agree on > 99 % of argmaxes; flash also
    rounds its softmax probabilities to the half dtype, so the bounds here leave room for that."""
    needs_flash()
    check_runner_against_torch(llama_dir, dtype, "flash")


@pytest.mark.parametrize("family", ["mistral_swa", "qwen2_swa"])
def test_flash_runner_with_sliding_window_matches_torch_runner(checkpoint_dir, family):
    """The same on checkpoints whose layers slide (window 8: Mistral on every layer, Qwen2 on layer 1),
    the draft step's block-aligned view included."""
    needs_flash()
    check_runner_against_torch(checkpoint_dir(family), "bfloat16", "flash")


@pytest.mark.parametrize("directory_of", ["llama_gqa", "mistral_swa", "qwen2_swa"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_triton_runner_matches_torch_runner(checkpoint_dir, directory_of, dtype):
    check_runner_against_torch(checkpoint_dir(directory_of), dtype, "triton")


def check_runner_against_torch(directory: str, dtype: str, backend: str) -> None:
    ref = runner_scenario(cuda_runner(directory, "float32", "torch"))
    same = runner_scenario(cuda_runner(directory, dtype, "torch"))
    got = runner_scenario(cuda_runner(directory, dtype, backend))
    rel_tol = 0.05 if dtype == "bfloat16" else 0.01
    for (kind, r), (_, t), (_, f) in zip(ref, same, got):
        scale = r.abs().max().item()
        assert (f - t).abs().max().item() <= rel_tol * scale, kind
        # no less accurate than the oracle in the same dtype (mean error is dominated by weight rounding)
        err_f, err_t = (f - r).abs().mean().item(), (t - r).abs().mean().item()
        assert err_f <= 1.5 * err_t + 1e-3 * scale, f"{kind}: {backend} {err_f} vs torch {err_t}"
        # picks the float32 oracle's token about as often as the torch backend does in the same dtype (3 % of the
        # positions, at least one, either way): on the tiny random checkpoints many top logits nearly tie, and
        # rounding in the dtype decides such a tie either way
        rows = r.shape[0]
        agree_f = (f.argmax(-1) == r.argmax(-1)).sum().item()
        agree_t = (t.argmax(-1) == r.argmax(-1)).sum().item()
        assert agree_f >= agree_t - max(1, 0.03 * rows), (
            f"{kind}: {backend} picks the float32 token at {agree_f} of {rows} positions, torch at {agree_t}")


# -- 2. speculative decoding on CUDA: greedy output equals autoregressive output ------------------------
# (run_worker: tests/test_decode_worker.py's loop, a prompt joining every few steps when asked)

def cuda_worker(directory, dtype="float32", backend="torch", block_size=16, kv_tokens=16384, profile=False,
                **spec) -> DecodeWorker:
    spec.setdefault("sink_tokens", 4)
    spec.setdefault("budget", 64)
    cfg = DecodeWorkerConfig(dtype=dtype, device=CUDA, block_size=block_size, kv_cache_tokens=kv_tokens,
                             attention_backend=backend, profile_on_start=profile,
                             speculation=SpeculationConfig(**spec))
    return DecodeWorker(directory, cfg)


def cuda_engine(directory, dtype="float32", backend="torch", block_size=16, **kw) -> ReferenceEngine:
    cfg = EngineConfig(dtype=dtype, device=CUDA, block_size=block_size, attention_backend=backend,
                       kv_cache_tokens=kw.pop("kv_cache_tokens", 16384), **kw)
    return ReferenceEngine(directory, cfg)


SPEC_PROMPTS = [3, 30, 130, 400, 90]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("k_policy,k", [("fixed", 1), ("fixed", 4), ("adaptive", 3)])
def test_greedy_self_speculation_on_cuda_is_lossless(llama_dir, k_policy, k, backend):
    prompts = prompts_of(SPEC_PROMPTS, seed=k)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    expected = [c.token_ids for c in cuda_engine(llama_dir, backend=backend).generate(prompts, params)]
    worker = cuda_worker(llama_dir, backend=backend, drafter="self_sparse", k_policy=k_policy, k=k, max_k=4,
                         budget=32)
    assert worker.runner.backend.name == backend
    if k_policy == "adaptive":
        worker.profile(batches=(1, 4), contexts=(64, 512), ks=(0, 2))
    assert worker.cache.kv.is_cuda
    assert run_worker(worker, prompts, params, join_every=2 if k_policy == "adaptive" else 0) == expected
    assert worker.pool.num_free == worker.pool.num_blocks
    assert worker.metrics.draft_tokens > 0 or k_policy == "adaptive"


@pytest.mark.parametrize("family", ["mistral_swa", "qwen2_swa"])
def test_greedy_self_speculation_on_cuda_is_lossless_with_sliding_window(checkpoint_dir, family):
    """float32 torch backend on CUDA, layers with window 8 and prompts far longer: the draft's sink + recent
    view (sink 2, 4 recent tokens) intersected with each layer's window; tokens equal the engine's."""
    directory = checkpoint_dir(family)
    prompts = prompts_of([40, 90, 300], seed=12)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    expected = [c.token_ids for c in cuda_engine(directory, token_budget=7).generate(prompts, params)]
    worker = cuda_worker(directory, drafter="self_sparse", k_policy="fixed", k=3, budget=6, sink_tokens=2)
    assert run_worker(worker, prompts, params) == expected
    assert worker.metrics.draft_tokens > 0
    assert worker.pool.num_free == worker.pool.num_blocks


def test_greedy_draft_model_speculation_on_cuda_is_lossless(checkpoint_dir):
    target, draft = checkpoint_dir("llama_gqa"), checkpoint_dir("llama_tied")
    prompts = prompts_of([9, 100, 250], seed=5)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    expected = [c.token_ids for c in cuda_engine(target).generate(prompts, params)]
    worker = cuda_worker(target, drafter="draft_model", draft_model=draft, k_policy="fixed", k=3, budget=48)
    assert worker.drafter.runner.cache.kv.is_cuda
    assert run_worker(worker, prompts, params) == expected
    assert worker.metrics.draft_tokens > 0
    assert worker.pool.num_free == worker.pool.num_blocks
    assert worker.drafter.pool.num_free == worker.drafter.pool.num_blocks


def _flash_speculation_agreement(directory: str) -> None:
    """bf16 + flash self-speculation (16 sink tokens as shipped, window 496) over long prompts against
    plain flash decoding: the tokens agree almost everywhere, the draft ran, and memory is returned."""
    needs_flash()
    prompts = prompts_of([600, 700, 300, 650], seed=8)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    plain = cuda_worker(directory, "bfloat16", "flash", FLASH_BLOCK, drafter="none")
    expected = run_worker(plain, prompts, params)
    worker = cuda_worker(directory, "bfloat16", "flash", FLASH_BLOCK, drafter="self_sparse", k_policy="fixed",
                         k=3, budget=512, sink_tokens=16)
    got = run_worker(worker, prompts, params)
    assert agreement(got, expected) >= 0.75, (got, expected)
    assert worker.metrics.draft_tokens > 0
    assert worker.pool.num_free == worker.pool.num_blocks


def test_flash_self_speculation_agrees_with_flash_decoding(llama_dir):
    """bf16 + flash, a sparse view over long prompts.
    Exact identity is not guaranteed in bf16: a verification pass computes k + 1 positions per sequence
    where plain decoding computes one, so its matrix products have other shapes and may round differently,
    and a near-tie argmax can flip (a numerical difference, not a logical one; the float32 tests above
    demand identity). The tokens must agree almost everywhere and memory must be returned."""
    _flash_speculation_agreement(llama_dir)


def test_flash_self_speculation_with_sliding_window_agrees_with_flash_decoding(checkpoint_dir):
    """The same on a Mistral with window 8 (every layer): the layer window lies inside the view, so the
    draft passes run on flash with window_size (7, 0) over the view's virtual table or, for unaligned
    views, through the torch gather."""
    _flash_speculation_agreement(checkpoint_dir("mistral_swa"))


@pytest.mark.parametrize("dtype,backend,block_size", [("float32", "torch", 16), ("bfloat16", "flash", FLASH_BLOCK),
                                                     ("bfloat16", "triton", 16)])
def test_decode_worker_profiles_on_start_on_cuda(llama_dir, dtype, backend, block_size):
    """The start-up profile (target passes and self-sparse draft passes of the shipped speculation
    settings) runs on CUDA and seeds both cost models; the pool is whole afterwards."""
    if backend == "flash":
        needs_flash()
    worker = cuda_worker(llama_dir, dtype, backend, block_size, kv_tokens=65536, profile=True,
                         drafter="self_sparse", k_policy="adaptive", budget=256, sink_tokens=16)
    assert worker.runner.backend.name == backend
    assert worker.speculator.target_cost.ready and worker.speculator.draft_cost.ready, worker.status()
    assert worker.pool.num_free == worker.pool.num_blocks


def test_seeded_sampled_speculation_on_cuda_is_reproducible(llama_dir):
    """Sampling draws from each request's generator: on CUDA the same seed must give the same tokens, the
    run must finish and free its memory (rejection sampling on CUDA probabilities)."""
    prompts = prompts_of([20, 150, 60], seed=3)
    params = [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=10 + i, ignore_eos=True)
              for i in range(len(prompts))]
    runs = []
    for _ in range(2):
        worker = cuda_worker(llama_dir, drafter="self_sparse", k_policy="fixed", k=2, budget=32)
        runs.append(run_worker(worker, prompts, params))
        assert worker.pool.num_free == worker.pool.num_blocks
    assert runs[0] == runs[1]
    assert [len(o) for o in runs[0]] == [24] * len(prompts)


# -- 3. the reference engine on CUDA end to end ---------------------------------------------------------

ENGINE_PROMPTS = [3, 17, 64, 150, 333]


def test_engine_on_cuda_matches_cpu_and_frees_every_block(llama_dir):
    """float32 torch backend: continuous batching with chunked prefill on CUDA gives the CPU engine's
    greedy tokens; the pool is whole at the end."""
    prompts = prompts_of(ENGINE_PROMPTS, seed=7)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    cpu = ReferenceEngine(llama_dir, EngineConfig(kv_cache_tokens=16384, token_budget=64, attention_backend="torch"))
    expected = [c.token_ids for c in cpu.generate(prompts, params)]
    engine = cuda_engine(llama_dir, token_budget=64)
    assert engine.cache.kv.is_cuda
    assert [c.token_ids for c in engine.generate(prompts, params)] == expected
    assert engine.pool.num_free == engine.pool.num_blocks
    assert not engine.has_unfinished()


def test_flash_engine_on_cuda_runs_end_to_end(llama_dir):
    """bf16 + flash, chunked prefill (chunks at nonzero offsets): the engine finishes every request, frees
    every block, and agrees with the torch backend in bf16 on almost every token (the two round attention
    differently, so a near-tie argmax may flip and the rest of that output with it)."""
    needs_flash()
    prompts = prompts_of(ENGINE_PROMPTS, seed=7)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = cuda_engine(llama_dir, "bfloat16", "torch", FLASH_BLOCK, token_budget=64)
    expected = [c.token_ids for c in ref.generate(prompts, params)]
    engine = cuda_engine(llama_dir, "bfloat16", "flash", FLASH_BLOCK, token_budget=64)
    assert engine.runner.backend.name == "flash"
    got = [c.token_ids for c in engine.generate(prompts, params)]
    assert [len(o) for o in got] == [24] * len(prompts)
    assert agreement(got, expected) >= 0.75, (got, expected)
    assert engine.pool.num_free == engine.pool.num_blocks


def test_triton_engine_on_cuda_runs_end_to_end(llama_dir):
    """bf16 + Triton with chunked prefill: every request finishes, every block is freed, and the tokens agree
    with the torch backend in bf16 almost everywhere; 'auto' picks Triton where flash-attn is absent."""
    prompts = prompts_of(ENGINE_PROMPTS, seed=7)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = [c.token_ids for c in cuda_engine(llama_dir, "bfloat16", "torch", token_budget=64).generate(prompts, params)]
    engine = cuda_engine(llama_dir, "bfloat16", "triton", token_budget=64)
    got = [c.token_ids for c in engine.generate(prompts, params)]
    assert [len(o) for o in got] == [24] * len(prompts)
    assert agreement(got, expected) >= 0.75, (got, expected)
    assert engine.pool.num_free == engine.pool.num_blocks
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        assert make_backend("auto", CUDA, 16, torch.bfloat16).name == "triton"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_steps_equal_eager_triton_steps(llama_dir, dtype):
    """compile_steps on CUDA: decode steps captured per batch bucket and replayed give the eager Triton engine's
    greedy and seeded tokens; a speculating decode worker (draft and verification steps captured too) gives
    its own plain decoding's tokens; every block is freed. The attention rows are the eager ones bit for bit
    (``test_triton_rows_are_alike_whatever_the_batch_and_split_count``), but a replayed step's matrix
    products run on the bucket's padded row count, for which cuBLAS may choose another bf16 kernel: bf16
    tokens are held to the file's agreement bound, float32 ones to identity."""
    prompts = prompts_of([5, 40, 300, 23, 90], seed=4)
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, top_p=0.9, seed=3)
    eager = cuda_engine(llama_dir, dtype, "triton", token_budget=64)
    graphs = cuda_engine(llama_dir, dtype, "triton", token_budget=64, compile_steps=True)
    assert type(graphs.runner.compiled).__name__ == "GraphSteps"
    for params in (greedy, seeded):
        want = [c.token_ids for c in eager.generate(prompts, params)]
        got = [c.token_ids for c in graphs.generate(prompts, params)]
        assert got == want if dtype == "float32" else agreement(got, want) >= 0.75, (got, want)
    steps = graphs.runner.compiled
    assert steps.failed is None and steps.steps > 0 and all(g.graph is not None for g in steps.graphs.values())
    assert graphs.pool.num_free == graphs.pool.num_blocks
    plain = cuda_worker(llama_dir, dtype, "triton", drafter="none")
    want = run_worker(plain, prompts, greedy)
    cfg = DecodeWorkerConfig(dtype=dtype, device=CUDA, block_size=16, kv_cache_tokens=16384, attention_backend="triton",
                             profile_on_start=False, compile_steps=True,
                             speculation=SpeculationConfig(drafter="self_sparse", k_policy="fixed", k=3, budget=64,
                                                           sink_tokens=4))
    worker = DecodeWorker(llama_dir, cfg)
    got = run_worker(worker, prompts, greedy)
    assert agreement(got, want) >= (1.0 if dtype == "float32" else 0.75), (got, want)
    assert worker.runner.compiled.failed is None and worker.metrics.draft_tokens > 0
    assert worker.pool.num_free == worker.pool.num_blocks


def test_auto_backend_runs_float32_on_cuda(llama_dir):
    """'auto' with a flash-sized block must pick a backend that runs the model's dtype: flash-attn has no
    float32 kernels, so a float32 engine must still run (and match the torch backend)."""
    needs_flash()
    prompts = prompts_of([40, 300], seed=1)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = [c.token_ids for c in cuda_engine(llama_dir, block_size=FLASH_BLOCK).generate(prompts, params)]
    engine = cuda_engine(llama_dir, "float32", "auto", FLASH_BLOCK)
    assert [c.token_ids for c in engine.generate(prompts, params)] == expected


def test_seeded_sampling_engine_on_cuda_is_reproducible(llama_dir):
    prompts = prompts_of([10, 90], seed=2)
    params = SamplingParams(max_tokens=16, temperature=0.8, top_k=50, seed=5, ignore_eos=True)
    runs = [[c.token_ids for c in cuda_engine(llama_dir).generate(prompts, params)] for _ in range(2)]
    assert runs[0] == runs[1]
    assert [len(o) for o in runs[0]] == [16, 16]


def test_sampling_surface_on_cuda_matches_cpu(llama_dir):
    """Penalties, bias, min_tokens on CUDA give the CPU engine's greedy tokens; log-probabilities of prompt
    and output agree within 1e-3; n sequences fork on CUDA blocks (the partly filled block copied there) and
    sequence i is the single request seeded seed + i; the speculating decode worker on CUDA is token-identical
    to plain decoding under the same penalties, and every block comes back."""
    prompts = prompts_of([37, 90], seed=3)
    greedy = SamplingParams(max_tokens=20, ignore_eos=True, presence_penalty=0.6, frequency_penalty=0.3,
                            repetition_penalty=1.3, logit_bias={5: 3.0}, min_tokens=4, logprobs=3, prompt_logprobs=2)
    cpu = ReferenceEngine(llama_dir, EngineConfig(kv_cache_tokens=16384, token_budget=64, attention_backend="torch"))
    expected = cpu.generate(prompts, greedy)
    engine = cuda_engine(llama_dir, token_budget=64)
    got = engine.generate(prompts, greedy)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for c, e in zip(got, expected):
        assert max(abs(a.logprob - b.logprob) for a, b in zip(c.logprobs, e.logprobs)) < 1e-3
        assert max(abs(a.logprob - b.logprob) for a, b in zip(c.prompt_logprobs[1:], e.prompt_logprobs[1:])) < 1e-3
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=9, n=3, ignore_eos=True, min_p=0.05)
    forked = engine.generate(prompts[:1], seeded)[0].sequences
    singles = [engine.generate(prompts[:1], dataclasses.replace(seeded, n=1, seed=9 + i))[0].token_ids
               for i in range(3)]
    assert [s.token_ids for s in forked] == singles
    assert engine.pool.num_free == engine.pool.num_blocks
    worker = cuda_worker(llama_dir, drafter="self_sparse", k_policy="fixed", k=3, budget=48)
    plain_params = dataclasses.replace(greedy, logprobs=None, prompt_logprobs=None)
    assert run_worker(worker, prompts, plain_params) == [c.token_ids for c in expected]
    assert worker.metrics.accepted_tokens > 0
    assert worker.pool.num_free == worker.pool.num_blocks


# -- 4. KV transfer: NCCL between two GPUs; gloo (staged through host memory) on one GPU or to a CPU cache -----

LAYERS, HEADS, HEAD_DIM = 2, 2, 16  # the llama_gqa checkpoint's KV layout


def mixed_device_proc(role, device, rdv, backend):
    """One end of a pair whose caches sit on different device types; returns how connecting ended."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    fp = KVFingerprint("llama", 64, VOCAB, LAYERS, HEADS, HEAD_DIM, 16, "float32")
    cache = PagedKVCache(KVCacheSpec(LAYERS, HEADS, HEAD_DIM, 16, torch.float32), 8, device)
    cfg = TransferConfig(backend=backend, timeout_s=5, connect_timeout_s=20)
    t0 = time.monotonic()
    try:
        if role == "prefill":
            KVSender(cache, "p", fp, HeadRange(0, HEADS), cfg).connect("d", rdv)
        else:
            KVReceiver(cache, PoolReserver(BlockPool(8, 16)), "d", fp, HeadRange(0, HEADS), cfg).connect("p", rdv)
    except TransferError as err:
        return {"error": str(err), "retryable": err.retryable, "elapsed": time.monotonic() - t0}
    return {"error": None, "elapsed": time.monotonic() - t0}


@pytest.mark.parametrize("cuda_side", ["prefill", "decode"])
def test_kv_pair_between_cuda_and_cpu_caches_needs_gloo(cuda_side):
    """A pair with a CUDA cache on one end and a CPU cache on the other forms over gloo with ``backend: auto``
    (the CUDA end stages its regions through host memory); with ``backend: nccl`` on the CUDA end it is refused
    there (not retryable: the placement is wrong), and the CPU end fails promptly instead of waiting."""
    devices = {"prefill": "cpu", "decode": "cpu", cuda_side: "cuda:0"}
    for backend, refused in (("auto", False), ("nccl", True)):
        store, rdv = Rendezvous.host_store()
        out = run_procs({role: (mixed_device_proc, dict(role=role, device=devices[role], rdv=rdv,
                                                        backend=backend if role == cuda_side else "auto"))
                         for role in ("prefill", "decode")}, timeout_s=90)
        del store
        cuda_end = out[cuda_side]
        cpu_end = out["decode" if cuda_side == "prefill" else "prefill"]
        if not refused:
            assert cuda_end["error"] is None and cpu_end["error"] is None, out
            continue
        assert cuda_end["error"] and "nccl" in cuda_end["error"] and cuda_end["retryable"] is False, cuda_end
        assert cpu_end["error"] is not None and cpu_end["elapsed"] < 20 + 10, cpu_end


NCCL_BLOCK, NCCL_BLOCKS, NCCL_HEADS = 16, 24, 4
NCCL_FP = KVFingerprint("llama", 64, VOCAB, 3, NCCL_HEADS, 32, NCCL_BLOCK, "bfloat16")
# request -> (num_tokens, sender block ids): scattered blocks take the staged (gather / scatter) path
NCCL_REQUESTS = {"r-short": (5, [7]), "r-long": (70, [10, 11, 12, 13, 14]), "r-scattered": (40, [20, 2, 17])}


def nccl_reference_cache() -> torch.Tensor:
    g = torch.Generator().manual_seed(99)
    return torch.randn(3, 2, NCCL_BLOCKS, NCCL_BLOCK, NCCL_HEADS, 32, generator=g).to(torch.bfloat16)


def nccl_cache(device: str, fill: bool) -> PagedKVCache:
    cache = PagedKVCache(KVCacheSpec(3, NCCL_HEADS, 32, NCCL_BLOCK, torch.bfloat16), NCCL_BLOCKS, device)
    if fill:
        cache.kv.copy_(nccl_reference_cache())
    return cache


def nccl_sender_proc(rdv, dst_blocks_q, finished, device, backend):
    torch.cuda.set_device(torch.device(device))
    sender = KVSender(nccl_cache(device, fill=True), "p0", NCCL_FP, HeadRange(0, NCCL_HEADS),
                      TransferConfig(backend=backend, timeout_s=30))
    sender.connect("d0", rdv)
    for _ in NCCL_REQUESTS:  # the receiver has reserved for every request
        dst_blocks_q.get(timeout=60)
    for rid, (n, src_blocks) in NCCL_REQUESTS.items():
        sender.begin(rid, n, src_blocks, [LegTarget("d0", HeadRange(0, NCCL_HEADS), reserved=True)])
        sender.finish_prompt(rid, 7, b"\x01")
    done, failed, deadline = [], [], time.monotonic() + 60
    while len(done) + len(failed) < len(NCCL_REQUESTS) and time.monotonic() < deadline:
        ev = sender.poll()
        group = sender.open_group({rid: len(b) for rid, (_, b) in NCCL_REQUESTS.items()})
        for layer in range(3):
            group.send_layer(layer)
        group.close()
        done += ev.done
        failed += [str(f.error) for f in ev.failed]
        time.sleep(0.002)
    finished.wait(timeout=60)  # both stay up until both are done (acknowledgements in flight)
    return {"done": sorted(done), "failed": failed}


def nccl_receiver_proc(rdv, dst_blocks_q, finished, device, backend):
    torch.cuda.set_device(torch.device(device))
    cache = nccl_cache(device, fill=False)
    pool = BlockPool(NCCL_BLOCKS, NCCL_BLOCK)
    pool.allocate(3)  # fragment the pool: reservations differ from the sender's block ids
    receiver = KVReceiver(cache, PoolReserver(pool), "d0", NCCL_FP, HeadRange(0, NCCL_HEADS),
                          TransferConfig(backend=backend, timeout_s=30))
    receiver.connect("p0", rdv)
    for rid, (n, _) in NCCL_REQUESTS.items():
        dst_blocks_q.put((rid, receiver.reserve(rid, n)))
    completed, failed, deadline = {}, [], time.monotonic() + 60
    while len(completed) + len(failed) < len(NCCL_REQUESTS) and time.monotonic() < deadline:
        ev = receiver.poll()
        failed += [str(f.error) for f in ev.failed]
        for kv in ev.completed:
            completed[kv.request_id] = kv
        time.sleep(0.002)
    finished.wait(timeout=60)
    ref = nccl_reference_cache()
    exact = {}
    for rid, kv in completed.items():
        src = NCCL_REQUESTS[rid][1]
        got = cache.kv[:, :, list(kv.block_ids[: len(src)])].cpu()
        exact[rid] = torch.equal(got.view(torch.int16), ref[:, :, src].view(torch.int16))
    return {"exact": exact, "failed": failed, "first_tokens": {rid: kv.first_token for rid, kv in completed.items()},
            "data_on": str(receiver._channels["p0"].device)}


def _transfer_cuda_caches(sender_device: str, receiver_device: str, backend: str) -> dict:
    store, rdv = Rendezvous.host_store()
    ctx = context()
    args = dict(rdv=rdv, dst_blocks_q=ctx.Queue(), finished=ctx.Barrier(2), backend=backend)
    out = run_procs({"p0": (nccl_sender_proc, dict(args, device=sender_device)),
                     "d0": (nccl_receiver_proc, dict(args, device=receiver_device))}, timeout_s=180)
    del store
    assert out["p0"] == {"done": sorted(NCCL_REQUESTS), "failed": []}
    assert out["d0"]["failed"] == []
    assert out["d0"]["exact"] == {rid: True for rid in NCCL_REQUESTS}
    assert out["d0"]["first_tokens"] == {rid: 7 for rid in NCCL_REQUESTS}
    return out


@two_gpus
def test_kv_transfer_over_nccl_is_byte_exact():
    """A bf16 cache on cuda:0 sends three prompts (contiguous and scattered blocks) to a cache on cuda:1
    over NCCL; the receiver's reserved blocks hold exactly the sender's bytes."""
    out = _transfer_cuda_caches("cuda:0", "cuda:1", "auto")
    assert out["d0"]["data_on"].startswith("cuda")  # the data path was NCCL, not gloo


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kv_transfer_over_gloo_between_cuda_caches_is_byte_exact():
    """``kv_transfer.backend: gloo``: two processes whose bf16 caches share one GPU (where NCCL cannot pair
    them) move the same prompts over gloo, each region staged through host memory; byte-exact."""
    out = _transfer_cuda_caches("cuda:0", "cuda:0", "gloo")
    assert out["d0"]["data_on"] == "cpu"  # the data path was gloo


DISAGG_PROMPTS = prompts_of([5, 40, 300, 90], seed=13)
DISAGG_MAX_TOKENS = 16


def disagg_prefill_proc(path, rdv, handoff, firsts_q, finished):
    """A prefill worker on cuda:0 streaming each prompt's KV layer by layer to the decode worker."""
    from prefill_worker.config import PrefillWorkerConfig
    from prefill_worker.messages import KVDestination, PrefillRequest
    from prefill_worker.worker import PrefillWorker

    torch.cuda.set_device(0)
    worker = PrefillWorker(path, PrefillWorkerConfig(dtype="float32", device="cuda:0", block_size=16,
                                                     kv_cache_tokens=8192, token_budget=64, attention_backend="torch",
                                                     transfer=TransferConfig(timeout_s=30)), "prefill-0")
    worker.connect("decode-0", rdv)
    for _ in DISAGG_PROMPTS:
        rid, prompt, params, reserved = handoff.get(timeout=60)
        worker.add_request(PrefillRequest(rid, prompt, params, KVDestination("decode-0", reserved=reserved)))
    transferred, failed, deadline = set(), [], time.monotonic() + 90
    while len(transferred) + len(failed) < len(DISAGG_PROMPTS) and time.monotonic() < deadline:
        out = worker.step()
        failed += [f.reason for f in out.failed]
        for ft in out.first_tokens:
            firsts_q.put((ft.request_id, ft.token_id))
        transferred.update(out.transferred)
        if out.empty:
            time.sleep(0.002)
    finished.wait(timeout=60)
    return {"failed": failed, "blocks_free": worker.pool.num_free == worker.pool.num_blocks}


def disagg_decode_proc(path, rdv, handoff, firsts_q, finished):
    """A decode worker on cuda:1 (greedy self-speculation) receiving the prompts' KV from prefill."""
    from decode_worker.messages import DecodeRequest

    torch.cuda.set_device(1)
    cfg = DecodeWorkerConfig(dtype="float32", device="cuda:1", block_size=16, kv_cache_tokens=8192,
                             attention_backend="torch", profile_on_start=False,
                             speculation=SpeculationConfig(drafter="self_sparse", k_policy="fixed", k=2, budget=64,
                                                           sink_tokens=4))
    worker = DecodeWorker(path, cfg, "decode-0", TransferConfig(timeout_s=30))
    worker.connect("prefill-0", rdv)
    params = SamplingParams(max_tokens=DISAGG_MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(DISAGG_PROMPTS):
        reserved = worker.add_remote(DecodeRequest(f"r{i}", tuple(prompt), params))
        handoff.put((f"r{i}", tuple(prompt), params, reserved))
    outs, failures, finished_ids, deadline = {}, [], set(), time.monotonic() + 120
    while len(finished_ids) + len(failures) < len(DISAGG_PROMPTS) and time.monotonic() < deadline:
        for d in worker.step():
            if not hasattr(d, "token_ids"):
                failures.append(str(d))
                continue
            outs.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finished:
                finished_ids.add(d.request_id)
    finished.wait(timeout=60)
    return {"tokens": outs, "failures": failures, "blocks_free": worker.pool.num_free == worker.pool.num_blocks}


@two_gpus
def test_disaggregated_prefill_to_speculative_decode_over_nccl_matches_the_engine(llama_dir):
    """Prefill worker on cuda:0, decode worker on cuda:1 (KV over NCCL, layer-wise), greedy tokens equal
    the engine's on CUDA; both pools are whole at the end."""
    params = SamplingParams(max_tokens=DISAGG_MAX_TOKENS, ignore_eos=True)
    expected = [c.token_ids for c in cuda_engine(llama_dir).generate(DISAGG_PROMPTS, params)]
    store, rdv = Rendezvous.host_store()
    ctx = context()
    args = dict(path=llama_dir, rdv=rdv, handoff=ctx.Queue(), firsts_q=ctx.Queue(), finished=ctx.Barrier(2))
    out = run_procs({"p": (disagg_prefill_proc, args), "d": (disagg_decode_proc, args)}, timeout_s=300)
    del store
    assert out["p"]["failed"] == [] and out["d"]["failures"] == []
    firsts = dict(args["firsts_q"].get(timeout=10) for _ in DISAGG_PROMPTS)
    got = [[firsts[f"r{i}"]] + out["d"]["tokens"][f"r{i}"] for i in range(len(DISAGG_PROMPTS))]
    assert got == expected
    assert out["p"]["blocks_free"] and out["d"]["blocks_free"]
