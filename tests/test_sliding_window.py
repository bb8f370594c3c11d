"""Sliding-window attention, computed as transformers 5.24 does: a query at position p of a layer with
window W sees keys p - W + 1 .. p.

Tiny random checkpoints (tests/checkpoints.py): ``mistral_swa`` (window 8 on both layers) and ``qwen2_swa``
(use_sliding_window, max_window_layers 1: layer 0 full, layer 1 window 8), with prompts of 40-100 tokens,
far past the window. Checked: config parsing and refusals, every CPU backend against the dense oracle,
the flash backend's window logic against an emulated flash-attn kernel, logits and greedy tokens against
transformers (chunked prefill, decode), and speculative decoding against autoregressive decoding.
"""

from __future__ import annotations

import random

import pytest
import torch

from decode_worker.config import DecodeWorkerConfig, SpeculationConfig
from decode_worker.worker import DecodeWorker
from modeling.attention import AttentionMetadata, TorchAttentionBackend, make_backend
from modeling.attention.torch_backend import dense_reference_attention
from modeling.block_pool import BlockTable
from modeling.checkpoint import load_model
from modeling.config import ModelConfig
from modeling.engine import EngineConfig, ReferenceEngine
from modeling.errors import CheckpointError
from modeling.runner import StepInput
from modeling.sampling import SamplingParams
from tests.test_decode_worker import run_worker
from tests.test_model_hf import hf_greedy, hf_model, make_runner, random_prompts

WINDOW = 8  # the window of the *_swa checkpoints
SWA_FAMILIES = ["mistral_swa", "qwen2_swa"]


def _cpu_backends() -> list[str]:
    from modeling.attention.cpu_kernel import cpu_kernel_available

    return ["torch", "cpu"] if cpu_kernel_available() else ["torch"]


CPU_BACKENDS = _cpu_backends()


# -- config.json: which layers slide, and what is refused --------------------------------------------------

def hf_dict(model_type: str, **fields) -> dict:
    raw = dict(model_type=model_type, vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2)
    raw.update(fields)
    return raw


