"""Speculation on one decode worker: the drafter, the pass-cost models, the acceptance estimate and the
speculation-length policy, and each step's passes (a plain decode pass at k = 0; else k draft passes and
one verification pass over all k + 1 positions, under the rule in ``decode_worker/verify.py``).

The worker owns the requests and their blocks; this object owns everything that decides and runs a step's
forward passes. It never touches the block pool, except for the temporary blocks of ``profile``.
"""

from __future__ import annotations

import time

import torch

from decode_worker.config import DecodeWorkerConfig, SpeculationConfig
from decode_worker.drafters import DraftModelDrafter, Drafter, SelfSparseDrafter, window_start
from decode_worker.metrics import WorkerMetrics
from decode_worker.policy import (AcceptanceEstimator, AdaptiveK, KChoice, LinearCostModel, PassShape,
                                  StepCorrection, StepK)
from decode_worker.verify import Verdict, verify_greedy, verify_sampled
from modeling.block_pool import BlockPool, BlockTable
from modeling.checkpoint import load_model
from modeling.cpu_linear import use_skinny_linear
from modeling.grammar import constrain
from modeling.kv_cache import KVCacheSpec, PagedKVCache
from modeling.pass_log import PassLog
from modeling.runner import ModelRunner, StepInput
from modeling.sampling import processed_logits, target_probs
from modeling.sequence import Sequence


