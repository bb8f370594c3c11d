"""A follower rank of a tensor-parallel prefill instance: its shard's forward passes, streaming its own KV
heads to the decode ranks that hold them.

The driver (rank 0, the :class:`PrefillWorker`) schedules and owns the blocks; block ids are the same on
every rank. It tells this rank when a prompt's transfer begins (``kv_begin``: its slot, blocks and
destination), which blocks each forward makes final (the ``ready`` map in the step description), the
first tokens that end the transfers (``kv_finish``), and when to report outcomes (``kv_sync``, see
:mod:`kv_transfer.rank_sync`).
"""

from __future__ import annotations

from kv_transfer.channel import Rendezvous
from kv_transfer.descriptors import KVFingerprint
from kv_transfer.errors import TransferError
from kv_transfer.rank_sync import exchange_outcomes
from kv_transfer.sender import KVSender
from kv_transfer.streaming import forward_streaming, leg_targets
from modeling.heads import peer_ranks, rank_peer_id
from modeling.runner import ModelRunner
from modeling.tp_group import TPGroup
from modeling.tp_runner import StepDescription, TPFollower
from prefill_worker.config import PrefillWorkerConfig


class PrefillRankFollower(TPFollower):
    """Forward passes in step with the driver, each streaming this rank's heads of the ready blocks."""

    def __init__(self, runner: ModelRunner, group: TPGroup, instance_id: str, config: PrefillWorkerConfig):
        super().__init__(runner, group)
        self.config = config
        self.model_config = runner.model.config
        fingerprint = KVFingerprint.of(self.model_config, config.block_size, runner.cache.spec.dtype)
        self.sender = KVSender(runner.cache, rank_peer_id(instance_id, group.rank, group.size), fingerprint,
                               group.shard.kv_heads(self.model_config), config.transfer)
        self._slots: dict[str, int] = {}
        self._done: list[int] = []
        self._failed: list[int] = []
        self.actions.update(kv_begin=self._begin, kv_finish=self._finish, kv_sync=self._sync)

    def connect(self, decode_id: str, rendezvous: Rendezvous, generation: int = 0, decode_tp: int = 1) -> None:
        """Form this rank's channels to the decode ranks it sends heads to (called by the controller beside
        the serving loop, as the driver's own ``connect`` is)."""
        for r in peer_ranks(self.model_config.num_key_value_heads, self.group.size, decode_tp, self.group.rank,
                            sending=True):
            self.sender.connect(rank_peer_id(decode_id, r, decode_tp), rendezvous, generation)

    def run_step(self, desc: StepDescription) -> None:
        ready = (desc.side or {}).get("ready", {})
        forward_streaming(self.runner, self.sender, desc.inputs, ready, self.config.layerwise_streaming)

    def _begin(self, request_id: str, slot: int, num_tokens: int, src_blocks: list[int], decode_id: str,
               decode_tp: int, reserved: bool) -> None:
        targets = leg_targets(self.model_config, self.group.rank, self.group.size, decode_id, decode_tp, reserved)
        if not targets:  # this rank's heads are sent by a replica
            self._done.append(slot)
            return
        try:
            self.sender.begin(request_id, num_tokens, src_blocks, targets)
        except TransferError:
            self._failed.append(slot)
            return
        self._slots[request_id] = slot

    def _finish(self, ends: list[list]) -> None:
        for request_id, token, state, forks in ends:
            self.sender.finish_prompt(request_id, token, bytes.fromhex(state), state=forks)

    def _sync(self) -> None:
        events = self.sender.poll()
        self._done += [self._slots.pop(rid) for rid in events.done if rid in self._slots]
        self._failed += [self._slots.pop(f.request_id) for f in events.failed if f.request_id in self._slots]
        exchange_outcomes(self.group, self._done, self._failed)
