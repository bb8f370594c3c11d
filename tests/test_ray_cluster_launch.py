"""Launching on an existing Ray cluster, as the README documents: `ray start --head`, then
`magicserve serve` with `ray.address` pointing at it, then the gRPC client CLI."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from controller.startup import parse_line
from frontend.client import Client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_wait_ready_times_out_cleanly_when_no_server_listens():
    """The polling loop below relies on this: a timed-out wait raises TimeoutError naming the address, and
    leaves no connectivity-polling thread behind to raise after the channel closes."""
    import threading

    address = f"127.0.0.1:{free_port()}"
    before = threading.active_count()
    with Client(address) as client:
        for _ in range(3):
            with pytest.raises(TimeoutError, match=address):
                client.wait_ready(timeout_s=0.2)
    time.sleep(0.5)
    assert threading.active_count() <= before


@pytest.mark.skipif(shutil.which("ray") is None, reason="ray CLI not on PATH")
def test_ray_start_head_then_serve(llama_dir, tmp_path):
    ray_port, grpc_port, http_port = free_port(), free_port(), free_port()
    # a throwaway localhost cluster: no auth token (a parallel local Ray may rewrite ~/.ray/auth_token)
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    subprocess.run(["ray", "start", "--head", f"--port={ray_port}", "--num-cpus=4", "--include-dashboard=false",
                    "--disable-usage-stats"], check=True, env=env, capture_output=True, timeout=120)
    config = tmp_path / "cluster.yaml"
    config.write_text(
        f"model: {{path: {llama_dir}, dtype: float32}}\n"
        f"ray: {{address: '127.0.0.1:{ray_port}'}}\n"
        "prefill: {kv_cache_tokens: 4096, attention_backend: torch}\n"
        "decode: {kv_cache_tokens: 4096, attention_backend: torch}\n"
        f"server: {{port: {grpc_port}, http_port: {http_port}}}\n")
    log = open(tmp_path / "serve.log", "w")
    serve = subprocess.Popen([sys.executable, "-m", "frontend.cli", "serve", "--config", str(config)],
                             stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        with Client(f"127.0.0.1:{grpc_port}") as client:
            deadline = time.time() + 150
            while True:
                try:
                    client.wait_ready(timeout_s=2)
                    result = client.generate([5, 6, 7], max_tokens=8, ignore_eos=True)
                    break
                except Exception:
                    assert serve.poll() is None, (tmp_path / "serve.log").read_text()
                    assert time.time() < deadline, (tmp_path / "serve.log").read_text()
                    time.sleep(1)
            assert len(result.token_ids) == 8 and result.finish_reason == "length"
        out = subprocess.run([sys.executable, "-m", "frontend.cli", "status", "--address", f"127.0.0.1:{grpc_port}"],
                             capture_output=True, text=True, timeout=60)
        assert "prefill-0" in out.stdout and "decode-0" in out.stdout, out.stdout + out.stderr
        assert "dtype float32 (set in the config)" in out.stdout, out.stdout
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models", timeout=30) as r:  # the HTTP front too
            assert json.load(r)["data"][0]["id"] == os.path.basename(llama_dir)
    finally:
        serve.terminate()  # SIGTERM: drain and shut down
        try:
            serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            serve.kill()
        subprocess.run(["ray", "stop", "--force"], env=env, capture_output=True, timeout=120)
    assert serve.returncode is not None
    lines = [ln for ln in (tmp_path / "serve.log").read_text().splitlines() if ln.startswith("magicserve:")]
    # the first line says what it serves in which dtype and why; the start-up's phases come before the ready line
    assert lines[0].startswith("magicserve: starting 1 prefill + 1 decode") and lines[0].endswith(
        "in float32 (set in the config)"), lines
    phases = next(parse_line(ln) for ln in lines if parse_line(ln))
    assert set(phases) == {"ray", "placement", "workers", "kv channels", "fronts"}, lines
