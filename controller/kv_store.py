"""The cluster's KV store, when ``magicserve serve`` runs it: a Mooncake master and a segment server on every node.

With ``kv_tiers.store.backend: mooncake`` and no ``master_address``, the cluster starts, on the head node, a
``mooncake_master`` (the store's index: which object lives where) and a ``mooncake_client`` segment server
(the memory that holds the objects, ``segment_mb``), each on free ports of ``host`` (localhost unless
configured), and hands the master's address to every instance. Every other node an instance is placed on gets
a segment server of its own, started there by a Ray actor (:class:`NodeSegment`), so the store's memory grows
with the cluster and objects can live near the instances that write them. The objects live in the segment
servers, not in the instances, so a drained, retired or dead instance's blocks stay in the store; a node that
leaves takes its segment's copies with it (``kv_tiers.store.replicas`` keeps each block on as many nodes, and
:meth:`MooncakeStoreService.forget_lost` lets a later :meth:`~MooncakeStoreService.cover` serve that node
again). The processes stop with the cluster (and with the process that started them); their logs go to
temporary directories named in the log. What each segment holds, as the master reports it, is
:meth:`MooncakeStoreService.occupancy`.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field

from modeling.instance_config import KVStoreConfig
from modeling.kv_tiers.store import local_address_towards

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


def _libc_prctl():
    """glibc's ``prctl``, looked up here in the parent (None off Linux or without glibc): the child between fork
    and exec only calls it, so it takes no lock another thread of this many-threaded process may hold."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: terminated when the process that started it dies, so a store process never
    outlives the server or the actor that owns it."""
    _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


def _spawn(argv: list[str], log_path: str) -> subprocess.Popen:
    with open(log_path, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent if _PRCTL is not None else None)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _start_segment(config: KVStoreConfig, master_address: str, host: str, log_dir: str,
                   timeout_s: float) -> tuple[subprocess.Popen, str]:
    """A ``mooncake_client`` segment server holding ``config.segment_mb`` on a free port of ``host``, listening;
    (its process, its address)."""
    port = _free_port(host)
    log_path = os.path.join(log_dir, f"segment-{port}.log")
    proc = _spawn([_binary("mooncake_client"), f"--global_segment_size={config.segment_mb}MB",
                   f"--master_server_address={master_address}", "--metadata_server=P2PHANDSHAKE", f"--host={host}",
                   f"--port={port}", f"--protocol={config.protocol}"], log_path)
    try:
        _wait_for_port(host, port, proc, "mooncake_client (the store's segment server)", log_path, timeout_s)
    except BaseException:
        _stop(proc)
        raise
    return proc, f"{host}:{port}"


class NodeSegment:
    """A Ray actor on one node: the segment server holding that node's part of the store (started by
    :meth:`MooncakeStoreService.cover`)."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None

    def start(self, config: KVStoreConfig, master_address: str, timeout_s: float) -> str:
        """Start the segment server, bound to this node's address towards the master; its address."""
        log_dir = tempfile.mkdtemp(prefix="magicserve-kv-segment-")
        self._proc, name = _start_segment(config, master_address, local_address_towards(master_address), log_dir,
                                          timeout_s)
        log.info("kv store: a %d MiB segment server at %s (log in %s)", config.segment_mb, name, log_dir)
        return name

    def stop(self) -> None:
        if self._proc is not None:
            _stop(self._proc)
            self._proc = None


def placement_nodes(groups: Iterable) -> list[str]:
    """The Ray nodes the bundles of placement ``groups`` were placed on."""
    import ray

    return [node for g in groups for node in ray.util.placement_group_table(g).get("bundles_to_node_id", {}).values()]


@dataclass(frozen=True)
class StoreSegment:
    """One segment server as the master reports it: its name (``host:port``), the Ray node it runs on (empty:
    not one this cluster started), and its memory."""

    name: str
    node: str
    capacity_bytes: int
    used_bytes: int


@dataclass(frozen=True)
class StoreOccupancy:
    """The store as its master reports it: every segment, and the objects (KV blocks) it holds."""

    segments: tuple[StoreSegment, ...]
    objects: int

    @property
    def capacity_bytes(self) -> int:
        return sum(s.capacity_bytes for s in self.segments)

    @property
    def used_bytes(self) -> int:
        return sum(s.used_bytes for s in self.segments)


_SEGMENT_METRIC = re.compile(r'^(segment_total_capacity_bytes|segment_allocated_bytes)\{segment="([^"]+)"\} (\S+)$')


def parse_master_metrics(text: str, nodes: dict[str, str]) -> StoreOccupancy:
    """The master's Prometheus text (``mooncake_master --metrics_port``) as occupancy; ``nodes``: segment name ->
    Ray node."""
    capacity: dict[str, int] = {}
    used: dict[str, int] = {}
    objects = 0
    for line in text.splitlines():
        m = _SEGMENT_METRIC.match(line)
        if m:
            (capacity if m.group(1) == "segment_total_capacity_bytes" else used)[m.group(2)] = int(float(m.group(3)))
        elif line.startswith("master_key_count "):
            objects = int(float(line.split()[1]))
    segments = tuple(StoreSegment(name, nodes.get(name, ""), capacity[name], used.get(name, 0))
                     for name in sorted(capacity))
    return StoreOccupancy(segments, objects)


