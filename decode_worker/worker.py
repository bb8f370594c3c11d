"""The decode worker: continuous-batching decode with MagicDec-style speculative decoding.

A plain class (the controller wraps it as a Ray actor). Sequences arrive with their prompt KV already
in this worker's blocks (``reserve`` then ``admit``, fed by kv_transfer) or are prefilled here
(``add_local``: tests, benchmarks, recompute after preemption). Each ``step``:

    choose k  ->  reserve room for k  ->  draft k tokens  ->  verify all k + 1 in one target pass
              ->  accept / recover / bonus per sequence  ->  roll back rejected KV  ->  emit deltas

k = 0 is a plain decode step. Sequences join and leave at every step, each with its own sampling
parameters and stop conditions.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from decode_worker.config import DecodeWorkerConfig, SpeculationConfig
from decode_worker.drafters import DraftModelDrafter, Drafter, SelfSparseDrafter, window_start
from decode_worker.policy import AcceptanceEstimator, AdaptiveK, KChoice, LinearCostModel, PassShape, StepCorrection
from decode_worker.verify import Verdict, verify_greedy, verify_sampled
from modeling.attention import make_backend
from modeling.block_pool import BlockPool, BlockTable
from modeling.checkpoint import LoadedModel, load_model
from modeling.errors import InvalidRequestError, OutOfBlocksError
from modeling.kv_cache import KVCacheSpec, PagedKVCache
from modeling.output import OutputStream
from modeling.pass_log import PassLog
from modeling.runner import ModelRunner, StepInput
from modeling.sampling import RequestSampler, SamplingParams, target_probs
from modeling.sequence import FinishReason, Sequence, SequenceStatus
from modeling.tokenizer import load_tokenizer_if_present


@dataclass(frozen=True)
class DecodeRequest:
    """A sequence handed over after prefill: its prompt KV is in the blocks reserved for
    ``request_id``; ``first_token`` was sampled by the prefill worker (and already streamed)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    first_token: int
    params: SamplingParams
    # the request's generator state after the first token (FirstToken.sampler_state), so a seeded
    # request continues the very random stream a colocated engine would use
    sampler_state: bytes | None = None


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one request from one step (the first token of an admitted request is not
    repeated). finish_reason is 'stop' | 'length' | 'abort' when finished."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    draft_tokens: int = 0
    accepted_tokens: int = 0


@dataclass
class RequestStats:
    draft_tokens: int = 0
    accepted_tokens: int = 0
    spec_steps: int = 0  # steps with k > 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass
class WorkerMetrics:
    """Counters of a decode worker (see ``summary``)."""

    steps: int = 0
    tokens: int = 0  # emitted tokens
    draft_tokens: int = 0
    accepted_tokens: int = 0
    seq_spec_steps: int = 0  # (sequence, step) pairs with k > 0
    k_counts: dict[int, int] = field(default_factory=dict)
    step_times: deque = field(default_factory=lambda: deque(maxlen=1024))
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    preemptions: int = 0

    def summary(self) -> dict:
        times = sorted(self.step_times)
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            "mean_accepted_length": self.accepted_tokens / self.seq_spec_steps if self.seq_spec_steps else 0.0,
            "k_counts": dict(sorted(self.k_counts.items())),
            "median_step_ms": 1e3 * times[len(times) // 2] if times else 0.0,
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
            "preemptions": self.preemptions,
        }


@dataclass
class _Live:
    seq: Sequence
    stream: OutputStream
    stats: RequestStats = field(default_factory=RequestStats)


