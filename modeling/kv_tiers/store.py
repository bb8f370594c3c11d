"""The store tier: full KV blocks in a cluster-wide store (Mooncake Store), where any instance on any node
finds the blocks another computed, and where they outlive the instance that wrote them.

Each block is one object, keyed ``magicserve/<namespace>/<hash as 16 hex digits>`` (the namespace hashes
what besides the tokens shapes the KV: ``tiers.py``), holding the same bytes as a disk tier file: a header
with the payload's length and CRC-32, then the KV. A missing, truncated or corrupt object is a miss (counted),
never served.

The store is an outside service, so every call may fail: a failed call marks it down for ``retry_s``, during
which lookups find nothing there and the instance computes; the next call after that tries again, and
serving heals when the store is back. Connecting (which waits for the master) and every write run on the
tiers' writer thread; lookups and loads run on the worker's thread over a client of their own, so a slow write
never holds a step.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import zlib
from collections.abc import Sequence

from modeling.instance_config import KVStoreConfig
from modeling.kv_tiers.disk import HEADER, MAGIC
from modeling.kv_tiers.events import STORE, TierEvents
from modeling.kv_tiers.stats import TierStats

log = logging.getLogger("magicserve.kv_tiers")

MB = 1 << 20
EXISTS = 1


class StoreUnavailable(RuntimeError):
    """The store's client library is missing or cannot load."""


def _client_class():
    # the client library logs through glog to stderr, an error line on every connect included; our own log
    # reports what fails (read when the library loads)
    os.environ.setdefault("GLOG_minloglevel", "3")
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as err:
        raise StoreUnavailable(
            "kv_tiers.store.backend: mooncake needs the mooncake-transfer-engine package (pip install -e '.[store]') "
            f"and libibverbs1 (apt-get install libibverbs1): {err}") from None
    return MooncakeDistributedStore


def client_problem() -> str | None:
    """Why the store's client library cannot load here (None: it can)."""
    try:
        _client_class()
    except StoreUnavailable as err:
        return str(err)
    return None


def local_address_towards(master_address: str) -> str:
    """This node's address as the master's host sees it (the interface a connection to it leaves from)."""
    host = master_address.rsplit(":", 1)[0]
    if host in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent: this only picks the route
        return s.getsockname()[0]


def encode(block_hash: int, payload: bytes) -> bytes:
    """A block's object: header (magic, hash, length, CRC-32) and payload, as the disk tier writes its files."""
    return HEADER.pack(MAGIC, block_hash, len(payload), zlib.crc32(payload)) + payload


def decode(block_hash: int, data: bytes, expected_bytes: int) -> memoryview | None:
    """The payload of a block's object, or None when it is not the whole, intact object of that block."""
    if len(data) != HEADER.size + expected_bytes:
        return None
    magic, stored_hash, nbytes, crc = HEADER.unpack_from(data)
    payload = memoryview(data)[HEADER.size:]
    if magic != MAGIC or stored_hash != block_hash or nbytes != expected_bytes or zlib.crc32(payload) != crc:
        return None
    return payload


class StoreTier:
    """Blocks in the store under ``namespace``, over two clients (reads on the worker's thread and the read-ahead
    thread, one call at a time; writes on the writer's), connected from the writer thread (``connect``)."""

    def __init__(self, config: KVStoreConfig, namespace: str):
        """Raises :class:`StoreUnavailable` when the client library cannot load (before any thread starts)."""
        self._client_cls = _client_class()
        self.config = config
        self.prefix = f"magicserve/{namespace}/"
        self.stats = TierStats()
        self.events: TierEvents | None = None  # set while the router is told what the store holds
        self._reader = None
        self._writer = None
        self._put_config = None
        self._down_until = 0.0
        self._ready = threading.Event()
        self._reading = threading.Lock()  # the reader client serves one call at a time

    def _key(self, block_hash: int) -> str:
        return f"{self.prefix}{block_hash:016x}"

    # -- connection (the writer thread) -----------------------------------------------------------

    def connect(self) -> bool:
        """Set up both clients (blocks while the master is unreachable); False, logged, when it fails."""
        cls = self._client_cls
        c = self.config
        host = local_address_towards(c.master_address)
        clients = []
        for _ in range(2):
            client = cls()
            rc = client.setup(host, "P2PHANDSHAKE", 0, c.local_buffer_mb * MB, c.protocol, c.rdma_devices,
                              c.master_address)
            if rc != 0:
                log.warning("kv store: connecting to the Mooncake master at %s failed (%d); computing instead",
                            c.master_address, rc)
                self._mark_down()
                return False
            clients.append(client)
        self._reader, self._writer = clients
        self._put_config = self._replicate_config()
        self._ready.set()
        log.info("kv store: connected to the Mooncake master at %s as %s", c.master_address, host)
        return True

    def _replicate_config(self):
        from mooncake.store import ReplicateConfig

        config = ReplicateConfig()
        config.replica_num = self.config.replicas  # the master puts each copy in another segment
        return config

    @property
    def connected(self) -> bool:
        return self._ready.is_set()

    def wait_connected(self, timeout_s: float) -> bool:
        return self._ready.wait(timeout_s)

    def _mark_down(self) -> None:
        if time.monotonic() >= self._down_until:
            log.warning("kv store: a call failed; computing instead for %.0f s", self.config.retry_s)
        self._down_until = time.monotonic() + self.config.retry_s

    def ready_to_retry(self) -> bool:
        """No failed call within the last ``retry_s``."""
        return time.monotonic() >= self._down_until

    def _usable(self) -> bool:
        return self._ready.is_set() and time.monotonic() >= self._down_until

    # -- reads (the worker's thread) --------------------------------------------------------------

    def find(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes``, from the first, the store holds (0 while it is down)."""
        if not hashes or not self._usable():
            return 0
        try:
            with self._reading:
                found = self._reader.batch_is_exist([self._key(h) for h in hashes])
        except Exception:  # the client library raises its own errors: any of them means down
            found = [-1]
        n = 0
        for r in found:
            if r != EXISTS:
                if r < 0:
                    self._mark_down()
                break
            n += 1
        return n

    def read(self, hashes: Sequence[int], expected_bytes: int) -> list[memoryview]:
        """The payloads of the leading run of ``hashes`` the store returns whole and intact."""
        if not hashes or not self._usable():
            return []
        try:
            with self._reading:
                data = self._reader.get_batch([self._key(h) for h in hashes])
        except Exception:
            self._mark_down()
            return []
        out = []
        for h, d in zip(hashes, data):
            payload = decode(h, d, expected_bytes) if d else None
            if payload is None:
                if d:
                    self.stats.corrupt += 1
                break
            out.append(memoryview(bytearray(payload)))  # writable, as torch.frombuffer wants it
        return out

    # -- writes (the writer thread) ---------------------------------------------------------------

    def write(self, block_hash: int, payload: bytes) -> bool:
        """Put the block's object (an object already there stays as it is)."""
        if not self._usable():
            return False
        data = encode(block_hash, payload)
        try:
            rc = self._writer.put(self._key(block_hash), data, self._put_config)
        except Exception:
            rc = -1
        if rc != 0:
            self._mark_down()
            return False
        self.stats.stored += 1
        self.stats.bytes_out += len(data)
        if self.events is not None:
            self.events.add(STORE, block_hash, True)
        return True

    def close(self) -> None:
        for client in (self._reader, self._writer):
            if client is not None:
                try:
                    client.close()
                except Exception:
                    pass
        self._reader = self._writer = None
        self._ready.clear()
