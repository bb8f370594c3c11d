"""The disk tier: full KV blocks as files in a local directory, least recently used evicted first.

One file per block, ``<hash as 16 hex digits>.kv``: a header (magic, the block's hash, the payload's length and
its CRC-32) and the block's KV as raw bytes (never pickled). A file is written under a temporary name and
renamed, so a reader sees a whole file or none; a truncated or corrupt one (a disk error, a crash mid-rename on
a file system without atomic rename) fails its length or checksum, is deleted and counted, and the block is
computed instead. The directory outlives the process: a restarted instance indexes the files it finds (oldest
modification first) and serves them after checking each as it loads it.

An instance holds its directory by an exclusive lock on ``.lock`` (released when the process ends); a second
instance under the same name takes the next free ``name.1``, ``name.2``. Written from the tier's writer thread
and read from the worker's thread: the index is guarded by a lock.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import zlib
from collections import OrderedDict

from modeling.kv_tiers.events import DISK, TierEvents
from modeling.kv_tiers.stats import TierStats

MAGIC = b"MSKVBLK1"
HEADER = struct.Struct("<8sQQI")  # magic, block hash, payload bytes, CRC-32 of the payload
SUFFIX = ".kv"


class DiskTier:
    """Up to ``capacity_bytes`` of block files in ``directory`` (which this instance holds locked)."""

    def __init__(self, directory: str, capacity_bytes: int, lock_fd: int):
        self.directory = directory
        self.capacity_bytes = capacity_bytes
        self._lock_fd = lock_fd
        self._lock = threading.Lock()
        self._index: OrderedDict[int, int] = OrderedDict()  # hash -> file size, least recently used first
        self.stats = TierStats(capacity_bytes=capacity_bytes)
        self.events: TierEvents | None = None  # set while the router is told what the tier holds
        self._index_existing()

    @classmethod
    def open(cls, root: str, name: str, capacity_bytes: int) -> "DiskTier":
        """The tier in ``root/name`` (or ``root/name.N``, the first not locked by another live process)."""
        os.makedirs(root, exist_ok=True)
        for n in range(1024):
            directory = os.path.join(root, name if n == 0 else f"{name}.{n}")
            os.makedirs(directory, exist_ok=True)
            fd = os.open(os.path.join(directory, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return cls(directory, capacity_bytes, fd)
        raise OSError(f"kv_tiers.disk_dir: every directory {root}/{name}[.N] is in use by another process")

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = -1

    def __contains__(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def hashes(self) -> list[int]:
        """The hashes held now, least recently used first."""
        with self._lock:
            return list(self._index)

    def _tell(self, block_hash: int, stored: bool) -> None:
        if self.events is not None:
            self.events.add(DISK, block_hash, stored)

    def _path(self, block_hash: int) -> str:
        return os.path.join(self.directory, f"{block_hash:016x}{SUFFIX}")

    def _index_existing(self) -> None:
        found = []
        for entry in os.scandir(self.directory):
            if entry.name.startswith(".tmp-"):
                os.unlink(entry.path)  # a write the last process did not finish
            elif entry.name.endswith(SUFFIX) and entry.is_file():
                try:
                    block_hash = int(entry.name[:-len(SUFFIX)], 16)
                except ValueError:
                    continue
                st = entry.stat()
                found.append((st.st_mtime_ns, block_hash, st.st_size))
        for _, block_hash, size in sorted(found):
            self._index[block_hash] = size
            self.stats.bytes += size
        self.stats.blocks = len(self._index)
        with self._lock:
            self._evict_for(0)

    def _evict_for(self, size: int) -> None:
        """Drop least recently used files until ``size`` more bytes fit (the caller holds the lock)."""
        while self._index and self.stats.bytes + size > self.capacity_bytes:
            block_hash, old = self._index.popitem(last=False)
            self.stats.bytes -= old
            self.stats.evicted += 1
            self._tell(block_hash, False)
            try:
                os.unlink(self._path(block_hash))
            except FileNotFoundError:
                pass
        self.stats.blocks = len(self._index)

    def write(self, block_hash: int, payload: bytes) -> bool:
        """Store ``payload`` as the block's file (from the writer thread). False when held already or larger
        than the tier."""
        size = HEADER.size + len(payload)
        with self._lock:
            if block_hash in self._index or size > self.capacity_bytes:
                return False
        header = HEADER.pack(MAGIC, block_hash, len(payload), zlib.crc32(payload))
        tmp = os.path.join(self.directory, f".tmp-{block_hash:016x}-{threading.get_ident()}")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        with self._lock:
            self._evict_for(size)
            os.replace(tmp, self._path(block_hash))
            self._index[block_hash] = size
            self.stats.bytes += size
            self.stats.stored += 1
            self.stats.bytes_out += size
            self.stats.blocks = len(self._index)
        self._tell(block_hash, True)
        return True

    def read(self, block_hash: int, expected_bytes: int) -> memoryview | None:
        """The block's payload of ``expected_bytes`` (None: not held, or the file is truncated or corrupt, in
        which case it is deleted and counted)."""
        with self._lock:
            if block_hash not in self._index:
                return None
            self._index.move_to_end(block_hash)
        path = self._path(block_hash)
        buf = bytearray(HEADER.size + expected_bytes)
        try:
            with open(path, "rb") as f:
                n = f.readinto(buf)
                longer = bool(f.read(1))
        except FileNotFoundError:  # evicted by the writer since the lookup: a miss
            return None
        ok = n == len(buf) and not longer
        if ok:
            magic, stored_hash, nbytes, crc = HEADER.unpack_from(buf)
            payload = memoryview(buf)[HEADER.size:]
            ok = magic == MAGIC and stored_hash == block_hash and nbytes == expected_bytes and \
                zlib.crc32(payload) == crc
        if not ok:
            self._discard(block_hash)
            self.stats.corrupt += 1
            return None
        try:
            os.utime(path)  # a restarted instance orders its index by this
        except FileNotFoundError:
            pass
        return payload

    def _discard(self, block_hash: int) -> None:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self.stats.bytes -= size
                self.stats.blocks = len(self._index)
                self._tell(block_hash, False)
        try:
            os.unlink(self._path(block_hash))
        except FileNotFoundError:
            pass
