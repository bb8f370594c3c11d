"""One request as the router runs it (no torch, no Ray): ``RequestRun`` owns the request's state machine, where it
is placed, the order of its output and its timings, and is fed typed events (``RunEvent``) from the instances.

An instance's share of the load is the runs placed on it: ``Instance.assigned`` (requests held there),
``Instance.migrating_in`` (migrations into it not yet committed) and ``Instance.placed`` (blocks placed since its
last load report) are written here, by the run as it is placed, handed off, moved and ended, and emptied only
when the instance dies (``Recovery.fail_instance``: its requests are failed over).
Placement, streaming, recovery, migration and scaling call the run's methods; none edits its fields.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Union

from controller.output_order import OutputOrder
from controller.placement import record_placement
from controller.request_state import RequestRecord, RequestState
from controller.routing import Delta, Final, Instance
from decode_worker.messages import TokenDelta
from modeling.params import SamplingParams
from modeling.prefix_cache import CachedPrompt
from modeling.resume import ResumedSequence, ResumeRequest
from prefill_worker.messages import FirstToken

# -- what instances tell a run --------------------------------------------------------------------------------


@dataclass(frozen=True)
class FirstTokenArrived:
    """The prefill instance sampled the first token of each sequence (or scored the prompt: ``token_id`` None)."""

    first: FirstToken


@dataclass(frozen=True)
class OutputArrived:
    """A decode (or colocated) instance reported output of the request."""

    delta: TokenDelta
    source: Instance


@dataclass(frozen=True)
class RunFailed:
    """An instance failed the request; ``retryable``: it may run again or continue elsewhere."""

    reason: str
    retryable: bool = True


@dataclass(frozen=True)
class RunHandedBack:
    """``source``, draining, gave the request up before computing any of it: it is placed anew elsewhere."""

    source: Instance


@dataclass(frozen=True)
class MigrationEnded:
    """The request's live migration was committed or aborted: it decodes again."""


@dataclass(frozen=True)
class RunCancelled:
    """The request was cancelled (its stream ends)."""


RunEvent = Union[FirstTokenArrived, OutputArrived, RunFailed, RunHandedBack, MigrationEnded, RunCancelled]


@dataclass(frozen=True)
class StreamTimes:
    """What one emitted piece of output means for latency: the time to first token when it carried the request's
    first token, else the gap since the previous one and how many tokens came in it."""

    ttft_s: float | None = None
    gap_s: float | None = None
    tokens: int = 0


