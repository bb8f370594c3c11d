"""The gRPC front end: magicserve.v1.MagicServe, standard health checking and server reflection.

Every request field is validated here (INVALID_ARGUMENT naming the field) before the router sees it;
token ids and text are the only client input that reaches workers, as typed values (nothing is ever
unpickled). Binds 127.0.0.1 unless configured; a non-local bind needs TLS and a bearer token
(enforced by the config).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import json
import logging
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from controller.cluster import Cluster
from controller.colocated_router import ColocatedRouter
from controller.config import ClusterConfig
from controller.metrics import ServingMetrics
from controller.router import Router
from controller.routing import Delta, Final, RouterError
from controller.scaling import Scaler
from controller.startup import StartupTimeline
from frontend.chat_template import ChatTemplate
from frontend.client import Client
from frontend.http_server import HttpServer, OpenAIServer
from frontend.openai_protocol import OpenAIProtocol
from modeling.checkpoint import load_config as load_model_config
from modeling.checkpoint import read_eos_token_ids
from modeling.dtype_choice import DtypeChoice
from modeling.errors import InvalidRequestError
from modeling.params import SamplingParams
from modeling.request_check import check_token_ids
from modeling.structured_output import StructuredOutput, constraint_of
from modeling.tokenizer import TextTokenizer
from protos.magicserve.v1 import magicserve_pb2 as pb
from protos.magicserve.v1 import magicserve_pb2_grpc as pb_grpc

log = logging.getLogger("magicserve.server")

_REQUEST_ID = re.compile(r"[A-Za-z0-9._\-]{1,64}")
_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}
PASS_LOG_BATCH = 2048  # passes per DrainPassLog message (well under the default 4 MiB message limit)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["MagicServe"].full_name
DRAIN_TIMEOUT_S = 600.0  # DrainInstance without a timeout waits this long for the instance to empty


class RequestValidator:
    """Turns a GenerateRequest into (prompt ids, SamplingParams) or raises InvalidRequestError."""

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int, max_prompt_tokens: int, max_tokens: int,
                 grammar_check: Callable[[StructuredOutput], object] | None = None):
        self.tokenizer = tokenizer
        self.grammar_check = grammar_check
        self.vocab_size = vocab_size
        self.max_prompt_tokens = max_prompt_tokens
        self.max_tokens = max_tokens

    def prompt_ids(self, req: pb.GenerateRequest) -> list[int]:
        which = req.WhichOneof("input")
        if which is None:
            raise InvalidRequestError("input", "set exactly one of prompt or prompt_token_ids")
        if which == "prompt":
            if not req.prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            ids = check_token_ids(self.tokenizer.encode(req.prompt), self.vocab_size, "prompt")
        else:
            ids = check_token_ids(req.prompt_token_ids.ids, self.vocab_size, "prompt_token_ids.ids", "prompt_token_ids")
        if len(ids) > self.max_prompt_tokens:
            raise InvalidRequestError("prompt", f"{len(ids)} tokens exceed the limit of {self.max_prompt_tokens}")
        return ids

    def sampling(self, req: pb.GenerateRequest, streaming: bool) -> SamplingParams:
        if not req.HasField("sampling"):
            raise InvalidRequestError("sampling", "required (at least sampling.max_tokens)")
        s = req.sampling
        low = 0 if s.HasField("prompt_logprobs") else 1  # 0: score the prompt alone
        if not low <= s.max_tokens <= self.max_tokens:
            raise InvalidRequestError("sampling.max_tokens", f"must be in [{low}, {self.max_tokens}], got "
                                      f"{s.max_tokens}" + ("" if low == 0 else " (0 only with prompt_logprobs)"))
        n = int(s.n) or 1
        best_of = int(s.best_of) if s.HasField("best_of") else None
        if streaming and best_of is not None and best_of != n:
            raise InvalidRequestError("sampling.best_of", "Generate streams every sequence: use GenerateUnary for "
                                      "best_of > n")
        params = SamplingParams(
            max_tokens=int(s.max_tokens), temperature=float(s.temperature), top_k=int(s.top_k),
            top_p=float(s.top_p) if s.HasField("top_p") and s.top_p != 0 else 1.0,
            seed=int(s.seed) if s.HasField("seed") else None,
            stop=tuple(s.stop), stop_token_ids=tuple(int(t) for t in s.stop_token_ids), ignore_eos=bool(s.ignore_eos),
            presence_penalty=float(s.presence_penalty), frequency_penalty=float(s.frequency_penalty),
            repetition_penalty=float(s.repetition_penalty) if s.HasField("repetition_penalty") and
            s.repetition_penalty != 0 else 1.0,
            min_p=float(s.min_p), min_tokens=int(s.min_tokens),
            logit_bias={int(t): float(b) for t, b in s.logit_bias.items()},
            include_stop_str_in_output=bool(s.include_stop_str_in_output),
            logprobs=int(s.logprobs) if s.HasField("logprobs") else None,
            prompt_logprobs=int(s.prompt_logprobs) if s.HasField("prompt_logprobs") else None,
            skip_special_tokens=bool(s.skip_special_tokens) if s.HasField("skip_special_tokens") else True,
            spaces_between_special_tokens=bool(s.spaces_between_special_tokens)
            if s.HasField("spaces_between_special_tokens") else True,
            n=n, best_of=best_of, structured=self.structured(s),
        )
        try:
            return params.with_ranking_logprobs().validate(self.vocab_size)
        except InvalidRequestError as err:
            raise InvalidRequestError(f"sampling.{err.field}", err.reason) from None

    def structured(self, s: pb.SamplingParameters) -> StructuredOutput | None:
        """The ``structured_output`` oneof (compiled here: a grammar the engine refuses is an error naming it)."""
        kind = s.WhichOneof("structured_output")
        if kind is None:
            return None
        field = f"sampling.{kind}"
        if kind == "json_schema":
            out = constraint_of("json", s.json_schema, field)
        elif kind == "json_object":
            if not s.json_object:
                return None
            out = StructuredOutput("json_object", "", field)
        elif kind == "choice":
            out = StructuredOutput.choice(list(s.choice.options), f"{field}.options")
        else:
            out = StructuredOutput(kind, getattr(s, kind), field)
        if self.grammar_check is not None:
            self.grammar_check(out)
        return out

    def targets(self, req: pb.GenerateRequest) -> None:
        for name in ("ttft_target_ms", "tpot_target_ms"):
            if req.HasField(name) and not getattr(req, name) > 0:
                raise InvalidRequestError(name, f"must be > 0, got {getattr(req, name)}")
        if req.request_id and not _REQUEST_ID.fullmatch(req.request_id):
            raise InvalidRequestError("request_id", "letters, digits, '.', '_', '-' only; at most 64 characters")


class MagicServeServicer(pb_grpc.MagicServeServicer):
    """``pass_log_fn``: an async callable returning the instances' drained pass logs
    (``Cluster.drain_pass_logs``), or None where the config leaves ``DrainPassLog`` off; ``store_fn``: one
    returning the cluster's KV store's occupancy (``MooncakeStoreService.occupancy_now``), None where the server
    runs no store."""

    def __init__(self, router: Router, validator: RequestValidator, status_fn, model_name: str, pass_log_fn=None,
                 scaler: Scaler | None = None, dtype_choice: DtypeChoice | None = None, store_fn=None):
        self.router = router
        self.store_fn = store_fn
        self.dtype_choice = dtype_choice
        self.scaler = scaler
        self.validator = validator
        self.status_fn = status_fn
        self.model_name = model_name
        self.pass_log_fn = pass_log_fn

    async def _start(self, request, context, streaming: bool):
        try:
            ids = self.validator.prompt_ids(request)
            params = self.validator.sampling(request, streaming)
            self.validator.targets(request)
        except InvalidRequestError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        rid = request.request_id or self.router.new_request_id()
        return rid, ids, params

    async def Generate(self, request, context):
        rid, ids, params = await self._start(request, context, streaming=True)
        try:
            async for item in self.router.generate(rid, ids, params, request.priority):
                yield _to_response(rid, item)
        except RouterError as err:
            await context.abort(getattr(grpc.StatusCode, err.code), str(err))

    async def GenerateUnary(self, request, context):
        rid, ids, params = await self._start(request, context, streaming=False)
        sequences: dict[int, pb.GeneratedSequence] = {}
        prompt_logprobs, final = [], None
        try:
            async for item in self.router.generate(rid, ids, params, request.priority):
                if isinstance(item, Delta):
                    seq = sequences.setdefault(item.index, pb.GeneratedSequence(index=item.index))
                    seq.token_ids.extend(item.token_ids)
                    seq.text += item.text
                    seq.logprobs.extend(_logprobs(item.logprobs))
                    seq.cumulative_logprob += sum(lp.logprob for lp in item.logprobs)
                    if item.finish_reason is not None:
                        seq.finish_reason = _FINISH.get(item.finish_reason, 0)
                    if item.prompt_logprobs is not None:
                        prompt_logprobs = _logprobs(lp for lp in item.prompt_logprobs if lp is not None)
                else:
                    final = item
        except RouterError as err:
            await context.abort(getattr(grpc.StatusCode, err.code), str(err))
        for index in range(params.num_sequences):
            seq = sequences.setdefault(index, pb.GeneratedSequence(index=index))
            if not seq.finish_reason:
                seq.finish_reason = _FINISH.get(final.finish_reason, 0)
        ordered = [sequences[i] for i in sorted(sequences)]
        if params.num_sequences > params.n:  # best_of: the n with the highest cumulative log-probability
            ordered = sorted(ordered, key=lambda q: q.cumulative_logprob, reverse=True)[: params.n]
            for i, seq in enumerate(ordered):
                seq.index = i
        top = ordered[0]
        return pb.GenerateResult(request_id=rid, token_ids=top.token_ids, text=top.text,
                                 finish_reason=top.finish_reason, usage=_usage(final), logprobs=top.logprobs,
                                 prompt_logprobs=prompt_logprobs, sequences=ordered)

    async def GetClusterStatus(self, request, context):
        statuses = await self.status_fn()
        store = await self.store_fn() if self.store_fn is not None else None
        q = self.router.queue_stats()
        failures = collections.Counter()
        for (name, _), count in self.router.call_failures.items():
            failures[name] += count
        return pb.ClusterStatus(
            instances=[pb.InstanceStatus(
                name=s["name"], role=s["role"], device=s.get("device", ""), alive=s.get("alive", True),
                queue_length=s.get("queue_length", 0), running=s.get("running", 0),
                free_kv_blocks=s.get("free_kv_blocks", 0), total_kv_blocks=s.get("total_kv_blocks", 0),
                acceptance_rate=s.get("acceptance_rate", 0.0), mean_accepted_length=s.get("mean_accepted_length", 0.0),
                tokens_generated=s.get("tokens_generated", 0), preemptions=s.get("preemptions", 0),
                cached_kv_blocks=s.get("cached_kv_blocks", 0), prefix_cache_queries=s.get("prefix_cache_queries", 0),
                prefix_cache_hits=s.get("prefix_cache_hits", 0), call_failures=failures.get(s["name"], 0),
                prefix_cache_tier_hits=s.get("prefix_cache_tier_hits", 0), kv_tiers=_tier_statuses(s),
                local_prefills=s.get("local_prefills", 0))
                for s in statuses],
            queued_requests=q["waiting"], running_requests=q["active"], model=self.model_name,
            migrations_committed=self.router.migrations.counts["committed"],
            migrations_aborted=self.router.migrations.counts["aborted"],
            pools=[pb.PoolShape(pool=role, current=s["current"], desired=s["desired"], held=s["held"],
                                instances=s["instances"])
                   for role, s in (self.scaler.shape().items() if self.scaler is not None else ())],
            recent_scaling=[_scale_result(d, self.scaler) for d in (self.scaler.decisions if self.scaler else ())],
            dtype=self.dtype_choice.dtype if self.dtype_choice else "",
            dtype_reason=self.dtype_choice.reason if self.dtype_choice else "",
            load_aware_placements=[pb.PlacementCount(prefilled_on=where, reason=reason, count=n)
                                   for (where, reason), n in sorted(self.router.context.load_aware.counts.items())],
            kv_store_segments=[pb.KVStoreSegment(name=seg.name, node=seg.node, capacity_bytes=seg.capacity_bytes,
                                                 used_bytes=seg.used_bytes) for seg in (store.segments if store else ())],
            kv_store_objects=store.objects if store else 0)

    async def ScalePool(self, request, context):
        if self.scaler is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this server cannot resize its pools")
        try:
            decision = await self.scaler.scale(request.pool, int(request.instances),
                                               hold=request.hold if request.HasField("hold") else None,
                                               switch_from=request.switch_from)
        except RouterError as err:
            await context.abort(getattr(grpc.StatusCode, err.code), str(err))
        return _scale_result(decision, self.scaler)

    async def MigrateRequest(self, request, context):
        if not _REQUEST_ID.fullmatch(request.request_id):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "request_id: required; letters, digits, '-', '_', '.' (at most 64)")
        if request.timeout_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s: must be >= 0, got {request.timeout_s}")
        try:
            outcome = await self.router.migrations.migrate(request.request_id, request.destination or None,
                                                request.timeout_s or None)
        except RouterError as err:
            await context.abort(getattr(grpc.StatusCode, err.code), str(err))
        return _migration_result(outcome)

    async def DrainInstance(self, request, context):
        if not request.instance:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "instance: required (a decode instance's name)")
        if request.timeout_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s: must be >= 0, got {request.timeout_s}")
        try:
            outcome = await self.router.migrations.drain(request.instance, request.timeout_s or DRAIN_TIMEOUT_S, request.undo)
        except RouterError as err:
            await context.abort(getattr(grpc.StatusCode, err.code), str(err))
        return pb.DrainResult(instance=outcome.instance, drained=outcome.drained,
                              migrations=[_migration_result(m) for m in outcome.migrations],
                              finished_in_place=outcome.finished_in_place, handed_back=outcome.handed_back)

    async def DrainPassLog(self, request, context):
        if self.pass_log_fn is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "DrainPassLog is off; enable it with server.pass_log_rpc: true in the config "
                                "or `magicserve serve --pass-log-rpc`")
        try:
            logs = await self.pass_log_fn()
        except Exception as err:  # an instance that does not answer: say which call failed, not a stack
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"DrainPassLog: {type(err).__name__}: {err}")
        # up to 65536 passes per worker: encoded off the event loop that streams tokens
        for message in await asyncio.to_thread(_pass_log_messages, logs):
            yield message


def _pass_log_messages(logs: list[dict]) -> list[pb.InstancePasses]:
    """``Cluster.drain_pass_logs``'s logs as DrainPassLog messages: each instance's passes in batches of
    ``PASS_LOG_BATCH``, one message even for an instance without passes."""
    out = []
    for log in logs:
        records = log["records"]
        for start in range(0, max(1, len(records)), PASS_LOG_BATCH):
            out.append(pb.InstancePasses(
                name=log["name"], role=log["role"], dropped=log["dropped"] if start == 0 else 0,
                passes=[pb.TimedPass(kind=r["kind"], end_unix_s=r["end_s"], seconds=r["seconds"],
                                     shape_json=json.dumps(r["shape"], separators=(",", ":")))
                        for r in records[start:start + PASS_LOG_BATCH]]))
    return out


def _tier_statuses(status: dict) -> list:
    """An instance status's KV tiers (``kv_tiers``: tier -> ``TierStats`` fields) as ``KVTierStatus`` messages."""
    return [pb.KVTierStatus(tier=tier, hits=t["hits"], load_bytes=t["bytes_in"], load_seconds=t["load_s"],
                            stored=t["stored"], evictions=t["evicted"], corrupt=t["corrupt"], blocks=t["blocks"],
                            bytes=t["bytes"], capacity_bytes=t["capacity_bytes"], read_ahead=t["read_ahead"],
                            read_ahead_seconds=t["read_ahead_s"])
            for tier, t in (status.get("kv_tiers") or {}).items()]


