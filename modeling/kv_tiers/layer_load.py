"""Blocks loaded from the KV tiers, written into the cache layer by layer while the pass that reads them runs.

A load (:meth:`KVTiers.load`, once its owner has called ``load_layer_by_layer``) has every block's KV on the
host already (host tier, read ahead,
or read at load time); what is left is the copy into the cache, which on a GPU crosses PCIe: a 7K-token prompt
of Llama-3.1-8B is 0.9 GB, tens of milliseconds. Written layer by layer beside the pass, layer ``i``'s copy
overlaps the pass's work on the layers before it, and the pass waits only for what is not in yet when it
reaches layer ``i`` (:meth:`LayerLoads.wait_for_layer_load`, a :class:`~modeling.kv_connector.LayerHook`).

On a GPU the copies run on a stream of their own, one event per layer; the pass's stream waits on the event,
the host never does. On CPU a thread of its own copies, and the pass waits on the thread's progress.

The owner's contract (the prefill worker's): every forward pass after a layered load runs with this hook, and
:meth:`finish` is called after each pass, or before anything else reads or reuses the cache when no pass runs.
Loads are applied in the order they were added, so a block freed and handed out again before the pass (a load
into it, then the new owner's writes) ends as if each load had been written at once.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from modeling.kv_cache import PagedKVCache


@dataclass
class _Load:
    """One load's blocks and their KV on the host, one [L, 2, bs, H, D] tensor per block."""

    blocks: list[int]
    parts: list[torch.Tensor]
    layers_done: int = 0  # CPU: layers written, from the first
    events: list = field(default_factory=list)  # GPU: one event per layer, recorded once its copy is queued
    error: str = ""


class LayerLoads:
    """Loads into one single-rank instance's cache, written layer by layer beside the forward pass (see the
    module's docstring). Methods are for the owner's thread; on CPU one copier thread of its own."""

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.num_layers = cache.spec.num_layers
        self._pending: list[_Load] = []  # added since the last finish, in order
        self.loads_added = 0
        self._cuda = cache.device.type == "cuda"
        self._cond = threading.Condition()
        self._closed = False
        if self._cuda:
            self._stream = torch.cuda.Stream(cache.device)
        else:
            self._queue: deque[_Load] = deque()
            self._thread = threading.Thread(target=self._copy_loop, name="kv-tier-layer-load", daemon=True)
            self._thread.start()

    def __len__(self) -> int:
        """Loads added and not yet finished."""
        return len(self._pending)

    def add(self, blocks: Sequence[int], parts: Sequence[torch.Tensor]) -> None:
        """Write ``parts[i]`` (a block's KV [L, 2, bs, H, D] on the host) into ``blocks[i]``, layer by layer,
        starting now; the pass's :meth:`wait_for_layer_load` and :meth:`finish` wait for them."""
        load = _Load(list(blocks), list(parts))
        if not load.blocks:
            return
        self.loads_added += 1
        self._pending.append(load)
        if self._cuda:
            self._queue_copies(load)
            return
        with self._cond:
            self._queue.append(load)
            self._cond.notify_all()

    # -- the hook (the pass's thread) ----------------------------------------------------------------

    def wait_for_layer_load(self, layer: int) -> None:
        """Every pending load's layer ``layer`` is in the cache (on a GPU: the pass's stream waits for it)."""
        if not self._pending:
            return
        if self._cuda:
            stream = torch.cuda.current_stream(self.cache.device)
            for load in self._pending:
                stream.wait_event(load.events[layer])
            return
        with self._cond:
            self._cond.wait_for(lambda: all(ld.layers_done > layer or ld.error for ld in self._pending))
        self._raise_failed()

    def save_kv_layer(self, layer: int) -> None:
        """Nothing to save: the tiers keep blocks once they are final (``PrefixCache.commit``)."""

    def finish(self) -> None:
        """Every pending load is in the cache (on a GPU: ordered before whatever the current stream runs next);
        raises RuntimeError when a copy failed (the blocks' KV is not what their hashes say)."""
        if not self._pending:
            return
        try:
            if self._cuda:
                torch.cuda.current_stream(self.cache.device).wait_stream(self._stream)
            else:
                with self._cond:
                    self._cond.wait_for(lambda: all(ld.layers_done == self.num_layers or ld.error
                                                    for ld in self._pending))
                self._raise_failed()
        finally:
            self._pending.clear()

    def close(self) -> None:
        """Finish what is pending and stop the copier thread."""
        try:
            self.finish()
        finally:
            if not self._cuda:
                with self._cond:
                    self._closed = True
                    self._cond.notify_all()
                self._thread.join()

    def _raise_failed(self) -> None:
        failed = [ld.error for ld in self._pending if ld.error]
        if failed:
            raise RuntimeError(f"kv tiers: writing a loaded block into the cache failed: {failed[0]}")

    # -- the copies ----------------------------------------------------------------------------------

    def _queue_copies(self, load: _Load) -> None:
        """GPU: queue the load's copies on the side stream, layer by layer, an event after each layer."""
        device = self.cache.device
        current = torch.cuda.current_stream(device)
        self._stream.wait_stream(current)  # the blocks' earlier readers and writers come first
        n, (_, two, bs, heads, dim) = len(load.blocks), load.parts[0].shape
        # allocated on the side stream, so the allocator keeps it from other streams until its copies end
        with torch.cuda.stream(self._stream):
            index = torch.tensor(load.blocks, dtype=torch.int64).to(device, non_blocking=True)
            staging = torch.empty((n, two, bs, heads, dim), dtype=self.cache.kv.dtype, device=device)
            for layer in range(self.num_layers):
                for i, part in enumerate(load.parts):
                    staging[i].copy_(part[layer], non_blocking=True)  # pinned host memory: an asynchronous copy
                self.cache.kv[layer].index_copy_(1, index, staging.transpose(0, 1))
                event = torch.cuda.Event()
                event.record(self._stream)
                load.events.append(event)

    def _copy_loop(self) -> None:
        """CPU: write each queued load into the cache, layer by layer, in order."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                load = self._queue[0]
            try:
                index = torch.tensor(load.blocks, dtype=torch.int64)
                for layer in range(self.num_layers):
                    rows = torch.stack([part[layer] for part in load.parts], dim=1)  # [2, n, bs, H, D]
                    self.cache.kv[layer].index_copy_(1, index, rows)
                    with self._cond:
                        load.layers_done = layer + 1
                        self._cond.notify_all()
            except Exception as err:  # reported to the pass's thread, which fails the step
                with self._cond:
                    load.error = f"{type(err).__name__}: {err}"
                    self._cond.notify_all()
            with self._cond:
                self._queue.popleft()