class Speculator:
    """Chooses each step's k and runs its passes for the worker's ``runner`` (the target model and cache)."""

    def __init__(self, runner: ModelRunner, config: DecodeWorkerConfig, vocab_size: int, metrics: WorkerMetrics,
                 pass_log: PassLog):
        self.runner = runner
        self.config = config
        self.vocab_size = vocab_size
        self.metrics = metrics
        self.pass_log = pass_log
        self.drafter = self._make_drafter()
        self.target_cost = LinearCostModel()
        self.draft_cost = LinearCostModel()
        self.acceptance = AcceptanceEstimator()
        self.step_correction = StepCorrection()
        self.policy = self._make_policy()
        self.step_k = StepK(self.spec, self.policy)
        self.target_pass_s = 0.0  # the latest target pass's seconds (riders included)
        self.rider_logits = torch.empty(0)  # the latest target pass's riders' logits rows

    @property
    def spec(self) -> SpeculationConfig:
        return self.config.speculation

    def step_tokens(self) -> int:
        """The most positions one step may add to a sequence."""
        return self.spec.max_k + 1 if self.spec.enabled else 1

    # -- k ----------------------------------------------------------------------------------------

    def choose_k(self, seqs: list[Sequence], key: tuple) -> tuple[int, KChoice | None]:
        """This step's k for the batch ``seqs`` (``key``: their request ids in admission order), and the
        adaptive policy's choice behind it (None for fixed k or no speculation)."""
        return self.step_k.choose(key, [len(s.tokens) for s in seqs], self.drafter.kv_tokens_read)

    def forget_choice(self) -> None:
        """The batch changed outside a step (a request stopped or resumed for a migration)."""
        self.step_k.forget()

    # -- passes -----------------------------------------------------------------------------------

    def run(self, seqs: list[Sequence], k: int, choice: KChoice | None,
            riders: list[StepInput] = ()) -> tuple[list[Verdict], torch.Tensor]:
        """The step's passes: (one verdict per sequence, the target logits [B, k + 1, V] at the verified
        positions). ``choice``: the policy's prediction for this very step (its timing corrects the policy),
        None when the step ran otherwise (fixed k, a lowered k, a smaller batch). ``riders``: further inputs
        (local-prefill chunks) computed in the same target pass; their logits rows are left in
        ``rider_logits``, the pass's seconds in ``target_pass_s``, and the pass does not correct the target
        cost model or the policy (its time is not a decode pass's)."""
        if riders:
            choice = None
        t0, draft_before = time.perf_counter(), self.metrics.draft_time_s
        verdicts, logits = self._decode(seqs, riders) if k == 0 else self._speculate(seqs, k, riders)
        if choice is not None:  # the policy corrects draft and verify time apart
            draft_s = self.metrics.draft_time_s - draft_before
            self.policy.observe_step(choice, draft_s, time.perf_counter() - t0 - draft_s)
        if k > 0:  # a sequence that finishes at this step still verified its drafts
            self.acceptance.observe_step([(k, v.num_accepted) for v in verdicts])
        return verdicts, logits

    def _target_pass(self, seqs: list[Sequence], k: int, inputs: list[StepInput],
                     riders: list[StepInput]) -> torch.Tensor:
        """The target pass over ``inputs`` (k + 1 logits rows each) and the ``riders``: the inputs' logits."""
        t0 = time.perf_counter()
        logits = self.runner.run(list(inputs) + list(riders))
        self.target_pass_s = time.perf_counter() - t0
        rows = len(inputs) * (k + 1)
        self.rider_logits = logits[rows:]
        if riders:  # a mixed pass: each sequence's k + 1 positions as decode tokens reading its KV
            self.pass_log.record("mixed", self.target_pass_s, chunks=[[r.start, len(r.token_ids)] for r in riders],
                                 decode_seqs=len(seqs) * (k + 1),
                                 decode_kv_tokens=(k + 1) * sum(len(s.tokens) + k for s in seqs))
        else:
            self._observe_target(seqs, k, self.target_pass_s)
        return logits[:rows]

    def predict_target_s(self, seqs: list[Sequence], k: int) -> float | None:
        """The target cost model's seconds for the target pass of ``seqs`` at ``k`` alone (None: not fitted)."""
        return self.target_cost.predict(_target_shape(seqs, k)) if self.target_cost.ready else None

    def _decode(self, seqs: list[Sequence], riders: list[StepInput] = ()) -> tuple[list[Verdict], torch.Tensor]:
        """A plain decode step: (one token per sequence, the target logits [B, 1, V])."""
        logits = self._target_pass(seqs, 0, [StepInput([s.tokens[-1]], len(s.tokens) - 1, s.block_table.blocks)
                                             for s in seqs], riders)
        verdicts = [Verdict(0, [s.sampler.choose(logits[i], s.tokens)]) for i, s in enumerate(seqs)]
        return verdicts, logits.unsqueeze(1)

    def _speculate(self, seqs: list[Sequence], k: int,
                   riders: list[StepInput] = ()) -> tuple[list[Verdict], torch.Tensor]:
        """Draft k tokens per sequence and verify them in one target pass: (the verdicts, the target logits
        [B, k + 1, V]). Each verified position's logits are processed with the tokens before it, drafts
        included, exactly as plain decoding would process them there."""
        t0 = time.perf_counter()
        proposal = self.drafter.propose(seqs, k)
        t1 = time.perf_counter()
        lens = [len(s.tokens) for s in seqs]
        draft_shape = sum((PassShape(len(seqs), sum(self.drafter.kv_tokens_read(n, j) for n in lens), len(seqs))
                           for j in range(k)), PassShape(0, 0, 0, 0))
        self.draft_cost.observe(draft_shape, t1 - t0)
        self.pass_log.record("draft", t1 - t0, passes=k, seqs=draft_shape.seqs, kv_tokens=draft_shape.kv_tokens,
                             new_tokens=draft_shape.new_tokens)  # the log's order: draft, verify, step
        tv = time.perf_counter()
        inputs = [
            StepInput([s.tokens[-1]] + proposal.tokens[i], len(s.tokens) - 1, s.block_table.blocks, num_logits=k + 1)
            for i, s in enumerate(seqs)
        ]
        logits = self._target_pass(seqs, k, inputs, riders).view(len(seqs), k + 1, -1)  # [B, k + 1, V]
        t2 = time.perf_counter()
        self.metrics.draft_time_s += t1 - t0
        self.metrics.verify_time_s += t2 - tv
        raw_argmax = torch.argmax(logits, dim=-1).tolist()
        verdicts = []
        for i, s in enumerate(seqs):
            params, drafts = s.sampler.params, proposal.tokens[i]
            raw = logits[i]
            processed = processed_logits(s.sampler, raw, s.tokens, drafts)
            masks = self._grammar_masks(s, proposal, i)
            if masks is not None:
                processed = constrain(processed, masks)
            if params.greedy:
                best = raw_argmax[i] if processed is raw else torch.argmax(processed, dim=-1).tolist()
                verdicts.append(verify_greedy(drafts, best))
            else:
                p = target_probs(processed, params)
                verdicts.append(verify_sampled(drafts, proposal.probs[i], p, s.sampler.generator))
        return verdicts, logits

    @staticmethod
    def _grammar_masks(seq: Sequence, proposal, i: int) -> torch.Tensor | None:
        """The grammar's masks [k + 1, V] at a sequence's verified positions (None without structured output):
        those its drafts were chosen under, or, with ``grammar_drafts`` off, the walk along its drafts now."""
        if seq.sampler.grammar is None:
            return None
        path = proposal.paths[i] if proposal.paths else None
        return path.close() if path is not None else seq.sampler.grammar.path_masks(proposal.tokens[i])

    def _observe_target(self, seqs: list[Sequence], k: int, seconds: float) -> None:
        shape = _target_shape(seqs, k)
        self.pass_log.record("verify" if k else "decode", seconds, seqs=shape.seqs, kv_tokens=shape.kv_tokens,
                             new_tokens=shape.new_tokens)
        self.target_cost.observe(shape, seconds)

    # -- set-up -----------------------------------------------------------------------------------

    def profile(self, pool: BlockPool, max_model_len: int, batches: tuple[int, ...] = (1, 4, 16),
                contexts: tuple[int, ...] = (256, 2048, 8192), ks: tuple[int, ...] = (0, 3)) -> None:
        """Time synthetic target and draft passes to seed the cost models (KV content is irrelevant to
        timing), in free blocks of ``pool`` taken for the time being; call when the worker is idle."""
        budget_tokens = pool.num_free * pool.block_size // 2
        for b in batches:
            b = min(b, self.config.max_num_seqs)
            for ctx in contexts:
                if b * (ctx + 8) > budget_tokens or ctx + 8 > max_model_len:
                    continue
                tables = [BlockTable(pool.block_size) for _ in range(b)]
                for t in tables:
                    t.ensure_capacity(pool, ctx + 8)
                try:
                    for k in ks:
                        inputs = [StepInput([1] * (k + 1), ctx, t.blocks, num_logits=k + 1) for t in tables]
                        self.runner.run(inputs)  # warm-up
                        t0 = time.perf_counter()
                        self.runner.run(inputs)
                        self.target_cost.observe(PassShape(b, b * (ctx + k + 1), b * (k + 1)), time.perf_counter() - t0)
                    if self.spec.drafter == "self_sparse":
                        starts = [window_start(self.spec, ctx)] * b
                        inputs = [StepInput([1], ctx, t.blocks) for t in tables]
                        t0 = time.perf_counter()
                        self.runner.run(inputs, sink_len=self.spec.sink_tokens, window_starts=starts)
                        kv = b * self.drafter.kv_tokens_read(ctx + 1, 0)
                        self.draft_cost.observe(PassShape(b, kv, b), time.perf_counter() - t0)
                finally:
                    for t in tables:
                        t.release(pool)
        self.target_cost.fit()
        self.draft_cost.fit()

    def reconfigure(self, config: DecodeWorkerConfig, seqs: list[Sequence]) -> None:
        """Switch to ``config.speculation`` between steps, the running ``seqs`` keeping their draft state
        (rebuilt). Cost models and the step-time correction carry over unless the drafter (kind or model)
        changes, the acceptance estimate unless the draft's view (budget, sink, positions) changes too."""
        for seq in seqs:
            self.drafter.release(seq)
        old, spec = self.spec, config.speculation
        kind_changed = spec.drafter != old.drafter or spec.draft_model != old.draft_model
        # what the draft attends to decides its acceptance (not its cost, which the models take per shape)
        view_changed = kind_changed or (spec.budget, spec.sink_tokens, spec.draft_positions) != (
            old.budget, old.sink_tokens, old.draft_positions)
        self.config = config
        self.drafter = self._make_drafter()
        if kind_changed:
            self.draft_cost = LinearCostModel()
            self.step_correction = StepCorrection()
        if view_changed:
            self.acceptance = AcceptanceEstimator()
        self.policy = self._make_policy()
        self.step_k = StepK(self.spec, self.policy)
        for seq in seqs:
            self.drafter.admit(seq)

    def status(self) -> dict:
        """The estimates behind the policy (``GetClusterStatus``)."""
        return {
            "acceptance_rate_estimate": self.acceptance.rate,
            "acceptance_rate_by_depth": [self.acceptance.rate_at(d) for d in range(1, self.spec.max_k + 1)],
            "target_cost": self.target_cost.coefficients(),
            "draft_cost": self.draft_cost.coefficients(),
            "step_correction": self.step_correction.summary(),
        }

    def _make_policy(self) -> AdaptiveK:
        slo = self.spec.tpot_slo_ms / 1e3 if self.spec.tpot_slo_ms else None
        return AdaptiveK(self.spec.max_k, self.target_cost, self.draft_cost, self.acceptance, slo, self.step_correction)

    def _make_drafter(self) -> Drafter:
        spec, cfg = self.spec, self.config
        if spec.drafter != "draft_model":
            return SelfSparseDrafter(self.runner, spec)
        draft = load_model(spec.draft_model, cfg.dtype, cfg.device)
        if draft.config.vocab_size != self.vocab_size:
            raise ValueError(f"speculation.draft_model: vocabulary {draft.config.vocab_size} differs from the "
                             f"target's {self.vocab_size}")
        dc, bs = draft.config, cfg.block_size
        # per sequence: sink + window, plus one window-sized prefill chunk or k drafts, plus slack
        per_seq = 2 * spec.budget + spec.max_k + 3 * bs
        blocks = cfg.max_num_seqs * (-(-per_seq // bs))
        cache = PagedKVCache(KVCacheSpec(dc.num_hidden_layers, dc.num_key_value_heads, dc.head_dim, bs, draft.dtype),
                             blocks, draft.device)
        if self.runner.backend.name == "cpu":  # as build_runner does for the target
            use_skinny_linear(draft.model)
        return DraftModelDrafter(ModelRunner(draft.model, cache, self.runner.backend), BlockPool(blocks, bs), spec,
                                 cfg.prefill_chunk)


def _target_shape(seqs: list[Sequence], k: int) -> PassShape:
    """The target (decode or verify) pass over ``seqs`` at ``k``: k + 1 new positions each, after its tokens."""
    b = len(seqs)
    return PassShape(b, sum(len(s.tokens) for s in seqs) + b * k, b * (k + 1))
