"""The single-process reference engine: continuous batching, chunked prefill, paged KV.

It is the colocated baseline for every later comparison and the correctness oracle for the
disaggregated system. ``step()`` reads as the skeleton of a serving loop: schedule, run, sample, emit.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field

import torch

from modeling.block_pool import BlockTable
from modeling.checkpoint import LoadedModel
from modeling.errors import InvalidRequestError, OutOfBlocksError
from modeling.forks import sequence_id, split_sequence_id
from modeling.runner import StepInput
from modeling.instance_config import InstanceConfig, Problems, booleans, compile_steps_problems, integers, set_by
from modeling.instance_core import InstanceCore, follower_runner
from modeling.logprobs import TokenLogprob
from modeling.sampling import PromptLogprobs, SamplingParams, sampler_for, token_logprobs
from modeling.scheduler import ChunkedPrefillScheduler, ScheduledChunk
from modeling.output import OutputStream
from modeling.pass_log import PassLog
from modeling.request_check import check_request_id, check_room_to_generate, check_token_ids
from modeling.resume import ResumeRequest, generator_state, seeded_state
from modeling.sequence import FinishReason, Sequence, SequenceStatus
from modeling.tp_group import TPGroup
from modeling.tp_runner import TPFollower, copy_kv_blocks


@dataclass(frozen=True)
class EngineConfig(InstanceConfig):
    """One engine instance, and the pool of ``mode: colocated`` (its ``colocated:`` section): chunked prefill
    and decode in one batch of at most ``max_num_seqs`` sequences and ``token_budget`` tokens per step
    (decode tokens first, then prefill chunks). ``max_model_len`` None: the model's
    ``max_position_embeddings``. ``prefix_caching``: keep full blocks' KV after their request ends and start
    a prompt from its longest cached prefix (``modeling/prefix_cache.py``)."""

    token_budget: int = 512
    max_num_seqs: int = 64
    max_model_len: int | None = None
    prefix_caching: bool = field(default=True, metadata=set_by("prefix_caching.enabled"))
    # run decode, verification and draft steps through a compiled forward (modeling/compiled_step.py): on CUDA
    # with the triton attention backend, CUDA graphs per batch bucket; on CPU with the cpu backend,
    # torch.compile with the kernels as custom operators (logits identical to eager, measured no faster on
    # small models: benchmarks/decode_step.py --compile)
    compile_steps: bool = False

    def check(self) -> Problems:
        errs = super().check() + integers(self, ("token_budget", "max_num_seqs")) + booleans(self, ("prefix_caching",))
        errs += compile_steps_problems(self)
        if self.max_model_len is not None:
            errs += integers(self, ("max_model_len",))
        return errs


@dataclass
class RequestOutput:
    """What one step produced for one sequence of a request: new tokens and text, and the finish state.
    ``request_id`` is the sequence's (``modeling/forks.py``: the request's own for its first sequence)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for them
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the request's first output, when asked for
    position: int = 0  # output position of new_token_ids[0]
    text_offset: int = 0  # characters of the sequence's text before new_text


