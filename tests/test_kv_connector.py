"""The KV connector seam (``modeling/kv_connector.py``): the model runner's layer hook, eager and compiled (each
hook method sees every layer once per pass, and the KV written is the run's without a hook), a connector other
than the prefill -> decode transfer plugged into the prefill worker, and the typed tensor-parallel actions."""

from __future__ import annotations

import json

import pytest
import torch

from modeling.checkpoint import load_model
from modeling.compiled_step import compiled_steps_supported
from modeling.errors import KVConnectorError
from modeling.kv_connector import BlockRelease, FinishedKV, KVConnector, StepKV
from modeling.runner import StepInput
from modeling.sampling import SamplingParams
from modeling.tp_group import TPError
from modeling.tp_runner import CopyBlocks, build_runner, decode_action, encode_action
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.messages import KVDestination, PrefillRequest
from prefill_worker.worker import PrefillWorker
from tests.test_model_hf import random_prompts

BLOCK = 4


def _cpu_kernel_reason() -> str | None:
    """Why the compiled half cannot run here (None: it can)."""
    from modeling.attention import cpu_kernel

    if not compiled_steps_supported("cpu", "cpu"):
        return "compiled steps unsupported with the cpu backend on CPU"
    if not cpu_kernel.cpu_kernel_available():
        return f"cpu attention kernel unavailable: {cpu_kernel.cpu_kernel_error()}"
    return None


def _identity_dtype() -> str:
    """bf16 where the CPU extension's skinny linear layers make compiled and eager rows alike (see
    test_compiled_step.py), else float32."""
    from modeling.cpu_linear import skinny_linear_available

    return "bfloat16" if skinny_linear_available() else "float32"


class RecordingHook:
    """A layer hook that records its calls and, at each ``save_kv_layer``, what the cache holds at the pass's
    slots for that layer and the next (written, and not yet written when the pass runs eagerly)."""

    def __init__(self, cache, slots: torch.Tensor):
        self.cache, self.slots = cache, slots
        self.loads: list[int] = []
        self.saves: list[int] = []
        self.next_written: list[bool] = []

    def wait_for_layer_load(self, layer: int) -> None:
        self.loads.append(layer)

    def save_kv_layer(self, layer: int) -> None:
        self.saves.append(layer)
        flat = self.cache.kv.flatten(2, 3)  # [L, 2, slots, H, D]
        assert flat[layer][:, self.slots].abs().sum() > 0  # this layer's KV of the pass is in the cache
        if layer + 1 < flat.shape[0]:
            self.next_written.append(bool(flat[layer + 1][:, self.slots].abs().sum() > 0))


