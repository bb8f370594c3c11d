"""Targets of the SLO sweep: what one request costs on a server, timed on the client.

* :class:`GrpcTarget` streams magicserve's ``Generate`` RPC (``frontend.client.AsyncClient``);
* :class:`OpenAITarget` streams an OpenAI-compatible ``/v1/completions`` endpoint (``vllm serve``) over a
  small HTTP/1.1 client of its own (:func:`post_sse`: asyncio streams, chunked transfer coding,
  server-sent events), so the sweep needs no HTTP library.

Both fill a :class:`RequestRecord`: TTFT at the first token, TPOT = (last token time - first token time)
/ (tokens - 1), end-to-end latency at the final message, finish reason, draft / accepted tokens where
the server reports them.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import urllib.parse
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

Clock = Callable[[], float]  # seconds since the start of the rate


def finished_normally(rec: dict) -> bool:
    """A request (a ``RequestRecord``'s fields, or its JSON) that ended without error at EOS / a stop or at
    its length: the SLO definition's ``ok``."""
    return rec.get("error") is None and rec.get("finish_reason") in ("stop", "length")


class TargetError(RuntimeError):
    """A request the server refused or broke off; the message is recorded as the request's error."""


@dataclass
class RequestRecord:
    """One measured request. Times are seconds; ``sent_s`` is relative to the start of the rate,
    ``ttft_s`` and ``e2e_s`` to ``sent_s``. ``finish_reason`` is the server's ("stop", "length",
    "abort"), "unfinished" when the rate's time limit cut it off, None after an error.
    ``server_ttft_s`` / ``server_tpot_s``: the same figures as the server timed them (from the request's
    arrival at its router), where the target reports them (magicserve's usage; None for OpenAI targets).
    The client's own figures include its lateness in sending and in reading tokens; the server's do not."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int  # requested (max_tokens, EOS ignored)
    prompt_offset: int = 0  # where the prompt starts in the token corpus
    sent_s: float | None = None
    completion_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    server_ttft_s: float | None = None
    server_tpot_s: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    _last_token_s: float | None = field(default=None, repr=False)  # not serialised (see to_json)
    _output_ids: list = field(default_factory=list, repr=False)  # the output's token ids, where the target sends them

    def start(self, now: float) -> None:
        self.sent_s = now

    def add_tokens(self, n: int, now: float) -> None:
        """``n`` new tokens arrived at ``now`` (rate clock)."""
        if n <= 0:
            return
        if self.ttft_s is None:
            self.ttft_s = now - self.sent_s
        self.completion_tokens += n
        self._last_token_s = now

    def finish(self, reason: str, now: float, completion_tokens: int | None = None) -> None:
        """The final message: server-side token count (when reported) wins over the streamed count."""
        if completion_tokens is not None:
            self.completion_tokens = completion_tokens
        self.finish_reason = reason
        self.e2e_s = now - self.sent_s
        if self.ttft_s is not None and self._last_token_s is not None:
            first = self.sent_s + self.ttft_s
            self.tpot_s = (self._last_token_s - first) / (self.completion_tokens - 1) if self.completion_tokens > 1 else 0.0

    @property
    def ok(self) -> bool:
        """Finished normally (the SLO definition's ``ok``)."""
        return finished_normally(self.__dict__)

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


# --------------------------------------------------------------------------------------------------
# magicserve gRPC


class GrpcTarget:
    """magicserve's streaming ``Generate`` RPC."""

    kind = "grpc"

    def __init__(self, address: str, token: str | None = None, tls_ca: str | None = None):
        self.address = address
        self._token, self._tls_ca = token, tls_ca
        self._client = None

    async def start(self) -> dict:
        """Connect; returns what the server says about itself (model name, instances)."""
        import grpc

        from frontend.client import AsyncClient

        self._client = AsyncClient(self.address, token=self._token, tls_ca=self._tls_ca)
        try:
            st = await self._client.status()
        except grpc.RpcError as err:
            raise TargetError(f"{self.address}: GetClusterStatus failed: {err.code().name}: {err.details()}") from None
        return {"model": st.model, "instances": [{"name": i.name, "role": i.role, "device": i.device}
                                                 for i in st.instances]}

    async def generate(self, prompt: list[int], max_tokens: int, sampling: dict, record: RequestRecord,
                       clock: Clock, request_id: str = "") -> None:
        import grpc

        record.start(clock())
        try:
            async for chunk in self._client.generate_stream(prompt, max_tokens=max_tokens, ignore_eos=True,
                                                            request_id=request_id, **sampling):
                now = clock()
                if not chunk.final:
                    record.add_tokens(len(chunk.token_ids), now)
                    continue
                u = chunk.usage
                record.draft_tokens, record.accepted_tokens = u["draft_tokens"], u["accepted_draft_tokens"]
                record.server_ttft_s, record.server_tpot_s = u["ttft_ms"] / 1e3, u["mean_tpot_ms"] / 1e3
                record.finish(chunk.finish_reason, now, u["completion_tokens"])
        except grpc.RpcError as err:
            raise TargetError(f"{err.code().name}: {err.details()}") from None
        if record.finish_reason is None:
            raise TargetError("stream ended without a final message")

    async def wait_idle(self, timeout_s: float) -> bool:
        """Poll the cluster status until nothing runs or queues (the previous rate drained)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            with contextlib.suppress(Exception):  # a status that fails to come back is not "idle"
                st = await self._client.status()
                if st.running_requests == 0 and st.queued_requests == 0:
                    return True
            await asyncio.sleep(0.25)
        return False

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()


# --------------------------------------------------------------------------------------------------
# OpenAI-compatible HTTP (vLLM)


class ChunkedDecoder:
    """Incremental decoder of HTTP/1.1 ``Transfer-Encoding: chunked`` bodies (RFC 9112 section 7.1):
    a hex size line, that many data bytes, CRLF; a zero size ends the body (trailers are ignored)."""

    def __init__(self):
        self._buf = b""
        self._state = "size"  # size -> data -> crlf -> size ...
        self._need = 0  # data bytes left of the current chunk
        self.done = False

    def feed(self, data: bytes) -> bytes:
        """Add received bytes; return the body bytes they complete."""
        self._buf += data
        out = bytearray()
        while not self.done:
            if self._state == "size":
                line_end = self._buf.find(b"\r\n")
                if line_end < 0:
                    break
                size_text = self._buf[:line_end].split(b";", 1)[0].strip()
                try:
                    self._need = int(size_text, 16)
                except ValueError:
                    raise TargetError(f"bad HTTP chunk size line {self._buf[:line_end][:40]!r}") from None
                self._buf = self._buf[line_end + 2 :]
                self.done = self._need == 0
                self._state = "data"
            elif self._state == "data":
                take = min(self._need, len(self._buf))
                out += self._buf[:take]
                self._buf, self._need = self._buf[take:], self._need - take
                if self._need:
                    break
                self._state = "crlf"
            else:
                if len(self._buf) < 2:
                    break
                if self._buf[:2] != b"\r\n":
                    raise TargetError("HTTP chunk not followed by CRLF")
                self._buf, self._state = self._buf[2:], "size"
        return bytes(out)


class SSEParser:
    """Incremental server-sent-events parser: ``feed(bytes)`` returns the ``data`` of each completed
    event (multi-line data joined with newlines). Comments and other fields are ignored."""

    def __init__(self):
        self._text = codecs.getincrementaldecoder("utf-8")()
        self._pending = ""
        self._data: list[str] = []

    def feed(self, data: bytes) -> list[str]:
        self._pending += self._text.decode(data)
        events = []
        while True:
            nl = self._pending.find("\n")
            if nl < 0:
                break
            line, self._pending = self._pending[:nl].rstrip("\r"), self._pending[nl + 1 :]
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(" ") else value)
        return events


def parse_http_url(url: str) -> tuple[str, int]:
    """``http://host:port`` -> (host, port); raises ValueError naming what is wrong."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"--url: need http://host:port (plain HTTP), got {url!r}")
    if not parts.hostname:
        raise ValueError(f"--url: no host in {url!r}")
    if parts.path not in ("", "/"):
        raise ValueError(f"--url: give the server root (http://host:port), not a path, got {url!r}")
    return parts.hostname, parts.port or 80


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split(" ", 2)[1])
    except (IndexError, ValueError):
        raise TargetError(f"bad HTTP status line {lines[0][:80]!r}") from None
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return status, headers


async def _body_chunks(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The message body, decoded from chunked coding or delimited by Content-Length / EOF."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        dec = ChunkedDecoder()
        while not dec.done:
            data = await reader.read(65536)
            if not data:
                raise TargetError("connection closed inside a chunked body")
            out = dec.feed(data)
            if out:
                yield out
        return
    left = int(headers["content-length"]) if "content-length" in headers else None
    while left is None or left > 0:
        data = await reader.read(65536 if left is None else min(65536, left))
        if not data:
            if left:
                raise TargetError("connection closed before the end of the body")
            return
        if left is not None:
            left -= len(data)
        yield data


@contextlib.asynccontextmanager
async def _http_request(host: str, port: int, method: str, path: str, body: bytes | None = None):
    """One HTTP/1.1 exchange on its own connection: yields (status, headers, body iterator)."""
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 22)
    try:
        head = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close", "Accept: */*"]
        if body is not None:
            head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (body or b""))
        await writer.drain()
        status, headers = await _read_head(reader)
        yield status, headers, _body_chunks(reader, headers)
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def http_get_json(host: str, port: int, path: str) -> tuple[int, object]:
    async with _http_request(host, port, "GET", path) as (status, _, chunks):
        body = b"".join([c async for c in chunks])
    try:
        return status, json.loads(body) if body else None
    except ValueError:
        return status, body.decode("utf-8", "replace")


async def post_sse(host: str, port: int, path: str, payload: dict) -> AsyncIterator[str]:
    """POST ``payload`` as JSON; yields the data of each server-sent event. Non-200 -> TargetError."""
    async with _http_request(host, port, "POST", path, json.dumps(payload).encode()) as (status, _, chunks):
        if status != 200:
            body = b"".join([c async for c in chunks]).decode("utf-8", "replace")
            raise TargetError(f"HTTP {status}: {body[:300]}")
        parser = SSEParser()
        async for data in chunks:
            for event in parser.feed(data):
                yield event


def queue_gauges(metrics_text: str) -> float | None:
    """Running + waiting requests in a Prometheus exposition (vLLM's or magicserve's gauges); None when
    it has neither."""
    total, seen = 0.0, False
    for line in metrics_text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.split(":", 1)[-1] in ("num_requests_running", "num_requests_waiting") and ":" in name:
            seen = True
            total += float(line.rsplit(" ", 1)[1])
    return total if seen else None


class OpenAITarget:
    """An OpenAI-compatible ``/v1/completions`` endpoint, streamed (vLLM's extensions, which magicserve's
    HTTP front also takes: ``ignore_eos``, ``return_token_ids``; prompt as a token-id list)."""

    kind = "openai"

    def __init__(self, url: str, model: str | None = None):
        self.url = url
        self.host, self.port = parse_http_url(url)
        self.model = model

    async def start(self) -> dict:
        try:
            status, body = await http_get_json(self.host, self.port, "/v1/models")
        except OSError as err:
            raise TargetError(f"{self.url}: cannot connect ({err})") from None
        if status != 200 or not isinstance(body, dict) or not body.get("data"):
            raise TargetError(f"GET {self.url}/v1/models: HTTP {status}: {str(body)[:200]}")
        served = [m["id"] for m in body["data"]]
        if self.model is None:
            self.model = served[0]
        elif self.model not in served:
            raise TargetError(f"--served-model: {self.model!r} not served; the server has {served}")
        return {"model": self.model}

    async def generate(self, prompt: list[int], max_tokens: int, sampling: dict, record: RequestRecord,
                       clock: Clock, request_id: str = "") -> None:
        payload = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                   "stream_options": {"include_usage": True}, "ignore_eos": True, "return_token_ids": True,
                   "temperature": sampling.get("temperature", 0.0)}
        if sampling.get("seed") is not None:
            payload["seed"] = sampling["seed"]
        record.start(clock())
        finish, usage_tokens, done = None, None, False
        async for event in post_sse(self.host, self.port, "/v1/completions", payload):
            now = clock()
            if event.strip() == "[DONE]":
                done = True
                break
            msg = json.loads(event)
            if "error" in msg or msg.get("object") == "error":
                raise TargetError(f"server error: {str(msg.get('error', msg))[:300]}")
            for choice in msg.get("choices") or ():
                ids = choice.get("token_ids")
                record.add_tokens(len(ids) if ids is not None else int(bool(choice.get("text"))), now)
                record._output_ids.extend(ids or ())
                finish = choice.get("finish_reason") or finish
            if msg.get("usage"):
                usage_tokens = msg["usage"].get("completion_tokens")
        if not done:
            raise TargetError("event stream ended without [DONE]")
        if finish is None:
            raise TargetError("stream finished without a finish_reason")
        record.finish(finish, clock(), usage_tokens)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Poll ``/metrics`` until the server's running and waiting request gauges (vLLM's ``vllm:`` or
        magicserve's ``magicserve:`` ``num_requests_running`` / ``num_requests_waiting``) are 0; a server
        without them gets a moment to abort the requests whose connections closed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            try:
                status, body = await http_get_json(self.host, self.port, "/metrics")
            except OSError:
                status, body = 0, None
            busy = queue_gauges(body) if status == 200 and isinstance(body, str) else None
            if busy is None:
                await asyncio.sleep(min(1.0, timeout_s))
                return True
            if busy == 0:
                return True
            await asyncio.sleep(0.25)
        return False

    async def close(self) -> None:
        return None
