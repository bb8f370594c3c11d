"""Ray actors around the prefill and decode workers (one class: an instance may change role), and the colocated
reference engine.

Each actor owns its worker and runs the worker's loop on a background thread; the router talks to it
through small methods (submit, add_remote, abort, poll, status) that pass the worker's step gate
(``controller/step_gate.py``: a call waiting when a step ends goes before the next step).
Outputs are batched: ``poll`` returns everything produced since the previous poll (token deltas of a
whole decode step travel in one Ray call, never one call per token).

The classes are plain; ``ray_actor_class`` wraps them with ``ray.remote`` (threaded, restartable).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass

import ray
import torch

from controller.actor_messages import ColocatedRequest, WorkerCrashed
from controller.step_gate import StepGate
from decode_worker.messages import TokenDelta
from decode_worker.sources import LocalPrefill, RemoteKV, Resume
from decode_worker.worker import DecodeWorker
from decode_worker.worker import follower as decode_follower
from kv_transfer.channel import Rendezvous, TransferConfig
from modeling.engine import ReferenceEngine
from modeling.engine import follower as engine_follower
from modeling.forks import split_sequence_id
from modeling.heads import rank_peer_id
from modeling.resume import ResumeRequest
from modeling.tp import TPShard
from modeling.tp_group import TPGroup, TPGroupConfig
from modeling.tp_runner import TPDriverRunner, load_for_rank
from prefill_worker.worker import PrefillWorker
from prefill_worker.worker import follower as prefill_follower

log = logging.getLogger("magicserve.actors")

# How long the loop thread sleeps when its worker has nothing to do.
_IDLE_SLEEP_S = 0.002
LOAD_REPORT_PERIOD_S = 0.1  # a decode instance's block counts alone are reported at most this often


def _cache_status(worker) -> dict:
    """The KV blocks, prefix-cache and KV-tier counters of a worker with a block ``pool``, its ``prefix_cache``
    and its instance ``core`` (``kv_tiers``: each tier's ``TierStats``, by tier name)."""
    stats, pool, tiers = worker.prefix_cache.stats, worker.pool, worker.core.tiers
    return {"free_kv_blocks": pool.num_free, "total_kv_blocks": pool.num_blocks,
            "cached_kv_blocks": pool.num_cached, "prefix_cache_queries": stats.queries,
            "prefix_cache_hits": stats.hits, "prefix_cache_tier_hits": stats.tier_hits,
            "prefix_cache_evictions": pool.num_evictions,
            "kv_tiers": {} if tiers is None else {name: t.as_dict() for name, t in tiers.stats().items()}}


def _scheduler_status(instance_id: str, role: str, worker) -> dict:
    """Status of a worker with a chunked-prefill ``scheduler``, a block ``pool`` and its ``prefix_cache``."""
    return {"name": instance_id, "role": role, "device": str(worker.loaded.device),
            "queue_length": len(worker.scheduler.waiting), "running": len(worker.scheduler.running),
            **_cache_status(worker)}


def _with_cache_events(out: list, worker) -> list:
    """``out`` and, when the worker's prefix cache changed, its events for the router's index."""
    events = worker.prefix_cache.take_events()
    return out if events is None else [*out, events]


class _LoopActor:
    """Runs ``self._step()`` on a thread (an idle step returns nothing and the thread sleeps briefly);
    collects outputs in an outbox."""

    def _start_loop(self, name: str) -> None:
        self._gate = StepGate()  # the loop's steps and the control calls, fair to the calls
        self._outbox: list = []
        self._cond = threading.Condition()
        self._stop = False
        self._crashed: str | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop:
            try:
                with self._gate.step():
                    produced = self._step()
            except Exception:  # a crashed loop must be visible to the router, not silent
                self._crashed = traceback.format_exc()
                log.error("worker loop crashed:\n%s", self._crashed)
                self._emit([WorkerCrashed(self._crashed)])
                return
            if produced:
                self._emit(produced)
            else:
                time.sleep(_IDLE_SLEEP_S)

    def _emit(self, items: list) -> None:
        with self._cond:
            self._outbox.extend(items)
            self._cond.notify_all()

    def poll(self, timeout_s: float = 0.05) -> list:
        """Everything produced since the last poll (waits up to ``timeout_s`` for something)."""
        with self._cond:
            if not self._outbox:
                self._cond.wait(timeout_s)
            out, self._outbox = self._outbox, []
        return out

    def pass_log(self) -> list[dict]:
        """The worker's timed forward passes since the last call (``modeling/pass_log.py``)."""
        return self._pass_log().drain()

    def pass_log_counted(self) -> dict:
        """``pass_log`` with ``dropped``: passes the log could not keep since the last call
        (``{"records": [...], "dropped": n}``)."""
        records, dropped = self._pass_log().take()
        return {"records": records, "dropped": dropped}

    def _pass_log(self):
        return self.worker.pass_log

    def ping(self) -> str:
        if self._crashed:
            raise RuntimeError(f"worker loop crashed: {self._crashed}")
        return self.instance_id

    def _core(self):
        return self.worker.core

    def shutdown(self) -> None:
        """Stop the loop, then finish the KV tiers' queued writes (the instance's core)."""
        self._stop = True
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._core().close()


@dataclass(frozen=True)
class RankSpec:
    """Rank ``rank`` of a tensor-parallel instance of ``size`` ranks, whose group forms on the controller's
    store at ``host:port`` under the instance's ``generation`` (a restarted instance forms a new group)."""

    rank: int
    size: int
    host: str
    port: int
    generation: int = 0
    collective_timeout_s: float = 60.0

    def form(self, instance_id: str, device: str):
        """Join the instance's group (blocks until every rank has joined)."""

        store = Rendezvous(self.host, self.port).connect()
        config = TPGroupConfig(collective_timeout_s=self.collective_timeout_s, interface_host=self.host)
        return TPGroup.form(store, instance_id, TPShard(self.rank, self.size), device, config, self.generation)


def _driver_group(tp: RankSpec | None, instance_id: str, device: str):
    return None if tp is None else tp.form(instance_id, device)


ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class ChangeRole:
    """Action: once the driver has stopped this rank's loop, become a rank of a ``role`` instance (its channels
    closed, its cache freed, a follower of the new role built over the same shard and group)."""

    role: str


class DisaggregatedActor(_LoopActor):
    """A prefill or a decode instance (``role``): a prefill worker (chunked prefill, first tokens, KV sent to
    decode instances) or a decode worker (KV received, speculative decoding), whichever ``role`` says now.

    ``become`` changes the role between two steps, in the same process: the worker, drained by the router, is
    closed (its KV channels aborted, its tiers' writes finished) and a worker of the other role takes its place
    over the same weights in memory; its disk tier, kept under the instance's name, is found again, and its host
    tier's blocks are kept where the new role's blocks are keyed alike (the pool starts empty). The controller
    then forms the new role's KV channels. ``pools``: each role's pool config. With ``tp``, the instance's rank 0
    (the other ranks are :class:`RankFollowerActor`): the other ranks change role with it (:class:`ChangeRole`),
    over the same group."""

    def __init__(self, model_path: str, config, instance_id: str, threads: int = 1, transfer_config=None,
                 role: str = "prefill", pools: dict | None = None, tp: RankSpec | None = None):
        if role not in ROLES:
            raise ValueError(f"role: must be one of {', '.join(ROLES)}, got {role!r}")
        torch.set_num_threads(threads)
        self.instance_id, self.role = instance_id, role
        self.pools = {**(pools or {}), role: config}
        self.transfer_config = transfer_config or TransferConfig()
        self.worker = self._make_worker(role, model_path, _driver_group(tp, instance_id, config.device))
        self._last_report, self._reported_at = None, 0.0
        self._start_loop(f"{role}-loop-{instance_id}")

    def _make_worker(self, role: str, model, tp=None):
        if role == "prefill":
            return PrefillWorker(model, self.pools[role], self.instance_id, tp=tp)
        return DecodeWorker(model, self.pools[role], self.instance_id, self.transfer_config, tp=tp)

    def become(self, role: str) -> None:
        """Change to ``role`` between steps (see the class doc). Raises ValueError for a role this instance
        cannot take, RuntimeError while its worker still holds work (the router drains it first)."""
        if role not in self.pools:
            raise ValueError(f"role: must be one of {', '.join(self.pools)}, got {role!r}")
        with self._gate.call():
            if role == self.role:
                return
            if self._holds_work():
                raise RuntimeError(f"{self.instance_id} still holds work as a {self.role} instance")
            old = self.worker
            loaded = old.loaded
            runner = old.core.runner
            group = runner.group if isinstance(runner, TPDriverRunner) else None
            if group is not None:  # the other ranks switch once the old worker stops their loop
                runner.call(ChangeRole(role))
            if self.role == "prefill":  # peers see the channels end
                old.sender.close()
            else:  # the KV and migration channels it receives over, and those it migrates requests over
                old.receiver.close()
                old.migrations.close()
            old.close()  # the tiers' queued writes finished and their directory released for the new worker
            if group is not None:
                group.barrier()  # every other rank has taken the action in: it switches before serving again
            runner = None
            tiers, salt = old.core.tiers, old.core.prefix_cache.salt
            host = tiers.host if tiers is not None else None  # host memory: outlives the old KV cache
            self.worker = old = tiers = None  # the old KV cache freed before the new one takes the memory
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.worker = self._make_worker(role, loaded, group)
            kept = self.worker.core.adopt_host_tier(host, salt)
            self.role = role
            if kept:
                log.info("%s kept %d blocks of its host tier", self.instance_id, kept)
            self._last_report = None
            log.warning("%s is a %s instance now", self.instance_id, role)

    def holds_work(self) -> bool:
        """Whether the worker still holds a request, a transfer or a migration (the router's drain ends a moment
        before the worker lets go: a migrated request's source copy, an acknowledgement in flight)."""
        with self._gate.call():
            return self._holds_work()

    def _holds_work(self) -> bool:
        w = self.worker
        if self.role == "prefill":
            return w.has_work() or bool(w.transfers_pending())
        return bool(w.requests) or bool(w.migrations.outgoing) or bool(w.migrations.incoming)

    def _as(self, role: str):
        """The worker, which must be of ``role`` (a call for the other role fails: the router retries it)."""
        if self.role != role:
            raise RuntimeError(f"{self.instance_id} is a {self.role} instance, not a {role} one")
        return self.worker

    def connect(self, peer_id: str, host: str, port: int, generation: int = 0, peer_tp: int = 1) -> None:
        """Form the KV channels with an instance of the other pool of ``peer_tp`` ranks (blocks until they
        join; not under the loop lock)."""
        self.worker.connect(peer_id, Rendezvous(host, port), generation, peer_tp)

    def abort(self, request_id: str) -> bool:
        with self._gate.call():
            return self.worker.abort(request_id)

    def hand_back(self) -> list[str]:
        """The requests the draining worker gives up before beginning them (``hand_back`` of either role): the
        router places each anew elsewhere."""
        with self._gate.call():
            return self.worker.hand_back()

    def status(self) -> dict:
        with self._gate.call():
            w = self.worker
            if self.role == "prefill":
                return {**_scheduler_status(self.instance_id, "prefill", w), **w.transfer_stats()}
            m = w.metrics.summary()
            return {"name": self.instance_id, "role": "decode", "device": str(w.loaded.device),
                    "queue_length": w.num_waiting_for_kv, "running": w.num_running, "local_prefills": len(w.prefills),
                    **_cache_status(w),
                    "acceptance_rate": m["acceptance_rate"], "mean_accepted_length": m["mean_accepted_length"],
                    "tokens_generated": m["tokens"], "draft_tokens": m["draft_tokens"],
                    "accepted_tokens": m["accepted_tokens"], "spec_steps": m["seq_spec_steps"],
                    "k_counts": m["k_counts"], "last_k": m["last_k"], "preemptions": m["preemptions"]}

    def _step(self) -> list:
        w = self.worker
        if self.role == "prefill":
            if not w.has_work() and not w.transfers_pending():
                return _with_cache_events([], w)
            out = w.step()
            return _with_cache_events([] if out.empty else [out], w)
        out = w.step()  # polls the KV receiver even when idle: handshakes wait on it
        report = w.request_loads()
        now = time.monotonic()
        # the router places new requests by these: a change in what the instance holds goes out at once,
        # a change in block counts alone at most every LOAD_REPORT_PERIOD_S
        last = self._last_report
        if last is None or report.holds != last.holds or \
                (report != last and now - self._reported_at >= LOAD_REPORT_PERIOD_S):
            self._last_report, self._reported_at = report, now
            out = [*out, report]
        return _with_cache_events(out, w)

    # prefill: prompts to compute

    def submit(self, request) -> None:
        with self._gate.call():
            self._as("prefill").add_request(request)

    # decode admission: every source through the worker's one door (``DecodeWorker.admit``)

    def add_remote(self, request) -> bool:
        """Hold ``request`` (a ``DecodeRequest``) until its KV arrives, with room reserved; False: no room."""
        with self._gate.call():
            return self._as("decode").admit(request, RemoteKV())

    def add_prefill(self, request, late: bool = False) -> bool:
        """Prefill ``request`` here from its cached prefix, then decode it (``late``: after the queued prompts
        that are not, ``LocalPrefill``); False: no room."""
        with self._gate.call():
            return self._as("decode").admit(request, LocalPrefill(late))

    def add_resume(self, request) -> bool:
        """Continue ``request`` (a ``ResumeRequest``) where a dead instance left it; False: no room."""
        with self._gate.call():
            return self._as("decode").admit(request, Resume())

    # live migration between decode instances (``decode_worker/migration.py``; the router decides every outcome)

    def connect_migration(self, destination: str, host: str, port: int, generation: int,
                          destination_tp: int = 1) -> None:
        """Form the channels this instance migrates requests to ``destination`` over (blocks until the
        destination's ``connect`` joins; not under the loop lock)."""

        self._as("decode").migrations.connect(destination, Rendezvous(host, port), generation, destination_tp)

    def migrate_in(self, request, num_tokens: int):
        """Destination: the positions reserved for a request migrating here, or None (no room); admitted
        through the worker's door as ``MigrationIn`` with room for the steps its source runs meanwhile."""
        with self._gate.call():
            return self._as("decode").migrations.begin_in(request, num_tokens)

    def migrate_out(self, request_id: str, destination: str, capacity_tokens: int) -> str | None:
        """Source: start sending a decoding request to ``destination``; None when started, else why not."""
        with self._gate.call():
            return self._as("decode").migrations.begin_out(request_id, destination, capacity_tokens)

    def commit_migration(self, request_id: str) -> bool:
        with self._gate.call():
            return self._as("decode").migrations.commit(request_id)

    def finish_migration(self, request_id: str) -> bool:
        with self._gate.call():
            return self._as("decode").migrations.finish(request_id)

    def abort_migration(self, request_id: str) -> bool:
        with self._gate.call():
            return self._as("decode").migrations.abort(request_id)

    def request_loads(self):
        """The pool's load report now (``PoolLoad``: each running request's KV blocks and the blocks held
        otherwise), read by the global rescheduling policy (``controller/migration_policy.py``)."""
        with self._gate.call():
            return self._as("decode").request_loads()


class ColocatedActor(_LoopActor):
    """A colocated instance: the single-process reference engine (chunked prefill and decode share each
    step's token budget; no KV transfer, no speculation). Every step yields one ``TokenDelta`` per
    request that sampled a token; a request's first delta carries its first token."""

    def __init__(self, model_path: str, config, instance_id: str, threads: int = 1, tp: RankSpec | None = None):
        torch.set_num_threads(threads)
        self.instance_id = instance_id
        self.engine = ReferenceEngine(model_path, config, tp=_driver_group(tp, instance_id, config.device),
                                      instance_id=instance_id)
        self._tokens_generated = 0
        self._start_loop(f"colocated-loop-{instance_id}")

    def submit(self, request: ColocatedRequest) -> None:
        with self._gate.call():
            self.engine.add_request(list(request.prompt_ids), request.params, request.request_id)

    def add_resume(self, request: ResumeRequest) -> bool:
        """Continue ``request`` where a dead instance left it (always taken: the engine queues it)."""
        with self._gate.call():
            self.engine.add_resume(request)
            return True

    def abort(self, request_id: str) -> bool:
        with self._gate.call():
            return self.engine.abort(request_id)

    def status(self) -> dict:
        with self._gate.call():
            return {**_scheduler_status(self.instance_id, "colocated", self.engine),
                    "tokens_generated": self._tokens_generated}

    def _pass_log(self):
        return self.engine.pass_log

    def _core(self):
        return self.engine.core

    def _step(self) -> list:
        if not self.engine.has_unfinished():
            return _with_cache_events([], self.engine)
        deltas = []
        for out in self.engine.step():
            state = b"" if out.finished else self.engine.sampler_state(out.request_id)  # what a resume continues from
            rid, index = split_sequence_id(out.request_id)
            # the request's first delta says what was found of its prompt (asked before a release forgets it)
            cached = self.engine.prefix_cache.found(out.request_id) if index == 0 and out.position == 0 else None
            if out.finished:
                self.engine.release(out.request_id)
            self._tokens_generated += len(out.new_token_ids)
            reason = out.finish_reason.value if out.finish_reason is not None else None
            deltas.append(TokenDelta(rid, out.new_token_ids, out.new_text, out.finished, reason,
                                     logprobs=tuple(out.logprobs or ()),
                                     prompt_logprobs=None if out.prompt_logprobs is None else tuple(out.prompt_logprobs),
                                     index=index, position=out.position, text_offset=out.text_offset,
                                     sampler_state=state, cached=cached))
        return _with_cache_events(deltas, self.engine)


class RankFollowerActor:
    """Rank 1.. of a tensor-parallel instance: runs the driver's steps on its shard, on a background thread
    (``serve``); ``connect`` forms this rank's own KV channels beside it. A broken group (the driver or
    another rank died, a collective timed out) ends the thread and ``ping`` reports it. When its instance changes
    role (:class:`ChangeRole`, then the driver stops the loop), the rank closes its channels and serves again as
    a rank of the new role, over the same shard and group; ``pools``: each role's pool config."""

    def __init__(self, role: str, model_path: str, config, instance_id: str, threads: int, tp: RankSpec,
                 transfer_config=None, pools: dict | None = None):
        torch.set_num_threads(threads)
        self.base_id = instance_id
        self.instance_id = rank_peer_id(instance_id, tp.rank, tp.size)
        self.pools = {**(pools or {}), role: config}
        self.transfer_config = transfer_config
        self.group = tp.form(instance_id, config.device)
        self.loaded = load_for_rank(model_path, config.dtype, config.device, self.group)
        self.role = role
        self.follower = self._make_follower(role)
        self._next_role: str | None = None
        self._ready = threading.Event()  # clear while the rank changes role: channels form on the new follower
        self._ready.set()
        self._crashed: str | None = None
        self._thread = threading.Thread(target=self._serve, name=f"tp-follower-{self.instance_id}", daemon=True)
        self._thread.start()

    def _make_follower(self, role: str):
        config = self.pools[role]
        if role == "prefill":
            follower = prefill_follower(self.loaded, config, self.group, self.base_id)
        elif role == "decode":
            follower = decode_follower(self.loaded, config, self.group, self.base_id, self.transfer_config)
        else:
            follower = engine_follower(self.loaded, config, self.group)
        follower.on(ChangeRole, self._change_role)
        return follower

    def _change_role(self, action: ChangeRole) -> None:
        if action.role not in self.pools:
            raise ValueError(f"role: must be one of {', '.join(self.pools)}, got {action.role!r}")
        self._ready.clear()
        self._next_role = action.role

    def _serve(self) -> None:
        try:
            while True:
                self.follower.serve()
                role, self._next_role = self._next_role, None
                if role is None:
                    return
                self.group.barrier()  # with the driver: it builds its new worker once every rank has stopped
                self._become(role)
        except Exception:  # noqa: BLE001 - the controller learns of it through ping
            self._crashed = traceback.format_exc()
            log.error("tensor-parallel rank stopped:\n%s", self._crashed)
        finally:
            self._ready.set()  # a caller waiting to connect sees the crash, not a hang

    def _become(self, role: str) -> None:
        old = self.follower
        if self.role == "prefill":
            old.sender.close()
        elif self.role == "decode" and self.transfer_config is not None:
            old.receiver.close()
            old.migration.close()
        self.follower = old = None  # the old KV cache freed before the new one takes the memory
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.follower = self._make_follower(role)
        self.role = role
        self._ready.set()
        log.warning("%s is a rank of a %s instance now", self.instance_id, role)

    def _switched(self):
        """The follower, once a role change under way has finished."""
        self._ready.wait()
        return self.follower

    def connect(self, peer_id: str, host: str, port: int, generation: int = 0, peer_tp: int = 1) -> None:
        self._switched().connect(peer_id, Rendezvous(host, port), generation, peer_tp)

    def connect_migration(self, destination: str, host: str, port: int, generation: int,
                          destination_tp: int = 1) -> None:
        """A decode rank's channels to the ranks of ``destination`` it sends its heads to when a request
        migrates there."""

        self._switched().connect_migration(destination, Rendezvous(host, port), generation, destination_tp)

    def ping(self) -> str:
        if self._crashed:
            raise RuntimeError(f"tensor-parallel rank stopped: {self._crashed}")
        return self.instance_id

    def pid(self) -> int:
        """This rank's process id (operators and fault tests signal it)."""
        return os.getpid()


@functools.cache
def ray_actor_class(cls):
    """``ray.remote`` version of an actor class: threaded (poll / submit run beside the loop). Ray does not
    restart it: the controller replaces a dead instance as a whole (every rank, new groups and channels).
    One per class: every instance and restart reuses it."""

    return ray.remote(max_concurrency=16, max_restarts=0, max_task_retries=0)(cls)