@dataclass
class MooncakeStoreService:
    """A running master and its segment servers; ``master_address`` is what the instances connect to."""

    config: KVStoreConfig
    master_address: str
    log_dir: str
    metrics_address: str = ""  # the master's Prometheus endpoint, host:port
    processes: list[subprocess.Popen] = field(default_factory=list)
    segments: dict[str, str] = field(default_factory=dict)  # segment name -> the Ray node it runs on
    _node_actors: dict[str, object] = field(default_factory=dict)  # Ray node -> its NodeSegment actor

    @classmethod
    def start(cls, config: KVStoreConfig, host: str = "127.0.0.1", timeout_s: float = 60.0,
              master_port: int | None = None, node: str = "") -> "MooncakeStoreService":
        """Start the master (on ``master_port``, None: a free one), then a segment server here (on Ray node
        ``node``, when known) holding ``config.segment_mb``; returns once both listen."""
        log_dir = tempfile.mkdtemp(prefix="magicserve-kv-store-")
        service = cls(config, master_address="", log_dir=log_dir)
        try:
            port = master_port or _free_port(host)
            metrics_port = _free_port(host)
            master_log = os.path.join(log_dir, "master.log")
            master = _spawn([_binary("mooncake_master"), f"--rpc_address={host}", f"--rpc_port={port}",
                             f"--metrics_host={host}", f"--metrics_port={metrics_port}"], master_log)
            service.processes.append(master)
            _wait_for_port(host, port, master, "mooncake_master", master_log, timeout_s)
            service.master_address, service.metrics_address = f"{host}:{port}", f"{host}:{metrics_port}"
            segment, _ = _start_segment(config, service.master_address, host, log_dir, timeout_s)
            service.processes.append(segment)
            service.segments[service._new_segment(timeout_s)] = node
        except BaseException:
            service.stop()
            raise
        log.info("kv store: Mooncake master at %s, a %d MiB segment server (logs in %s)", service.master_address,
                 config.segment_mb, log_dir)
        return service

    def cover(self, nodes: Iterable[str], timeout_s: float = 60.0) -> list[str]:
        """Start a segment server on each of the Ray ``nodes`` that has none yet (a :class:`NodeSegment` actor
        pinned there); the nodes it started one on. One that fails to start is logged and left out: the store
        serves with the segments it has."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.forget_lost()
        held = set(self.segments.values())
        started = []
        for node in dict.fromkeys(n for n in nodes if n and n not in held):
            actor = ray.remote(num_cpus=0, max_restarts=0)(NodeSegment).options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
            try:
                ray.get(actor.start.remote(self.config, self.master_address, timeout_s), timeout=timeout_s + 30)
                name = self._new_segment(timeout_s)
            except Exception as err:
                log.warning("kv store: no segment server on node %s: %s", node, err)
                ray.kill(actor)
                continue
            self._node_actors[node] = actor
            self.segments[name] = node
            started.append(node)
        return started

    def forget_lost(self) -> list[str]:
        """Forget the segments the master no longer reports (their server or node went away, and the master
        dropped them once their heartbeats stopped for its client TTL, with the copies they held): the nodes
        they were on, which :meth:`cover` serves again. Nothing when the master does not answer."""
        occupancy = self.occupancy()
        if occupancy is None:
            return []
        live = {s.name for s in occupancy.segments}
        lost = []
        for name in [n for n in self.segments if n not in live]:
            node = self.segments.pop(name)
            actor = self._node_actors.pop(node, None)
            if actor is not None:
                import ray

                try:
                    ray.kill(actor)
                except Exception:  # its node is gone, and the actor with it
                    pass
            log.warning("kv store: the segment server at %s (node %s) left the store; the blocks only it held "
                        "are computed again when asked for", name, node or "of the master")
            lost.append(node)
        return lost

    def _new_segment(self, timeout_s: float) -> str:
        """The name the master gives the segment just started (its transfer endpoint, not the address it was
        started on): the one segment it reports that this service does not know yet."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            occupancy = self.occupancy()
            new = [s.name for s in occupancy.segments if s.name not in self.segments] if occupancy else []
            if len(new) == 1:
                return new[0]
            time.sleep(0.1)
        raise KVStoreError(f"the store's master at {self.master_address} did not report the new segment server "
                           f"within {timeout_s:.0f} s")

    def occupancy(self, timeout_s: float = 2.0) -> StoreOccupancy | None:
        """Every segment's memory and the objects held, from the master (None: it did not answer)."""
        try:
            with urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=timeout_s) as resp:
                text = resp.read().decode("utf-8", "replace")
        except OSError:
            return None
        return parse_master_metrics(text, self.segments)

    async def occupancy_now(self) -> StoreOccupancy | None:
        """:meth:`occupancy`, off the event loop."""
        return await asyncio.to_thread(self.occupancy)

    def stop(self) -> None:
        """Stop the other nodes' segment servers, this node's, then the master (the store's contents go with
        them)."""
        if self._node_actors:
            import ray

            for actor in self._node_actors.values():
                try:
                    ray.get(actor.stop.remote(), timeout=30)
                    ray.kill(actor)
                except Exception:  # the node or the actor is gone: its process went with it
                    pass
            self._node_actors.clear()
        for proc in reversed(self.processes):
            _stop(proc)
        self.processes.clear()
