"""Prometheus metrics of a serving cluster (``GET /metrics`` on the HTTP front).

Names follow vLLM's where an equivalent exists, with the ``magicserve:`` prefix instead of ``vllm:``
(``vllm:time_to_first_token_seconds`` -> ``magicserve:time_to_first_token_seconds``, same buckets), so a
dashboard ports by a rename. Every series carries ``model_name``; per-instance series add ``instance``
and ``role``.

Two sources:

* the router reports each request as it goes (:class:`ServingMetrics` ``first_token`` / ``tokens`` /
  ``finished`` / ``failed``): latency histograms, request and token counters. They live in this process,
  so a worker restart never moves them back;
* each scrape reads the instances' status (:meth:`ServingMetrics.observe_instances`): KV blocks, queues,
  speculation and KV-transfer counts. A worker's own counters restart at 0 when its instance is replaced;
  :class:`MonotonicTotals` carries the totals over, so exported counters never go backwards.

No torch here; the registry is per server (tests run several in one process).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from modeling.prefix_cache import CachedPrompt

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (vllm/v1/metrics/buckets.py), so histograms compare bucket for bucket
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)

PREFIX = "magicserve:"

disable_created_metrics()  # no ``*_created`` series (as vLLM): they double the exposition for no dashboard


class MonotonicTotals:
    """Cumulative counters of instances whose own counts restart at 0 when the instance is replaced.

    ``update(instance, generation, values)`` takes the instance's current counts; a new generation, or a
    count below the last one seen, means the instance restarted: what it had counted is banked and its
    new counts add on top. ``total(instance, name)`` is then never below an earlier total."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], float] = {}
        self._banked: dict[tuple[str, str], float] = {}
        self._generation: dict[str, int] = {}

    def update(self, instance: str, generation: int, values: dict[str, float]) -> None:
        restarted = self._generation.get(instance, generation) != generation
        self._generation[instance] = generation
        for name, value in values.items():
            key = (instance, name)
            last = self._last.get(key, 0.0)
            if restarted or value < last:
                self._banked[key] = self._banked.get(key, 0.0) + last
            self._last[key] = value

    def total(self, instance: str, name: str) -> float:
        key = (instance, name)
        return self._banked.get(key, 0.0) + self._last.get(key, 0.0)

    def names(self, instance: str) -> list[str]:
        return sorted({n for i, n in self._last if i == instance})


# instance counters exported per instance: status key -> (metric name, help)
_INSTANCE_COUNTERS = {
    "draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens proposed by speculative decoding."),
    "accepted_tokens": ("spec_decode_num_accepted_tokens", "Draft tokens the target model accepted."),
    "spec_steps": ("spec_decode_num_drafts", "Speculation rounds (a sequence's draft-and-verify in one step)."),
    "kv_transfers_completed": ("kv_transfers", "KV transfers every receiver acknowledged."),
    "kv_transfers_failed": ("kv_transfer_failures", "KV transfers that failed (the request was retried or failed)."),
    "kv_transfer_bytes": ("kv_transfer_bytes", "Bytes of KV cache sent by prefill instances (K and V, every layer)."),
    "kv_transfer_seconds": ("kv_transfer_seconds", "Seconds from a KV transfer's start to its last acknowledgement."),
    "preemptions": ("num_preemptions", "Sequences a decode instance preempted (KV dropped, recomputed later)."),
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the instance's prefix cache."),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the instance's prefix cache (not computed)."),
    "prefix_cache_tier_hits": ("prefix_cache_tier_hits", "Prompt tokens of the prefix-cache hits loaded from a KV "
                               "tier below the pool (host memory, disk)."),
    "prefix_cache_evictions": ("prefix_cache_evictions", "Cached KV blocks evicted to make room."),
}
# KV tier counters (``TierStats`` fields, per instance and tier): field -> (metric name, help)
_TIER_COUNTERS = {
    "hits": ("kv_tier_hits", "KV blocks loaded from the tier into the instance's pool."),
    "bytes_in": ("kv_tier_load_bytes", "Bytes of KV loaded from the tier into the pool."),
    "load_s": ("kv_tier_load_seconds", "Seconds the worker spent loading KV blocks from the tier (on its step)."),
    "stored": ("kv_tier_stored", "KV blocks written into the tier."),
    "bytes_out": ("kv_tier_store_bytes", "Bytes of KV written into the tier."),
    "evicted": ("kv_tier_evictions", "KV blocks the tier dropped to make room."),
    "corrupt": ("kv_tier_corrupt", "Tier entries found truncated or failing their checksum (recomputed)."),
    "dropped": ("kv_tier_dropped_writes", "KV blocks not written to the tier because its writer was behind."),
    "read_ahead": ("kv_tier_read_ahead", "Of the KV blocks loaded from the tier, those read while their prompt "
                   "waited (off the worker's step)."),
    "read_ahead_s": ("kv_tier_read_ahead_seconds", "Seconds reading KV blocks ahead, off the worker's step."),
}
# KV tier gauges: field -> (metric name, help)
_TIER_GAUGES = {
    "blocks": ("kv_tier_blocks", "KV blocks the tier holds."),
    "bytes": ("kv_tier_bytes", "Bytes the tier holds."),
    "capacity_bytes": ("kv_tier_capacity_bytes", "Bytes the tier may hold."),
}