def _scale_result(d, scaler) -> pb.ScalePoolResult:
    return pb.ScalePoolResult(pool=d.pool, desired=d.desired, current=scaler.shape()[d.pool]["current"],
                              added=list(d.added), removed=list(d.removed), error=d.error, seconds=d.seconds,
                              switched=list(d.switched), switch_from=d.switch_from, handed_back=d.handed_back)


def _migration_result(m) -> pb.MigrationResult:
    return pb.MigrationResult(request_id=m.request_id, source=m.source, destination=m.destination,
                              committed=m.committed, reason=m.reason, seconds=m.seconds,
                              source_tokens=m.source_tokens)


def _usage(final: Final | None) -> pb.Usage:
    if final is None:
        return pb.Usage()
    return pb.Usage(prompt_tokens=final.prompt_tokens, completion_tokens=final.completion_tokens,
                    ttft_ms=final.ttft_s * 1e3, mean_tpot_ms=final.mean_tpot_s * 1e3,
                    draft_tokens=final.draft_tokens, accepted_draft_tokens=final.accepted_tokens,
                    cached_prompt_tokens=final.cached.tokens)


def _logprobs(logprobs) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]) for lp in logprobs]


def _to_response(rid: str, item) -> pb.GenerateResponse:
    if isinstance(item, Delta):
        prompt = () if item.prompt_logprobs is None else [lp for lp in item.prompt_logprobs if lp is not None]
        return pb.GenerateResponse(request_id=rid, delta=pb.TokenDelta(
            token_ids=item.token_ids, text=item.text, index=item.index, logprobs=_logprobs(item.logprobs),
            finish_reason=_FINISH.get(item.finish_reason, 0), prompt_logprobs=_logprobs(prompt)))
    return pb.GenerateResponse(request_id=rid, final=pb.GenerateFinal(
        finish_reason=_FINISH.get(item.finish_reason, 0), usage=_usage(item)))


