"""Prompts' KV arriving at a decode instance: the receiving side of the prefill -> decode KV connector
(:mod:`modeling.kv_connector`) on the driver rank; the sending side is ``kv_transfer/connector.py``.

Scheduler side: the owner (the worker's ``Admission``) allocates a transfer's blocks first, with its one
allocation call, then ``update_state_after_alloc`` hands them to this instance's ``KVReceiver`` (and, on a
tensor-parallel instance, to every rank's, with :class:`ReserveKV`): block ids never leave the instance, and
the receiver never asks the owner for room. ``request_finished`` (``drop``) stops expecting a transfer.
Worker side: bytes arrive on the receiver's threads between steps, so nothing loads inside a forward pass;
``get_finished`` (``poll``) says which transfers completed on every rank and which failed. A failed or
cancelled transfer's blocks go back to the owner (``on_release``) only once no bytes are in flight into them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

from decode_worker.ranks import FollowerRanks
from kv_transfer.channel import Rendezvous, TransferConfig
from kv_transfer.descriptors import KVFingerprint
from kv_transfer.rank_sync import FollowerOutcomes
from kv_transfer.receiver import KVReceiver, ReceivedKV
from modeling.config import ModelConfig
from modeling.errors import InvalidRequestError
from modeling.heads import HeadRange, peer_ranks, rank_peer_id
from modeling.kv_cache import PagedKVCache
from modeling.kv_connector import (BlockRelease, ExternalTokens, FinishedKV, HandOff, KVConnector, KVFailure,
                                   KVRequest)


# -- what the driver tells the other ranks (modeling/tp_runner.py's actions; decode_worker/tp_rank.py runs them) --


@dataclass(frozen=True)
class ReserveKV:
    """Expect the request's transfer of ``num_tokens`` positions into ``blocks`` (the first ``cached_blocks``
    hold their KV already); ``slot`` numbers it in outcome reports."""

    request_id: str
    slot: int
    num_tokens: int
    blocks: tuple[int, ...]
    cached_blocks: int


@dataclass(frozen=True)
class ReleaseKV:
    """Stop expecting the request's transfer."""

    request_id: str


@dataclass(frozen=True)
class SyncKV:
    """Poll the receiver and report finished and failed transfers' slots (``kv_transfer/rank_sync.py``)."""


class GivenBlocks:
    """A ``KVReceiver``'s ``BlockReserver`` that reserves nothing: it hands the receiver the blocks its owner
    allocated for a transfer (``give``) when the receiver registers that transfer.

    ``refuse_unknown``: a transfer nobody gave blocks for is refused (the driver: no request waits for it
    here); otherwise it is answered BUSY until the blocks come (a follower rank, told by the driver).
    ``on_release``: who frees a failed or cancelled transfer's blocks, once no bytes are in flight (None: the
    driver frees them, for a follower rank)."""

    def __init__(self, refuse_unknown: bool = False, on_release: Callable[[str], None] | None = None):
        self._given: dict[str, list[int]] = {}
        self._refuse_unknown = refuse_unknown
        self._on_release = on_release

    def give(self, request_id: str, blocks: list[int]) -> None:
        self._given[request_id] = list(blocks)

    def take_back(self, request_id: str) -> None:
        """The blocks given for ``request_id`` were not taken (the receiver refused the transfer)."""
        self._given.pop(request_id, None)

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        blocks = self._given.pop(request_id, None)
        if blocks is None and self._refuse_unknown:
            raise InvalidRequestError("request_id", f"{request_id!r} is not waiting for KV on this worker")
        return blocks

    def release_reservation(self, request_id: str) -> None:
        if self._on_release is not None:
            self._on_release(request_id)


