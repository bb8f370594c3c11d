"""The decode worker's side of live migration (the protocol: ``docs/architecture.md``, live migration; the
decisions of when to stop and what to send: ``decode_worker/migration.py``; the KV legs:
``decode_worker/migration_sender.py``).

A source sends a running request's KV in rounds while it keeps decoding, then stops it and sends the rest
with its state; a destination holds the request, with room reserved, until the router commits (it decodes
there) or aborts (it is freed there). The worker owns the requests and their blocks: this component reaches
them only through a :class:`MigrationHost` (``decode_worker/migration_host.py`` adapts the worker's parts),
admits requests migrating in through the worker's one door (``MigrationIn``), and on a tensor-parallel
instance has every rank act on its own heads (``MigrationHost.ranks``).
"""

from __future__ import annotations

import itertools
from typing import Protocol

import torch

from decode_worker.drafters import DraftLayout
from decode_worker.held import HeldRequest
from decode_worker.messages import DecodeRequest, MigrationArrived, MigrationFailed, TokenDelta
from decode_worker.migration import MigrationState, OutgoingMigration, headroom_tokens, should_stop
from decode_worker.migration_sender import (AdvanceMigrations, BeginMigration, CancelMigration, MigrationLegs,
                                            SyncMigrations)
from decode_worker.ranks import FollowerRanks
from decode_worker.sources import MigrationIn
from kv_transfer.channel import Rendezvous
from kv_transfer.errors import TransferError
from kv_transfer.receiver import ReceivedKV
from modeling.errors import InvalidRequestError
from modeling.sequence import Sequence, SequenceStatus

DraftState = tuple[torch.Tensor, DraftLayout]  # a draft model's cache of one sequence and where it sits


class MigrationHost(Protocol):
    """What live migration needs of its decode instance, and nothing more."""

    instance_id: str
    block_size: int
    max_model_len: int
    ranks: FollowerRanks | None  # tensor parallel: the other ranks, each acting on its own heads

    def open_legs(self) -> MigrationLegs:
        """This rank's sender of migrating KV; raises InvalidRequestError when the instance moves no KV."""

    def max_k(self) -> int:
        """The largest speculation length the instance may run now."""

    def step_tokens(self) -> int:
        """The most positions one step may add to a sequence."""

    def admit(self, request: DecodeRequest, source: MigrationIn) -> bool:
        """The worker's door (``DecodeWorker.admit``), for a request migrating in."""

    def held(self, request_id: str) -> HeldRequest | None:
        """The sequence held under ``request_id``, or None."""

    def stop(self, seq: Sequence) -> None:
        """``seq`` leaves the running batch, keeping its blocks and draft state."""

    def join(self, seq: Sequence, draft: DraftState | None) -> None:
        """An arrived ``seq`` joins the running batch: its blocks trimmed to its tokens, the draft state
        its source sent imported (or rebuilt here)."""

    def resume(self, seq: Sequence) -> None:
        """A stopped ``seq`` rejoins the running batch (its draft state rebuilt if the drafter lost it)."""

    def release(self, request_id: str) -> None:
        """A stopped request now lives elsewhere: free its copy here (its cached blocks stay cached)."""

    def export_draft(self, seq: Sequence) -> DraftState | None:
        """The draft model's cache of ``seq``, to send along; None without a draft model holding it."""

    def emit(self, event: object) -> None:
        """Output raised between steps, emitted by the next step."""