@dataclass
class RequestRun:
    """One request on the router side (see the module doc). ``decoders``: the decode instances whose output
    counts, the one placed on and each a live migration moved it to; ``avoid``: instances that failed a call for
    it (placed elsewhere while others can)."""

    record: RequestRecord
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    priority: int = 0
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    prefill: Instance | None = None
    decode: Instance | None = None  # colocated: the instance that runs the request
    decoders: set = field(default_factory=set)
    order: OutputOrder = field(default_factory=OutputOrder)  # what was streamed, per sequence
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    migration: object = None  # controller.migrations.PendingMigration in progress, undecided
    finished_sequences: set = field(default_factory=set)  # n > 1: the sequences that have ended
    prompt_hashes: dict = field(default_factory=dict)  # the prompt's block hashes per way of hashing (kv_index)
    # seeded sampling: each sequence's generator state after the last token reported (by sequence index)
    sampler_states: dict = field(default_factory=dict)
    resumes: int = 0  # times it continued on another decode instance after its own died
    avoid: set = field(default_factory=set)
    prefill_tokens: int = 0  # prompt tokens its prefill instance computes (the prompt less what it holds cached)
    late: bool = False  # its prompt misses the TTFT SLO wherever it goes: computed in a late lane (load_aware)
    cached: CachedPrompt | None = None  # what the instance that computed its prompt found of it instead

    @property
    def request_id(self) -> str:
        return self.record.request_id

    @property
    def tokens_streamed(self) -> int:
        return self.order.emitted_tokens()

    @property
    def state(self) -> RequestState:
        return self.record.state

    def tell(self, event: RunEvent) -> None:
        self.events.put_nowait(event)

    # -- placement: the only writer of the instances' bookkeeping -----------------------------------------

    def expect_prefill(self, tokens: int) -> None:
        """The prefill instance chosen for the prompt computes ``tokens`` of it (the load-aware policy counts
        them queued there until the first token)."""
        self.prefill_tokens = tokens

    def place(self, decode: Instance, prefill: Instance | None = None, tokens: int | None = None) -> None:
        """Held by ``decode`` (its KV reserved there for ``tokens`` positions, the prompt by default) and, with
        ``prefill``, prefilled there: both count the request from now on."""
        rid = self.request_id
        self.decode, self.prefill, self.decoders = decode, prefill, {decode}
        decode.assigned.add(rid)
        record_placement(decode, rid, len(self.prompt_ids) if tokens is None else tokens)
        if prefill is not None:
            prefill.assigned.add(rid)

    def place_on_prefill(self, prefill: Instance) -> None:
        """Scored on ``prefill`` alone (it generates nothing: ``max_tokens`` 0)."""
        self.prefill = prefill
        prefill.assigned.add(self.request_id)

    def place_colocated(self, inst: Instance) -> None:
        self.decode, self.decoders = inst, {inst}
        inst.assigned.add(self.request_id)

    def unplace(self) -> None:
        """A placement that did not take: no instance holds the request."""
        for inst in (self.prefill, self.decode):
            if inst is not None:
                inst.assigned.discard(self.request_id)
        self.prefill = self.decode = None
        self.decoders = set()

    def detach(self) -> list[Instance]:
        """Leave the prefill and decode instances; the alive ones, which are to be told to abort it."""
        alive = []
        for inst in (self.prefill, self.decode):
            if inst is not None:
                inst.assigned.discard(self.request_id)
                if inst.alive:
                    alive.append(inst)
        self.prefill = self.decode = None
        return alive

    def restart(self, reason: str, retry: bool = True) -> None:
        """Queued again to run afresh elsewhere (nothing was streamed): its output starts over. ``retry`` False:
        not counted against its retries (an instance handed it back, nothing failed)."""
        self.record.to(RequestState.QUEUED, reason, retry)
        self.order, self.decoders = OutputOrder(), set()

    def handed_off(self, prefill: Instance) -> None:
        """``prefill`` finished with the request (its KV is on the decode instance, or its prompt was scored)."""
        prefill.assigned.discard(self.request_id)

    def left(self, inst: Instance) -> bool:
        """``inst`` no longer holds the request (a failed call); it avoids ``inst`` from now on. False when it was
        not there."""
        if self.request_id not in inst.assigned:
            return False
        inst.assigned.discard(self.request_id)
        self.avoid.add(inst.name)
        return True

    def released(self, instances: list[Instance]) -> None:
        """The request ended: every instance that counted it has its room back."""
        for inst in instances:
            if self.request_id in inst.assigned:
                inst.assigned.discard(self.request_id)
                inst.room = True

    # -- live migration -------------------------------------------------------------------------------------

    def migration_started(self, migration) -> None:
        """A live migration to ``migration.destination`` began (the request keeps decoding on its source)."""
        self.migration = migration
        self.record.to(RequestState.MIGRATING)
        migration.destination.migrating_in.add(self.request_id)

    def migration_committed(self) -> tuple[Instance, Instance]:
        """The destination holds the request: it decodes there (the source's last deltas still count, the
        output order emits each position once). Returns (source, destination)."""
        m, rid = self.migration, self.request_id
        self.migration = None
        self.decode = m.destination
        self.decoders.add(m.destination)
        m.source.assigned.discard(rid)
        m.destination.migrating_in.discard(rid)
        m.destination.assigned.add(rid)
        return m.source, m.destination

    def migration_dropped(self, migration) -> None:
        """``migration`` was aborted: the request stays on its source, the destination counts it no more."""
        if self.migration is migration:
            self.migration = None
        migration.destination.migrating_in.discard(self.request_id)

    # -- output -----------------------------------------------------------------------------------------------

    def prefilling(self) -> None:
        """An instance took the prompt to compute."""
        self.record.to(RequestState.PREFILLING)

    def transferring(self) -> None:
        """The prefill instance reported the first token: the KV is on its way (state moves forward only)."""
        if self.record.state is RequestState.PREFILLING:
            self.record.to(RequestState.TRANSFERRING)

    def output_from_decoder(self, delta: TokenDelta, kv_transfer: bool) -> None:
        """A decode instance reported ``delta``: the request decodes (its transfer, if any, is complete), and a
        seeded sequence's generator state is kept (a resume elsewhere continues the same random stream)."""
        self._decoding(kv_transfer)
        self._found(delta.cached)
        if delta.sampler_state:
            self.sampler_states[delta.index] = delta.sampler_state

    def migration_ended(self) -> None:
        """Its live migration was committed or aborted: it decodes on."""
        if self.record.state is RequestState.MIGRATING:
            self.record.to(RequestState.DECODING)

    def _decoding(self, kv_transfer: bool) -> None:
        state = self.record.state
        if state is RequestState.PREFILLING and kv_transfer and self.prefill is not None:
            self.record.to(state := RequestState.TRANSFERRING)
        if state in (RequestState.PREFILLING, RequestState.TRANSFERRING):
            self.record.to(RequestState.DECODING)

    def first_tokens(self, first: FirstToken) -> list[TokenDelta]:
        """The first token of each sequence as the prefill instance sampled it, with its text, as output pieces
        at position 0 (the decode instance continues after them)."""
        rid = self.request_id
        self._found(first.cached)
        pieces = [TokenDelta(rid, [first.token_id], first.text, False,
                             logprobs=() if first.logprob is None else (first.logprob,),
                             prompt_logprobs=first.prompt_logprobs)]
        pieces += [TokenDelta(rid, [token], text, False, logprobs=() if lp is None else (lp,), index=index)
                   for index, token, lp, text in first.forks]
        return pieces

    def _found(self, cached: CachedPrompt | None) -> None:
        """The first instance to compute the prompt says what it found of it (a resume's recomputation or a
        retry does not change it)."""
        if self.cached is None and cached is not None:
            self.cached = cached

    def emit(self, piece: TokenDelta) -> tuple[Delta | None, StreamTimes]:
        """The client's delta for an output piece cut to what was not streamed yet (None: nothing to send), and
        what it means for latency. Counts the piece's speculation."""
        ids = list(piece.token_ids)
        self.draft_tokens += piece.draft_tokens
        self.accepted_tokens += piece.accepted_tokens
        times = StreamTimes()
        if ids:
            now = time.perf_counter()
            if not self.first_token_at:
                self.first_token_at = self.last_token_at = now
                times = StreamTimes(ttft_s=now - self.arrival)
            elif piece.position > 0:  # a sequence's first token is no step of its own
                times = StreamTimes(gap_s=now - self.last_token_at, tokens=len(ids))
                self.last_token_at = now
        finish_reason = None
        if self.params.num_sequences > 1 and piece.finished:  # one of several sequences ended: its choice closes
            self.finished_sequences.add(piece.index)
            finish_reason = piece.finish_reason or "stop"
        if not ids and not piece.text and piece.prompt_logprobs is None and finish_reason is None:
            return None, times
        return Delta(ids, piece.text, tuple(piece.logprobs), piece.prompt_logprobs, piece.index, finish_reason), times

    def all_finished(self, piece) -> bool:
        """Whether the emitted ``piece`` ends the request (its only sequence, or the last of several, ended)."""
        n = self.params.num_sequences
        return piece.finished and (n == 1 or len(self.finished_sequences) >= n)

    def scored(self, first: FirstToken) -> Delta:
        """The prompt was scored (nothing to generate): the prefill instance is done with it, and the one delta
        carries the prompt's log-probabilities."""
        if self.prefill is not None:
            self.handed_off(self.prefill)
        self._found(first.cached)
        self.first_token_at = self.last_token_at = time.perf_counter()
        return Delta([], "", prompt_logprobs=first.prompt_logprobs)

    def final(self, reason: str | None) -> Final:
        n = self.tokens_streamed
        tpot = (self.last_token_at - self.first_token_at) / (n - 1) if n > 1 else 0.0
        return Final(reason or "stop", len(self.prompt_ids), n, self.first_token_at - self.arrival, tpot,
                     self.draft_tokens, self.accepted_tokens, frozenset(self.finished_sequences),
                     self.cached or CachedPrompt())

    def end(self, state: RequestState, reason: str = "") -> None:
        if not self.record.state.terminal:
            self.record.to(state, reason)

    # -- resuming -----------------------------------------------------------------------------------------------

    def resume_request(self) -> ResumeRequest:
        """What a decode instance needs to continue the request, every running sequence from the tokens the client
        received (counted as one more resume; the instance it resumes on is the only one whose output counts)."""
        self.resumes += 1
        self.decoders = set()
        sequences = tuple(ResumedSequence(i, *self.order.emitted(i), self.sampler_states.get(i, b""))
                          for i in self.running_sequences())
        return ResumeRequest(self.request_id, tuple(self.prompt_ids), self.params, sequences)

    def running_sequences(self) -> list[int]:
        return [i for i in range(self.params.num_sequences) if i not in self.finished_sequences]

    def can_resume(self, max_resumes: int) -> bool:
        """Whether the request continues elsewhere after its instance failed with output out: fewer than
        ``max_resumes`` resumes so far, and every sequence still running has streamed its first token."""
        running = self.running_sequences()
        return self.resumes < max_resumes and bool(running) and all(self.order.emitted_tokens(i) > 0 for i in running)