def _slots(tables: list[list[int]], spans: list[tuple[int, int]], bs: int, device) -> torch.Tensor:
    return torch.tensor([t[p // bs] * bs + p % bs for t, (s, e) in zip(tables, spans) for p in range(s, e)],
                        device=device)


def _hooked_equals_plain(runner, prompts: list[list[int]], chunks: list[list[int]]) -> list[RecordingHook]:
    """Run the prompts chunk by chunk twice over the same runner, into two disjoint sets of blocks: with a
    recording hook and without. The hidden states and every block's KV are equal; returns the hooks."""
    bs = runner.block_size
    per_seq = -(-max(len(p) for p in prompts) // bs)
    hooked = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    plain = [[b + len(prompts) * per_seq for b in t] for t in hooked]
    hooks, start = [], [0] * len(prompts)
    for sizes in chunks:
        spans = [(s, s + n) for s, n in zip(start, sizes)]
        def inputs(tables):
            return [StepInput(p[s:e], s, t, num_logits=1) for p, (s, e), t in zip(prompts, spans, tables)]
        hook = RecordingHook(runner.cache, _slots(hooked, spans, bs, runner.device))
        got, rows = runner.forward(inputs(hooked), kv_hook=hook)
        want, _ = runner.forward(inputs(plain))
        assert torch.equal(got, want)
        hooks.append(hook)
        start = [e for _, e in spans]
    kv = runner.cache.kv
    for a, b in zip(hooked, plain):
        assert torch.equal(kv[:, :, a], kv[:, :, b])
    return hooks


def _check_compiled_hook(runner, layers: int, prompts: list[list[int]], chunks: list[list[int]]) -> None:
    hooks = _hooked_equals_plain(runner, prompts, chunks)  # prefill chunks of <= 16 tokens each
    assert runner.compiled.failed is None and runner.compiled.steps == 2 * len(hooks)  # all ran compiled
    for hook in hooks:
        assert hook.loads == hook.saves == list(range(layers))
        assert hook.next_written == [True] * (layers - 1)  # the whole pass was written first


def test_the_eager_hook_sees_each_layer_once_around_its_write(llama_dir):
    loaded = load_model(llama_dir, "float32", "cpu")
    layers = loaded.config.num_hidden_layers
    runner = build_runner(loaded, 64, BLOCK, "torch")
    prompts = random_prompts([21, 9], seed=5)
    hooks = _hooked_equals_plain(runner, prompts, [[13, 6], [8, 3]])
    for hook in hooks:
        assert hook.loads == hook.saves == list(range(layers))
        assert hook.next_written == [False] * (layers - 1)  # called before the next layer writes


def test_the_compiled_hook_sees_each_layer_once_after_the_pass(checkpoint_dir):
    reason = _cpu_kernel_reason()
    if reason is not None:
        pytest.skip(reason)
    loaded = load_model(checkpoint_dir("llama_gqa"), _identity_dtype(), "cpu")
    layers = loaded.config.num_hidden_layers
    runner = build_runner(loaded, 64, BLOCK, "cpu", compile_steps=True)
    _check_compiled_hook(runner, layers, random_prompts([21, 9], seed=6), [[13, 6], [8, 3]])


@pytest.mark.gpu
def test_the_cuda_graph_hook_sees_each_layer_once_after_the_pass(checkpoint_dir):
    """CUDA graphs (``GraphSteps``: chunks of equal length per sequence, replayed) call the hook after the pass."""
    loaded = load_model(checkpoint_dir("llama_gqa"), "float32", "cuda")
    runner = build_runner(loaded, 64, 16, "triton", compile_steps=True)
    assert type(runner.compiled).__name__ == "GraphSteps"
    _check_compiled_hook(runner, loaded.config.num_hidden_layers, random_prompts([24, 24], seed=8), [[16, 16], [8, 8]])


class MemoryStore(KVConnector):
    """A connector that keeps prompts' KV in memory (a stand-in for a host tier): ``save_kv_layer`` copies the
    layer's final blocks; a finished request's blocks may go at the next ``get_finished``."""

    def __init__(self):
        self.cache = None
        self.blocks: dict[str, list[int]] = {}
        self.saved: dict[str, dict[int, torch.Tensor]] = {}  # request -> layer -> [2, blocks, block_size, H, D]
        self.passes: list[list[int]] = []  # the layers saved in each pass
        self.ended: list[str] = []
        self.final: dict[str, torch.Tensor] = {}  # request -> its blocks' KV when it ended [L, 2, blocks, ...]
        self._step: StepKV | None = None

    def register_kv_cache(self, cache) -> None:
        self.cache = cache

    def update_state_after_alloc(self, request, blocks, num_external_tokens) -> None:
        if request.request_id == "refused":
            raise KVConnectorError("no room in the store", retryable=True)
        self.blocks[request.request_id] = list(blocks)

    def request_finished(self, request_id, hand_off=None) -> BlockRelease:
        self.ended.append(request_id)
        self.final[request_id] = self.cache.kv[:, :, self.blocks[request_id]].clone()
        return BlockRelease.WHEN_FINISHED

    def start_load_kv(self, step: StepKV) -> None:
        self._step = step
        self.passes.append([])

    def save_kv_layer(self, layer: int) -> None:
        self.passes[-1].append(layer)
        for rid, n in self._step.final_blocks.items():
            self.saved.setdefault(rid, {})[layer] = self.cache.kv[layer][:, self.blocks[rid][:n]].clone()

    def wait_for_save(self) -> None:
        self._step = None

    def get_finished(self) -> FinishedKV:
        done, self.ended = self.ended, []
        return FinishedKV(sent=done)


def _serve(worker: PrefillWorker, prompts: list[list[int]]) -> tuple[dict, list, list]:
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for i, p in enumerate(prompts):
        worker.add_request(PrefillRequest(f"r{i}", tuple(p), params, KVDestination("store")))
    worker.add_request(PrefillRequest("refused", tuple(prompts[0]), params, KVDestination("store")))
    firsts, transferred, failed = {}, [], []
    while worker.has_work():
        out = worker.step()
        firsts.update({ft.request_id: ft.token_id for ft in out.first_tokens})
        transferred += out.transferred
        failed += [(f.request_id, f.retryable) for f in out.failed]
    return firsts, sorted(transferred), failed


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_another_connector_plugs_into_the_prefill_worker(checkpoint_dir, compiled):
    """The prefill worker drives any KVConnector: it is told of each prompt after its blocks are allocated (one
    it refuses fails, retryable), saves every layer of every pass, ends each prompt, and its ``get_finished``
    frees the blocks. What it saved is the prompts' KV; with ``compile_steps`` the chunks run compiled."""
    if compiled and _cpu_kernel_reason() is not None:
        pytest.skip(_cpu_kernel_reason())
    directory = checkpoint_dir("llama_gqa")
    backend, dtype = ("cpu", _identity_dtype()) if compiled else ("torch", "float32")
    config = PrefillWorkerConfig(block_size=BLOCK, kv_cache_tokens=256, token_budget=12, attention_backend=backend,
                                 dtype=dtype, compile_steps=compiled, prefix_caching=False)
    store = MemoryStore()
    worker = PrefillWorker(directory, config, kv_connector=store)
    prompts = random_prompts([19, 7, 26], seed=7)
    firsts, transferred, failed = _serve(worker, prompts)
    assert failed == [("refused", True)]
    assert transferred == ["r0", "r1", "r2"] and worker.pool.num_free == worker.pool.num_blocks
    layers = worker.loaded.config.num_hidden_layers
    assert store.passes and all(p == list(range(layers)) for p in store.passes)
    assert worker.transfer.pending() == 0  # the built-in transfer was not used
    for i in range(len(prompts)):  # what was saved is each prompt's KV as the cache held it at its end
        for layer in range(layers):
            assert torch.equal(store.saved[f"r{i}"][layer], store.final[f"r{i}"][layer])
    if compiled:
        assert worker.runner.compiled.failed is None and worker.runner.compiled.steps == len(store.passes)
        eager = PrefillWorker(directory, PrefillWorkerConfig(**{**config.__dict__, "compile_steps": False}),
                              kv_connector=MemoryStore())
        assert _serve(eager, prompts)[0] == firsts


def test_tp_actions_travel_as_json_and_only_as_registered_types():
    action = CopyBlocks(((1, 2), (3, 4)))
    wire = json.loads(json.dumps(encode_action(action)))
    assert decode_action(wire, {"CopyBlocks": CopyBlocks}) == action
    with pytest.raises(TPError, match="no action 'CopyBlocks'"):
        decode_action(wire, {})
    with pytest.raises(TPError, match="malformed CopyBlocks"):
        decode_action({"action": "CopyBlocks", "fields": {"copies": [], "extra": 1}}, {"CopyBlocks": CopyBlocks})
    with pytest.raises(TypeError, match="dataclass instance"):
        encode_action({"name": "kv_begin"})