class LiveMigrations:
    """Outgoing and incoming migrations of one decode instance (rank 0 of it)."""

    def __init__(self, host: MigrationHost):
        self.host = host
        self.legs: MigrationLegs | None = None  # this rank's sender, formed by the first ``connect``
        self._slots = itertools.count(1)  # TP: numbers outgoing migrations for the rank reports
        self.outgoing: dict[str, OutgoingMigration] = {}
        self.incoming: set[str] = set()
        self._draft_imports: dict[str, DraftState] = {}  # arrived requests' draft caches, imported on commit

    def forget(self, request_id: str) -> None:
        """A request ended here: whatever migration it was in goes (the router aborts the other end)."""
        self.cancel_outgoing(request_id)
        self.incoming.discard(request_id)
        self._draft_imports.pop(request_id, None)

    def connect(self, destination: str, rendezvous: Rendezvous, generation: int = 0, destination_tp: int = 1) -> None:
        """Form this rank's channels to the ranks of ``destination`` (an instance of ``destination_tp``
        ranks) this instance migrates requests over (blocks until they join with the destination's
        ``DecodeWorker.connect``, giving this instance's id and degree; the other ranks connect on their
        own, ``DecodeRankFollower``)."""
        if self.legs is None:
            self.legs = self.host.open_legs()
        self.legs.connect(destination, destination_tp, rendezvous, generation)

    def close(self) -> None:
        """Close the channels this instance migrates requests over (the instance stops decoding: a role change);
        a later ``connect`` forms them anew."""
        if self.legs is not None:
            self.legs.close()
            self.legs = None

    def begin_in(self, request: DecodeRequest, num_tokens: int) -> int | None:
        """Destination: hold ``request`` for a migration, with blocks for its ``num_tokens`` positions now
        and headroom for the steps its source runs meanwhile. Returns the positions reserved (the source's
        transfer is accepted into them, found by the request id), or None when there is no room."""
        host = self.host
        capacity = min(host.max_model_len, num_tokens + headroom_tokens(host.max_k(), host.block_size))
        if num_tokens < len(request.prompt_ids) + 1 or num_tokens >= capacity:
            raise InvalidRequestError("num_tokens", f"must be in ({len(request.prompt_ids)}, {capacity}), "
                                      f"got {num_tokens}")
        if not host.admit(request, MigrationIn(capacity)):
            return None
        self.incoming.add(request.request_id)
        return capacity

    def begin_out(self, request_id: str, destination: str, capacity_tokens: int) -> str | None:
        """Source: start migrating a running request to ``destination``, which holds ``capacity_tokens``
        positions for it; it keeps decoding here meanwhile. None when started, else why not."""
        held, where = self.host.held(request_id), self.host.instance_id
        if held is None or held.seq.status is not SequenceStatus.RUNNING:
            return f"{request_id!r} is not decoding on {where}"
        if request_id in self.outgoing:
            return f"{request_id!r} is already migrating"
        if self.legs is None or not self.legs.connected(destination):
            return f"no migration channel from {where} to {destination}"
        if held.seq.num_tokens + self.host.step_tokens() >= capacity_tokens:
            return f"{request_id!r} has outgrown the {capacity_tokens} positions reserved on {destination}"
        src_blocks = list(held.seq.block_table.blocks)
        try:
            self.legs.begin(request_id, capacity_tokens, src_blocks, destination)
        except (TransferError, ValueError) as err:
            return str(err)
        ranks = self.host.ranks
        m = OutgoingMigration(request_id, capacity_tokens, slot=next(self._slots), ranks_caught_up=ranks is None)
        self.outgoing[request_id] = m
        if ranks is not None:  # every rank sends its own heads (a rank that cannot fails its slot)
            ranks.call(BeginMigration(request_id, m.slot, capacity_tokens, tuple(src_blocks), destination))
        return None

    def commit(self, request_id: str) -> bool:
        """Destination: the router committed the migration; the request decodes here from the next step."""
        held = self.host.held(request_id)
        if request_id not in self.incoming or held is None or held.seq.status is not SequenceStatus.MIGRATING:
            return False
        self.incoming.discard(request_id)
        seq = held.seq
        self.host.join(seq, self._draft_imports.pop(request_id, None))
        # the output so far, from its start: whatever of it the router did not read from the source (should the
        # source die first) it takes from here
        self.host.emit(TokenDelta(request_id, list(seq.output_ids), held.stream.text[:held.stream.sent], False))
        return True

    def finish(self, request_id: str) -> bool:
        """Source: the request now lives on its destination; free its copy here."""
        m = self.outgoing.get(request_id)
        if m is None or not m.stopped or self.host.held(request_id) is None:
            return False
        # the destination acknowledged every byte (DONE) before it reported the arrival that made the router
        # commit: this rank's sender counts the transfer when it reads that DONE; the other ranks forget theirs
        del self.outgoing[request_id]
        if self.host.ranks is not None:
            self.host.ranks.call(CancelMigration(request_id))
        self.host.release(request_id)
        return True

    def abort(self, request_id: str) -> bool:
        """Source: the router aborted the migration; the request goes on decoding here (resumed if it had
        stopped for the last copy)."""
        m = self.outgoing.get(request_id)
        if m is None:
            return False
        self.cancel_outgoing(request_id)
        held = self.host.held(request_id)
        if m.stopped and held is not None and held.seq.status is SequenceStatus.MIGRATING:
            self.host.resume(held.seq)
        return True

    def arrive(self, kv: ReceivedKV) -> MigrationArrived:
        """A migrating request's KV and state are here: hold it for the router's commit. Raises
        InvalidRequestError naming the field when the state does not fit what arrived."""
        held = self.host.held(kv.request_id)
        seq = held.seq
        try:
            state = MigrationState.decode(kv.state)
        except (ValueError, KeyError, TypeError) as err:
            raise InvalidRequestError("state", f"malformed migration state: {err}") from None
        tokens = list(seq.prompt_ids) + list(state.output_ids)
        if not state.num_computed == kv.num_tokens == len(tokens) - 1:
            raise InvalidRequestError("state", f"{kv.num_tokens} positions sent for {len(tokens)} tokens "
                                      f"({state.num_computed} computed)")
        if seq.block_table.capacity < len(tokens):
            raise InvalidRequestError("state", f"{len(tokens)} tokens exceed the room reserved")
        seq.tokens = tokens
        seq.sampler.catch_up(state.output_ids)
        seq.num_computed = state.num_computed
        if state.sampler_state:
            seq.sampler.generator.set_state(torch.frombuffer(bytearray.fromhex(state.sampler_state), dtype=torch.uint8))
        seq.status = SequenceStatus.MIGRATING
        if state.draft is not None and kv.extra is not None:
            self._draft_imports[seq.request_id] = (kv.extra, DraftLayout(*state.draft))
        # the stream, made at admission, has seen nothing yet: the text state as the source had it ...
        held.stream.push(seq.output_ids, None)
        held.stream.sent = state.text_sent  # ... of which this much was streamed
        held.first_token_at = state.first_token_at
        return MigrationArrived(seq.request_id, len(state.output_ids))

    def poll(self) -> list:
        """Failures of outgoing migrations' transfers on any rank (the request stays here until the router
        decides); on a tensor-parallel instance, also which migrations every other rank has caught up."""
        if self.legs is None:
            return []
        failed = [(f.request_id, str(f.error)) for f in self.legs.poll()]
        ranks = self.host.ranks
        if ranks is not None and self.outgoing:
            ranks.call(SyncMigrations())
            reports = ranks.exchange()[1:]
            by_slot = {m.slot: m for m in self.outgoing.values()}
            for m in self.outgoing.values():
                m.ranks_caught_up = all(m.slot in caught for caught, _ in reports)
            for rank, (_, bad) in enumerate(reports, start=1):
                failed += [(by_slot[s].request_id, f"rank {rank}'s KV transfer failed") for s in bad if s in by_slot]
        out = []
        for rid, why in failed:
            m = self.outgoing.get(rid)
            if m is not None and not m.failed:
                m.failed = True  # nothing more goes out; a stopped request waits for the router's abort
                out.append(MigrationFailed(rid, why))
        return out

    def advance(self) -> None:
        """After a step: send each outgoing request's newly final blocks (a round), or stop it and send
        the rest with its state (``decode_worker/migration.py``)."""
        if not self.outgoing:
            return
        legs, bs = self.legs, self.host.block_size
        rounds, ends = [], []  # what the other ranks do on their legs, in the same order
        for m in [m for m in self.outgoing.values() if not m.stopped and not m.failed]:
            held = self.host.held(m.request_id)  # an outgoing request that ends or is preempted is cancelled
            seq = held.seq
            caught_up = legs.caught_up(m.request_id) and m.ranks_caught_up
            if should_stop(caught_up, m.rounds, seq.num_tokens, self.host.step_tokens(), m.capacity_tokens):
                ends.append(self._stop_and_copy(m, held))
                continue
            full = seq.num_computed // bs  # blocks whose every position holds final KV
            if full > m.blocks_sent:
                blocks = list(seq.block_table.blocks)
                legs.send_round(m.request_id, blocks, full)
                rounds.append([m.request_id, blocks, full])
                m.blocks_sent = full
            m.rounds += 1
        legs.flush()
        if self.host.ranks is not None and (rounds or ends):
            self.host.ranks.call(AdvanceMigrations(tuple((rid, tuple(b), n) for rid, b, n in rounds),
                                                   tuple((rid, tuple(b), n) for rid, b, n in ends)))

    def _stop_and_copy(self, m: OutgoingMigration, held: HeldRequest) -> list:
        """Stop the request here and send the rest of its KV and its state; returns the end for the other
        ranks' legs ``[request id, blocks, positions]``."""
        seq = held.seq
        self.host.stop(seq)  # its draft state stays until the router decides
        seq.status = SequenceStatus.MIGRATING
        n = seq.num_computed  # every token but the last has its KV here
        exported = self.host.export_draft(seq)  # a draft model's own cache moves too (a window's worth)
        draft_kv, draft = None, None
        if exported is not None:
            draft_kv, layout = exported
            draft = (layout.computed, layout.entries, layout.evicted)
        state = MigrationState(tuple(seq.output_ids), n, seq.sampler.generator.get_state().numpy().tobytes().hex(),
                               held.stream.sent, draft, held.first_token_at)
        blocks = list(seq.block_table.blocks)
        self.legs.end(seq.request_id, blocks, n, state.encode(), draft_kv)
        m.stopped = True
        return [seq.request_id, blocks, n]

    def cancel_outgoing(self, request_id: str) -> bool:
        """Stop migrating ``request_id`` away, on every rank (it stays here); False when it was not."""
        if self.outgoing.pop(request_id, None) is None:
            return False
        self.legs.cancel(request_id)
        if self.host.ranks is not None:
            self.host.ranks.call(CancelMigration(request_id))
        return True
