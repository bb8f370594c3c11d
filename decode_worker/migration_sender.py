"""One rank's share of outgoing live migrations: its KV heads, sent to the destination ranks that hold them.

A decode instance of ``tp`` ranks migrates a request to another of ``destination_tp`` ranks the way a
prefill instance hands a prompt to a decode instance: each source rank sends only its own heads, over its
own pair channels, to the destination ranks the transfer plan (:mod:`modeling.heads`) assigns them.
Block ids are the same on every rank of an instance, so one list of source blocks and one of destination
blocks describe every leg. The driver (rank 0) decides the rounds and the stop; each rank runs them on its
legs with an instance of this class. The request's state (and a draft model's cache) travels on rank 0's
legs only; the other ranks end theirs with the positions sent. The driver tells the other ranks each
decision as a typed action (:class:`BeginMigration`, :class:`AdvanceMigrations`, :class:`CancelMigration`,
:class:`SyncMigrations`; ``decode_worker/tp_rank.py`` runs them).
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_transfer.channel import Rendezvous, TransferConfig
from kv_transfer.descriptors import KVFingerprint
from kv_transfer.sender import KVSender, TransferFailure, leg_targets
from modeling.config import ModelConfig
from modeling.heads import HeadRange, peer_ranks, rank_peer_id
from modeling.kv_cache import PagedKVCache


@dataclass(frozen=True)
class BeginMigration:
    """``MigrationLegs.begin`` on every rank; ``slot`` numbers the migration in outcome reports."""

    request_id: str
    slot: int
    capacity_tokens: int
    src_blocks: tuple[int, ...]
    destination: str


@dataclass(frozen=True)
class AdvanceMigrations:
    """After a step, in order: each round ``(request id, blocks, ready blocks)`` (``send_round``), a flush, then
    each stop-and-copy ``(request id, blocks, positions)`` (``end``)."""

    rounds: tuple[tuple[str, tuple[int, ...], int], ...]
    ends: tuple[tuple[str, tuple[int, ...], int], ...]


@dataclass(frozen=True)
class CancelMigration:
    """Forget the request's migration (committed elsewhere, aborted, finished or preempted)."""

    request_id: str


@dataclass(frozen=True)
class SyncMigrations:
    """Apply the destinations' replies and report caught-up and failed migrations' slots."""


class MigrationLegs:
    """The sender of rank ``rank`` of a ``tp``-rank decode instance, for requests it migrates away."""

    def __init__(self, cache: PagedKVCache, instance_id: str, rank: int, tp: int, model_config: ModelConfig,
                 block_size: int, heads: HeadRange, transfer: TransferConfig):
        self.model_config = model_config
        self.rank, self.tp = rank, tp
        fingerprint = KVFingerprint.of(model_config, block_size, cache.spec.dtype)
        self.sender = KVSender(cache, rank_peer_id(instance_id, rank, tp), fingerprint, heads, transfer,
                               role="decode")
        self._destination_tp: dict[str, int] = {}
        self._active: set[str] = set()  # requests with legs from this rank (none where a replica sends)

    def connect(self, destination: str, destination_tp: int, rendezvous: Rendezvous, generation: int) -> None:
        """Form this rank's channels to the ranks of ``destination`` it sends heads to (blocks until they
        join; each of them connects with this instance's id)."""
        for r in peer_ranks(self.model_config.num_key_value_heads, self.tp, destination_tp, self.rank, sending=True):
            self.sender.connect(rank_peer_id(destination, r, destination_tp), rendezvous, generation)
        self._destination_tp[destination] = destination_tp

    def connected(self, destination: str) -> bool:
        d_tp = self._destination_tp.get(destination)
        if d_tp is None:
            return False
        ranks = peer_ranks(self.model_config.num_key_value_heads, self.tp, d_tp, self.rank, sending=True)
        return all(self.sender.connected(rank_peer_id(destination, r, d_tp)) for r in ranks)

    def begin(self, request_id: str, capacity_tokens: int, src_blocks: list[int], destination: str) -> None:
        """Announce a live transfer to ``destination``, which holds ``capacity_tokens`` positions for the
        request. Raises TransferError (no working channel) or ValueError."""
        if destination not in self._destination_tp:
            raise ValueError(f"destination: no migration channel to {destination!r}")
        targets = leg_targets(self.model_config, self.rank, self.tp, destination, self._destination_tp[destination],
                              reserved=True)
        if targets:
            self.sender.begin(request_id, capacity_tokens, list(src_blocks), targets, live=True)
            self._active.add(request_id)

    def send_round(self, request_id: str, src_blocks: list[int], ready_blocks: int) -> None:
        """The request's blocks now, of which the first ``ready_blocks`` hold final KV (sent at ``flush``)."""
        if request_id in self._active and self.sender.transferring(request_id):
            self.sender.extend(request_id, list(src_blocks), ready_blocks)

    def end(self, request_id: str, src_blocks: list[int], num_tokens: int, state: str = "", extra=None) -> None:
        """Stop-and-copy: send the blocks holding the ``num_tokens`` positions not sent yet, then end the
        legs (``state`` and ``extra`` ride on them: rank 0 passes the request's)."""
        if request_id not in self._active or not self.sender.transferring(request_id):
            return
        self.sender.extend(request_id, list(src_blocks), -(-num_tokens // self.sender.fingerprint.block_size))
        self.sender.flush()
        self.sender.finish_prompt(request_id, None, num_tokens=num_tokens, state=state, extra=extra)

    def flush(self) -> None:
        self.sender.flush()

    def close(self) -> None:
        """Abort every channel to the destinations (their receivers see them end; pending legs fail)."""
        self.sender.close()
        self._destination_tp.clear()
        self._active.clear()

    def caught_up(self, request_id: str) -> bool:
        """Every block sent so far taken by the destination (true where this rank sends nothing)."""
        return request_id not in self._active or self.sender.caught_up(request_id)

    def poll(self) -> list[TransferFailure]:
        """Apply the destinations' replies; the transfers that failed (forgotten here)."""
        events = self.sender.poll()
        for rid in events.done:
            self._active.discard(rid)
        failed = [f for f in events.failed if f.request_id in self._active]
        for f in failed:
            self._active.discard(f.request_id)
        return failed

    def cancel(self, request_id: str) -> None:
        """Forget a request's transfer here (committed elsewhere, aborted, finished or preempted)."""
        self._active.discard(request_id)
        self.sender.cancel(request_id)