class DecodeWorker:
    """Owns a paged KV cache, a drafter and the speculation policy for one decode instance."""

    # Deciding k costs ~0.1 ms of Python, a few per cent of a batch-1 step on CPU. While the batch holds
    # the same sequences, a decision is reused for this many steps: contexts grow by a few tokens per
    # step and the acceptance estimate moves slowly, so the best k rarely changes within that span.
    CHOICE_REUSE_STEPS = 4

    def __init__(self, model: LoadedModel | str, config: DecodeWorkerConfig = DecodeWorkerConfig()):
        self.config = config
        spec_cfg = config.speculation
        self.loaded = model if isinstance(model, LoadedModel) else load_model(model, config.dtype, config.device)
        mc = self.loaded.config
        self.max_model_len = mc.max_position_embeddings
        self.tokenizer = load_tokenizer_if_present(self.loaded.path)
        self.pool = BlockPool(config.kv_cache_tokens // config.block_size, config.block_size)
        kv_spec = KVCacheSpec(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, config.block_size, self.loaded.dtype)
        self.cache = PagedKVCache(kv_spec, self.pool.num_blocks, self.loaded.device)
        backend = make_backend(config.attention_backend, self.loaded.device, config.block_size)
        self.runner = ModelRunner(self.loaded.model, self.cache, backend)
        self.drafter = self._make_drafter(backend)
        self.target_cost = LinearCostModel()
        self.draft_cost = LinearCostModel()
        self.acceptance = AcceptanceEstimator()
        self.step_correction = StepCorrection()
        slo = spec_cfg.tpot_slo_ms / 1e3 if spec_cfg.tpot_slo_ms else None
        self.policy = AdaptiveK(spec_cfg.max_k, self.target_cost, self.draft_cost, self.acceptance, slo,
                                self.step_correction)
        self._cached_choice: tuple[tuple, int, KChoice] | None = None  # (request ids, reuses left, choice)
        self.metrics = WorkerMetrics()
        self.pass_log = PassLog()
        self._live: dict[str, _Live] = {}  # running sequences, in admission order
        self._reserved: dict[str, BlockTable] = {}
        self._preempted: deque[_Live] = deque()
        if config.profile_on_start:
            self.profile()

    # -- admission --------------------------------------------------------------------------------

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Reserve blocks for a prompt's KV before it is transferred; None when there is no room
        (back-pressure: the caller waits or goes elsewhere)."""
        if request_id in self._reserved or request_id in self._live:
            raise InvalidRequestError("request_id", f"{request_id!r} is already on this worker")
        # keep room for the first decode step too
        needed = self.pool.blocks_for_tokens(num_tokens + 1)
        if len(self._live) >= self.config.max_num_seqs or not self.pool.can_allocate(needed):
            return None
        table = BlockTable(self.config.block_size)
        table.ensure_capacity(self.pool, num_tokens + 1)
        self._reserved[request_id] = table
        return list(table.blocks)

    def release_reservation(self, request_id: str) -> None:
        """Free reserved blocks whose transfer failed."""
        table = self._reserved.pop(request_id, None)
        if table is not None:
            table.release(self.pool)

    def admit(self, request: DecodeRequest) -> list[TokenDelta]:
        """Start decoding a sequence whose prompt KV is in its reserved blocks."""
        table = self._reserved.pop(request.request_id, None)
        if table is None:
            raise InvalidRequestError("request_id", f"{request.request_id!r} has no reserved blocks")
        seq = self._new_sequence(request.request_id, list(request.prompt_ids), request.params, table)
        if request.sampler_state:
            state = torch.frombuffer(bytearray(request.sampler_state), dtype=torch.uint8)
            seq.sampler.generator.set_state(state)
        seq.num_computed = len(seq.prompt_ids)
        return self._start(seq, request.first_token)

    def add_local(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> list[TokenDelta]:
        """Prefill on this worker, then decode (tests, benchmarks, single-process use)."""
        params.validate(self.loaded.config.vocab_size)
        if not prompt_ids or len(prompt_ids) >= self.max_model_len:
            raise InvalidRequestError("prompt", f"must have 1 to {self.max_model_len - 1} tokens, got {len(prompt_ids)}")
        blocks = self.reserve(request_id, len(prompt_ids))
        if blocks is None:
            raise OutOfBlocksError(f"no room for a {len(prompt_ids)}-token prompt")
        table = self._reserved.pop(request_id)
        seq = self._new_sequence(request_id, list(prompt_ids), params, table)
        logits = self._prefill(seq, len(prompt_ids), want_logits=True)
        return self._start(seq, seq.sampler.choose(logits[0]))

    def abort(self, request_id: str) -> bool:
        """Cancel a request and free its KV (reserved or live)."""
        if request_id in self._reserved:
            self.release_reservation(request_id)
            return True
        live = self._live.get(request_id)
        if live is None:
            for p in list(self._preempted):
                if p.seq.request_id == request_id:
                    self._preempted.remove(p)
                    return True
            return False
        self._finish(live, FinishReason.ABORT)
        return True

    def has_work(self) -> bool:
        return bool(self._live or self._preempted)

    @property
    def num_running(self) -> int:
        return len(self._live)

    def request_stats(self, request_id: str) -> RequestStats | None:
        live = self._live.get(request_id)
        return live.stats if live else None

    # -- the step ---------------------------------------------------------------------------------

    def step(self, k: int | None = None) -> list[TokenDelta]:
        """One decode iteration over every running sequence. ``k`` overrides the policy."""
        self._resume_preempted()
        lives = list(self._live.values())
        if not lives:
            return []
        start = time.perf_counter()
        planned, choice = self._choose_k(lives) if k is None else (k, None)
        batch = len(lives)
        k, lives = self._make_room(lives, planned)
        if not lives:
            return []
        seqs = [lv.seq for lv in lives]
        t_forward, draft_before = time.perf_counter(), self.metrics.draft_time_s
        if k == 0:
            verdicts = self._decode(seqs)
        else:
            verdicts = self._speculate(seqs, k)
        if choice is not None and k == planned and len(seqs) == batch:  # same shape as predicted
            draft_s = self.metrics.draft_time_s - draft_before  # the policy corrects draft and verify apart
            self.policy.observe_step(choice, draft_s, time.perf_counter() - t_forward - draft_s)
        if k > 0:  # before committing: a sequence that finishes still verified its drafts
            self.acceptance.observe_step([(k, v.num_accepted) for v in verdicts])
        deltas = [self._commit(lv, v, k) for lv, v in zip(lives, verdicts)]
        seconds = time.perf_counter() - start
        self._record_step(k, seconds)
        self.pass_log.record("step", seconds, k=k, seqs=len(lives))
        return deltas

    def _choose_k(self, lives: list[_Live]) -> tuple[int, KChoice | None]:
        """This step's k, and the adaptive policy's choice behind it (None for fixed / no speculation)."""
        spec = self.config.speculation
        if not spec.enabled:
            return 0, None
        if spec.k_policy == "fixed":
            return spec.k, None
        key = tuple(self._live)  # the running request ids, in admission order
        cached = self._cached_choice
        if cached is not None and cached[0] == key and cached[1] > 0:
            self._cached_choice = (key, cached[1] - 1, cached[2])
            return cached[2].k, cached[2]
        choice = self._adaptive_choice([lv.seq for lv in lives])
        self._cached_choice = (key, self.CHOICE_REUSE_STEPS - 1, choice)
        return choice.k, choice

    def _adaptive_choice(self, seqs: list[Sequence]) -> KChoice:
        lens = [len(s.tokens) for s in seqs]
        b = len(seqs)

        def target_pass(k: int) -> PassShape:
            return PassShape(b, sum(lens) + b * k, b * (k + 1))

        def draft_pass(step: int) -> PassShape:
            return PassShape(b, sum(self.drafter.kv_tokens_read(n, step) for n in lens), b)

        return self.policy.choose(target_pass, draft_pass)

    def _decode(self, seqs: list[Sequence]) -> list[Verdict]:
        t0 = time.perf_counter()
        logits = self.runner.run([StepInput([s.tokens[-1]], len(s.tokens) - 1, s.block_table.blocks) for s in seqs])
        self._observe_target(seqs, 0, time.perf_counter() - t0)
        return [Verdict(0, [s.sampler.choose(logits[i])]) for i, s in enumerate(seqs)]

    def _speculate(self, seqs: list[Sequence], k: int) -> list[Verdict]:
        t0 = time.perf_counter()
        proposal = self.drafter.propose(seqs, k)
        t1 = time.perf_counter()
        inputs = [
            StepInput([s.tokens[-1]] + proposal.tokens[i], len(s.tokens) - 1, s.block_table.blocks, num_logits=k + 1)
            for i, s in enumerate(seqs)
        ]
        logits = self.runner.run(inputs).view(len(seqs), k + 1, -1)  # [B, k + 1, V]
        t2 = time.perf_counter()
        lens = [len(s.tokens) for s in seqs]
        draft_shape = sum((PassShape(len(seqs), sum(self.drafter.kv_tokens_read(n, j) for n in lens), len(seqs))
                           for j in range(k)), PassShape(0, 0, 0, 0))
        self.draft_cost.observe(draft_shape, t1 - t0)
        self.pass_log.record("draft", t1 - t0, passes=k, seqs=draft_shape.seqs, kv_tokens=draft_shape.kv_tokens,
                             new_tokens=draft_shape.new_tokens)
        self._observe_target(seqs, k, t2 - t1)
        self.metrics.draft_time_s += t1 - t0
        self.metrics.verify_time_s += t2 - t1
        greedy = torch.argmax(logits, dim=-1).tolist()
        verdicts = []
        for i, s in enumerate(seqs):
            params = s.sampler.params
            if params.greedy:
                verdicts.append(verify_greedy(proposal.tokens[i], greedy[i]))
            else:
                p = target_probs(logits[i], params)
                verdicts.append(verify_sampled(proposal.tokens[i], proposal.probs[i], p, s.sampler.generator))
        return verdicts

    def _observe_target(self, seqs: list[Sequence], k: int, seconds: float) -> None:
        b = len(seqs)
        kv_tokens = sum(len(s.tokens) for s in seqs) + b * k
        self.pass_log.record("verify" if k else "decode", seconds, seqs=b, kv_tokens=kv_tokens, new_tokens=b * (k + 1))
        self.target_cost.observe(PassShape(b, kv_tokens, b * (k + 1)), seconds)

    def _commit(self, live: _Live, verdict: Verdict, k: int) -> TokenDelta:
        """Append the verdict's tokens (up to a stop), roll back rejected KV, emit the delta."""
        seq = live.seq
        n = len(seq.tokens)
        appended: list[int] = []
        reason = None
        for tok in verdict.tokens:
            appended.append(tok)
            reason = seq.append_token(tok)
            if reason is not None:
                break
        text, reason = live.stream.push(appended, reason)
        if k > 0:
            live.stats.draft_tokens += k
            live.stats.accepted_tokens += verdict.num_accepted
            live.stats.spec_steps += 1
            self.metrics.draft_tokens += k
            self.metrics.accepted_tokens += verdict.num_accepted
            self.metrics.seq_spec_steps += 1
        self.metrics.tokens += len(appended)
        if reason is not None:
            self._finish(live, reason)
        else:
            # verification computed positions n-1 .. n-1+accepted with target KV; later ones are stale
            seq.num_computed = n + verdict.num_accepted
            seq.block_table.truncate(self.pool, seq.num_computed + 1)
            self.drafter.on_verified(seq, seq.num_computed)
        return TokenDelta(seq.request_id, appended, text, reason is not None,
                          reason.value if reason is not None else None, k, verdict.num_accepted)

    def _record_step(self, k: int, seconds: float) -> None:
        self.metrics.steps += 1
        self.metrics.k_counts[k] = self.metrics.k_counts.get(k, 0) + 1
        self.metrics.step_times.append(seconds)

    # -- memory -----------------------------------------------------------------------------------

    def _make_room(self, lives: list[_Live], k: int) -> tuple[int, list[_Live]]:
        """Give every sequence blocks for positions up to len + k - 1, lowering k to 0 and then
        preempting the newest sequences (recomputed later) when the pool runs short."""
        while lives:
            try:
                for lv in lives:
                    lv.seq.block_table.ensure_capacity(self.pool, len(lv.seq.tokens) + k)
                return k, lives
            except OutOfBlocksError:
                if k > 0:
                    k = 0
                    continue
                victim = lives.pop()
                self._preempt(victim)
        return 0, lives

    def _preempt(self, live: _Live) -> None:
        seq = live.seq
        del self._live[seq.request_id]
        self.drafter.release(seq)
        seq.block_table.release(self.pool)
        seq.num_computed = 0
        seq.status = SequenceStatus.WAITING
        self._preempted.append(live)
        self.metrics.preemptions += 1

    def _resume_preempted(self) -> None:
        while self._preempted:
            live = self._preempted[0]
            seq = live.seq
            if not self.pool.can_allocate(self.pool.blocks_for_tokens(len(seq.tokens) + 1)) or len(self._live) >= self.config.max_num_seqs:
                return
            self._preempted.popleft()
            seq.block_table.ensure_capacity(self.pool, len(seq.tokens))
            self._prefill(seq, len(seq.tokens) - 1, want_logits=False)
            seq.status = SequenceStatus.RUNNING
            self._live[seq.request_id] = live
            self.drafter.admit(seq)

    def _prefill(self, seq: Sequence, upto: int, want_logits: bool) -> torch.Tensor:
        """Compute the KV of tokens[:upto] in chunks; logits of the last one if wanted."""
        logits = torch.empty(0)
        chunk = self.config.prefill_chunk
        for start in range(0, upto, chunk):
            end = min(upto, start + chunk)
            last = end == upto and want_logits
            logits = self.runner.run([StepInput(seq.tokens[start:end], start, seq.block_table.blocks, num_logits=int(last))])
        seq.num_computed = upto
        return logits

    # -- lifecycle --------------------------------------------------------------------------------

    def _new_sequence(self, request_id: str, prompt: list[int], params: SamplingParams, table: BlockTable) -> Sequence:
        return Sequence(
            request_id=request_id, prompt_ids=prompt, sampler=RequestSampler(params),
            eos_token_ids=frozenset(self.loaded.eos_token_ids), block_table=table,
            max_model_len=self.max_model_len, status=SequenceStatus.RUNNING,
        )

    def _start(self, seq: Sequence, first_token: int) -> list[TokenDelta]:
        live = _Live(seq, OutputStream.for_sequence(seq, self.tokenizer))
        self._live[seq.request_id] = live
        reason = seq.append_token(first_token)
        text, reason = live.stream.push([first_token], reason)
        self.metrics.tokens += 1
        if reason is not None:
            self._finish(live, reason)
        else:
            self.drafter.admit(seq)
        return [TokenDelta(seq.request_id, [first_token], text, reason is not None,
                           reason.value if reason is not None else None)]

    def _finish(self, live: _Live, reason: FinishReason) -> None:
        seq = live.seq
        self._live.pop(seq.request_id, None)
        self.drafter.release(seq)
        seq.block_table.release(self.pool)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _make_drafter(self, backend) -> Drafter:
        spec = self.config.speculation
        if spec.drafter == "draft_model":
            draft = load_model(spec.draft_model, self.config.dtype, self.config.device)
            if draft.config.vocab_size != self.loaded.config.vocab_size:
                raise ValueError(
                    f"speculation.draft_model: vocabulary {draft.config.vocab_size} differs from the target's "
                    f"{self.loaded.config.vocab_size}"
                )
            dc = draft.config
            bs = self.config.block_size
            # per sequence: sink + window, plus one window-sized prefill chunk or k drafts, plus slack
            per_seq = 2 * spec.budget + spec.max_k + 3 * bs
            blocks = self.config.max_num_seqs * (-(-per_seq // bs))
            pool = BlockPool(blocks, bs)
            cache = PagedKVCache(KVCacheSpec(dc.num_hidden_layers, dc.num_key_value_heads, dc.head_dim, bs, draft.dtype),
                                 blocks, draft.device)
            return DraftModelDrafter(ModelRunner(draft.model, cache, backend), pool, spec, self.config.prefill_chunk)
        return SelfSparseDrafter(self.runner, spec)

    # -- profiling --------------------------------------------------------------------------------

    def profile(self, batches: tuple[int, ...] = (1, 4, 16), contexts: tuple[int, ...] = (256, 2048, 8192),
                ks: tuple[int, ...] = (0, 3)) -> None:
        """Time synthetic target and draft passes to seed the cost models (KV content is irrelevant
        to timing). Uses free blocks temporarily; call when the worker is idle."""
        budget_tokens = self.pool.num_free * self.pool.block_size // 2
        for b in batches:
            b = min(b, self.config.max_num_seqs)
            for ctx in contexts:
                if b * (ctx + 8) > budget_tokens or ctx + 8 > self.max_model_len:
                    continue
                tables = [BlockTable(self.pool.block_size) for _ in range(b)]
                for t in tables:
                    t.ensure_capacity(self.pool, ctx + 8)
                try:
                    for k in ks:
                        inputs = [StepInput([1] * (k + 1), ctx, t.blocks, num_logits=k + 1) for t in tables]
                        self.runner.run(inputs)  # warm-up
                        t0 = time.perf_counter()
                        self.runner.run(inputs)
                        self.target_cost.observe(PassShape(b, b * (ctx + k + 1), b * (k + 1)), time.perf_counter() - t0)
                    if self.config.speculation.drafter == "self_sparse":
                        spec = self.config.speculation
                        starts = [window_start(spec, ctx)] * b
                        inputs = [StepInput([1], ctx, t.blocks) for t in tables]
                        t0 = time.perf_counter()
                        self.runner.run(inputs, sink_len=spec.sink_tokens, window_starts=starts)
                        kv = b * self.drafter.kv_tokens_read(ctx + 1, 0)
                        self.draft_cost.observe(PassShape(b, kv, b), time.perf_counter() - t0)
                finally:
                    for t in tables:
                        t.release(self.pool)
        self.target_cost.fit()
        self.draft_cost.fit()

    def set_speculation(self, spec: SpeculationConfig) -> None:
        """Switch speculation settings between steps (planner updates, benchmarks). The drafter is
        rebuilt; cost models and the step-time correction carry over unless the drafter (kind or model)
        changes, the acceptance estimate unless the draft's view (budget, sink, positions) changes too."""
        live = [lv.seq for lv in self._live.values()]
        for seq in live:
            self.drafter.release(seq)
        old = self.config.speculation
        kind_changed = spec.drafter != old.drafter or spec.draft_model != old.draft_model
        # what the draft attends to decides its acceptance (not its cost, which the models take per shape)
        view_changed = kind_changed or (spec.budget, spec.sink_tokens, spec.draft_positions) != (
            old.budget, old.sink_tokens, old.draft_positions)
        self.config = dataclasses.replace(self.config, speculation=spec)
        self.drafter = self._make_drafter(self.runner.backend)
        if kind_changed:
            self.draft_cost = LinearCostModel()
            self.step_correction = StepCorrection()
        if view_changed:
            self.acceptance = AcceptanceEstimator()
        slo = spec.tpot_slo_ms / 1e3 if spec.tpot_slo_ms else None
        self.policy = AdaptiveK(spec.max_k, self.target_cost, self.draft_cost, self.acceptance, slo,
                                self.step_correction)
        self._cached_choice = None
        for seq in live:
            self.drafter.admit(seq)

    def rewind(self, request_id: str, num_tokens: int) -> None:
        """Cut a running sequence back to its first ``num_tokens`` tokens (at least prompt + 1),
        dropping the KV of later positions; its text stream restarts from there."""
        live = self._live[request_id]
        seq = live.seq
        if not seq.num_prompt < num_tokens <= len(seq.tokens):
            raise ValueError(f"num_tokens: must be in ({seq.num_prompt}, {len(seq.tokens)}], got {num_tokens}")
        del seq.tokens[num_tokens:]
        seq.num_computed = min(seq.num_computed, num_tokens - 1)
        seq.block_table.truncate(self.pool, num_tokens)
        self.drafter.on_verified(seq, seq.num_computed)
        live.stream = OutputStream.for_sequence(seq, self.tokenizer)
        live.stream.push(seq.output_ids, None)
        live.stats = RequestStats()

    def status(self) -> dict:
        """Queue lengths, memory and metrics (GetClusterStatus reads this)."""
        return {
            "running": len(self._live),
            "reserved": len(self._reserved),
            "preempted": len(self._preempted),
            "free_blocks": self.pool.num_free,
            "total_blocks": self.pool.num_blocks,
            "acceptance_rate_estimate": self.acceptance.rate,
            "acceptance_rate_by_depth": [self.acceptance.rate_at(d)
                                         for d in range(1, self.config.speculation.max_k + 1)],
            "metrics": self.metrics.summary(),
            "target_cost": self.target_cost.coefficients(),
            "draft_cost": self.draft_cost.coefficients(),
            "step_correction": self.step_correction.summary(),
        }
