"""Driving a tensor-parallel instance: rank 0 schedules and broadcasts each step, every rank runs it.

The driver (rank 0) is the whole worker (engine, prefill or decode worker) with a
:class:`TPDriverRunner` in place of its :class:`ModelRunner`: before each forward it broadcasts a compact
:class:`StepDescription` (token ids, positions, block tables and the sparse-view settings as int64),
then runs its own shard. Followers
(:class:`TPFollower`) hold only their shard of the model and of the KV cache; they loop receiving
descriptions and running the same forward, so the all-reduces inside it line up across ranks. Only the
driver computes logits and samples.

Between forwards the driver may have every follower run an *action* (``TPDriverRunner.call``): a small frozen
dataclass of plain values (strings, numbers, booleans, None, tuples and string-keyed dicts of them), e.g. a
KV-transfer instruction. It travels as JSON naming its class; a follower rebuilds it only as one of the
action types it registered (``TPFollower.on``) and runs that type's handler.

Wire format per step, over the group's control channel: ``int64 [op, n_numbers, n_side_bytes, 0]``,
then the numbers (int64), then the side payload (uint8 JSON) when there is one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import numpy as np
import torch

from modeling.attention import make_backend
from modeling.checkpoint import LoadedModel, load_model
from modeling.compiled_step import CompiledSteps, compiled_steps_supported
from modeling.cpu_linear import use_skinny_linear
from modeling.kv_cache import KVCacheSpec, PagedKVCache
from modeling.heads import shard_heads
from modeling.kv_connector import LayerHook
from modeling.runner import ModelRunner, StepInput
from modeling.step_graphs import GraphSteps
from modeling.tp import install_all_reduce
from modeling.tp_group import TPError, TPGroup

log = logging.getLogger(__name__)

OP_RUN, OP_STOP, OP_CALL = 1, 2, 3
_OPS = (OP_RUN, OP_STOP, OP_CALL)


@dataclass(frozen=True)
class CopyBlocks:
    """Action: copy whole KV blocks (source, destination) in the follower's cache."""

    copies: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class GatherKVBlocks:
    """Action: send this rank's heads of whole KV blocks to rank 0 (:class:`ShardedBlocks`'s read)."""

    blocks: tuple[int, ...]


@dataclass(frozen=True)
class ScatterKVBlocks:
    """Action: receive this rank's heads of whole KV blocks from rank 0 and write them (:class:`ShardedBlocks`'s
    write)."""

    blocks: tuple[int, ...]


def encode_action(action: Any) -> dict[str, Any]:
    """The JSON-able form of an action (a dataclass instance): its class name and its fields."""
    if not dataclasses.is_dataclass(action) or isinstance(action, type):
        raise TypeError(f"action: expected a dataclass instance, got {action!r}")
    fields = {f.name: getattr(action, f.name) for f in dataclasses.fields(action)}
    return {"action": type(action).__name__, "fields": fields}


def decode_action(side: dict[str, Any], types: dict[str, type]) -> Any:
    """The action ``side`` describes, rebuilt as one of ``types`` (class name -> class; JSON lists become
    tuples). Raises TPError for anything else."""
    name = side.get("action") if isinstance(side, dict) else None
    cls = types.get(name) if isinstance(name, str) else None
    fields = side.get("fields") if cls is not None else None
    if not isinstance(fields, dict):
        raise TPError(f"protocol error: follower has no action {name!r}")
    try:
        return cls(**{name: _frozen(value) for name, value in fields.items()})
    except TypeError as err:
        raise TPError(f"protocol error: malformed {cls.__name__}: {err}") from None