ADMIN_METHODS = frozenset(f"/{SERVICE_NAME}/{m}" for m in ("MigrateRequest", "DrainInstance", "DrainPassLog",
                                                             "ScalePool"))


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without ``authorization: Bearer <token>`` (health checks stay open); with an
    ``admin_token``, the operator calls (``ADMIN_METHODS``) need that one instead of the clients'."""

    def __init__(self, token: str | None, admin_token: str | None = None):
        self._expected = None if token is None else f"Bearer {token}".encode()
        self._admin = None if admin_token is None else f"Bearer {admin_token}".encode()

    async def intercept_service(self, continuation, details):
        if details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(details)
        expected = self._admin if self._admin is not None and details.method in ADMIN_METHODS else self._expected
        if expected is None:
            return await continuation(details)
        got = dict(details.invocation_metadata or ()).get("authorization", "")
        if not hmac.compare_digest(got.encode() if isinstance(got, str) else got, expected):
            which = "the operator token" if expected is self._admin else "bearer token"

            async def deny(request, context):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong {which}")
            return grpc.unary_unary_rpc_method_handler(deny)
        return await continuation(details)


async def start_server(config: ClusterConfig, servicer: MagicServeServicer) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Start the gRPC server; returns (server, bound port, health servicer)."""
    sc = config.server
    token, admin_token = sc.token(), sc.admin_token()
    interceptors = [BearerTokenInterceptor(token, admin_token)] if token or admin_token else []
    server = grpc.aio.server(interceptors=interceptors, options=[
        ("grpc.max_receive_message_length", sc.max_message_bytes),
        ("grpc.max_send_message_length", sc.max_message_bytes),
    ])
    add_servicer(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, reflection.SERVICE_NAME, health.SERVICE_NAME), server)
    address = f"{sc.host}:{sc.port}" if ":" not in sc.host else f"[{sc.host}]:{sc.port}"
    if sc.tls_cert:
        with open(sc.tls_key, "rb") as k, open(sc.tls_cert, "rb") as c:
            creds = grpc.ssl_server_credentials([(k.read(), c.read())])
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"server.port: cannot bind {address}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer


def add_servicer(servicer, server) -> None:
    """Register the MagicServe methods, as the generated ``add_MagicServeServicer_to_server`` does, but
    decoding each request ourselves: a body that is not the method's message is INVALID_ARGUMENT naming
    the expected type (grpc's own deserializer failure would reach the client as an opaque error)."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["MagicServe"].methods:
        request_cls, response_cls = GetMessageClass(method.input_type), GetMessageClass(method.output_type)
        impl = getattr(servicer, method.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(_decoding(impl, request_cls, method.server_streaming),
                                     request_deserializer=None, response_serializer=response_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def _decoding(impl, request_cls, streaming: bool):
    """``impl`` (an async method of the servicer) taking the raw request bytes instead of the message."""
    async def decode(raw: bytes, context):
        try:
            return request_cls.FromString(raw)
        except DecodeError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request: not a valid {request_cls.DESCRIPTOR.full_name} message ({err})")

    if streaming:
        async def stream(raw: bytes, context):
            async for item in impl(await decode(raw, context), context):
                yield item
        return stream

    async def unary(raw: bytes, context):
        return await impl(await decode(raw, context), context)
    return unary


def build_router(config: ClusterConfig, cluster, metrics=None) -> Router:
    """The router of the config's mode over a started cluster's instances."""
    lim = config.limits
    if config.mode == "colocated":
        return ColocatedRouter(cluster.colocated, lim.max_concurrent_requests, lim.max_queue_length,
                               lim.request_timeout_s, restart=cluster.restart, check_ranks=cluster.check_ranks,
                               metrics=metrics, prefix_routing=config.prefix_caching.routing())
    router = Router(cluster.prefill, cluster.decode, lim.max_concurrent_requests, lim.max_queue_length,
                    lim.request_timeout_s, restart=cluster.restart, check_ranks=cluster.check_ranks, metrics=metrics,
                    connect_pair=cluster.connect_migration_pair,
                    prefix_routing=config.prefix_caching.routing(config.prefill.devices_per_instance > 0))
    mig = config.migration
    router.migrations.configure(mig.policy(), mig.timeout_s, mig.interval_s if mig.enabled else None)
    router.context.load_aware.policy = config.load_aware.policy(config.slo)
    return router


@dataclass(frozen=True)
class BoundPorts:
    """Where a started server listens: gRPC, and the HTTP front (None where ``server.http_port`` is null)."""

    grpc: int
    http: int | None
    startup: StartupTimeline | None = None  # where the start-up went, phase by phase


def grammar_check(model_path: str, mc) -> Callable[[StructuredOutput], object]:
    """Compiles a request's grammar against the served model's vocabulary (cached per distinct grammar),
    raising InvalidRequestError naming the part the engine refuses: checked before the request is admitted."""
    eos = tuple(sorted(read_eos_token_ids(model_path, mc)))

    def check(output: StructuredOutput):
        from modeling.grammar import compiler_for

        return compiler_for(model_path, mc.vocab_size, eos).compile(output)

    return check


def start_planner(config: ClusterConfig, router: Router, scaler: Scaler) -> asyncio.Task | None:
    """With ``autoscale.enabled``: the online planner's loop over the router's observations (None otherwise)."""
    a = config.autoscale
    if not a.enabled:
        return None
    from planner.online import LoadWindow, OnlinePlanner, ScalePolicy
    from planner.profile import Profile
    from planner.search import SLOTarget
    from planner.simulator import SimConfig

    problem = scaler.cluster.switch_problem()
    if a.role_changes_only and problem is not None:
        log.warning("autoscale.role_changes_only: the pools cannot exchange instances (%s); the online planner "
                    "leaves the shape as it is", problem)
    planner = OnlinePlanner(Profile.load(config.autoscale_profile), SimConfig.from_cluster_config(config),
                            SLOTarget(config.slo.ttft_ms / 1e3, config.slo.tpot_ms / 1e3, config.slo.attainment),
                            a.planning_bounds(config.pools), a.decision_time_limit_s,
                            switchable=problem is None, role_changes_only=a.role_changes_only)
    router.load_window = scaler.window = LoadWindow(a.window_s)
    policy = ScalePolicy(a.cooldown_s, a.scale_down_after)
    return asyncio.get_running_loop().create_task(
        scaler.plan_forever(planner, policy, router.load_window, a.interval_s, a.headroom, a.min_window_requests))


def _openai_server(config: ClusterConfig, router: Router, metrics, tokenizer: TextTokenizer, mc, status_fn,
                   store_fn=None):
    lim = config.limits
    protocol = OpenAIProtocol(metrics.model_name, tokenizer, ChatTemplate.from_checkpoint(config.model_path),
                              mc.vocab_size, lim.max_prompt_tokens, lim.max_tokens, mc.max_position_embeddings,
                              grammar_check(config.model_path, mc), config.server.tool_call_parser)
    return OpenAIServer(router, protocol, metrics, status_fn, token=config.server.token(), store_fn=store_fn)


async def serve_forever(config: ClusterConfig, ready_callback=None, stop_event: asyncio.Event | None = None) -> None:
    """Bring up the cluster and serve gRPC and the HTTP front until ``stop_event`` (or SIGINT/SIGTERM);
    drains on the way out. ``ready_callback(BoundPorts)`` once both listen."""
    cluster = Cluster(config)
    loop = asyncio.get_running_loop()
    timeline = StartupTimeline()
    await loop.run_in_executor(None, cluster.start, timeline)
    http = None
    fronts_from = timeline.clock()  # the router, gRPC and HTTP servers
    try:
        tokenizer = TextTokenizer(config.model_path)
        mc = load_model_config(config.model_path)
        model_name = os.path.basename(config.model_path)
        metrics = ServingMetrics(model_name)
        router = build_router(config, cluster, metrics)
        router.start()
        validator = RequestValidator(tokenizer, mc.vocab_size, config.limits.max_prompt_tokens, config.limits.max_tokens,
                                     grammar_check(config.model_path, mc))
        scaler = Scaler(cluster, router, config.autoscale, metrics)
        planning = start_planner(config, router, scaler)
        store_fn = cluster.kv_store.occupancy_now if cluster.kv_store is not None else None
        servicer = MagicServeServicer(router, validator, cluster.statuses, model_name,
                                      cluster.drain_pass_logs if config.server.pass_log_rpc else None, scaler,
                                      config.dtype_choice, store_fn)
        server, port, health_servicer = await start_server(config, servicer)
        log.info("serving magicserve.v1 on %s:%d", config.server.host, port)
        http_port = None
        if config.server.http_port is not None:
            front = _openai_server(config, router, metrics, tokenizer, mc, cluster.statuses, store_fn)
            sc = config.server
            http = HttpServer(front.app, sc.host, sc.http_port, sc.tls_cert, sc.tls_key)
            http_port = await http.start()
            log.info("serving the OpenAI-compatible API on %s:%d", sc.host, http_port)
        timeline.add("fronts", timeline.clock() - fronts_from)
        log.info("%s", timeline.describe())
        if ready_callback is not None:
            ready_callback(BoundPorts(port, http_port, timeline))
        stop_event = stop_event or asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop_event.set)
            except (NotImplementedError, RuntimeError):
                pass  # not the main thread
        await stop_event.wait()
        log.info("shutting down: draining in-flight requests")
        await health_servicer.enter_graceful_shutdown()
        if planning is not None:
            planning.cancel()  # no resize while the server drains
        if http is not None:
            front.accepting = False
        await router.stop(drain_timeout_s=30.0)
        await server.stop(grace=5.0)
    finally:
        if http is not None:
            await http.stop()
        cluster.shutdown()


@contextlib.contextmanager
def serving(config: ClusterConfig, start_timeout_s: float = 180.0):
    """Serve ``config`` (``server.port: 0`` / ``http_port: 0`` pick free ports) on a background thread;
    yields the ``BoundPorts`` and drains and shuts the cluster down on exit (profiler calibration, tests)."""
    ready, state = [], {}

    def run():
        async def main():
            state["loop"], state["stop"] = asyncio.get_running_loop(), asyncio.Event()
            await serve_forever(config, ready_callback=ready.append, stop_event=state["stop"])
        try:
            asyncio.run(main())
        except Exception as err:  # reported below if it never became ready
            state["error"] = err

    thread = threading.Thread(target=run, name="magicserve-server", daemon=True)
    thread.start()
    deadline = time.time() + start_timeout_s
    while not ready and thread.is_alive() and time.time() < deadline:
        time.sleep(0.1)
    if not ready:
        if "loop" in state:  # still starting: stop it
            try:
                state["loop"].call_soon_threadsafe(state["stop"].set)
            except RuntimeError:  # the thread ended (its loop is closed): its error says why
                pass
        thread.join(timeout=60)
        error = state.get("error")
        if error is not None:
            raise RuntimeError(f"server failed to start: {type(error).__name__}: {error}") from error
        raise RuntimeError(f"server did not start within {start_timeout_s:.0f} s")
    try:
        yield ready[0]
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(timeout=60)


@contextlib.contextmanager
def serve_in_thread(config: ClusterConfig, start_timeout_s: float = 180.0):
    """:func:`serving`, yielding the gRPC address ``host:port``."""
    with serving(config, start_timeout_s) as ports:
        yield f"{config.server.host}:{ports.grpc}"


@contextlib.contextmanager
def serve_with_client(config: ClusterConfig, start_timeout_s: float = 180.0):
    """:func:`serve_in_thread`, yielding a :class:`Client` connected to it (the calibration's ``serve``)."""
    with serve_in_thread(config, start_timeout_s) as address, Client(address) as client:
        yield client
