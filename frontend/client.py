"""Python client library for magicserve's gRPC API, sync and asyncio.

    from frontend.client import Client
    with Client("127.0.0.1:50051") as c:
        for chunk in c.generate_stream("def add(a, b):", max_tokens=32):
            print(chunk.text, end="")
        result = c.generate("import os", max_tokens=16, temperature=0.8, seed=1)

``AsyncClient`` has the same methods as coroutines / async iterators.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import grpc

from protos.magicserve.v1 import magicserve_pb2 as pb
from protos.magicserve.v1 import magicserve_pb2_grpc as pb_grpc

FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


@dataclass
class Chunk:
    """One streamed message: new token ids and text of sequence ``index`` (with their log-probabilities
    when asked for), or the final one (finish_reason set, usage). With n > 1 a sequence's last delta carries
    its own finish_reason."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: dict | None = None
    index: int = 0
    logprobs: list[dict] = field(default_factory=list)
    final: bool = False


@dataclass
class Result:
    """A whole completion: the first (with best_of, the best) sequence's tokens and text, and every sequence
    returned in ``sequences`` (dicts: index, token_ids, text, finish_reason, logprobs, cumulative_logprob)."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    usage: dict = field(default_factory=dict)
    logprobs: list[dict] = field(default_factory=list)
    prompt_logprobs: list[dict] = field(default_factory=list)
    sequences: list[dict] = field(default_factory=list)


# SamplingParameters fields that are set only when given (proto3 ``optional``)
_OPTIONAL = ("top_p", "seed", "repetition_penalty", "logprobs", "prompt_logprobs", "skip_special_tokens",
             "spaces_between_special_tokens", "best_of")


def build_request(prompt: str | list[int], max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                  stop: list[str] | None = None, stop_token_ids: list[int] | None = None, ignore_eos: bool = False,
                  request_id: str = "", ttft_target_ms: float | None = None, tpot_target_ms: float | None = None,
                  priority: int = 0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                  min_p: float = 0.0, min_tokens: int = 0, logit_bias: dict[int, float] | None = None,
                  include_stop_str_in_output: bool = False, n: int = 1, structured_output: dict | None = None,
                  **optional) -> pb.GenerateRequest:
    """A GenerateRequest; ``optional`` takes the fields unset unless given: top_p, seed, repetition_penalty,
    logprobs, prompt_logprobs, skip_special_tokens, spaces_between_special_tokens, best_of.
    ``structured_output``: one of ``{"json_schema": <schema dict>}``, ``{"json_object": True}``,
    ``{"regex": str}``, ``{"choice": [str, ...]}``, ``{"grammar": str}``."""
    unknown = set(optional) - set(_OPTIONAL)
    if unknown:
        raise TypeError(f"build_request: unknown argument {sorted(unknown)[0]!r}")
    sampling = pb.SamplingParameters(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                     stop=stop or [], stop_token_ids=stop_token_ids or [], ignore_eos=ignore_eos,
                                     presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                     min_p=min_p, min_tokens=min_tokens, logit_bias=logit_bias or {},
                                     include_stop_str_in_output=include_stop_str_in_output, n=n)
    for name, value in optional.items():
        if value is not None:
            setattr(sampling, name, value)
    for kind, value in (structured_output or {}).items():
        if kind == "json_schema":
            sampling.json_schema = json.dumps(value)
        elif kind == "choice":
            sampling.choice.options.extend(value)
        elif kind in ("json_object", "regex", "grammar"):
            setattr(sampling, kind, value)
        else:
            raise TypeError(f"build_request: structured_output {kind!r}; allowed: json_schema, json_object, regex, "
                            "choice, grammar")
    req = pb.GenerateRequest(sampling=sampling, request_id=request_id, priority=priority)
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids.ids.extend(prompt)
    if ttft_target_ms is not None:
        req.ttft_target_ms = ttft_target_ms
    if tpot_target_ms is not None:
        req.tpot_target_ms = tpot_target_ms
    return req


def usage_dict(u: pb.Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "ttft_ms": u.ttft_ms,
            "mean_tpot_ms": u.mean_tpot_ms, "draft_tokens": u.draft_tokens,
            "accepted_draft_tokens": u.accepted_draft_tokens, "cached_prompt_tokens": u.cached_prompt_tokens}


def logprobs_of(entries) -> list[dict]:
    """TokenLogprob messages as dicts: token_id, logprob, rank, top [(token id, logprob), ...]."""
    return [{"token_id": e.token_id, "logprob": e.logprob, "rank": e.rank,
             "top": [(t.token_id, t.logprob) for t in e.top]} for e in entries]


def to_chunk(resp: pb.GenerateResponse) -> Chunk:
    if resp.WhichOneof("kind") == "delta":
        d = resp.delta
        return Chunk(list(d.token_ids), d.text, FINISH_NAMES.get(d.finish_reason), index=d.index,
                     logprobs=logprobs_of(d.logprobs))
    return Chunk([], "", FINISH_NAMES.get(resp.final.finish_reason, "unspecified"), usage_dict(resp.final.usage),
                 final=True)


def to_result(res: pb.GenerateResult) -> Result:
    sequences = [{"index": q.index, "token_ids": list(q.token_ids), "text": q.text,
                  "finish_reason": FINISH_NAMES.get(q.finish_reason, "unspecified"), "logprobs": logprobs_of(q.logprobs),
                  "cumulative_logprob": q.cumulative_logprob} for q in res.sequences]
    return Result(res.request_id, list(res.token_ids), res.text, FINISH_NAMES.get(res.finish_reason, "unspecified"),
                  usage_dict(res.usage), logprobs_of(res.logprobs), logprobs_of(res.prompt_logprobs), sequences)


def pass_log_of(messages: list[pb.InstancePasses]) -> list[dict]:
    """A ``DrainPassLog`` stream as plain data, one entry per instance (its batches joined, in order):
    ``name``, ``role``, ``dropped`` and ``records`` (``modeling/pass_log.py``'s dicts: ``kind``, ``end_s``,
    ``seconds``, ``shape``)."""
    out: dict[str, dict] = {}
    for m in messages:
        inst = out.setdefault(m.name, {"name": m.name, "role": m.role, "dropped": 0, "records": []})
        inst["dropped"] += int(m.dropped)
        inst["records"].extend({"kind": p.kind, "end_s": p.end_unix_s, "seconds": p.seconds,
                                "shape": json.loads(p.shape_json)} for p in m.passes)
    return list(out.values())


def _credentials(tls_ca: str | None):
    if tls_ca is None:
        return None
    with open(tls_ca, "rb") as f:
        return grpc.ssl_channel_credentials(f.read())


def _metadata(token: str | None):
    return (("authorization", f"Bearer {token}"),) if token else None


class Client:
    """Blocking client. ``token``: bearer token; ``tls_ca``: CA certificate (PEM) for TLS."""

    def __init__(self, address: str = "127.0.0.1:50051", token: str | None = None, tls_ca: str | None = None):
        creds = _credentials(tls_ca)
        self.address = address
        self._channel = grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
        self._stub = pb_grpc.MagicServeStub(self._channel)
        self._metadata = _metadata(token)

    def generate_stream(self, prompt, **kwargs):
        """Yields Chunks; the last one carries finish_reason and usage. Closing the iterator cancels."""
        call = self._stub.Generate(build_request(prompt, **kwargs), metadata=self._metadata)
        try:
            for resp in call:
                yield to_chunk(resp)
        finally:
            call.cancel()

    def generate(self, prompt, **kwargs) -> Result:
        return to_result(self._stub.GenerateUnary(build_request(prompt, **kwargs), metadata=self._metadata))

    def status(self) -> pb.ClusterStatus:
        return self._stub.GetClusterStatus(pb.ClusterStatusRequest(), metadata=self._metadata)

    def drain_pass_log(self) -> list[dict]:
        """The workers' timed passes since the last drain (``pass_log_of``); the server must enable it."""
        return pass_log_of(list(self._stub.DrainPassLog(pb.PassLogRequest(), metadata=self._metadata)))

    def migrate(self, request_id: str, destination: str = "", timeout_s: float = 0.0) -> pb.MigrationResult:
        """Move a decoding request to ``destination`` (default: the freest other decode instance), aborting
        if not committed within ``timeout_s`` (0: the server's ``migration.timeout_s``)."""
        return self._stub.MigrateRequest(pb.MigrateRequestRequest(request_id=request_id, destination=destination,
                                                                  timeout_s=timeout_s), metadata=self._metadata)

    def drain(self, instance: str, undo: bool = False, timeout_s: float = 0.0) -> pb.DrainResult:
        """Migrate every request off decode ``instance`` and place none there (``undo``: back in service)."""
        return self._stub.DrainInstance(pb.DrainRequest(instance=instance, undo=undo, timeout_s=timeout_s),
                                        metadata=self._metadata)

    def scale(self, pool: str, instances: int, hold: bool | None = None, switch_from: str = "") -> pb.ScalePoolResult:
        """Resize ``pool`` to ``instances`` while serving (``hold`` false: release a manual hold;
        ``switch_from``: the other pool gives or takes the instances, each changing role in place)."""
        req = pb.ScalePoolRequest(pool=pool, instances=instances, switch_from=switch_from)
        if hold is not None:
            req.hold = hold
        return self._stub.ScalePool(req, metadata=self._metadata)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Block until the channel connects; ``TimeoutError`` (naming the address) after ``timeout_s``."""
        future = grpc.channel_ready_future(self._channel)
        try:
            future.result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            # an abandoned future keeps a thread polling the channel's connectivity, which raises once
            # the channel is closed: cancel it
            future.cancel()
            raise TimeoutError(f"no magicserve server ready at {self.address} within {timeout_s} s") from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncClient:
    """asyncio client with the same methods."""

    def __init__(self, address: str = "127.0.0.1:50051", token: str | None = None, tls_ca: str | None = None):
        creds = _credentials(tls_ca)
        self._channel = grpc.aio.secure_channel(address, creds) if creds else grpc.aio.insecure_channel(address)
        self._stub = pb_grpc.MagicServeStub(self._channel)
        self._metadata = _metadata(token)

    async def generate_stream(self, prompt, **kwargs):
        call = self._stub.Generate(build_request(prompt, **kwargs), metadata=self._metadata)
        try:
            async for resp in call:
                yield to_chunk(resp)
        finally:
            call.cancel()

    async def generate(self, prompt, **kwargs) -> Result:
        return to_result(await self._stub.GenerateUnary(build_request(prompt, **kwargs), metadata=self._metadata))

    async def status(self) -> pb.ClusterStatus:
        return await self._stub.GetClusterStatus(pb.ClusterStatusRequest(), metadata=self._metadata)

    async def drain_pass_log(self) -> list[dict]:
        return pass_log_of([m async for m in self._stub.DrainPassLog(pb.PassLogRequest(), metadata=self._metadata)])

    async def migrate(self, request_id: str, destination: str = "", timeout_s: float = 0.0) -> pb.MigrationResult:
        return await self._stub.MigrateRequest(
            pb.MigrateRequestRequest(request_id=request_id, destination=destination, timeout_s=timeout_s),
            metadata=self._metadata)

    async def drain(self, instance: str, undo: bool = False, timeout_s: float = 0.0) -> pb.DrainResult:
        return await self._stub.DrainInstance(pb.DrainRequest(instance=instance, undo=undo, timeout_s=timeout_s),
                                              metadata=self._metadata)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
