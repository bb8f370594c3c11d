"""benchmarks/slo_sweep.py: the HTTP/SSE client, prompt construction, records -> attainment / goodput,
figures, the comparison, argument errors, the open-loop time limit, the order of a sweep, launched servers
stopped with their children; and one small sweep against a real local magicserve server (Ray cluster +
gRPC on a tiny checkpoint)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import sys
import time

import pytest

from benchmarks import slo_compare, slo_sweep
from benchmarks.slo_sweep import ChunkedDecoder, OpenAITarget, RequestRecord, SSEParser, TargetError
from controller.defaults import DEFAULT_MODEL_DIR
from planner.workload import RequestSpec, save_trace


def split_randomly(data: bytes, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, 12)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]


# --------------------------------------------------------------------------------------------------
# HTTP / SSE


def test_sse_parser_any_split():
    stream = ('data: {"a": 1}\r\n\r\n: keep-alive comment\n\nevent: x\ndata: line1\ndata:line2\n\n'
              'data: {"t": "é€"}\n\ndata: [DONE]\n\n').encode()
    for seed in range(20):
        parser = SSEParser()
        events = [e for part in split_randomly(stream, seed) for e in parser.feed(part)]
        assert events == ['{"a": 1}', "line1\nline2", '{"t": "é€"}', "[DONE]"]


def test_chunked_decoder_any_split():
    body = b"".join(f"{len(c):x};ext=1\r\n".encode() + c + b"\r\n" for c in (b"hello ", b"", b"world" * 50)[::2])
    body += b"0\r\nTrailer: x\r\n\r\n"
    for seed in range(20):
        dec = ChunkedDecoder()
        out = b"".join(dec.feed(part) for part in split_randomly(body, seed))
        assert out == b"hello " + b"world" * 50 and dec.done
    with pytest.raises(TargetError, match="chunk size"):
        ChunkedDecoder().feed(b"zz\r\n")


def _sse_chunk(payload: str) -> bytes:
    data = f"data: {payload}\n\n".encode()
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _fake_openai_server(requests_seen: list):
    """A vLLM-like /v1/models + streaming /v1/completions (chunked transfer coding)."""

    async def handle(reader, writer):
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        length = next((int(line.split(":")[1]) for line in head.split("\r\n") if line.lower().startswith("content-length")), 0)
        body = json.loads(await reader.readexactly(length)) if length else None
        if head.startswith("GET /v1/models"):
            data = json.dumps({"object": "list", "data": [{"id": "tiny"}]}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
        elif body["max_tokens"] > 100:
            data = b'{"error": {"message": "max_tokens too large"}}'
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
        else:
            requests_seen.append(body)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            n = body["max_tokens"]
            first = {"choices": [{"index": 0, "text": "a", "token_ids": [5], "prompt_token_ids": body["prompt"]}]}
            writer.write(_sse_chunk(json.dumps(first)))
            await writer.drain()
            for i in range(1, n - 1, 2):  # two tokens per event, as with speculation
                await asyncio.sleep(0.01)
                writer.write(_sse_chunk(json.dumps({"choices": [{"index": 0, "text": "bc", "token_ids": [6, 7]}]})))
                await writer.drain()
            last = {"choices": [{"index": 0, "text": "", "token_ids": [8] if n % 2 == 0 else [], "finish_reason": "length"}]}
            writer.write(_sse_chunk(json.dumps(last)))
            writer.write(_sse_chunk(json.dumps({"choices": [], "usage": {"completion_tokens": n}})))
            writer.write(_sse_chunk("[DONE]") + b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_openai_target_against_fake_server():
    async def run():
        seen: list = []
        server = await _fake_openai_server(seen)
        port = server.sockets[0].getsockname()[1]
        target = OpenAITarget(f"http://127.0.0.1:{port}")
        assert (await target.start())["model"] == "tiny"
        loop = asyncio.get_running_loop()
        clock = loop.time
        rec = RequestRecord(0, 0.0, 3, 8)
        await target.generate([11, 12, 13], 8, {"temperature": 0.0}, rec, clock)
        bad = RequestRecord(1, 0.0, 3, 500)
        with pytest.raises(TargetError, match="HTTP 400"):
            await target.generate([11], 500, {"temperature": 0.0}, bad, clock)
        server.close()
        return seen, rec

    seen, rec = asyncio.run(run())
    assert seen[0]["prompt"] == [11, 12, 13] and seen[0]["ignore_eos"] is True and seen[0]["stream"] is True
    assert seen[0]["temperature"] == 0.0 and seen[0]["max_tokens"] == 8
    assert rec.finish_reason == "length" and rec.completion_tokens == 8 and rec.ok
    assert 0 <= rec.ttft_s < rec.e2e_s and rec.tpot_s > 0


# --------------------------------------------------------------------------------------------------
# prompts


def test_prompts_exact_lengths_without_eos():
    corpus = slo_sweep.heldout_corpus(DEFAULT_MODEL_DIR, 20000)
    eos = slo_sweep.model_eos_ids(DEFAULT_MODEL_DIR)
    assert eos == {0} and len(corpus) >= 20000 and 0 not in corpus
    lengths = [1, 16, 300, 2048, 7936]
    prompts = slo_sweep.make_prompts(corpus, lengths, seed=3)
    assert [len(p) for _, p in prompts] == lengths
    assert all(corpus[off : off + len(p)] == p for off, p in prompts)
    assert prompts == slo_sweep.make_prompts(corpus, lengths, seed=3)
    assert prompts != slo_sweep.make_prompts(corpus, lengths, seed=4)
    with pytest.raises(ValueError, match="longest prompt"):
        slo_sweep.make_prompts(corpus[:10], [11], seed=0)


# --------------------------------------------------------------------------------------------------
# records -> attainment, goodput, figures, comparison


def rec(i, ttft, tpot, finish="length", error=None):
    r = RequestRecord(i, float(i), 10, 5, finish_reason=finish, error=error, ttft_s=ttft, tpot_s=tpot,
                      completion_tokens=5 if finish == "length" else 0)
    return r.to_json()


def sweep_result(label="sys", cores=2.0, per_rate=None):
    """A two-rate result: at rate 1 all 4 attain, at rate 2 one of 4 does."""
    per_rate = per_rate or {
        1.0: [rec(0, 0.1, 0.01), rec(1, 0.2, 0.02), rec(2, 0.3, 0.03), rec(3, 0.4, 0.04)],
        2.0: [rec(0, 0.1, 0.01), rec(1, 5.0, 0.02), rec(2, 0.1, 0.5), rec(3, None, None, "unfinished")],
    }
    settings = {"target": "grpc", "workload": "chat", "num_requests": 4, "rates": sorted(per_rate), "cv": 1.0, "seed": 0,
                "temperature": 0.0, "ttft_slo_ms": 1000.0, "tpot_slo_ms": 100.0, "attainment_target": 0.9,
                "slo_scales": [0.25, 1.0, 100.0], "scale_rate": None, "label": label, "cores": cores}
    rows = [slo_sweep.summarize_rate(r, recs, 10.0, 60.0, 1.0, 0.1) for r, recs in sorted(per_rate.items())]
    return {"benchmark": "slo_sweep", "command": "test", "hardware": {"cpus": 2, "platform": "test"},
            "settings": settings, "rates": rows, "server": {"model": "m"}}


def test_records_to_attainment():
    records = [rec(0, 0.5, 0.05), rec(1, 1.5, 0.05), rec(2, 0.5, 0.15), rec(3, 1.5, 0.15),
               rec(4, 0.1, 0.01, finish=None, error="UNAVAILABLE: x"), rec(5, 0.1, None, finish="unfinished"),
               rec(6, 0.1, 0.01, finish="abort")]
    a = slo_sweep.attainment_of(records, 1.0, 0.1)
    assert a == {"both": 1 / 7, "ttft_only": 2 / 7, "tpot_only": 2 / 7, "requests": 7}
    row = slo_sweep.summarize_rate(1.0, records, 10.0, 60.0, 1.0, 0.1)
    assert (row["finished"], row["errors"], row["unfinished"]) == (4, 1, 1)
    assert math.isclose(row["latency_ms"]["ttft_p50"], 1000.0)


def test_attainment_on_the_servers_clock():
    late = rec(0, 1.5, 0.05)  # the client saw the first token late ...
    late.update(server_ttft_s=0.4, server_tpot_s=0.05)  # ... the server sent it in time
    slow = rec(1, 0.5, 0.05)
    slow.update(server_ttft_s=0.45, server_tpot_s=0.2)
    assert slo_sweep.attainment_of([late, slow], 1.0, 0.1)["both"] == 0.5  # client: only `slow` (TPOT 0.05)
    assert slo_sweep.attainment_of([late, slow], 1.0, 0.1, "server")["both"] == 0.5  # server: only `late`
    assert slo_sweep.outcome_of(late, "server").ttft_s == 0.4 and slo_sweep.outcome_of(late).ttft_s == 1.5
    assert slo_sweep.server_view([late, slow], 1.0, 0.1)["server_attainment"]["ttft_only"] == 1.0
    assert slo_sweep.server_view([rec(2, 0.5, 0.05)], 1.0, 0.1) == {}  # an OpenAI target reports none
    with pytest.raises(ValueError, match="timing"):
        slo_sweep.outcome_of(late, "wall")


def test_analysis_figures_and_compare(tmp_path):
    result = slo_sweep.analyse(sweep_result())
    assert result["goodput"]["both"] == pytest.approx(1.0 + (1.0 - 0.9) / (1.0 - 0.25))
    assert result["goodput_per_core"]["both"] == pytest.approx(result["goodput"]["both"] / 2)
    sc = result["slo_scale"]
    assert sc["rate"] == 1.0 and sc["both"] == [0.5, 1.0, 1.0]  # at a quarter of the SLOs, two of four still attain
    files = slo_sweep.write_outputs(result, str(tmp_path / "sweep"))
    for key in ("json", "md", "rate_png", "scale_png"):
        assert os.path.getsize(files[key]) > 0
    assert open(files["rate_png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert "Goodput at 90%" in open(files["md"]).read()

    other = slo_sweep.analyse(sweep_result("other", cores=4.0))
    slo_sweep.write_outputs(other, str(tmp_path / "other"))
    assert slo_compare.main([files["json"], str(tmp_path / "other.json"), "--per-core", "--out", str(tmp_path / "cmp")]) == 0
    md = open(tmp_path / "cmp.md").read()
    assert "| sys | 2 |" in md and "| other | 4 |" in md and "0.50 |" in md  # same goodput on twice the cores
    assert os.path.getsize(tmp_path / "cmp.png") > 0


@pytest.mark.parametrize("argv, flag", [
    (["--address", "a:1", "--rates", "1,0.5"], "--rates"),
    (["--address", "a:1", "--rates", "x"], "--rates"),
    (["--target", "grpc"], "--address"),
    (["--address", "a:1", "--launch-vllm", "m"], "--launch-vllm"),
    (["--target", "openai", "--url", "https://h:1"], "--url"),
    (["--address", "a:1", "--attainment-target", "1.5"], "--attainment-target"),
    (["--address", "a:1", "--scale-rate", "3", "--rates", "1,2"], "--scale-rate"),
    (["--address", "a:1", "--workload", "nope"], "--workload"),
    (["--address", "nohost"], "--address"),
    (["--address", "a:1", "--warmup", "-1"], "--warmup"),
    (["--address", "a:1", "--num-requests", "0"], "--num-requests"),
    (["--target", "openai", "--address", "a:1"], "--address"),
    (["--target", "openai", "--url", "http://h:1", "--launch", "missing.yaml"], "--launch"),
    (["--target", "openai", "--url", "http://h:1", "--launch-vllm", "m"], "--launch-vllm"),
])
def test_bad_arguments_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        slo_sweep.main(argv)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


class SlowTarget:
    """Tokens every 10 ms; request 1 never finishes."""

    async def generate(self, prompt, max_tokens, sampling, record, clock, request_id=""):
        record.start(clock())
        for _ in range(10**6 if record.index == 1 else max_tokens):
            await asyncio.sleep(0.01)
            record.add_tokens(1, clock())
        if record.index == 2:
            raise RuntimeError("boom")
        record.finish("length", clock())


def test_open_loop_time_limit_and_errors():
    trace = [RequestSpec(0.0, 4, 3), RequestSpec(0.01, 4, 3), RequestSpec(0.02, 4, 3), RequestSpec(5.0, 4, 3)]
    plan = slo_sweep.RatePlan(1.0, trace, [(0, [1] * 4)] * 4, time_limit_s=0.5)
    args = slo_sweep.build_parser().parse_args(["--address", "a:1"])
    t0 = time.perf_counter()
    run = asyncio.run(slo_sweep.run_rate(SlowTarget(), plan, args, "t"))
    records = run.records
    assert time.perf_counter() - t0 < 2.0 and 0.5 <= run.duration_s < 1.0 and run.loop_lag_max_s < 0.5
    assert records[0].ok and records[0].completion_tokens == 3
    assert records[1].finish_reason == "unfinished" and records[1].ttft_s is not None
    assert records[2].error == "RuntimeError: boom"
    assert records[3].finish_reason == "unfinished" and records[3].sent_s is None  # its arrival is after the limit


class ScriptedTarget:
    """Records what the sweep asks of it, in order; every request finishes at once with its tokens."""

    def __init__(self):
        self.calls: list = []

    async def start(self):
        self.calls.append("start")
        return {"model": "scripted"}

    async def generate(self, prompt, max_tokens, sampling, record, clock, request_id=""):
        self.calls.append(request_id.split("-", 1)[1])
        record.start(clock())
        record.add_tokens(max_tokens, clock())
        record.finish("length", clock(), max_tokens)

    async def wait_idle(self, timeout_s):
        self.calls.append("idle")
        return True

    async def close(self):
        self.calls.append("close")


def test_sweep_warms_up_then_runs_each_rate_once_the_server_is_idle():
    args = slo_sweep.build_parser().parse_args(["--address", "a:1", "--warmup", "1"])
    trace = [RequestSpec(0.0, 4, 3), RequestSpec(0.01, 4, 2)]
    plans = [slo_sweep.RatePlan(r, trace, [(0, [1] * 4)] * 2, time_limit_s=5.0) for r in (1.0, 2.0)]
    target, seen = ScriptedTarget(), []
    on_rate = lambda plan, run: seen.append((plan.rate, run))  # noqa: E731
    server = asyncio.run(slo_sweep.sweep(target, plans, [(0, [1] * 4)], args, on_rate))
    assert server == {"model": "scripted"}
    assert target.calls == ["start", "warm-0", "idle", "r0-0", "r0-1", "idle", "r1-0", "r1-1", "close"]
    assert [rate for rate, _ in seen] == [1.0, 2.0]
    assert all(r.ok and r.completion_tokens == s.output_tokens for _, run in seen for r, s in zip(run.records, trace))


# --------------------------------------------------------------------------------------------------
# launched servers are always stopped, children included


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not running
        return f.read().split(")")[-1].split()[0] != "Z"


def test_managed_server_stops_its_process_group(tmp_path):
    from benchmarks.slo_sweep import LaunchError, ManagedServer

    flag, child_pid = tmp_path / "up", tmp_path / "child.pid"
    # a "server" that ignores SIGTERM and leaves a child behind: the group kill must get both
    code = (f"import os, signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            f"open({str(child_pid)!r}, 'w').write(str(c.pid)); open({str(flag)!r}, 'w').close(); time.sleep(600)")
    server = ManagedServer("fake", [sys.executable, "-c", code], flag.exists, startup_timeout_s=30,
                           stop_grace_s=0.5, log_path=str(tmp_path / "log"))
    with pytest.raises(RuntimeError, match="inside"):
        with server:
            leader, child = server.proc.pid, int(child_pid.read_text())
            assert _alive(leader) and _alive(child)
            raise RuntimeError("inside")
    time.sleep(0.2)
    assert not _alive(leader) and not _alive(child)

    failing = ManagedServer("broken", [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"],
                            lambda: False, startup_timeout_s=30, log_path=str(tmp_path / "log2"))
    with pytest.raises(LaunchError, match="(?s)exited with code 3.*no model here"):
        with failing:
            pass


# --------------------------------------------------------------------------------------------------
# one real sweep against a real local server


@pytest.fixture(scope="module")
def served(llama_dir):
    """(gRPC address, HTTP front URL) of one real server."""
    from controller.config import parse_config
    from frontend.server import serving

    cfg = parse_config({
        "model": {"path": llama_dir, "dtype": "float32"},
        "ray": {"num_cpus": 4, "num_gpus": 0},
        "prefill": {"kv_cache_tokens": 2048, "attention_backend": "torch", "token_budget": 64},
        "decode": {"kv_cache_tokens": 2048, "attention_backend": "torch",
                   "speculation": {"k_policy": "fixed", "k": 2, "budget": 32, "sink_tokens": 4}},
        "server": {"port": 0, "http_port": 0},
        "kv_transfer": {"timeout_s": 10},
    })
    with serving(cfg) as ports:
        yield f"127.0.0.1:{ports.grpc}", f"http://127.0.0.1:{ports.http}"


@pytest.fixture(scope="module")
def server(served):
    return served[0]


def test_sweep_against_real_server(server, llama_dir, tmp_path):
    trace = tmp_path / "trace.jsonl"
    save_trace([RequestSpec(0.0, 40, 8), RequestSpec(0.3, 64, 12), RequestSpec(0.5, 24, 6)], str(trace))
    out = str(tmp_path / "sweep")
    code = slo_sweep.main(["--target", "grpc", "--address", server, "--model", llama_dir, "--trace", str(trace),
                           "--rates", "2", "--warmup", "1", "--time-limit-s", "60", "--ttft-slo-ms", "5000",
                           "--tpot-slo-ms", "1000", "--out", out])
    assert code == 0
    result = json.load(open(out + ".json"))
    (row,) = result["rates"]
    assert row["rate"] == 2.0 and row["requests"] == 3
    for r, (p, o) in zip(row["records"], [(40, 8), (64, 12), (24, 6)]):
        assert r["error"] is None, r
        assert (r["prompt_tokens"], r["output_tokens"], r["completion_tokens"]) == (p, o, o)
        assert r["finish_reason"] == "length"
        assert 0 < r["ttft_s"] <= r["e2e_s"] and r["tpot_s"] > 0
        assert r["draft_tokens"] >= r["accepted_tokens"] >= 0
        # the server's clock starts when the request reaches it and stops when it sends: inside the client's
        assert 0 < r["server_ttft_s"] <= r["ttft_s"] and r["server_tpot_s"] > 0
    assert row["server_attainment"]["requests"] == 3 and row["server_latency_ms"]["ttft_p50"] > 0
    assert "on the server's own clock" in open(out + ".md").read()
    assert [r["arrival_s"] for r in row["records"]] == pytest.approx([0.0, 0.6, 1.0])  # the trace rescaled to 2 req/s
    assert row["attainment"]["requests"] == 3 and 0.0 <= row["attainment"]["both"] <= 1.0
    assert result["settings"]["rates"] == [2.0] and "goodput" in result
    for suffix in ("_rate.png", "_scale.png", ".md"):
        assert os.path.getsize(out + suffix) > 0


def test_openai_sweep_against_magicserves_http_front(served, llama_dir, tmp_path):
    """The same client path that measures vLLM, against magicserve's OpenAI-compatible front: every
    token counted (return_token_ids), the finish reason, and the idle wait reading /metrics."""
    trace = tmp_path / "trace.jsonl"
    save_trace([RequestSpec(0.0, 40, 8), RequestSpec(0.2, 30, 5)], str(trace))
    out = str(tmp_path / "sweep_http")
    code = slo_sweep.main(["--target", "openai", "--url", served[1], "--model", llama_dir, "--trace", str(trace),
                           "--rates", "2", "--warmup", "1", "--time-limit-s", "60", "--ttft-slo-ms", "5000",
                           "--tpot-slo-ms", "1000", "--out", out])
    assert code == 0
    (row,) = json.load(open(out + ".json"))["rates"]
    for r, (p, o) in zip(row["records"], [(40, 8), (30, 5)]):
        assert r["error"] is None, r
        assert (r["prompt_tokens"], r["completion_tokens"], r["finish_reason"]) == (p, o, "length")
        assert 0 < r["ttft_s"] <= r["e2e_s"] and r["tpot_s"] > 0


def test_queue_gauges_read_either_servers_metrics():
    from benchmarks._slo_targets import queue_gauges

    vllm = 'vllm:num_requests_running{engine="0",model_name="m"} 2.0\nvllm:num_requests_waiting{model_name="m"} 1.0\n'
    ours = "# TYPE magicserve:num_requests_running gauge\nmagicserve:num_requests_running{model_name=\"m\"} 0.0\n"
    assert queue_gauges(vllm) == 3.0
    assert queue_gauges(ours) == 0.0
    assert queue_gauges("other_metric 1.0\n") is None
