"""A follower rank of a tensor-parallel decode instance that receives its own KV heads.

The driver (rank 0, the :class:`DecodeWorker`) owns every request and block; this rank mirrors its
reservations. The driver tells it each reservation (``kv_reserve``: the same block ids on every rank, and
the transfer's slot), each release, and when to report: on ``kv_sync`` the rank polls its receiver and
all ranks exchange outcomes (:mod:`kv_transfer.rank_sync`). Between those calls it runs the driver's
forward passes like any follower.
"""

from __future__ import annotations

from kv_transfer.channel import Rendezvous, TransferConfig
from kv_transfer.descriptors import KVFingerprint
from kv_transfer.heads import peer_ranks, rank_peer_id
from kv_transfer.rank_sync import exchange_outcomes
from kv_transfer.receiver import KVReceiver
from modeling.runner import ModelRunner
from modeling.tp_group import TPGroup
from modeling.tp_runner import TPFollower


class _DriverBlocks:
    """BlockReserver of a follower rank: the blocks the driver reserved; freeing them is the driver's."""

    def __init__(self):
        self.given: dict[str, list[int]] = {}

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        return self.given.pop(request_id, None)

    def release_reservation(self, request_id: str) -> None:
        pass


class DecodeRankFollower(TPFollower):
    """Forward passes in step with the driver, plus this rank's share of every prompt's KV."""

    def __init__(self, runner: ModelRunner, group: TPGroup, instance_id: str, transfer: TransferConfig):
        super().__init__(runner, group)
        model = runner.model
        self.config = model.config
        heads = group.shard.kv_heads(self.config)
        self._blocks = _DriverBlocks()
        fingerprint = KVFingerprint.of(self.config, runner.block_size, runner.cache.spec.dtype)
        self.receiver = KVReceiver(runner.cache, self._blocks, rank_peer_id(instance_id, group.rank, group.size),
                                   fingerprint, heads, transfer)
        self._slots: dict[str, int] = {}
        self._done: list[int] = []
        self._failed: list[int] = []
        self.actions.update(kv_reserve=self._reserve, kv_release=self._release, kv_sync=self._sync)

    def connect(self, prefill_id: str, rendezvous: Rendezvous, generation: int = 0, prefill_tp: int = 1) -> None:
        """Form this rank's channels with the prefill ranks holding its heads (called by the controller
        beside the serving loop, as the driver's own ``connect`` is)."""
        for r in peer_ranks(self.config.num_key_value_heads, prefill_tp, self.group.size, self.group.rank,
                            sending=False):
            self.receiver.connect(rank_peer_id(prefill_id, r, prefill_tp), rendezvous, generation)

    def _reserve(self, request_id: str, slot: int, num_tokens: int, blocks: list[int]) -> None:
        self._blocks.given[request_id] = list(blocks)
        self.receiver.reserve(request_id, num_tokens)
        self._slots[request_id] = slot
        self.group.barrier()  # the driver hands out the block ids only once every rank expects them

    def _release(self, request_id: str) -> None:
        self._slots.pop(request_id, None)
        self.receiver.release(request_id)

    def _sync(self) -> None:
        events = self.receiver.poll()
        self._done += [self._slots.pop(kv.request_id) for kv in events.completed if kv.request_id in self._slots]
        self._failed += [self._slots.pop(f.request_id) for f in events.failed if f.request_id in self._slots]
        exchange_outcomes(self.group, self._done, self._failed)
