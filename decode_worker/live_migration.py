"""The decode worker's side of live migration (the protocol: ``docs/architecture.md``, live migration; the
decisions of when to stop and what to send: ``decode_worker/migration.py``; the KV legs:
``decode_worker/migration_sender.py``).

A source sends a running request's KV in rounds while it keeps decoding, then stops it and sends the rest
with its state; a destination holds the request, with room reserved, until the router commits (it decodes
there) or aborts (it is freed there). The worker owns the requests and their blocks: this component reads
and changes them through the worker's ``requests``, ``scheduler``, ``pool`` and ``speculator``, holds new
ones with ``hold``, and on a tensor-parallel instance has every rank act on its own heads
(``runner.call``).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from decode_worker.drafters import DraftLayout, DraftModelDrafter
from decode_worker.messages import DecodeRequest, MigrationArrived, MigrationFailed, TokenDelta
from decode_worker.migration import MigrationState, OutgoingMigration, headroom_tokens, should_stop
from decode_worker.migration_sender import MigrationLegs
from kv_transfer.channel import Rendezvous
from kv_transfer.errors import TransferError
from kv_transfer.rank_sync import exchange_outcomes
from kv_transfer.receiver import ReceivedKV
from modeling.errors import InvalidRequestError, OutOfBlocksError
from modeling.output import OutputStream
from modeling.sequence import SequenceStatus

if TYPE_CHECKING:  # the worker imports this module
    from decode_worker.worker import DecodeWorker


class LiveMigrations:
    """Outgoing and incoming migrations of one decode worker (rank 0 of its instance)."""

    def __init__(self, worker: "DecodeWorker"):
        self.worker = worker
        self.legs: MigrationLegs | None = None  # this rank's sender, formed by the first ``connect``
        self._slots = itertools.count(1)  # TP: numbers outgoing migrations for the rank reports
        self.outgoing: dict[str, OutgoingMigration] = {}
        self.incoming: set[str] = set()
        self._draft_imports: dict[str, tuple] = {}  # arrived requests' draft caches, imported on commit

    def forget(self, request_id: str) -> None:
        """A request ended here: whatever migration it was in goes (the router aborts the other end)."""
        self.cancel_outgoing(request_id)
        self.incoming.discard(request_id)
        self._draft_imports.pop(request_id, None)

    def connect(self, destination: str, rendezvous: Rendezvous, generation: int = 0,
                          destination_tp: int = 1) -> None:
        """Form this rank's channels to the ranks of ``destination`` (an instance of ``destination_tp``
        ranks) this instance migrates requests over (blocks until they join with the destination's ``DecodeWorker.connect``, giving
        this instance's id and degree; the other ranks connect on their own, ``DecodeRankFollower``)."""
        if self.worker.transfer is None:
            raise InvalidRequestError("destination", "this worker moves no KV (it was built without transfer)")
        if self.legs is None:
            size = 1 if self.worker.tp is None else self.worker.tp.size
            w = self.worker
            self.legs = MigrationLegs(w.cache, w.instance_id, 0, size, w.loaded.config, w.config.block_size,
                                      w.loaded.kv_heads, w.transfer)
        self.legs.connect(destination, destination_tp, rendezvous, generation)

    def begin_in(self, request: DecodeRequest, num_tokens: int) -> int | None:
        """Destination: hold ``request`` for a migration, with blocks for its ``num_tokens`` positions now
        and headroom for the steps its source runs meanwhile. Returns the positions reserved (the source's
        transfer is accepted into them, found by the request id), or None when there is no room."""
        capacity = min(self.worker.max_model_len,
                       num_tokens + headroom_tokens(self.worker.config.speculation.max_k, self.worker.config.block_size))
        if num_tokens < len(request.prompt_ids) + 1 or num_tokens >= capacity:
            raise InvalidRequestError("num_tokens", f"must be in ({len(request.prompt_ids)}, {capacity}), "
                                      f"got {num_tokens}")
        self.incoming.add(request.request_id)
        try:
            held = self.worker.hold(request, capacity)
        finally:
            if request.request_id not in self.worker.requests:
                self.incoming.discard(request.request_id)
        return capacity if held else None

    def begin_out(self, request_id: str, destination: str, capacity_tokens: int) -> str | None:
        """Source: start migrating a running request to ``destination``, which holds ``capacity_tokens``
        positions for it; it keeps decoding here meanwhile. None when started, else why not."""
        live = self.worker.requests.get(request_id)
        if live is None or live.seq.status is not SequenceStatus.RUNNING:
            return f"{request_id!r} is not decoding on {self.worker.instance_id}"
        if request_id in self.outgoing:
            return f"{request_id!r} is already migrating"
        if self.legs is None or not self.legs.connected(destination):
            return f"no migration channel from {self.worker.instance_id} to {destination}"
        if live.seq.num_tokens + self.worker.speculator.step_tokens() >= capacity_tokens:
            return f"{request_id!r} has outgrown the {capacity_tokens} positions reserved on {destination}"
        src_blocks = list(live.seq.block_table.blocks)
        try:
            self.legs.begin(request_id, capacity_tokens, src_blocks, destination)
        except (TransferError, ValueError) as err:
            return str(err)
        m = OutgoingMigration(request_id, capacity_tokens, slot=next(self._slots),
                              ranks_caught_up=self.worker.tp is None)
        self.outgoing[request_id] = m
        if self.worker.tp is not None:  # every rank sends its own heads (a rank that cannot fails its slot)
            self.worker.runner.call("mig_begin", request_id=request_id, slot=m.slot, capacity_tokens=capacity_tokens,
                                    src_blocks=src_blocks, destination=destination)
        return None

    def commit(self, request_id: str) -> bool:
        """Destination: the router committed the migration; the request decodes here from the next step."""
        live = self.worker.requests.get(request_id)
        if request_id not in self.incoming or live is None or live.seq.status is not SequenceStatus.MIGRATING:
            return False
        self.incoming.discard(request_id)
        seq = live.seq
        seq.block_table.truncate(self.worker.pool, seq.num_tokens)
        self.worker.scheduler.start(seq)
        # the output so far, from its start: whatever of it the router did not read from the source (should the
        # source die first) it takes from here
        self.worker.events.append(TokenDelta(request_id, list(seq.output_ids), live.stream.text[:live.stream.sent],
                                             False))
        draft = self._draft_imports.pop(request_id, None)
        try:
            if draft is None or not isinstance(self.worker.drafter, DraftModelDrafter):
                raise ValueError("no draft cache to import")
            kv, (computed, entries, evicted) = draft
            self.worker.drafter.import_state(seq, kv, DraftLayout(computed, entries, evicted))
        except (ValueError, OutOfBlocksError):  # none sent, another draft model, or no room: rebuild it here
            self.worker.drafter.admit(seq)
        return True

    def finish(self, request_id: str) -> bool:
        """Source: the request now lives on its destination; free its copy here."""
        m = self.outgoing.get(request_id)
        live = self.worker.requests.get(request_id)
        if m is None or not m.stopped or live is None:
            return False
        # the destination acknowledged every byte (DONE) before it reported the arrival that made the router
        # commit: this rank's sender counts the transfer when it reads that DONE; the other ranks forget theirs
        del self.outgoing[request_id]
        if self.worker.tp is not None:
            self.worker.runner.call("mig_cancel", request_id=request_id)
        del self.worker.requests[request_id]
        self.worker.drafter.release(live.seq)
        live.seq.block_table.release(self.worker.pool)  # its cached blocks stay cached here
        self.worker.prefix_cache.forget(request_id)
        live.seq.status = SequenceStatus.FINISHED
        return True

    def abort(self, request_id: str) -> bool:
        """Source: the router aborted the migration; the request goes on decoding here (resumed if it had
        stopped for the last copy)."""
        m = self.outgoing.get(request_id)
        if m is None:
            return False
        self.cancel_outgoing(request_id)
        live = self.worker.requests.get(request_id)
        if m.stopped and live is not None and live.seq.status is SequenceStatus.MIGRATING:
            self.worker.scheduler.start(live.seq)
            if isinstance(self.worker.drafter, DraftModelDrafter) and not self.worker.drafter.holds(live.seq):
                self.worker.drafter.admit(live.seq)  # the drafter was rebuilt meanwhile (set_speculation)
            self.worker.speculator.forget_choice()
        return True

    def arrive(self, live, kv: ReceivedKV) -> MigrationArrived:
        """A migrating request's KV and state are here: hold it for the router's commit."""
        seq = live.seq
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
            self._draft_imports[seq.request_id] = (kv.extra, state.draft)
        live.stream = OutputStream.for_sequence(seq, self.worker.tokenizer)
        live.stream.push(seq.output_ids, None)  # the text state as the source had it ...
        live.stream.sent = state.text_sent  # ... of which this much was streamed
        return MigrationArrived(seq.request_id, len(state.output_ids))

    def poll(self) -> list:
        """Failures of outgoing migrations' transfers on any rank (the request stays here until the router
        decides); on a tensor-parallel instance, also which migrations every other rank has caught up."""
        if self.legs is None:
            return []
        failed = [(f.request_id, str(f.error)) for f in self.legs.poll()]
        if self.worker.tp is not None and self.outgoing:
            self.worker.runner.call("mig_sync")
            reports = exchange_outcomes(self.worker.tp, [], [])[1:]
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
        legs, bs = self.legs, self.worker.config.block_size
        rounds, ends = [], []  # what the other ranks do on their legs, in the same order
        for m in [m for m in self.outgoing.values() if not m.stopped and not m.failed]:
            live = self.worker.requests[m.request_id]  # an outgoing request that ends or is preempted is cancelled
            seq = live.seq
            caught_up = legs.caught_up(m.request_id) and m.ranks_caught_up
            if should_stop(caught_up, m.rounds, seq.num_tokens, self.worker.speculator.step_tokens(), m.capacity_tokens):
                ends.append(self._stop_and_copy(m, live))
                continue
            full = seq.num_computed // bs  # blocks whose every position holds final KV
            if full > m.blocks_sent:
                blocks = list(seq.block_table.blocks)
                legs.send_round(m.request_id, blocks, full)
                rounds.append([m.request_id, blocks, full])
                m.blocks_sent = full
            m.rounds += 1
        legs.flush()
        if self.worker.tp is not None and (rounds or ends):
            self.worker.runner.call("mig_advance", rounds=rounds, ends=ends)

    def _stop_and_copy(self, m: OutgoingMigration, live) -> list:
        """Stop the request here and send the rest of its KV and its state; returns the end for the other
        ranks' legs ``[request id, blocks, positions]``."""
        seq = live.seq
        self.worker.scheduler.running.pop(seq.request_id)  # its draft state stays until the router decides
        seq.status = SequenceStatus.MIGRATING
        self.worker.speculator.forget_choice()
        n = seq.num_computed  # every token but the last has its KV here
        draft_kv, draft = None, None
        if isinstance(self.worker.drafter, DraftModelDrafter) and self.worker.drafter.holds(seq):
            draft_kv, layout = self.worker.drafter.export_state(seq)  # its own cache moves too (a window's worth)
            draft = (layout.computed, layout.entries, layout.evicted)
        state = MigrationState(tuple(seq.output_ids), n, seq.sampler.generator.get_state().numpy().tobytes().hex(),
                               live.stream.sent, draft)
        blocks = list(seq.block_table.blocks)
        self.legs.end(seq.request_id, blocks, n, state.encode(), draft_kv)
        m.stopped = True
        return [seq.request_id, blocks, n]

    def cancel_outgoing(self, request_id: str) -> bool:
        if self.outgoing.pop(request_id, None) is None:
            return False
        self.legs.cancel(request_id)
        if self.worker.tp is not None:
            self.worker.runner.call("mig_cancel", request_id=request_id)
        return True

