"""An instance's KV tiers over its paged KV cache: find, load back and write down full blocks by content hash.

The prefix cache (``modeling/prefix_cache.py``) drives it from the worker's thread: ``save`` when it caches
blocks (their KV is final), ``find`` and ``load`` when a prompt's prefix runs past what the pool holds. A save
copies the blocks' KV out of the cache at once (on a GPU: an asynchronous copy to pinned host memory), keeps
it in the host tier and queues it for the disk tier, whose writer thread writes it off the step. A load
takes each block from the host tier, else from its file (checked), and writes them into the given blocks.

Keys: a block's content hash already covers its tokens, every token before it, the model path, dtype and
block size (the prefix cache's salt); the disk tier's directory adds a fingerprint of the checkpoint's files
and the tensor-parallel layout, so a changed checkpoint at the same path never meets old files.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence

import torch

from modeling.kv_cache import PagedKVCache
from modeling.instance_config import KVTiersConfig
from modeling.kv_tiers.disk import DiskTier
from modeling.kv_tiers.host import HostTier
from modeling.kv_tiers.stats import TierStats

log = logging.getLogger("magicserve.kv_tiers")

MB = 1 << 20


def checkpoint_fingerprint(model_path: str) -> str:
    """Names, sizes and modification times of the checkpoint directory's files, hashed."""
    h = hashlib.sha256()
    try:
        entries = sorted(os.scandir(model_path), key=lambda e: e.name)
    except OSError:
        entries = []
    for e in entries:
        if e.is_file():
            st = e.stat()
            h.update(f"{e.name}\x1f{st.st_size}\x1f{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


class KVTiers:
    """The host tier and the disk tier (either may be None) of one instance's cache."""

    def __init__(self, cache: PagedKVCache, host: HostTier | None, disk: DiskTier | None, write_queue_blocks: int = 4096):
        spec = cache.spec
        self.cache = cache
        self.host = host
        self.disk = disk
        self.block_shape = (spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.block_bytes = spec.bytes_per_block
        self._pending_copy: torch.cuda.Event | None = None  # the last device -> host copy of a save
        self._queue: queue.Queue = queue.Queue(maxsize=write_queue_blocks)
        self._writer = None
        if disk is not None:
            self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
            self._writer.start()

    @classmethod
    def build(cls, config: KVTiersConfig, cache: PagedKVCache, salt: bytes, model_path: str, instance_name: str,
              layout: str = "tp1") -> "KVTiers | None":
        """The tiers ``config`` asks for over ``cache`` (None when it asks for none). The disk tier lives in
        ``<disk root>/<namespace>/<instance_name>``, the namespace hashing ``salt``, the checkpoint's files and
        ``layout`` (which part of the KV heads this cache holds)."""
        if not config.active:
            return None
        host = HostTier(config.host_memory_mb * MB) if config.host_memory_mb else None
        disk = None
        if config.disk_mb:
            namespace = hashlib.sha256(salt + b"\x1f" + checkpoint_fingerprint(model_path).encode() + b"\x1f" +
                                       layout.encode()).hexdigest()[:16]
            disk = DiskTier.open(os.path.join(config.resolved_disk_dir(), namespace), instance_name,
                                 config.disk_mb * MB)
            log.info("kv tiers of %s: host %d MiB, disk %d MiB in %s (%d blocks found)", instance_name,
                     config.host_memory_mb, config.disk_mb, disk.directory, len(disk))
        return cls(cache, host, disk, config.write_queue_blocks)

    # -- lookups and loads (the worker's thread) --------------------------------------------------

    def find(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes``, from the first, some tier holds."""
        n = 0
        for h in hashes:
            if not ((self.host is not None and h in self.host) or (self.disk is not None and h in self.disk)):
                break
            n += 1
        return n

    def load(self, hashes: Sequence[int], blocks: Sequence[int]) -> int:
        """Write the KV of ``hashes[i]`` into ``blocks[i]``, from the first until one is missing (evicted since
        ``find``) or fails its check; returns how many were loaded."""
        self._wait_for_copies()
        parts: list[torch.Tensor] = []
        per_tier: list[TierStats] = []
        for h in hashes:
            t0 = time.perf_counter()
            kv = self.host.get(h) if self.host is not None else None
            tier = self.host
            if kv is None and self.disk is not None:
                payload = self.disk.read(h, self.block_bytes)
                if payload is not None:
                    kv = torch.frombuffer(payload, dtype=torch.uint8).view(self.cache.spec.dtype).view(self.block_shape)
                    tier = self.disk
                    if self.host is not None:
                        self.host.put(h, self._pinned(kv))
            if kv is None:
                break
            tier.stats.load_s += time.perf_counter() - t0
            parts.append(kv)
            per_tier.append(tier.stats)
        if not parts:
            return 0
        t0 = time.perf_counter()
        idx = torch.tensor(list(blocks[:len(parts)]), dtype=torch.long, device=self.cache.kv.device)
        # [n, L, 2, bs, H, D] -> the cache's [L, 2, blocks, bs, H, D]
        stacked = torch.stack(parts).movedim(0, 2).to(self.cache.kv.device, non_blocking=True)
        self.cache.kv.index_copy_(2, idx, stacked)
        share = (time.perf_counter() - t0) / len(parts)
        for stats in per_tier:
            stats.hits += 1
            stats.bytes_in += self.block_bytes
            stats.load_s += share
        return len(parts)

    # -- write-down (the worker's thread; disk writes on the writer thread) ------------------------

    def save(self, blocks: Sequence[int], hashes: Sequence[int]) -> None:
        """Keep the KV of ``blocks`` (final, cached under ``hashes``) in the tiers that lack it."""
        todo = [(b, h) for b, h in zip(blocks, hashes)
                if (self.host is not None and h not in self.host) or (self.disk is not None and h not in self.disk)]
        if not todo:
            return
        copies = self._copy_out([b for b, _ in todo])
        for (_, h), kv in zip(todo, copies):
            if self.host is not None:
                self.host.put(h, kv)
            if self.disk is not None:
                try:
                    self._queue.put_nowait((h, kv, self._pending_copy))
                except queue.Full:
                    self.disk.stats.dropped += 1

    def _copy_out(self, blocks: list[int]) -> list[torch.Tensor]:
        """The blocks' KV on the host, one [L, 2, bs, H, D] tensor each (views of one copy)."""
        kv = self.cache.kv
        idx = torch.tensor(blocks, dtype=torch.long, device=kv.device)
        gathered = kv.index_select(2, idx).movedim(2, 0)  # [n, L, 2, bs, H, D]
        if kv.device.type == "cpu":
            out = gathered.contiguous()
        else:
            out = torch.empty(gathered.shape, dtype=kv.dtype, pin_memory=True)
            out.copy_(gathered, non_blocking=True)
            self._pending_copy = torch.cuda.Event()
            self._pending_copy.record()
        return list(out.unbind(0))

    def _pinned(self, kv: torch.Tensor) -> torch.Tensor:
        return kv.pin_memory() if self.cache.kv.device.type == "cuda" else kv

    def _wait_for_copies(self) -> None:
        if self._pending_copy is not None:
            self._pending_copy.synchronize()
            self._pending_copy = None

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                block_hash, kv, copied = item
                if copied is not None:
                    copied.synchronize()
                self.disk.write(block_hash, kv.contiguous().view(torch.uint8).numpy().tobytes())
            except OSError as err:  # a full or failing disk: the block stays computable
                log.warning("kv disk tier: writing block %016x failed: %s", item[0], err)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Return once every queued disk write is done."""
        if self._writer is not None:
            self._queue.join()

    def close(self) -> None:
        """Finish the queued writes, stop the writer and release the disk directory."""
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
            self._writer = None
        if self.disk is not None:
            self.disk.close()

    def stats(self) -> dict[str, TierStats]:
        """Each tier's counters, by name (``host``, ``disk``)."""
        out = {}
        if self.host is not None:
            out["host"] = self.host.stats
        if self.disk is not None:
            out["disk"] = self.disk.stats
        return out