@dataclass
class Completion:
    """A finished request, as returned by :meth:`ReferenceEngine.generate`."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    ttft_s: float = 0.0  # arrival to first token
    tpot_s: float = 0.0  # mean time per output token after the first
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    sequences: list["Completion"] = field(default_factory=list)  # n > 1: every sequence, this one first


@dataclass
class _Request:
    seq: Sequence
    stream: OutputStream
    arrival: float = 0.0
    first_token_at: float = 0.0
    finished_at: float = 0.0
    prompt_scorer: PromptLogprobs | None = None
    logprobs: list[TokenLogprob] | None = None
    emitted: bool = False  # an output was produced (the first carries the prompt's log-probabilities)


class ReferenceEngine:
    """Colocated prefill + decode in one process."""

    def __init__(self, model: LoadedModel | str, config: EngineConfig = EngineConfig(), tp: TPGroup | None = None,
                 instance_id: str = "colocated-0"):
        """``tp``: drive a tensor-parallel instance as its rank 0 (the other ranks run
        :func:`follower` with the same config); ``model`` is then a path, loaded as this rank's shard.
        ``instance_id`` names its KV tiers' directory."""
        self.config = config
        self.core = core = InstanceCore.build(model, config, tp, compile_steps=config.compile_steps,
                                              prefix_caching=config.prefix_caching, instance_id=instance_id)
        self.loaded, self.pool, self.runner, self.cache = core.loaded, core.pool, core.runner, core.cache
        self.prefix_cache, self.tokenizer = core.prefix_cache, core.tokenizer
        self.max_model_len = config.max_model_len or self.loaded.config.max_position_embeddings
        self.scheduler = ChunkedPrefillScheduler(config, self.pool, self.prefix_cache)
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self.pass_log = PassLog()  # one "mixed" record per step

    # -- requests ---------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams = SamplingParams(),
                    request_id: str | None = None) -> str:
        """Validate and queue a request; returns its id. Raises InvalidRequestError naming the field."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        check_request_id(request_id)
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        params.validate(vocab_size=self.loaded.config.vocab_size)
        prompt_ids = self._prompt_ids(prompt)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop", "stop strings need a tokenizer.json in the model directory")
        check_room_to_generate(len(prompt_ids), self.max_model_len)
        if self.pool.blocks_for_tokens(len(prompt_ids) + 1) > self.pool.num_blocks:
            raise InvalidRequestError("prompt", f"{len(prompt_ids)} tokens exceed the KV cache ({self.config.kv_cache_tokens} tokens)")
        eos = frozenset(self.loaded.eos_token_ids)
        seq = Sequence(
            request_id=request_id,
            prompt_ids=prompt_ids,
            sampler=sampler_for(self.loaded, params, prompt_ids),
            eos_token_ids=eos,
            block_table=BlockTable(self.config.block_size),
            max_model_len=min(self.max_model_len, self.pool.num_blocks * self.config.block_size),
        )
        stream = OutputStream.for_sequence(seq, self.tokenizer)
        scorer = None if params.prompt_logprobs is None else PromptLogprobs(prompt_ids, params.prompt_logprobs)
        self._requests[request_id] = _Request(seq, stream, arrival=time.perf_counter(), prompt_scorer=scorer,
                                              logprobs=None if params.logprobs is None else [])
        if scorer is not None:  # scoring the prompt needs the logits of every position
            self.prefix_cache.compute_in_full(request_id)
        self.scheduler.add(seq)
        return request_id

    def add_resume(self, request: ResumeRequest) -> None:
        """Continue ``request``: each of its sequences still running has its prompt and streamed output as its
        tokens, computed again here (from the longest cached prefix; the sequences share their prompt's blocks
        through it) before it samples the next; the grammar and (seeded) the generator follow the output, the
        text state is where the client's stream stands. Its outputs carry on from the next output position.
        Raises InvalidRequestError naming the field."""
        rid, prompt = request.request_id, list(request.prompt_ids)
        params = dataclasses.replace(request.params, prompt_logprobs=None)  # went out with the first token
        request.check_sequences()
        if self._sequence_ids(rid):
            raise InvalidRequestError("request_id", f"{rid!r} is already in use")
        max_len = min(self.max_model_len, self.pool.num_blocks * self.config.block_size)
        for s in request.sequences:
            check_room_to_generate(len(prompt) + len(s.output_ids), max_len, "sequences.output_ids")
        eos = frozenset(self.loaded.eos_token_ids)
        for s in request.sequences:
            output = list(s.output_ids)
            sampler = sampler_for(self.loaded, params, prompt).for_sequence(s.index)
            seq = Sequence(sequence_id(rid, s.index), prompt, sampler, eos, BlockTable(self.config.block_size), max_len)
            seq.tokens = prompt + output
            sampler.catch_up(output)
            if s.sampler_state:
                sampler.generator.set_state(generator_state(s.sampler_state))
            stream = OutputStream.for_sequence(seq, self.tokenizer)
            stream.push(output, None)  # the text state as the client's stream has it ...
            stream.sent = s.text_sent  # ... of which this much went out
            self._requests[seq.request_id] = _Request(seq, stream, arrival=time.perf_counter(), emitted=True,
                                                      logprobs=None if params.logprobs is None else [])
            self.scheduler.add(seq)

    def sampler_state(self, sequence: str) -> bytes:
        """The generator state of a seeded sequence after its last token (empty for the others)."""
        req = self._requests.get(sequence)
        return b"" if req is None else seeded_state(req.seq)

    def abort(self, request_id: str) -> bool:
        """Cancel a request (every sequence of it) and free its KV; False if unknown or already finished."""
        aborted = False
        for sid in self._sequence_ids(request_id):
            req = self._requests.pop(sid, None)
            if req is not None and not req.seq.is_finished:
                self.scheduler.finish(req.seq, FinishReason.ABORT)
                aborted = True
        return aborted

    def release(self, request_id: str) -> None:
        """Forget a finished sequence (for callers that stream ``step()`` outputs, by the output's
        ``request_id``; ``generate`` does it itself). Its KV was freed when it finished; the request's id may
        be used again once every sequence of it is released."""
        req = self._requests.get(request_id)
        if req is not None and req.seq.is_finished:
            del self._requests[request_id]

    def _sequence_ids(self, request_id: str) -> list[str]:
        """Every sequence of the request held here (a resumed request may hold only some of them)."""
        return [sid for sid in self._requests if split_sequence_id(sid)[0] == request_id]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def close(self) -> None:
        """Release a tensor-parallel instance's followers and finish the KV tiers' writes (``InstanceCore.close``)."""
        self.core.close()

    # -- the loop ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model, sample, emit deltas."""
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        t0 = time.perf_counter()
        inputs = [self._step_input(c, self._requests[c.seq.request_id]) for c in chunks]
        logits = self.runner.run(inputs)
        self._record_pass(chunks, time.perf_counter() - t0)
        return self._process(chunks, [inp.num_logits for inp in inputs], logits)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] = SamplingParams()) -> list[Completion]:
        """Run prompts to completion (all submitted at once: continuous batching does the rest)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        expected = sum(sp.num_sequences for sp in params_list)
        done: dict[str, Completion] = {}
        while len(done) < expected:
            for out in self.step():
                if out.finished:
                    req = self._requests.pop(out.request_id)
                    n_out = len(req.seq.output_ids)
                    done[out.request_id] = Completion(
                        out.request_id, req.seq.prompt_ids, req.seq.output_ids, req.stream.text, out.finish_reason,
                        ttft_s=req.first_token_at - req.arrival,
                        tpot_s=(req.finished_at - req.first_token_at) / max(1, n_out - 1),
                        logprobs=req.logprobs,
                        prompt_logprobs=None if req.prompt_scorer is None else req.prompt_scorer.logprobs,
                    )
        results = []
        for rid, sp in zip(ids, params_list):
            first = done[rid]
            if sp.num_sequences > 1:
                first.sequences = [done[sequence_id(rid, i)] for i in range(sp.num_sequences)]
            results.append(first)
        return results

    # -- internals --------------------------------------------------------------------------------

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("prompt", "text prompts need a tokenizer.json; pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = prompt
        return check_token_ids(ids, self.loaded.config.vocab_size, "prompt_token_ids", empty_field="prompt")

    @staticmethod
    def _step_input(chunk: ScheduledChunk, req: _Request) -> StepInput:
        """Logits at the chunk's last position when it samples, at all of them when they score the prompt."""
        seq = chunk.seq
        scoring = req.prompt_scorer is not None and req.prompt_scorer.wants(chunk.start)
        return StepInput(
            token_ids=seq.tokens[chunk.start : chunk.start + chunk.num_tokens],
            start=chunk.start,
            block_table=seq.block_table.blocks,
            num_logits=chunk.num_tokens if scoring else (1 if chunk.sample else 0),
        )

    def _record_pass(self, chunks: list[ScheduledChunk], seconds: float) -> None:
        """Log the step's pass: a chunk of one generated token (not recomputed) is a decode token, the
        rest are prefill chunks, as the simulator's colocated instance divides a step."""
        def is_decode(c: ScheduledChunk) -> bool:
            return c.num_tokens == 1 and c.start >= c.seq.num_prompt

        decodes = [c for c in chunks if is_decode(c)]
        prefills = [[c.start, c.num_tokens] for c in chunks if not is_decode(c)]
        self.pass_log.record("mixed", seconds, chunks=prefills, decode_seqs=len(decodes),
                             decode_kv_tokens=sum(c.start + 1 for c in decodes))

    def _process(self, chunks: list[ScheduledChunk], num_logits: list[int], logits: torch.Tensor) -> list[RequestOutput]:
        """``num_logits``: the rows of ``logits`` each chunk has, in order."""
        outputs: list[RequestOutput] = []
        row = 0
        for chunk, rows in zip(chunks, num_logits):
            seq = chunk.seq
            req = self._requests[seq.request_id]
            chunk_logits = logits[row : row + rows]
            row += rows
            if rows > 1:
                req.prompt_scorer.add(chunk_logits, chunk.start)
            seq.num_computed += chunk.num_tokens
            self.prefix_cache.commit(seq, seq.num_computed)  # no speculation here: every computed token is final
            if not chunk.sample:
                continue
            last = chunk_logits[-1]
            params = seq.sampler.params
            if params.max_tokens == 0:  # the prompt alone was asked for: nothing is generated
                outputs.append(self._emit(req, [], FinishReason.LENGTH))
                continue
            forks = []
            if params.num_sequences > 1 and not seq.output_ids and split_sequence_id(seq.request_id)[1] == 0:
                forks = self._fork(req)  # before the first sequence's token: it may finish and free its blocks
            for r in [req] + forks:  # every sequence's first token comes from the same logits
                token = r.seq.sampler.choose(last, r.seq.tokens)
                reason = r.seq.append_token(token)
                if r.logprobs is not None:
                    r.logprobs.extend(token_logprobs(last.unsqueeze(0), [token], params.logprobs))
                outputs.append(self._emit(r, [token], reason))
        return outputs

    def _fork(self, req: _Request) -> list[_Request]:
        """Sequences 1 .. n-1 of a request whose prompt was just computed, sharing its full KV blocks
        (``modeling/forks.py``). Those that find no room now start like new requests (their prompt is
        computed again); those returned sample their first token now."""
        parent = req.seq
        rid, n = parent.request_id, parent.sampler.params.num_sequences
        forked = []
        for i in range(1, n):
            seq = Sequence(sequence_id(rid, i), parent.prompt_ids, parent.sampler.for_sequence(i), parent.eos_token_ids,
                           BlockTable(self.config.block_size), parent.max_model_len)
            child = _Request(seq, OutputStream.for_sequence(seq, self.tokenizer), arrival=req.arrival, emitted=True,
                             logprobs=None if req.logprobs is None else [])
            self._requests[seq.request_id] = child
            try:
                seq.block_table, copies = parent.block_table.fork(self.pool, parent.num_prompt, parent.num_prompt + 1)
            except OutOfBlocksError:
                self.scheduler.add(seq)
                continue
            copy_kv_blocks(self.runner, copies)
            seq.num_computed = parent.num_prompt
            seq.status = SequenceStatus.RUNNING
            self.scheduler.running.append(seq)
            forked.append(child)
        return forked

    def _emit(self, req: _Request, tokens: list[int], reason: FinishReason | None) -> RequestOutput:
        """Turn sampled tokens into a delta (stop strings applied by the output stream)."""
        seq = req.seq
        now = time.perf_counter()
        if not req.first_token_at:
            req.first_token_at = now
        position, text_offset = len(seq.tokens) - seq.num_prompt - len(tokens), req.stream.sent
        new_text, reason = req.stream.push(tokens, reason)
        if reason is not None:
            req.finished_at = now
            self.scheduler.finish(seq, reason)
        prompt_logprobs = None
        if not req.emitted and req.prompt_scorer is not None:
            prompt_logprobs = req.prompt_scorer.logprobs
        req.emitted = True
        logprobs = None if req.logprobs is None else req.logprobs[len(req.logprobs) - len(tokens):]
        return RequestOutput(seq.request_id, tokens, new_text, reason is not None, reason, logprobs, prompt_logprobs,
                             position, text_offset)


def follower(model_path: str, config: EngineConfig, tp: TPGroup) -> TPFollower:
    """A non-driver rank of a tensor-parallel engine: its shard and cache, ready to ``serve()``."""
    return TPFollower(follower_runner(model_path, config, tp), tp)
