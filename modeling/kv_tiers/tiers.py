"""An instance's KV tiers over its paged KV cache: find, load back and write down full blocks by content hash.

The prefix cache (``modeling/prefix_cache.py``) drives it from the worker's thread: ``save`` when it caches
blocks (their KV is final), ``find`` and ``load`` when a prompt's prefix runs past what the pool holds. A save
copies the blocks' KV out of the cache at once (on a GPU: an asynchronous copy to pinned host memory), keeps
it in the host tier and queues it for the writer thread, which writes it to the disk tier and the cluster's
store off the step. A load takes each block from the host tier, else from its file (checked), else from the
store (checked), and writes them into the given blocks. A prompt that waits to be scheduled has the blocks only
the disk tier or the store holds read ahead on a thread of their own (``read_ahead``,
:class:`~modeling.kv_tiers.read_ahead.ReadAhead`), so its load copies them from host memory; a decode
instance's load for a prompt whose rest arrives from a prefill instance runs wholly on that thread
(``start_load`` / ``finish_load``). An owner that runs every pass with a layer hook may have its loads written
into the cache layer by layer beside the pass that reads them (``load_layer_by_layer``,
:class:`~modeling.kv_tiers.layer_load.LayerLoads`).

Keys: a block's content hash already covers its tokens, every token before it, the model path, dtype and
block size (the prefix cache's salt); the disk tier's directory and the store's key prefix add a fingerprint
of the checkpoint's files and the tensor-parallel degree, so a changed checkpoint at the same path never meets
old blocks. The tiers keep whole blocks (every KV head) whatever the degree: a sharded instance's rank 0 gathers
and scatters them across its ranks (:class:`~modeling.tp_runner.ShardedBlocks`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from typing import Protocol

import torch

from modeling.kv_cache import KVCacheSpec, PagedKVCache
from modeling.instance_config import KVTiersConfig
from modeling.kv_tiers.disk import DiskTier
from modeling.kv_tiers.events import DISK, HOST, STORE, TierEvents
from modeling.kv_tiers.host import HostTier
from modeling.kv_tiers.layer_load import LayerLoads
from modeling.kv_tiers.read_ahead import ReadAhead, ReadResult
from modeling.kv_tiers.stats import TierStats
from modeling.kv_tiers.store import StoreTier

log = logging.getLogger("magicserve.kv_tiers")

MB = 1 << 20
STORE_CONNECT_WAIT_S = 5.0  # an instance starting waits this long for the store before serving without it


SAMPLE_BYTES = 1 << 20


def checkpoint_fingerprint(model_path: str) -> str:
    """The checkpoint directory's file names, sizes and the bytes of each file's first and last MiB, hashed:
    the same on every node holding a copy of the checkpoint, different once its weights change."""
    h = hashlib.sha256()
    try:
        entries = sorted(os.scandir(model_path), key=lambda e: e.name)
    except OSError:
        entries = []
    for e in entries:
        if not e.is_file():
            continue
        size = e.stat().st_size
        h.update(f"{e.name}\x1f{size}\n".encode())
        with open(e.path, "rb") as f:
            h.update(f.read(SAMPLE_BYTES))
            if size > 2 * SAMPLE_BYTES:
                f.seek(size - SAMPLE_BYTES)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]


class WholeBlocks(Protocol):
    """Whole KV blocks of an instance's cache, every KV head of the model: the cache itself
    (:class:`~modeling.kv_cache.PagedKVCache`) where rank 0 holds every head, or
    :class:`~modeling.tp_runner.ShardedBlocks` on a sharded tensor-parallel instance."""

    spec: KVCacheSpec  # with the model's every KV head

    @property
    def device(self) -> torch.device: ...

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """[n, L, 2, block_size, H, D] on ``device``."""
        ...

    def write_blocks(self, blocks: list[int], kv: torch.Tensor) -> None: ...


class KVTiers:
    """The host tier, the disk tier and the cluster's store (each may be None) of one instance's cache."""

    def __init__(self, cache: WholeBlocks, host: HostTier | None, disk: DiskTier | None,
                 write_queue_blocks: int = 4096, store: StoreTier | None = None, read_ahead_bytes: int = 0):
        spec = cache.spec
        self.cache = cache
        self.host = host
        self.disk = disk
        self.store = store
        self.block_shape = (spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.block_bytes = spec.bytes_per_block
        self._pending_copy: torch.cuda.Event | None = None  # the last device -> host copy of a save
        self._queue: queue.Queue = queue.Queue(maxsize=write_queue_blocks)
        self._writer = None
        self._events: TierEvents | None = None
        self.names: tuple[str, ...] = tuple(self._by_name())  # the tiers this instance loads from
        self._read_ahead: ReadAhead | None = None
        self.layer_loads: LayerLoads | None = None  # loads written beside the next pass (load_layer_by_layer)
        if disk is not None or store is not None:
            self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
            self._writer.start()
            if read_ahead_bytes >= self.block_bytes:
                self._read_ahead = ReadAhead(self._read_slow, self.block_bytes, read_ahead_bytes)

    @classmethod
    def build(cls, config: KVTiersConfig, cache: WholeBlocks, salt: bytes, model_path: str, instance_name: str,
              layout: str = "tp1") -> "KVTiers | None":
        """The tiers ``config`` asks for over ``cache`` (None when it asks for none). The disk tier lives in
        ``<disk root>/<namespace>/<instance_name>``, the namespace hashing ``salt``, the checkpoint's files and
        ``layout`` (the tensor-parallel degree that computes the blocks: each degree's float sums round alike
        only among themselves)."""
        if not config.active:
            return None
        host = HostTier(config.host_memory_mb * MB) if config.host_memory_mb else None
        namespace = hashlib.sha256(salt + b"\x1f" + checkpoint_fingerprint(model_path).encode() + b"\x1f" +
                                   layout.encode()).hexdigest()[:16]
        disk = None
        if config.disk_mb:
            disk = DiskTier.open(os.path.join(config.resolved_disk_dir(), namespace), instance_name,
                                 config.disk_mb * MB)
            log.info("kv tiers of %s: host %d MiB, disk %d MiB in %s (%d blocks found)", instance_name,
                     config.host_memory_mb, config.disk_mb, disk.directory, len(disk))
        store = StoreTier(config.store, namespace) if config.store.enabled else None
        tiers = cls(cache, host, disk, config.write_queue_blocks, store, config.read_ahead_mb * MB)
        if store is not None and not store.wait_connected(STORE_CONNECT_WAIT_S):
            log.warning("kv tiers of %s: the store at %s is not reachable yet; serving without it meanwhile",
                        instance_name, config.store.master_address)
        return tiers

    def adopt_host(self, other: HostTier) -> int:
        """Keep the blocks of another host tier of the same cache layout (an instance's previous worker's, on a
        role change), least recently used first, as far as this one's capacity goes; how many were kept. The
        caller checks the blocks' keys mean the same here (the prefix cache's salt)."""
        if self.host is None:
            return 0
        kept = 0
        for block_hash, kv in other.items():
            if tuple(kv.shape) == self.block_shape and kv.dtype == self.cache.spec.dtype:
                kept += self.host.put(block_hash, kv)
        return kept

    def load_layer_by_layer(self) -> LayerLoads | None:
        """From now on, :meth:`load` hands the blocks it loads to the returned :class:`LayerLoads`, which writes
        them into the cache layer by layer beside the next forward pass: for an owner that runs every pass with
        it as a layer hook and calls its ``finish`` after each (``modeling/kv_tiers/layer_load.py``). None, and
        loads write at once, on a sharded tensor-parallel instance, whose writes are collectives between steps."""
        if self.layer_loads is None and isinstance(self.cache, PagedKVCache):
            self.layer_loads = LayerLoads(self.cache)
        return self.layer_loads

    # -- lookups and loads (the worker's thread) --------------------------------------------------

    def find(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes``, from the first, some tier holds."""
        n = 0
        for h in hashes:
            if not ((self.host is not None and h in self.host) or (self.disk is not None and h in self.disk)):
                break
            n += 1
        if self.store is not None and n < len(hashes):
            n += self.store.find(hashes[n:])
        return n

    def copies_from_memory(self, hashes: Sequence[int]) -> bool:
        """Whether loading the leading run of ``hashes`` the tiers hold is a copy within host memory: the cache is
        on CPU and the host tier holds each of them (up to the first no tier holds). Then there is nothing worth
        moving off the worker's thread."""
        if self.cache.device.type != "cpu":
            return False
        for h in hashes:
            if self.host is not None and h in self.host:
                continue
            on_disk = self.disk is not None and h in self.disk
            return not (on_disk or (self.store is not None and self.store.find([h])))
        return True

    def read_ahead(self, request_id: str, hashes: Sequence[int]) -> bool:
        """Start reading the blocks of ``hashes`` (a waiting prompt's, from the first its pool lacks) that only the
        disk tier or the store holds, up to the first no tier holds, for the request's :meth:`load` to take;
        whether a read was queued."""
        if self._read_ahead is None:
            return False
        held = {h for h in hashes if self.host is not None and h in self.host}
        return self._read_ahead.submit(request_id, hashes, held)

    def cancel_read_ahead(self, request_id: str) -> None:
        """Drop what is read ahead for the request (it ended, or was loaded), and stop its :meth:`start_load`:
        once this returns nothing writes into its blocks."""
        if self._read_ahead is not None:
            self._read_ahead.cancel(request_id)

    def read_ahead_held(self) -> tuple[int, int]:
        """(requests with blocks being read or held ahead, the bytes held): both 0 once every request ended."""
        ahead = self._read_ahead
        return (0, 0) if ahead is None else (len(ahead), ahead.held_bytes)

    def start_load(self, request_id: str, hashes: Sequence[int], blocks: Sequence[int]) -> bool:
        """Load as :meth:`load` does, in the background: the blocks the host tier holds now are taken at once,
        the rest read on the read-ahead thread, which then writes them all into ``blocks`` (which no step may
        read until :meth:`finish_load`). False, nothing started, where that cannot run beside the worker's
        steps (no disk tier or store, no read-ahead, or a sharded tensor-parallel cache, whose writes are
        collectives): the caller loads."""
        if self._read_ahead is None or not isinstance(self.cache, PagedKVCache):
            return False
        self._wait_for_copies()
        from_host = {h: self.host.get(h) for h in hashes if self.host is not None and h in self.host}

        def write(read: ReadResult) -> list[str]:
            parts, tiers = [], []
            for h in hashes:
                kv = from_host.get(h)
                got = read.blocks.get(h) if kv is None else None
                if kv is None and got is None:
                    break
                parts.append(kv if kv is not None else got.kv)
                tiers.append(HOST if kv is not None else got.tier)
            if parts:
                self.cache.write_blocks(list(blocks[:len(parts)]), torch.stack(parts))
                if self.cache.device.type == "cuda":  # written, not only queued, before the worker's steps read it
                    torch.cuda.current_stream(self.cache.device).synchronize()
            return tiers
        return self._read_ahead.submit(request_id, hashes, skip=from_host.keys(), then=write)

    def load_done(self, request_id: str) -> bool:
        """Whether the request's :meth:`start_load` has written its blocks (:meth:`finish_load` returns at once)."""
        return self._read_ahead is None or self._read_ahead.done(request_id)

    def finish_load(self, request_id: str) -> int:
        """Wait for the request's :meth:`start_load` to be written; how many of its blocks, from the first, were
        loaded (the rest were missing or failed their checks, or the write failed)."""
        t0 = time.perf_counter()
        read = self._read_ahead.take(request_id)
        waited = time.perf_counter() - t0
        if read.error:
            log.warning("kv tiers: loading %s failed: %s", request_id, read.error)
            return 0
        loaded: list[str] = read.done_with or []
        by_name = self._by_name()
        for name in loaded:
            stats = by_name[name].stats
            stats.hits += 1
            stats.bytes_in += self.block_bytes
            stats.load_s += waited / len(loaded)
        for h, got in read.blocks.items():
            self._promote_read(h, got.kv)
            stats = by_name[got.tier].stats
            stats.read_ahead += 1
            stats.read_ahead_s += got.seconds
        return len(loaded)

    def load(self, hashes: Sequence[int], blocks: Sequence[int], request_id: str = "") -> int:
        """Write the KV of ``hashes[i]`` into ``blocks[i]``, from the first until one is missing (evicted since
        ``find``) or fails its check; returns how many were loaded. What was read ahead for ``request_id`` is
        taken first (waiting for a read under way)."""
        t0 = time.perf_counter()
        ahead = self._read_ahead.take(request_id) if self._read_ahead is not None and request_id else ReadResult()
        waited = time.perf_counter() - t0
        self._wait_for_copies()
        parts: list[torch.Tensor] = []
        per_tier: list[TierStats] = []
        for h in hashes:
            t0 = time.perf_counter()
            read = ahead.blocks.get(h)
            if read is not None:
                tier = self._by_name()[read.tier]
                kv = self._promote_read(h, read.kv)
                tier.stats.read_ahead += 1
                tier.stats.read_ahead_s += read.seconds
                tier.stats.load_s += waited / len(ahead.blocks)
            elif h == ahead.missing:  # the slow tiers failed it already: only the host tier may hold it now
                kv = self.host.get(h) if self.host is not None else None
                if kv is None:
                    return self._write(parts, per_tier, blocks)
                tier = self.host
            else:
                kv, tier = self._local(h)
                if kv is None:
                    break
            tier.stats.load_s += time.perf_counter() - t0
            parts.append(kv)
            per_tier.append(tier.stats)
        if self.store is not None and len(parts) < len(hashes):
            t0 = time.perf_counter()
            rest = hashes[len(parts):]
            for h, payload in zip(rest, self.store.read(rest, self.block_bytes)):
                parts.append(self._promote(h, payload))
                per_tier.append(self.store.stats)
            self.store.stats.load_s += time.perf_counter() - t0
        return self._write(parts, per_tier, blocks)

    def _write(self, parts: list[torch.Tensor], per_tier: list[TierStats], blocks: Sequence[int]) -> int:
        """Write the loaded blocks' KV into the first of ``blocks`` (or hand them to :attr:`layer_loads`) and
        count them; how many."""
        if not parts:
            return 0
        t0 = time.perf_counter()
        if self.layer_loads is not None:
            self.layer_loads.add(blocks[:len(parts)], parts)
        else:
            self.cache.write_blocks(list(blocks[:len(parts)]), torch.stack(parts))  # [n, L, 2, bs, H, D]
        share = (time.perf_counter() - t0) / len(parts)
        for stats in per_tier:
            stats.hits += 1
            stats.bytes_in += self.block_bytes
            stats.load_s += share
        return len(parts)

    def _local(self, block_hash: int):
        """(the block's KV, the tier it came from) from the host or disk tier; (None, None) when neither has it."""
        kv = self.host.get(block_hash) if self.host is not None else None
        if kv is not None:
            return kv, self.host
        if self.disk is not None:
            payload = self.disk.read(block_hash, self.block_bytes)
            if payload is not None:
                return self._promote(block_hash, payload), self.disk
        return None, None

    def _promote(self, block_hash: int, payload) -> torch.Tensor:
        """A block's payload from a lower tier as its KV tensor, kept in the host tier too."""
        kv = self._as_kv(payload)
        if self.host is not None:
            self.host.put(block_hash, self._pinned(kv))
        return kv

    def _promote_read(self, block_hash: int, kv: torch.Tensor) -> torch.Tensor:
        """A block read ahead (pinned already on a GPU), kept in the host tier too."""
        if self.host is not None:
            self.host.put(block_hash, kv)
        return kv

    def _as_kv(self, payload) -> torch.Tensor:
        return torch.frombuffer(payload, dtype=torch.uint8).view(self.cache.spec.dtype).view(self.block_shape)

    def _read_slow(self, block_hash: int):
        """(the block's KV, the tier's name) from the disk tier, else the store; (None, None) when neither returns
        it whole and intact. The read-ahead thread's: it touches neither the host tier nor any counter but the
        reading tier's own."""
        if self.disk is not None:
            payload = self.disk.read(block_hash, self.block_bytes)
            if payload is not None:
                return self._pinned(self._as_kv(payload)), DISK
        if self.store is not None:
            got = self.store.read([block_hash], self.block_bytes)
            if got:
                return self._pinned(self._as_kv(got[0])), STORE
        return None, None

    # -- write-down (the worker's thread; disk writes on the writer thread) ------------------------

    def save(self, blocks: Sequence[int], hashes: Sequence[int]) -> None:
        """Keep the KV of ``blocks`` (final, cached under ``hashes``) in the tiers that lack it. A block the host
        and disk tiers hold already went to the store with them; with neither, every block goes to the store
        (which keeps an object it has)."""
        local = self.host is not None or self.disk is not None
        todo = [(b, h) for b, h in zip(blocks, hashes) if not local or
                (self.host is not None and h not in self.host) or (self.disk is not None and h not in self.disk)]
        if not todo:
            return
        copies = self._copy_out([b for b, _ in todo])
        for (_, h), kv in zip(todo, copies):
            if self.host is not None:
                self.host.put(h, kv)
            if self._writer is not None:
                try:
                    self._queue.put_nowait((h, kv, self._pending_copy))
                except queue.Full:
                    for tier in (self.disk, self.store):
                        if tier is not None:
                            tier.stats.dropped += 1

    def _copy_out(self, blocks: list[int]) -> list[torch.Tensor]:
        """The blocks' KV on the host, one [L, 2, bs, H, D] tensor each (views of one copy)."""
        gathered = self.cache.read_blocks(blocks)  # [n, L, 2, bs, H, D]
        if gathered.device.type == "cpu":
            out = gathered.contiguous()
        else:
            out = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            out.copy_(gathered, non_blocking=True)
            self._pending_copy = torch.cuda.Event()
            self._pending_copy.record()
        return list(out.unbind(0))

    def _pinned(self, kv: torch.Tensor) -> torch.Tensor:
        return kv.pin_memory() if self.cache.device.type == "cuda" else kv

    def _wait_for_copies(self) -> None:
        if self._pending_copy is not None:
            self._pending_copy.synchronize()
            self._pending_copy = None

    def _write_loop(self) -> None:
        retry_s = self.store.config.retry_s if self.store is not None else None
        while True:
            if self.store is not None and not self.store.connected and self.store.ready_to_retry():
                self.store.connect()
            try:
                item = self._queue.get(timeout=retry_s)
            except queue.Empty:
                continue
            try:
                if item is None:
                    return
                block_hash, kv, copied = item
                if copied is not None:
                    copied.synchronize()
                payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
                if self.disk is not None:
                    self.disk.write(block_hash, payload)
                if self.store is not None:
                    self.store.write(block_hash, payload)
            except OSError as err:  # a full or failing disk: the block stays computable
                log.warning("kv disk tier: writing block %016x failed: %s", item[0], err)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Return once every queued write (disk, store) is done."""
        if self._writer is not None:
            self._queue.join()

    def close(self) -> None:
        """Finish the queued writes, stop the writer, the read-ahead and the layer loads, and release the disk
        directory."""
        if self.layer_loads is not None:
            self.layer_loads.close()
            self.layer_loads = None
        if self._read_ahead is not None:
            self._read_ahead.close()
            self._read_ahead = None
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
            self._writer = None
        if self.disk is not None:
            self.disk.close()
        if self.store is not None:
            self.store.close()

    def _by_name(self) -> dict:
        tiers = {HOST: self.host, DISK: self.disk, STORE: self.store}
        return {name: tier for name, tier in tiers.items() if tier is not None}

    def stats(self) -> dict[str, TierStats]:
        """Each tier's counters, by name (``host``, ``disk``, ``store``)."""
        return {name: tier.stats for name, tier in self._by_name().items()}

    # -- what the router's index is told (``modeling/kv_tiers/events.py``) ---------------------------

    def record_events(self) -> tuple[tuple[str, int, bool], ...]:
        """Start logging what the tiers keep and drop; returns what the host and disk tiers hold now (the store
        cannot be listed: the index learns of its blocks as they are written)."""
        self._events = TierEvents()
        for tier in self._by_name().values():
            tier.events = self._events
        now = []
        for name, tier in ((HOST, self.host), (DISK, self.disk)):
            if tier is not None:
                now += [(name, h, True) for h in tier.hashes()]
        return tuple(now)

    def take_events(self) -> tuple[tuple[str, int, bool], ...]:
        """What the tiers kept and dropped since the last call (:meth:`record_events` first)."""
        return self._events.take() if self._events is not None else ()
