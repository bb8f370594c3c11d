"""A follower rank of a tensor-parallel prefill instance: its shard's forward passes, streaming its own KV
heads to the decode ranks that hold them through its own :class:`~kv_transfer.connector.TransferConnector`.

The driver (rank 0, the :class:`PrefillWorker` with a :class:`~kv_transfer.connector.TPTransferConnector`)
schedules and owns the blocks; block ids are the same on every rank. It tells this rank, as typed actions, what
its connector's scheduler side decided: a prompt's transfer begins (:class:`BeginTransfer`: its slot, blocks
and destination), the blocks the next forward makes final (:class:`SaveStep`), the first token that ends a
transfer (:class:`FinishTransfer`), a transfer given up (:class:`WithdrawTransfer`), and when to report outcomes (:class:`SyncTransfers`, see
:mod:`kv_transfer.rank_sync`).
"""

from __future__ import annotations

from kv_transfer.channel import Rendezvous
from kv_transfer.connector import (BeginTransfer, FinishTransfer, SaveStep, SyncTransfers, TransferConnector,
                                  WithdrawTransfer)
from kv_transfer.descriptors import KVFingerprint
from kv_transfer.rank_sync import exchange_outcomes
from kv_transfer.sender import KVSender
from modeling.errors import KVConnectorError
from modeling.heads import rank_peer_id
from modeling.kv_connector import HandOff, KVPeer, KVRequest, StepKV
from modeling.runner import ModelRunner
from modeling.tp_group import TPGroup
from modeling.tp_runner import StepDescription, TPFollower
from prefill_worker.config import PrefillWorkerConfig


class PrefillRankFollower(TPFollower):
    """Forward passes in step with the driver, each streaming this rank's heads of the ready blocks."""

    def __init__(self, runner: ModelRunner, group: TPGroup, instance_id: str, config: PrefillWorkerConfig):
        super().__init__(runner, group)
        self.config = config
        model_config = runner.model.config
        fingerprint = KVFingerprint.of(model_config, config.block_size, runner.cache.spec.dtype)
        sender = KVSender(runner.cache, rank_peer_id(instance_id, group.rank, group.size), fingerprint,
                          group.shard.kv_heads(model_config), config.transfer)
        self.kv = TransferConnector(sender, model_config, group.rank, group.size, config.layerwise_streaming)
        self._slots: dict[str, int] = {}
        self._done: list[int] = []
        self._failed: list[int] = []
        self.on(BeginTransfer, self._begin)
        self.on(SaveStep, self._save_step)
        self.on(FinishTransfer, self._finish)
        self.on(SyncTransfers, self._sync)
        self.on(WithdrawTransfer, self._withdraw)

    @property
    def sender(self) -> KVSender:
        return self.kv.sender

    def connect(self, decode_id: str, rendezvous: Rendezvous, generation: int = 0, decode_tp: int = 1) -> None:
        """Form this rank's channels to the decode ranks it sends heads to (called by the controller beside
        the serving loop, as the driver's own ``connect`` is)."""
        self.kv.connect(decode_id, rendezvous, generation, decode_tp)

    def run_step(self, desc: StepDescription) -> None:
        self.runner.forward(desc.inputs, desc.sink_len, desc.window_starts, kv_hook=self.kv)
        self.kv.wait_for_save()

    def _begin(self, action: BeginTransfer) -> None:
        peer = KVPeer(action.decode_id, action.reserved, action.decode_tp)
        try:
            self.kv.update_state_after_alloc(KVRequest(action.request_id, action.num_tokens, peer), action.blocks, 0)
        except KVConnectorError:
            self._failed.append(action.slot)
            return
        if self.kv.transferring(action.request_id):
            self._slots[action.request_id] = action.slot
        else:  # this rank's heads are sent by a replica
            self._done.append(action.slot)

    def _save_step(self, action: SaveStep) -> None:
        self.kv.start_load_kv(StepKV(dict(action.final_blocks)))

    def _finish(self, action: FinishTransfer) -> None:
        self.kv.request_finished(action.request_id,
                                 HandOff(action.first_token, bytes.fromhex(action.sampler_state), action.state))

    def _withdraw(self, action: WithdrawTransfer) -> None:
        self.kv.drop(action.request_id)
        self._slots.pop(action.request_id, None)

    def _sync(self, action: SyncTransfers) -> None:
        finished = self.kv.get_finished()
        self._done += [self._slots.pop(rid) for rid in finished.sent if rid in self._slots]
        self._failed += [self._slots.pop(f.request_id) for f in finished.failed if f.request_id in self._slots]
        exchange_outcomes(self.group, self._done, self._failed)