@dataclass(frozen=True)
class FinishedRequest:
    """What the router knows of a request that ended normally."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    mean_tpot_s: float
    e2e_s: float
    cached: CachedPrompt = CachedPrompt()


class _InstanceCollector:
    """Per-instance gauges and counters from the latest ``observe_instances`` snapshot."""

    def __init__(self, owner: "ServingMetrics"):
        self._owner = owner

    def collect(self):
        o = self._owner
        with o._lock:
            statuses = list(o._statuses)
        labels = ["model_name", "instance", "role"]

        def gauge(name, doc):
            return GaugeMetricFamily(PREFIX + name, doc, labels=labels)

        used, total, usage = (gauge("kv_cache_blocks_used", "KV cache blocks in use on the instance."),
                              gauge("kv_cache_blocks_total", "KV cache blocks of the instance."),
                              gauge("kv_cache_usage_perc", "Fraction of the instance's KV cache blocks in use (0-1)."))
        cached = gauge("kv_cache_blocks_cached", "KV blocks the instance holds under a prefix-cache hash (in use or "
                       "kept for reuse).")
        alive = gauge("instance_alive", "1 while the instance serves, 0 while it is down or being replaced.")
        generation = gauge("instance_generation", "How many times the instance was replaced as a whole.")
        running = gauge("instance_running_requests", "Requests the instance is computing.")
        queues = {"prefill": gauge("prefill_queue_length", "Prompts waiting on a prefill instance."),
                  "decode": gauge("decode_queue_length", "Requests on a decode instance waiting for their KV."),
                  "colocated": gauge("colocated_queue_length", "Prompts waiting on a colocated instance.")}
        local = gauge("decode_local_prefills", "Prompts a decode instance prefills itself beside its batch (a cache "
                      "hit, a prefill backlog, no prefill instance), queued or under way.")
        rate = gauge("spec_decode_acceptance_rate", "Accepted / proposed draft tokens since the instance started.")
        mean_len = gauge("spec_decode_mean_accepted_length", "Draft tokens accepted per speculation round.")
        k_now = gauge("spec_decode_k", "Speculation length chosen for the instance's latest step.")
        k_steps = CounterMetricFamily(PREFIX + "spec_decode_steps", "Decode steps by the speculation length chosen.",
                                      labels=labels + ["k"])
        counters = {key: CounterMetricFamily(PREFIX + name, doc, labels=labels)
                    for key, (name, doc) in _INSTANCE_COUNTERS.items()}
        tier_counters = {key: CounterMetricFamily(PREFIX + name, doc, labels=labels + ["tier"])
                         for key, (name, doc) in _TIER_COUNTERS.items()}
        tier_gauges = {key: GaugeMetricFamily(PREFIX + name, doc, labels=labels + ["tier"])
                       for key, (name, doc) in _TIER_GAUGES.items()}
        for st in statuses:
            lv = [o.model_name, st["name"], st["role"]]
            blocks, free = st.get("total_kv_blocks", 0), st.get("free_kv_blocks", 0)
            used.add_metric(lv, blocks - free)
            total.add_metric(lv, blocks)
            usage.add_metric(lv, (blocks - free) / blocks if blocks else 0.0)
            cached.add_metric(lv, st.get("cached_kv_blocks", 0))
            alive.add_metric(lv, 1.0 if st.get("alive") else 0.0)
            generation.add_metric(lv, st.get("generation", 0))
            running.add_metric(lv, st.get("running", 0))
            if st["role"] in queues:
                queues[st["role"]].add_metric(lv, st.get("queue_length", 0))
            if st["role"] == "decode":
                local.add_metric(lv, st.get("local_prefills", 0))
                rate.add_metric(lv, st.get("acceptance_rate", 0.0))
                mean_len.add_metric(lv, st.get("mean_accepted_length", 0.0))
                k_now.add_metric(lv, st.get("last_k", 0))
            for tier, values in (st.get("kv_tiers") or {}).items():
                for key, family in tier_gauges.items():
                    family.add_metric(lv + [tier], values.get(key, 0))
            for name in o._totals.names(st["name"]):
                if name.startswith("k_steps/"):
                    k_steps.add_metric(lv + [name.split("/", 1)[1]], o._totals.total(st["name"], name))
                elif name.startswith("kv_tier/"):
                    _, tier, key = name.split("/")
                    tier_counters[key].add_metric(lv + [tier], o._totals.total(st["name"], name))
                elif name in counters:
                    counters[name].add_metric(lv, o._totals.total(st["name"], name))
        yield from (used, total, usage, cached, alive, generation, running, *queues.values(), local, rate, mean_len, k_now,
                    k_steps, *counters.values(), *tier_counters.values(), *tier_gauges.values())


class ServingMetrics:
    """The metrics of one server: the router's hooks, the per-scrape instance snapshot, the exposition."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._statuses: list[dict] = []
        self._totals = MonotonicTotals()
        reg, m = self.registry, ["model_name"]
        self._ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                               m, buckets=TTFT_BUCKETS, registry=reg).labels(model_name)
        self._itl = Histogram(PREFIX + "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                              m, buckets=INTER_TOKEN_BUCKETS, registry=reg).labels(model_name)
        self._tpot = Histogram(PREFIX + "request_time_per_output_token_seconds",
                               "Histogram of time per output token (a request's mean) in seconds.",
                               m, buckets=INTER_TOKEN_BUCKETS, registry=reg).labels(model_name)
        self._e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                              m, buckets=REQUEST_LATENCY_BUCKETS, registry=reg).labels(model_name)
        self._success = Counter(PREFIX + "request_success", "Count of successfully processed requests.",
                                m + ["finished_reason"], registry=reg)
        self._errors = Counter(PREFIX + "request_errors", "Requests that ended in an error, by status code "
                               "(gRPC status names; the HTTP front counts its own refusals too).",
                               m + ["code"], registry=reg)
        self._prompt_tokens = Counter(PREFIX + "prompt_tokens", "Number of prefill tokens processed.", m,
                                      registry=reg).labels(model_name)
        cached = Counter(PREFIX + "prompt_tokens_cached", "Prompt tokens found cached rather than computed, in the "
                         "KV pool of the instance that computed the prompt or in the tiers below it.", m,
                         registry=reg)
        self._prompt_tokens_cached = cached.labels(model_name)
        by_source = Counter(PREFIX + "prompt_tokens_cached_by_source", "Prompt tokens found cached, by where: the "
                            "instance's KV pool (pool) or the tiers below it (tiers: host memory, disk, the "
                            "cluster's store).", m + ["source"], registry=reg)
        self._cached_by_source = {source: by_source.labels(model_name, source) for source in ("pool", "tiers")}
        self._generation_tokens = Counter(PREFIX + "generation_tokens", "Number of generation tokens processed.", m,
                                          registry=reg).labels(model_name)
        self._running = Gauge(PREFIX + "num_requests_running", "Requests admitted: prefilling, transferring or decoding.",
                              m, registry=reg).labels(model_name)
        self._waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting for admission.", m,
                              registry=reg).labels(model_name)
        self._migrations = Counter(PREFIX + "migrations", "Live migrations of decoding requests between decode "
                                   "instances, by outcome (committed: the request moved; aborted: it stayed).",
                                   m + ["outcome"], registry=reg)
        self._local_prefills = Counter(PREFIX + "decode_local_prefills", "Requests prefilled on their decode "
                                       "instance (no prefill instance, no transfer): from the KV it held cached, "
                                       "under a prefill backlog, or with no prefill instance in service.",
                                       m, registry=reg).labels(model_name)
        self._prefill_ahead = Counter(PREFIX + "prefill_ahead_passes", "Prompts an idle prefill instance was given "
                                      "to compute ahead while they waited for room on a decode instance "
                                      "(controller/prefill_ahead.py).", m, registry=reg).labels(model_name)
        self._load_aware = Counter(PREFIX + "load_aware_placements", "Where the load-aware policy had a prompt "
                                   "prefilled (prefill pool or decode instance) and why (controller/load_aware.py).",
                                   m + ["prefilled_on", "reason"], registry=reg)
        self._pool_instances = Gauge(PREFIX + "pool_instances", "Instances per pool: in service now (current), "
                                     "asked for (desired), and the online planner's latest choice (planned).", ["model_name", "pool", "kind"], registry=reg)
        self._planned_attainment = Gauge(PREFIX + "autoscale_predicted_attainment", "SLO attainment the online "
                                         "planner predicted for the shape it chose last.", ["model_name"],
                                         registry=reg).labels(model_name)
        self._resumes = Counter(PREFIX + "requests_resumed", "Requests continued on another decode instance after "
                                "the one decoding them died, from the tokens already streamed.",
                                m, registry=reg).labels(model_name)
        self._handed_back = Counter(PREFIX + "requests_handed_back", "Requests a draining instance (leaving its pool, "
                                    "changing role, or drained) gave up before computing any of them, placed anew "
                                    "elsewhere.",
                                    m, registry=reg).labels(model_name)
        self._call_failures = Counter(PREFIX + "instance_call_failures", "Calls the router made to an instance "
                                      "about a request that failed there (raised, timed out, or found the request "
                                      "not as the router holds it), by instance and call.",
                                      ["model_name", "instance", "call"], registry=reg)
        segment = ["model_name", "segment", "node"]
        self._store_capacity = Gauge(PREFIX + "kv_store_capacity_bytes", "Memory of each segment server of the "
                                     "cluster's KV store (controller/kv_store.py), as its master reports it.",
                                     segment, registry=reg)
        self._store_used = Gauge(PREFIX + "kv_store_used_bytes", "Bytes of KV blocks each segment server of the "
                                 "cluster's KV store holds.", segment, registry=reg)
        self._store_objects = Gauge(PREFIX + "kv_store_objects", "KV blocks the cluster's KV store holds.", m,
                                    registry=reg).labels(model_name)
        reg.register(_InstanceCollector(self))

    # -- the router's hooks (event loop thread) ----------------------------------------------------

    def first_token(self, ttft_s: float) -> None:
        self._ttft.observe(ttft_s)

    def tokens(self, count: int, interval_s: float) -> None:
        """``count`` tokens arrived ``interval_s`` after the previous ones: each is one inter-token gap
        of ``interval_s / count`` (speculation delivers several at once)."""
        for _ in range(count):
            self._itl.observe(interval_s / count)

    def finished(self, req: FinishedRequest) -> None:
        self._success.labels(self.model_name, req.finish_reason).inc()
        self._e2e.observe(req.e2e_s)
        if req.completion_tokens > 1:
            self._tpot.observe(req.mean_tpot_s)
        self._prompt_tokens.inc(req.prompt_tokens)
        self._prompt_tokens_cached.inc(req.cached.tokens)
        self._cached_by_source["pool"].inc(req.cached.tokens - req.cached.from_tiers)
        self._cached_by_source["tiers"].inc(req.cached.from_tiers)
        self._generation_tokens.inc(req.completion_tokens)

    def failed(self, code: str) -> None:
        """A request ended in error ``code`` (a gRPC status name such as UNAVAILABLE)."""
        self._errors.labels(self.model_name, code).inc()

    def migration(self, committed: bool) -> None:
        self._migrations.labels(self.model_name, "committed" if committed else "aborted").inc()

    def local_prefill(self) -> None:
        self._local_prefills.inc()

    def prefill_ahead(self) -> None:
        self._prefill_ahead.inc()

    def load_aware(self, prefilled_on: str, reason: str) -> None:
        """The load-aware policy placed a prompt's prefill on ``prefilled_on`` (prefill | decode) for ``reason``."""
        self._load_aware.labels(self.model_name, prefilled_on, reason).inc()

    def resumed(self) -> None:
        self._resumes.inc()

    def handed_back(self) -> None:
        self._handed_back.inc()

    def call_failed(self, instance: str, call: str) -> None:
        self._call_failures.labels(self.model_name, instance, call).inc()

    def planned(self, shape: dict, attainment: float) -> None:
        """The online planner's latest decision: each pool's instances and the attainment it predicted."""
        for pool, n in shape.items():
            self._pool_instances.labels(self.model_name, pool, "planned").set(n)
        self._planned_attainment.set(attainment)

    def pool_size(self, pool: str, current: int, desired: int) -> None:
        self._pool_instances.labels(self.model_name, pool, "current").set(current)
        self._pool_instances.labels(self.model_name, pool, "desired").set(desired)

    def queue(self, running: int, waiting: int) -> None:
        self._running.set(running)
        self._waiting.set(waiting)

    # -- scrapes ----------------------------------------------------------------------------------

    def observe_instances(self, statuses: list[dict]) -> None:
        """The instances' status (``Cluster.statuses``) as of this scrape."""
        for st in statuses:
            if not st.get("device"):
                continue  # did not answer: keep its last counts
            values = {key: float(st[key]) for key in _INSTANCE_COUNTERS if key in st}
            values.update({f"k_steps/{k}": float(n) for k, n in (st.get("k_counts") or {}).items()})
            values.update({f"kv_tier/{tier}/{key}": float(v) for tier, fields in (st.get("kv_tiers") or {}).items()
                           for key, v in fields.items() if key in _TIER_COUNTERS})
            self._totals.update(st["name"], int(st.get("generation", 0)), values)
        with self._lock:
            self._statuses = [dict(st) for st in statuses]

    def observe_store(self, occupancy) -> None:
        """The cluster's KV store as of this scrape (``MooncakeStoreService.occupancy``; None: the master did not
        answer, its last figures stay)."""
        if occupancy is None:
            return
        for seg in occupancy.segments:
            self._store_capacity.labels(self.model_name, seg.name, seg.node).set(seg.capacity_bytes)
            self._store_used.labels(self.model_name, seg.name, seg.node).set(seg.used_bytes)
        self._store_objects.set(occupancy.objects)

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
