"""The cluster's KV store, when ``magicserve serve`` runs it: a Mooncake master and a segment server.

With ``kv_tiers.store.backend: mooncake`` and no ``master_address``, the cluster starts, on the head node, a
``mooncake_master`` (the store's index: which object lives where) and a ``mooncake_client`` segment server
(the memory that holds the objects, ``segment_mb``), each on free ports of ``host`` (localhost unless
configured), and hands the master's address to every instance. The objects live in the segment server, not in
the instances, so a drained, retired or dead instance's blocks stay in the store. The processes stop with the
cluster; their logs go to a temporary directory named in the log.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

from modeling.instance_config import KVStoreConfig

log = logging.getLogger("magicserve.kv_store")


class KVStoreError(RuntimeError):
    """The store's processes could not start."""


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _binary(name: str) -> str:
    """The Mooncake executable ``name``: on PATH, else inside the ``mooncake`` package."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import mooncake
    except ImportError:
        mooncake = None
    path = os.path.join(os.path.dirname(mooncake.__file__), name) if mooncake is not None else ""
    if not path or not os.access(path, os.X_OK):
        raise KVStoreError(f"kv_tiers.store.backend: mooncake needs {name} (pip install -e '.[store]', and "
                           "apt-get install libibverbs1)")
    return path


def _wait_for_port(host: str, port: int, proc: subprocess.Popen, what: str, log_path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log_path, errors="replace") as f:
                tail = f.read()[-2000:]
            raise KVStoreError(f"{what} exited with {proc.returncode}:\n{tail}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise KVStoreError(f"{what} did not listen on {host}:{port} within {timeout_s:.0f} s (log: {log_path})")


@dataclass
class MooncakeStoreService:
    """A running master and segment server; ``master_address`` is what the instances connect to."""

    master_address: str
    log_dir: str
    processes: list[subprocess.Popen] = field(default_factory=list)

    @classmethod
    def start(cls, config: KVStoreConfig, host: str = "127.0.0.1", timeout_s: float = 60.0,
              master_port: int | None = None) -> "MooncakeStoreService":
        """Start the master (on ``master_port``, None: a free one), then the segment server holding
        ``config.segment_mb``; returns once both listen."""
        log_dir = tempfile.mkdtemp(prefix="magicserve-kv-store-")
        service = cls(master_address="", log_dir=log_dir)
        try:
            port = master_port or _free_port(host)
            metrics_port, client_port = _free_port(host), _free_port(host)
            master_log = os.path.join(log_dir, "master.log")
            master = service._spawn([_binary("mooncake_master"), f"--rpc_address={host}", f"--rpc_port={port}",
                                     f"--metrics_host={host}", f"--metrics_port={metrics_port}"], master_log)
            _wait_for_port(host, port, master, "mooncake_master", master_log, timeout_s)
            service.master_address = f"{host}:{port}"
            client_log = os.path.join(log_dir, "segment.log")
            segment = service._spawn([_binary("mooncake_client"), f"--global_segment_size={config.segment_mb}MB",
                                      f"--master_server_address={service.master_address}",
                                      "--metadata_server=P2PHANDSHAKE", f"--host={host}", f"--port={client_port}",
                                      f"--protocol={config.protocol}"], client_log)
            _wait_for_port(host, client_port, segment, "mooncake_client (the store's segment server)", client_log,
                           timeout_s)
        except BaseException:
            service.stop()
            raise
        log.info("kv store: Mooncake master at %s, a %d MiB segment server (logs in %s)", service.master_address,
                 config.segment_mb, log_dir)
        return service

    def _spawn(self, argv: list[str], log_path: str) -> subprocess.Popen:
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.processes.append(proc)
        return proc

    def stop(self) -> None:
        """Stop the segment server, then the master (the store's contents go with them)."""
        for proc in reversed(self.processes):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.processes.clear()
