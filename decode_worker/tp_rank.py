"""A follower rank of a tensor-parallel decode instance that receives its own KV heads.

The driver (rank 0, the :class:`DecodeWorker`) owns every request and block; this rank mirrors its
reservations. The driver tells it, as typed actions (``decode_worker/kv_inbox.py``), each reservation
(:class:`ReserveKV`: the same block ids on every rank, and the transfer's slot), each release
(:class:`ReleaseKV`), and when to report: on :class:`SyncKV` the rank polls its receiver and all ranks exchange
outcomes (:mod:`kv_transfer.rank_sync`). Between those calls it runs the driver's forward passes like any
follower.

Live migration: the rank sends its own heads of a request migrating away to the destination ranks that
hold them (:class:`MigrationLegs`). The driver announces each migration (:class:`BeginMigration`, with its
slot), the blocks of each round and each stop-and-copy (:class:`AdvanceMigrations`), and forgets them
(:class:`CancelMigration`); on :class:`SyncMigrations` the rank applies its destinations' replies and reports
which migrations it has caught up and which failed.
"""

from __future__ import annotations

import logging

from decode_worker.kv_inbox import GivenBlocks, ReleaseKV, ReserveKV, SyncKV
from decode_worker.migration_sender import (AdvanceMigrations, BeginMigration, CancelMigration, MigrationLegs,
                                            SyncMigrations)
from kv_transfer.channel import Rendezvous, TransferConfig
from kv_transfer.descriptors import KVFingerprint
from kv_transfer.errors import TransferError
from kv_transfer.rank_sync import exchange_outcomes
from kv_transfer.receiver import KVReceiver
from modeling.heads import peer_ranks, rank_peer_id
from modeling.runner import ModelRunner
from modeling.tp_group import TPGroup
from modeling.tp_runner import TPFollower

log = logging.getLogger("magicserve.decode")


class DecodeRankFollower(TPFollower):
    """Forward passes in step with the driver, plus this rank's share of every prompt's KV."""

    def __init__(self, runner: ModelRunner, group: TPGroup, instance_id: str, transfer: TransferConfig):
        super().__init__(runner, group)
        model = runner.model
        self.config = model.config
        heads = group.shard.kv_heads(self.config)
        self._blocks = GivenBlocks()  # the blocks the driver reserved; freeing them is the driver's
        fingerprint = KVFingerprint.of(self.config, runner.block_size, runner.cache.spec.dtype)
        self.receiver = KVReceiver(runner.cache, self._blocks, rank_peer_id(instance_id, group.rank, group.size),
                                   fingerprint, heads, transfer)
        self._slots: dict[str, int] = {}
        self._done: list[int] = []
        self._failed: list[int] = []
        self.on(ReserveKV, self._reserve)
        self.on(ReleaseKV, self._release)
        self.on(SyncKV, self._sync)
        self.migration = MigrationLegs(runner.cache, instance_id, group.rank, group.size, self.config,
                                       runner.block_size, heads, transfer)
        self._outgoing: dict[str, int] = {}  # request id -> slot of a migration leaving from this rank
        self._outgoing_failed: list[int] = []
        self.on(BeginMigration, self._mig_begin)
        self.on(AdvanceMigrations, self._mig_advance)
        self.on(SyncMigrations, self._mig_sync)
        self.on(CancelMigration, self._mig_cancel)

    def connect(self, prefill_id: str, rendezvous: Rendezvous, generation: int = 0, prefill_tp: int = 1) -> None:
        """Form this rank's channels with the prefill ranks holding its heads (called by the controller
        beside the serving loop, as the driver's own ``connect`` is)."""
        for r in peer_ranks(self.config.num_key_value_heads, prefill_tp, self.group.size, self.group.rank,
                            sending=False):
            self.receiver.connect(rank_peer_id(prefill_id, r, prefill_tp), rendezvous, generation)

    def connect_migration(self, destination: str, rendezvous: Rendezvous, generation: int = 0,
                          destination_tp: int = 1) -> None:
        """Form this rank's channels to the ranks of ``destination`` it sends heads to when a request
        migrates there (called by the controller beside the serving loop, as the driver's is)."""
        self.migration.connect(destination, destination_tp, rendezvous, generation)

    def _reserve(self, action: ReserveKV) -> None:
        self._blocks.give(action.request_id, list(action.blocks))
        self.receiver.reserve(action.request_id, action.num_tokens, action.cached_blocks)
        self._slots[action.request_id] = action.slot
        self.group.barrier()  # the driver hands out the block ids only once every rank expects them

    def _release(self, action: ReleaseKV) -> None:
        self._slots.pop(action.request_id, None)
        self.receiver.release(action.request_id)

    def _sync(self, action: SyncKV) -> None:
        events = self.receiver.poll()
        self._done += [self._slots.pop(kv.request_id) for kv in events.completed if kv.request_id in self._slots]
        for f in events.failed:  # the driver learns only that this rank failed; the reason is logged here
            log.warning("decode rank %d: KV transfer of %s failed: %s", self.group.rank, f.request_id, f.error)
        self._failed += [self._slots.pop(f.request_id) for f in events.failed if f.request_id in self._slots]
        exchange_outcomes(self.group, self._done, self._failed)

    # -- live migration (the driver's decisions, on this rank's heads) -----------------------------

    def _mig_begin(self, action: BeginMigration) -> None:
        try:
            self.migration.begin(action.request_id, action.capacity_tokens, list(action.src_blocks), action.destination)
        except (TransferError, ValueError):
            self._outgoing_failed.append(action.slot)
            return
        self._outgoing[action.request_id] = action.slot

    def _mig_advance(self, action: AdvanceMigrations) -> None:
        for request_id, blocks, ready in action.rounds:
            self.migration.send_round(request_id, list(blocks), ready)
        self.migration.flush()
        for request_id, blocks, num_tokens in action.ends:
            self.migration.end(request_id, list(blocks), num_tokens)

    def _mig_cancel(self, action: CancelMigration) -> None:
        if self._outgoing.pop(action.request_id, None) is not None:
            self.migration.cancel(action.request_id)

    def _mig_sync(self, action: SyncMigrations) -> None:
        for f in self.migration.poll():
            slot = self._outgoing.pop(f.request_id, None)
            if slot is not None:
                self._outgoing_failed.append(slot)
        caught_up = [slot for rid, slot in self._outgoing.items() if self.migration.caught_up(rid)]
        exchange_outcomes(self.group, caught_up, self._outgoing_failed)