@pytest.mark.parametrize("raw,windows", [
    (hf_dict("mistral"), (4096,) * 4),  # absent: MistralConfig's default 4096
    (hf_dict("mistral", sliding_window=None), None),
    (hf_dict("mistral", sliding_window=8, layer_types=["sliding_attention"] * 4), (8,) * 4),
    (hf_dict("qwen2", sliding_window=8), None),  # use_sliding_window defaults to false
    (hf_dict("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=2), (None, None, 8, 8)),
    (hf_dict("qwen2", use_sliding_window=True, sliding_window=8), None),  # max_window_layers defaults to 28
    (hf_dict("qwen2", use_sliding_window=True, sliding_window=None, max_window_layers=0), None),
    (hf_dict("qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=0,
             layer_types=["sliding_attention", "attention", "full_attention", "sliding_attention"]),
     (5, None, None, 5)),
    (hf_dict("llama", sliding_window=None, layer_types=["full_attention"] * 4), None),
])
def test_layer_windows_follow_transformers(raw, windows):
    config = ModelConfig.from_hf_dict(raw)
    assert config.layer_windows == windows
    assert [config.layer_window(i) for i in range(4)] == list(windows or (None,) * 4)


def test_layer_windows_agree_with_transformers_configs():
    """transformers' own Qwen2Config decides which layers slide; ours must agree."""
    from transformers import AutoConfig

    for mwl in (0, 2, 4):
        hf = AutoConfig.for_model("qwen2", num_hidden_layers=4, use_sliding_window=True, sliding_window=6,
                                  max_window_layers=mwl)
        ours = ModelConfig.from_hf_dict(hf_dict("qwen2", use_sliding_window=True, sliding_window=6,
                                                max_window_layers=mwl))
        want = [hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types]
        assert [ours.layer_window(i) for i in range(4)] == want


REFUSED = [
    (hf_dict("qwen2", use_sliding_window=True,
             layer_types=["full_attention", "chunked_attention", "full_attention", "full_attention"]),
     "layer_types[1]"),
    (hf_dict("qwen2", layer_types=["sliding_attention"] * 4), "layer_types"),  # no use_sliding_window
    (hf_dict("qwen2", layer_types=["full_attention"] * 3), "layer_types"),  # one per layer
    (hf_dict("mistral", sliding_window=8, layer_types=["full_attention", "sliding_attention"] * 2), "layer_types"),
    (hf_dict("llama", layer_types=["sliding_attention"] * 4), "layer_types"),
    (hf_dict("llama", sliding_window=4096), "sliding_window"),
    (hf_dict("mistral", sliding_window=0), "sliding_window"),
    (hf_dict("mistral", sliding_window="8"), "sliding_window"),
    (hf_dict("llama", attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (hf_dict("qwen2", final_logit_softcapping=30.0), "final_logit_softcapping"),
    (hf_dict("llama", attention_chunk_size=8192), "attention_chunk_size"),
    (hf_dict("llama", partial_rotary_factor=0.5), "partial_rotary_factor"),
    (hf_dict("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}),
     "rope_parameters.partial_rotary_factor"),
    (hf_dict("qwen2", rope_parameters={"full_attention": {"rope_type": "default"}}), "rope_parameters"),
    (hf_dict("mistral", rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling.rope_type"),
    (hf_dict("mistral", attention_bias=True), "attention_bias"),
    (hf_dict("qwen2", mlp_bias=True), "mlp_bias"),
]


@pytest.mark.parametrize("raw,field", REFUSED)
def test_unimplemented_fields_are_refused_naming_file_and_field(raw, field):
    path = "/models/x/config.json"
    with pytest.raises(CheckpointError) as err:
        ModelConfig.from_hf_dict(raw, file=path)
    assert err.value.file == path and err.value.field == field
    assert str(err.value).startswith(f"{path}: {field}: ")


def test_math_neutral_fields_are_accepted():
    config = ModelConfig.from_hf_dict(hf_dict("llama", pretraining_tp=4, attention_dropout=0.1,
                                              partial_rotary_factor=1.0, attn_logit_softcapping=None,
                                              use_sliding_window=True))
    assert config.layer_windows is None


# -- attention backends against the dense oracle ---------------------------------------------------------

def make_step(seq_lens, q_lens, sparse=False, dtype=torch.float32, hkv=2, g=4, d=64, bs=16, seed=0):
    """Random paged cache with fragmented tables; the step's new tokens are each sequence's last q_len."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n_blocks = [-(-n // bs) for n in seq_lens]
    ids = list(range(sum(n_blocks) + 3))
    rng.shuffle(ids)
    tables, at = [], 0
    for nb in n_blocks:
        tables.append(ids[at : at + nb])
        at += nb
    kc = torch.randn(len(ids), bs, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(len(ids), bs, hkv, d, generator=gen).to(dtype)
    qs = [0]
    for ql in q_lens:
        qs.append(qs[-1] + ql)
    q = (torch.randn(qs[-1], hkv * g, d, generator=gen) * 1.5).to(dtype)
    slots = [tables[b][p // bs] * bs + p % bs
             for b, (n, ql) in enumerate(zip(seq_lens, q_lens)) for p in range(n - ql, n)]
    starts = [max(0, n - ql - rng.randint(3, 40)) for n, ql in zip(seq_lens, q_lens)] if sparse else None
    meta = AttentionMetadata(query_start=qs, seq_lens=list(seq_lens), block_tables=tables,
                             slot_mapping=torch.tensor(slots, dtype=torch.int64), block_size=bs,
                             sink_len=4 if sparse else 0, window_starts=starts)
    flat_k, flat_v = kc.view(-1, hkv, d), vc.view(-1, hkv, d)
    return q, flat_k[meta.slot_mapping], flat_v[meta.slot_mapping], kc, vc, meta


def test_metadata_splits_the_prefix_at_the_window_edge():
    """4 new tokens at positions 96..99, window 10: position 90 (the last token's first key) on is seen by
    all of them, 87..89 by some (token p sees > p - 10), below 87 by none; a sparse view clips both."""
    meta = AttentionMetadata(query_start=[0, 4], seq_lens=[100], block_tables=[[0] * 7], slot_mapping=torch.zeros(4),
                             block_size=16)
    assert meta.shared_prefix_ranges(0, None) == [(0, 96)]
    assert meta.shared_prefix_ranges(0, 10) == [(90, 96)]
    assert meta.window_edge_ranges(0, 10) == [(87, 90)]
    assert meta.shared_prefix_ranges(0, 200) == [(0, 96)] and meta.window_edge_ranges(0, 200) == []
    meta.sink_len, meta.window_starts = 4, [89]
    assert meta.shared_prefix_ranges(0, 10) == [(90, 96)]
    assert meta.window_edge_ranges(0, 10) == [(89, 90)]
    assert meta.shared_prefix_ranges(0, 98) == [(2, 4), (89, 96)] and meta.window_edge_ranges(0, 98) == [(0, 2)]


# decode, verification (4, 6), prefill chunks shorter and longer than the window, a sequence from position 0
STEP = ([700, 333, 1000, 45, 1, 60, 9], [1, 4, 40, 6, 1, 60, 3])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("window", [1, 5, 16, 37, 4096])
def test_backends_match_dense_oracle_with_window(backend, sparse, window):
    q, k, v, kc, vc, meta = make_step(*STEP, sparse=sparse, seed=window)
    ref = dense_reference_attention(q, kc, vc, meta, window)
    be = TorchAttentionBackend(use_fused_cpu_kernel=False) if backend == "torch" else make_backend("cpu", "cpu", 16)
    out = be.forward(q, k, v, kc, vc, meta, window)
    assert (out - ref).abs().max().item() < 1e-5
    if window < 1000:  # the window really hides keys
        assert (ref - dense_reference_attention(q, kc, vc, meta)).abs().max().item() > 1e-2


def test_torch_backend_fused_path_with_window():
    q, k, v, kc, vc, meta = make_step(*STEP, seed=3)
    out = TorchAttentionBackend(use_fused_cpu_kernel=True).forward(q, k, v, kc, vc, meta, 7)
    assert (out - dense_reference_attention(q, kc, vc, meta, 7)).abs().max().item() < 1e-5


@pytest.mark.skipif("cpu" not in CPU_BACKENDS, reason="cpu attention kernel unavailable")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_verification_rows_equal_decode_steps_with_window(dtype):
    """Lossless speculation on the kernel: a verification row equals the decode step at its position bit
    for bit on one thread, also when the window edge moves between the rows."""
    from modeling.attention.cpu_kernel import paged_attention

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for window in (5, 37):
            q, _, _, kc, vc, meta = make_step([1500], [6], dtype=dtype, seed=window)
            verify = paged_attention(q, kc, vc, meta, sliding_window=window)
            for i in range(6):
                step = AttentionMetadata(query_start=[0, 1], seq_lens=[1495 + i], block_tables=meta.block_tables,
                                         slot_mapping=meta.slot_mapping[i : i + 1], block_size=16)
                decode = paged_attention(q[i : i + 1], kc, vc, step, sliding_window=window)
                assert torch.equal(decode[0], verify[i]), f"window {window} row {i}"
    finally:
        torch.set_num_threads(before)


def emulated_flash_varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                          window_size, block_table):
    """flash_attn_varlen_func's semantics on paged KV, in plain torch: queries aligned to the bottom right of
    each sequence's keys (read through ``block_table``); key j visible to query i iff
    j <= i + (n_k - n_q) and, with window_size[0] >= 0, j >= i + (n_k - n_q) - window_size[0]."""
    assert causal and window_size[1] in (0, -1)
    bs, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    k_flat, v_flat = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    out = torch.empty_like(q)
    for b in range(len(cu_seqlens_q) - 1):
        s, e = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        n_k, n_q = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b]), e - s
        slots = torch.tensor([int(block_table[b][j // bs]) * bs + j % bs for j in range(n_k)])
        i = torch.arange(n_q).unsqueeze(1) + (n_k - n_q)
        j = torch.arange(n_k).unsqueeze(0)
        visible = j <= i
        if window_size[0] >= 0:
            visible &= j >= i - window_size[0]
        o = torch.nn.functional.scaled_dot_product_attention(
            q[s:e].transpose(0, 1).unsqueeze(0), k_flat[slots].transpose(0, 1).unsqueeze(0),
            v_flat[slots].transpose(0, 1).unsqueeze(0), attn_mask=visible, enable_gqa=True)
        out[s:e] = o[0].transpose(0, 1)
    return out


# (seq_lens, q_lens, sink_len, block-aligned window starts, layer window, flash used for the step)
FLASH_CASES = [
    ([300, 200, 100], [1, 4, 40], 0, None, 24, True),  # full view: window_size (W - 1, 0)
    ([300, 200, 100], [1, 4, 40], 0, [160, 64, 32], 24, True),  # no sink: the virtual table keeps distances
    ([300, 200, 100], [1, 4, 6], 16, [256, 160, 48], 24, True),  # every row's window starts past the view's start
    ([300, 200, 20], [1, 4, 6], 16, [224, 128, 16], 64, True),  # first seq: window within view; last: full view
    ([30, 40], [1, 4], 16, [16, 32], 64, True),  # windows reach position 0: the whole view is visible
    ([300, 200], [1, 4], 16, [256, 176], 100, False),  # the window edge lies between sink and view: gathered
]


@pytest.mark.parametrize("case", FLASH_CASES)
def test_flash_backend_window_logic_with_emulated_kernel(case):
    """flash_backend's window handling (window_size, virtual tables of sparse views, the fallback) with the
    flash-attn kernel emulated by its documented semantics (tests/test_gpu.py runs the real one on CUDA)."""
    from modeling.attention.flash_backend import FlashAttentionBackend

    seq_lens, q_lens, sink, starts, window, uses_flash = case
    q, k, v, kc, vc, meta = make_step(seq_lens, q_lens, seed=1)
    meta.sink_len, meta.window_starts = sink, starts
    calls = []
    flash = FlashAttentionBackend.__new__(FlashAttentionBackend)  # no CUDA here: bypass the import check
    flash._varlen = lambda *a, **kw: calls.append(1) or emulated_flash_varlen(*a, **kw)
    flash._gather = TorchAttentionBackend()
    out = flash.forward(q, k, v, kc, vc, meta, window)
    assert (out - dense_reference_attention(q, kc, vc, meta, window)).abs().max().item() < 1e-5
    assert bool(calls) == uses_flash


# -- the model against transformers ---------------------------------------------------------------------

def test_transformers_honours_the_window(checkpoint_dir):
    """The oracle itself: transformers' eager and sdpa attention (sdpa is what the other tests load) agree,
    and their logits change once the prompt outgrows the window if the checkpoint's window is removed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = checkpoint_dir("mistral_swa")
    ids = torch.tensor(random_prompts([60], seed=2))
    no_window = AutoConfig.from_pretrained(directory)
    no_window.sliding_window = None
    with torch.no_grad():
        logits = {impl: AutoModelForCausalLM.from_pretrained(directory, attn_implementation=impl).eval()(ids).logits
                  for impl in ("eager", "sdpa")}
        full = AutoModelForCausalLM.from_pretrained(directory, config=no_window).eval()(ids).logits
    assert (logits["eager"] - logits["sdpa"]).abs().max().item() < 1e-4
    assert (logits["sdpa"][0, WINDOW:] - full[0, WINDOW:]).abs().max().item() > 0.1
    assert (logits["sdpa"][0, :WINDOW] - full[0, :WINDOW]).abs().max().item() < 1e-5


@pytest.mark.parametrize("family", SWA_FAMILIES)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_chunked_prefill_and_decode_logits_match_hf(checkpoint_dir, family, backend):
    """Prefill in chunks shorter and longer than the window (each over prior KV), then decode and a
    4-token verification-shaped pass: every logit row within 1e-4 of transformers' full forward."""
    directory = checkpoint_dir(family)
    tokens = random_prompts([100], seed=4)[0]
    with torch.no_grad():
        ref = hf_model(directory)(torch.tensor([tokens])).logits[0]
    runner, pool = make_runner(directory, backend=backend)
    table = BlockTable(16)
    table.ensure_capacity(pool, len(tokens))
    pos = 0
    for n in (5, 3, 13, 20, 1, 2, 30, 4, 1, 1, 1, 4, 15):  # sums to 100
        out = runner.run([StepInput(tokens[pos : pos + n], pos, table.blocks, num_logits=n)])
        assert (out - ref[pos : pos + n]).abs().max().item() < 1e-4, f"{n} tokens at {pos}"
        pos += n
    assert pos == len(tokens)


@pytest.mark.parametrize("family", SWA_FAMILIES)
def test_dense_forward_matches_hf(checkpoint_dir, family):
    directory = checkpoint_dir(family)
    ids = torch.tensor(random_prompts([70, 70], seed=5))
    with torch.no_grad():
        diff = (load_model(directory).model.forward_dense(ids) - hf_model(directory)(ids).logits).abs().max().item()
    assert diff < 1e-4


@pytest.mark.parametrize("family", SWA_FAMILIES)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_greedy_tokens_match_hf_generate(checkpoint_dir, family, backend):
    """Continuous batching with 6-token prefill chunks (shorter than the window), then decode."""
    directory = checkpoint_dir(family)
    prompts = random_prompts([40, 77, 100], seed=6)
    engine = ReferenceEngine(directory, EngineConfig(token_budget=6, kv_cache_tokens=4096, attention_backend=backend))
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    hf = hf_model(directory)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 24)


# -- speculative decoding: the draft's sparse view on windowed layers ------------------------------------

@pytest.mark.parametrize("family", SWA_FAMILIES)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("budget,sink", [(6, 2), (20, 4)])
def test_self_sparse_speculation_is_lossless_with_window(checkpoint_dir, family, backend, budget, sink):
    """Greedy self-speculation equals autoregressive decoding. Budget 6 (sink 2): the draft's recent window
    is shorter than the layer window, and the sink falls behind the layer window; budget 20: the layer
    window lies inside the view, so windowed layers draft exactly as the target computes."""
    directory = checkpoint_dir(family)
    prompts = random_prompts([40, 90, 61], seed=7)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    engine = ReferenceEngine(directory, EngineConfig(kv_cache_tokens=4096, attention_backend=backend))
    expected = [c.token_ids for c in engine.generate(prompts, params)]
    cfg = DecodeWorkerConfig(dtype="float32", kv_cache_tokens=4096, attention_backend=backend, profile_on_start=False,
                             speculation=SpeculationConfig(drafter="self_sparse", k_policy="fixed", k=3,
                                                           budget=budget, sink_tokens=sink))
    worker = DecodeWorker(directory, cfg)
    assert run_worker(worker, prompts, params) == expected
    assert worker.metrics.draft_tokens > 0
    assert worker.pool.num_free == worker.pool.num_blocks
    if family == "mistral_swa" and budget > WINDOW + sink:
        # every layer slides and the view covers the window: the draft is the target itself
        assert worker.metrics.accepted_tokens == worker.metrics.draft_tokens