def _frozen(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return {k: _frozen(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class StepDescription:
    """What every rank runs next. ``op``: OP_RUN (a forward over ``inputs``), OP_CALL (a follower action,
    ``side`` as :func:`encode_action` gives it) or OP_STOP."""

    op: int
    inputs: list[StepInput] = field(default_factory=list)
    sink_len: int = 0
    window_starts: list[int] | None = None
    side: dict[str, Any] | None = None

    def encode(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(header int64 [4], numbers int64 [n], side uint8 [m] or None)."""
        nums: list[int] = [len(self.inputs), self.sink_len, int(self.window_starts is not None)]
        tail: list[int] = []
        for inp in self.inputs:
            has_pos = inp.positions is not None
            nums += [inp.start, len(inp.token_ids), inp.num_logits, len(inp.block_table), int(has_pos)]
            tail += inp.token_ids
            tail += inp.block_table
            if has_pos:
                tail += inp.positions
        if self.window_starts is not None:
            tail += self.window_starts
        numbers = torch.from_numpy(np.asarray(nums + tail, dtype=np.int64))
        side = None
        if self.side is not None:
            side = torch.frombuffer(bytearray(json.dumps(self.side, separators=(",", ":")).encode()), dtype=torch.uint8)
        header = torch.tensor([self.op, numbers.numel(), 0 if side is None else side.numel(), 0], dtype=torch.int64)
        return header, numbers, side

    @staticmethod
    def decode(header: torch.Tensor, numbers: torch.Tensor, side: torch.Tensor | None) -> "StepDescription":
        op = int(header[0])
        if op not in _OPS:
            raise TPError(f"protocol error: unknown step op {op}")
        v = numbers.tolist()
        n_inputs, sink_len, has_windows = v[0], v[1], v[2]
        heads = [v[3 + 5 * i : 8 + 5 * i] for i in range(n_inputs)]
        pos = 3 + 5 * n_inputs
        inputs = []
        for start, n_tok, num_logits, n_blocks, has_pos in heads:
            tokens = v[pos : pos + n_tok]
            pos += n_tok
            blocks = v[pos : pos + n_blocks]
            pos += n_blocks
            positions = None
            if has_pos:
                positions = v[pos : pos + n_tok]
                pos += n_tok
            inputs.append(StepInput(tokens, start, blocks, num_logits, positions))
        windows = v[pos : pos + n_inputs] if has_windows else None
        side_obj = json.loads(side.numpy().tobytes()) if side is not None else None
        return StepDescription(op, inputs, sink_len, windows, side_obj)


def broadcast_step(group: TPGroup, desc: StepDescription) -> None:
    """Driver: send ``desc`` to every follower."""
    header, numbers, side = desc.encode()
    group.broadcast_ctrl(header)
    if numbers.numel():
        group.broadcast_ctrl(numbers)
    if side is not None:
        group.broadcast_ctrl(side)


def receive_step(group: TPGroup) -> StepDescription:
    """Follower: wait for the driver's next description."""
    header = torch.zeros(4, dtype=torch.int64)
    group.broadcast_ctrl(header)
    n_numbers, n_side = int(header[1]), int(header[2])
    if not 0 <= n_numbers < 1 << 32 or not 0 <= n_side < 1 << 32:
        raise TPError("protocol error: bad step header")
    numbers = torch.zeros(n_numbers, dtype=torch.int64)
    if n_numbers:
        group.broadcast_ctrl(numbers)
    side = None
    if n_side:
        side = torch.zeros(n_side, dtype=torch.uint8)
        group.broadcast_ctrl(side)
    return StepDescription.decode(header, numbers, side)


class TPDriverRunner(ModelRunner):
    """A ModelRunner on rank 0 of a TP group: every forward is first broadcast to the followers."""

    def __init__(self, model, cache, backend, group: TPGroup):
        super().__init__(model, cache, backend)
        self.group = group

    def forward(self, inputs: list[StepInput], sink_len: int = 0, window_starts: list[int] | None = None,
                kv_hook: LayerHook | None = None) -> tuple[torch.Tensor, list[int]]:
        self.announce(inputs, sink_len, window_starts)
        return super().forward(inputs, sink_len, window_starts, kv_hook)

    def announce(self, inputs: list[StepInput], sink_len: int = 0, window_starts: list[int] | None = None) -> None:
        """Tell the followers the forward this rank is about to run itself."""
        broadcast_step(self.group, StepDescription(OP_RUN, inputs, sink_len, window_starts))

    def call(self, action: Any) -> None:
        """Have every follower run ``action`` (a frozen dataclass of plain values, one of the types the
        followers registered with :meth:`TPFollower.on`)."""
        broadcast_step(self.group, StepDescription(OP_CALL, side=encode_action(action)))

    def stop(self) -> None:
        """Release the followers from their loops."""
        broadcast_step(self.group, StepDescription(OP_STOP))


ActionT = TypeVar("ActionT")


class TPFollower:
    """A follower rank: its shard of the model and cache, running what the driver describes.

    A worker kind that needs more than forward passes (the prefill worker's KV streaming) registers a handler
    per action type (:meth:`on`), and may replace ``run_step`` to wrap the forward (e.g. to hand it a KV
    connector's layer hook)."""

    def __init__(self, runner: ModelRunner, group: TPGroup):
        self.runner = runner
        self.group = group
        self.actions: dict[type, Callable[[Any], None]] = {}
        self.steps = 0
        self.on(CopyBlocks, self._copy_blocks)
        self.on(GatherKVBlocks, self._gather_blocks)
        self.on(ScatterKVBlocks, self._scatter_blocks)

    def on(self, action_type: type[ActionT], handler: Callable[[ActionT], None]) -> None:
        """Run ``handler(action)`` for each action of ``action_type`` the driver sends."""
        if any(t.__name__ == action_type.__name__ and t is not action_type for t in self.actions):
            raise ValueError(f"action_type: another action is named {action_type.__name__!r}")
        self.actions[action_type] = handler

    def _copy_blocks(self, action: CopyBlocks) -> None:
        self.runner.cache.copy_blocks(list(action.copies))

    def _gather_blocks(self, action: GatherKVBlocks) -> None:
        self.group.send_to(self.runner.cache.read_blocks(list(action.blocks)).contiguous(), 0)

    def _scatter_blocks(self, action: ScatterKVBlocks) -> None:
        cache = self.runner.cache
        spec = cache.spec
        kv = torch.empty(len(action.blocks), spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim,
                         dtype=spec.dtype, device=cache.device)
        self.group.recv_from(kv, 0)
        cache.write_blocks(list(action.blocks), kv)

    def run_step(self, desc: StepDescription) -> None:
        self.runner.forward(desc.inputs, desc.sink_len, desc.window_starts)

    def serve(self) -> int:
        """Run steps until the driver says stop; returns how many forwards ran. Raises TPError when the
        group breaks (the driver died or a collective timed out)."""
        while True:
            desc = receive_step(self.group)
            if desc.op == OP_STOP:
                return self.steps
            if desc.op == OP_CALL:
                action = decode_action(desc.side, {t.__name__: t for t in self.actions})
                self.actions[type(action)](action)
                continue
            if desc.inputs:
                self.run_step(desc)
                self.steps += 1


def copy_kv_blocks(runner: ModelRunner, copies: list[tuple[int, int]]) -> None:
    """Copy whole KV blocks (source, destination) in this rank's cache and, on a tensor-parallel driver, in
    every follower's (each holds its own heads of the same blocks)."""
    if not copies:
        return
    runner.cache.copy_blocks(copies)
    if isinstance(runner, TPDriverRunner):
        runner.call(CopyBlocks(tuple((src, dst) for src, dst in copies)))


class ShardedBlocks:
    """Whole KV blocks (every head of the model) of a sharded tensor-parallel instance, read and written from rank
    0, whose cache holds only its own heads: a read has every follower send its heads of the blocks over the
    group's data path (:class:`GatherKVBlocks`), a write sends each follower its heads (:class:`ScatterKVBlocks`).
    Serves the KV tiers as the cache itself serves them on an instance whose rank 0 holds every head (``spec``,
    ``device``, ``read_blocks``, ``write_blocks``); every call is a collective on the group, on the driver's
    thread between steps."""

    def __init__(self, runner: "TPDriverRunner", num_kv_heads: int):
        self.runner = runner
        self.cache = runner.cache
        self.group = runner.group
        self.spec = dataclasses.replace(self.cache.spec, num_kv_heads=num_kv_heads)
        # each rank's global KV heads (a replicated head is read from every rank holding it, written to each)
        self.heads = [shard_heads(num_kv_heads, self.group.size, r) for r in range(self.group.size)]

    @property
    def device(self) -> torch.device:
        return self.cache.device

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """[n, L, 2, block_size, H, D]: every head of ``blocks``."""
        self.runner.call(GatherKVBlocks(tuple(blocks)))
        s = self.spec
        out = torch.empty(len(blocks), s.num_layers, 2, s.block_size, s.num_kv_heads, s.head_dim, dtype=s.dtype,
                          device=self.device)
        out[..., self.heads[0].start : self.heads[0].end, :] = self.cache.read_blocks(blocks)
        for rank in range(1, self.group.size):
            heads = self.heads[rank]
            part = torch.empty(out.shape[:4] + (heads.size, s.head_dim), dtype=s.dtype, device=self.device)
            self.group.recv_from(part, rank)
            out[..., heads.start : heads.end, :] = part
        return out

    def write_blocks(self, blocks: list[int], kv: torch.Tensor) -> None:
        """Write ``kv`` [n, L, 2, block_size, H, D] (every head) into ``blocks`` on every rank."""
        self.runner.call(ScatterKVBlocks(tuple(blocks)))
        kv = kv.to(self.device)
        for rank in range(1, self.group.size):
            heads = self.heads[rank]
            self.group.send_to(kv[..., heads.start : heads.end, :].contiguous(), rank)
        self.cache.write_blocks(blocks, kv[..., self.heads[0].start : self.heads[0].end, :])


def load_for_rank(path: str, dtype: str, device: str, group: TPGroup | None) -> LoadedModel:
    """The model as this rank runs it: whole without a group (or with a 1-rank one), else this rank's
    slices with the all-reduces installed (their time accumulates in ``group.collectives``)."""
    if group is None or not group.shard.sharded:
        return load_model(path, dtype, device)
    loaded = load_model(path, dtype, device, shard=group.shard)
    group.collectives = install_all_reduce(loaded.model, group.all_reduce)
    return loaded


def build_runner(loaded: LoadedModel, num_blocks: int, block_size: int, attention_backend: str,
                 group: TPGroup | None = None, compile_steps: bool = False) -> ModelRunner:
    """A paged KV cache of ``num_blocks`` blocks for this rank's KV heads, the attention backend and the
    runner over them: a :class:`TPDriverRunner` on rank 0 of a sharded group, a plain runner otherwise
    (followers run plain forwards, in step with the driver). ``compile_steps``: compile the small steps
    (:mod:`modeling.compiled_step`) where supported and the model is not sharded; else eager, logged."""
    mc = loaded.config
    spec = KVCacheSpec(mc.num_hidden_layers, loaded.kv_heads.size, mc.head_dim, block_size, loaded.dtype)
    max_len = min(mc.max_position_embeddings, num_blocks * block_size)
    backend = make_backend(attention_backend, loaded.device, block_size, loaded.dtype, max_len)
    sharded = group is not None and group.shard.sharded
    compiled = compile_steps and not sharded and compiled_steps_supported(loaded.device, backend.name)
    if compile_steps and not compiled:
        log.warning("compile_steps: not supported with %s attention on %s%s; steps run eagerly", backend.name,
                    loaded.device, " (sharded)" if sharded else "")
    graphs = compiled and loaded.device.type == "cuda"
    cache = PagedKVCache(spec, num_blocks, loaded.device, scratch_blocks=1 if graphs else 0)
    if backend.name == "cpu":  # the CPU extension's kernels: its bf16 linear layers for small steps too
        use_skinny_linear(loaded.model)
    if group is not None and group.shard.sharded and group.rank == 0:
        return TPDriverRunner(loaded.model, cache, backend, group)
    runner = ModelRunner(loaded.model, cache, backend)
    if graphs:
        runner.compiled = GraphSteps(loaded.model, cache, max_len, split_keys=backend.split_keys)
    elif compiled:
        runner.compiled = CompiledSteps(loaded.model, cache)
    return runner