class KVInbox(KVConnector):
    """The transfers a decode instance expects, on each of its ranks, and their outcomes."""

    def __init__(self, cache: PagedKVCache, instance_id: str, model: ModelConfig, fingerprint: KVFingerprint,
                 heads: HeadRange, transfer: TransferConfig, ranks: FollowerRanks | None,
                 on_release: Callable[[str], None]):
        """``on_release(request_id)``: the transfer into that request's blocks failed or was cancelled and no
        bytes are in flight any more: the owner frees them (and drops the request)."""
        self._model = model
        self._block_size = cache.spec.block_size
        self._ranks = ranks
        self._size = 1 if ranks is None else ranks.size
        self._on_release = on_release
        self._given = GivenBlocks(refuse_unknown=True, on_release=on_release)
        self.receiver = KVReceiver(cache, self._given, rank_peer_id(instance_id, 0, self._size), fingerprint, heads,
                                   transfer)
        # TP: the slot of each transfer in flight, and which followers finished it
        self._outcomes = None if ranks is None else FollowerOutcomes(ranks.size)
        self._arrived: dict[str, ReceivedKV] = {}  # TP: complete on this rank, waiting on the others

    def connect(self, prefill_id: str, rendezvous: Rendezvous, generation: int = 0, prefill_tp: int = 1) -> None:
        """Form this rank's KV channels with a prefill instance of ``prefill_tp`` ranks: one per prefill rank
        holding heads this rank receives (blocks until they join; the other ranks connect on their own)."""
        for r in peer_ranks(self._model.num_key_value_heads, prefill_tp, self._size, 0, sending=False):
            self.receiver.connect(rank_peer_id(prefill_id, r, prefill_tp), rendezvous, generation)

    # -- scheduler side ---------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: KVRequest, num_computed_tokens: int) -> ExternalTokens:
        """Every position not cached here comes from the sender, between steps."""
        return ExternalTokens(max(0, request.num_tokens - num_computed_tokens), asynchronous=True)

    def update_state_after_alloc(self, request: KVRequest, blocks: Sequence[int], num_external_tokens: int) -> None:
        """Receive the request's transfer of ``num_tokens`` positions into ``blocks`` (the owner's), the last
        ``num_external_tokens`` of them from the sender (the blocks before hold their KV already: the sender
        skips them), on every rank. Raises ValueError, with nothing registered, when the receiver cannot take
        it."""
        request_id, num_tokens, blocks = request.request_id, request.num_tokens, list(blocks)
        cached_blocks = (num_tokens - num_external_tokens) // self._block_size
        self._given.give(request_id, blocks)
        try:
            self.receiver.reserve(request_id, num_tokens, cached_blocks)
        except ValueError:
            self._given.take_back(request_id)
            raise
        if self._ranks is not None:  # every rank expects its heads in the same blocks
            slot = self._outcomes.track(request_id)
            self._ranks.call(ReserveKV(request_id, slot, num_tokens, tuple(blocks), cached_blocks))
            self._ranks.barrier()

    def request_finished(self, request_id: str, hand_off: HandOff | None = None) -> BlockRelease:
        """Stop expecting the request's transfer, on every rank; its blocks are released (``on_release``) once
        no bytes are in flight into them (the request left while waiting for its KV)."""
        if self._arrived.pop(request_id, None) is None:
            self.receiver.release(request_id)
        else:  # complete here, waiting on other ranks: no bytes are in flight on this rank
            self._on_release(request_id)
        self._forget_on_ranks(request_id)
        return BlockRelease.WHEN_FINISHED

    # -- worker side ------------------------------------------------------------------------------------------

    def save_kv_layer(self, layer: int) -> None:
        """Nothing leaves through the inbox."""

    def wait_for_save(self) -> None:
        """Nothing leaves through the inbox."""

    def get_finished(self) -> FinishedKV[ReceivedKV]:
        """Transfers complete on every rank (``received``: their blocks the owner now fills with a request) and
        transfers that failed. Also answers the receiver's pending handshakes and enforces its timeouts."""
        events = self.receiver.poll()
        failed: list[KVFailure] = []
        completed = events.completed if self._ranks is None else self._complete_on_every_rank(events.completed, failed)
        for f in events.failed:  # the receiver has released the blocks (on_release)
            self._forget_on_ranks(f.request_id)
            failed.append(KVFailure(f.request_id, str(f.error), f.error.retryable))
        return FinishedKV(received=list(completed), failed=failed)

    def _complete_on_every_rank(self, completed: list[ReceivedKV], failed: list[KVFailure]) -> list[ReceivedKV]:
        """TP: the transfers every rank completed (this rank now or earlier); those a follower failed fail
        here too (``failed``), their blocks freed on every rank."""
        for kv in completed:
            self._arrived[kv.request_id] = kv
        if not self._outcomes:
            return []
        self._ranks.call(SyncKV())
        self._outcomes.absorb(self._ranks.exchange())
        for rid, why in self._outcomes.failures():
            self.request_finished(rid)
            failed.append(KVFailure(rid, why, True))
        ready = [rid for rid in self._arrived if self._outcomes.all_done(rid)]
        for rid in ready:
            self._outcomes.forget(rid)
        return [self._arrived.pop(rid) for rid in ready]

    def _forget_on_ranks(self, request_id: str) -> None:
        if self._outcomes is not None and request_id in self._outcomes:
            self._outcomes.forget(request_id)
            self._ranks.call(ReleaseKV(request_id))
