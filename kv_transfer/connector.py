"""The prefill -> decode KV transfer as a KV connector (:mod:`modeling.kv_connector`): its sending side, over a
:class:`~kv_transfer.sender.KVSender`.

Scheduler side (the prefill worker's loop): a prompt's transfer begins once its blocks are allocated
(``update_state_after_alloc``: a descriptor to every decode rank that holds some of its heads) and ends with its
first token (``request_finished``: a FIRST_TOKEN frame); its blocks stay until the decode side has
acknowledged every byte (``BlockRelease.WHEN_FINISHED``).

Worker side (every rank): ``start_load_kv`` opens the pass's piece group (the blocks each prompt makes final);
the runner's layer hook ``save_kv_layer`` posts a layer's sends as soon as the layer is written; ``wait_for_save``
closes the group; ``get_finished`` polls the sender: acknowledged transfers (their blocks may go) and failed
ones. Not ``layerwise``, a prompt's KV goes out only after its last chunk, every layer at once from
``wait_for_save``.

A tensor-parallel prefill instance runs one :class:`TransferConnector` per rank, each sending its own heads.
The driver's :class:`TPTransferConnector` tells the other ranks what its scheduler side decides, as typed actions
(:class:`BeginTransfer`, :class:`SaveStep`, :class:`FinishTransfer`, :class:`SyncTransfers`; run by
``prefill_worker/tp_rank.py``), and reports a transfer finished once every rank's legs are
(:mod:`kv_transfer.rank_sync`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kv_transfer.channel import Rendezvous
from kv_transfer.rank_sync import FollowerOutcomes, exchange_outcomes
from kv_transfer.sender import KVSender, StreamGroup, TransferStats, leg_targets
from modeling.config import ModelConfig
from modeling.heads import peer_ranks, rank_peer_id
from modeling.kv_connector import (BlockRelease, FinishedKV, HandOff, KVConnector, KVFailure, KVRequest, StepKV)
from modeling.tp_group import TPGroup
from modeling.tp_runner import TPDriverRunner


# -- what the driver of a tensor-parallel instance tells the other ranks (modeling/tp_runner.py's actions) ------


@dataclass(frozen=True)
class BeginTransfer:
    """``update_state_after_alloc`` on every rank: the prompt's ``num_tokens`` positions in ``blocks`` go to
    decode instance ``decode_id`` of ``decode_tp`` ranks; ``slot`` numbers the transfer in outcome reports."""

    request_id: str
    num_tokens: int
    blocks: tuple[int, ...]
    decode_id: str
    decode_tp: int
    reserved: bool
    slot: int


@dataclass(frozen=True)
class SaveStep:
    """``start_load_kv`` on every rank, before the forward the driver announces next: ``final_blocks`` as in
    :class:`~modeling.kv_connector.StepKV`."""

    final_blocks: dict[str, int]


@dataclass(frozen=True)
class FinishTransfer:
    """``request_finished`` on every rank: the prompt's first token and the sampler's state after it (hex)."""

    request_id: str
    first_token: int | None
    sampler_state: str
    state: str


@dataclass(frozen=True)
class WithdrawTransfer:
    """``withdraw_refused`` decided on the driver: every rank drops its legs of the request's transfer."""

    request_id: str


@dataclass(frozen=True)
class SyncTransfers:
    """Every rank polls its sender and reports its finished and failed transfers' slots
    (:func:`~kv_transfer.rank_sync.exchange_outcomes`)."""


# -- one rank ---------------------------------------------------------------------------------------------------


class TransferConnector(KVConnector):
    """Rank ``rank`` of a ``tp``-rank prefill instance sending its KV heads to decode instances.

    ``layerwise``: each layer's KV goes out as soon as the forward wrote it (else every layer after the pass)."""

    def __init__(self, sender: KVSender, model: ModelConfig, rank: int = 0, tp: int = 1, layerwise: bool = True):
        self.sender = sender
        self.layerwise = layerwise
        self._model = model
        self._rank, self._tp = rank, tp
        self._decode_tp: dict[str, int] = {}  # decode instance -> its tensor-parallel degree
        self._open: dict[str, int] = {}  # transfers begun here, not yet reported by get_finished -> their blocks
        self._step: StepKV | None = None  # the pass under way (start_load_kv .. wait_for_save)
        self._group: StreamGroup | None = None

    # -- control ----------------------------------------------------------------------------------------------

    def connect(self, decode_id: str, rendezvous: Rendezvous, generation: int = 0, decode_tp: int = 1) -> None:
        """Form this rank's KV channels to a decode instance of ``decode_tp`` ranks: one per decode rank it sends
        heads to (blocks until their receivers join)."""
        for r in peer_ranks(self._model.num_key_value_heads, self._tp, decode_tp, self._rank, sending=True):
            self.sender.connect(rank_peer_id(decode_id, r, decode_tp), rendezvous, generation)
        self._decode_tp[decode_id] = decode_tp

    def decode_tp(self, decode_id: str) -> int:
        """The tensor-parallel degree of a decode instance this rank connected to (1 if unknown)."""
        return self._decode_tp.get(decode_id, 1)

    def transferring(self, request_id: str) -> bool:
        """This rank's legs of the request's transfer are under way."""
        return self.sender.transferring(request_id)

    def pending(self) -> int:
        """Transfers not yet acknowledged by every receiver of this rank's legs."""
        return self.sender.pending()

    @property
    def stats(self) -> TransferStats:
        return self.sender.stats

    # -- scheduler side ---------------------------------------------------------------------------------------

    def update_state_after_alloc(self, request: KVRequest, blocks: Sequence[int], num_external_tokens: int) -> None:
        """Begin the transfer of a prompt with a peer (none: nothing to send). Raises TransferError (a
        KVConnectorError) when a decode rank it goes to has no working channel."""
        peer = request.peer
        if peer is None:
            return
        decode_tp = peer.ranks if peer.ranks is not None else self.decode_tp(peer.instance_id)
        targets = leg_targets(self._model, self._rank, self._tp, peer.instance_id, decode_tp, peer.reserved)
        if targets:  # none: a replica of this rank's heads sends them
            self.sender.begin(request.request_id, request.num_tokens, list(blocks), targets)
            self._open[request.request_id] = -(-request.num_tokens // self.sender.fingerprint.block_size)

    def request_finished(self, request_id: str, hand_off: HandOff | None = None) -> BlockRelease:
        """End the prompt's transfer with its first token (every receiver hands the prompt on only once this has
        arrived); its blocks go once ``get_finished`` reports it. A transfer under way ends only with a
        hand-off (ValueError otherwise)."""
        if request_id not in self._open:
            return BlockRelease.NOW
        if hand_off is None:
            raise ValueError(f"hand_off: the transfer of {request_id!r} is under way; it ends with the first token")
        self.sender.finish_prompt(request_id, hand_off.first_token, hand_off.sampler_state, state=hand_off.state)
        return BlockRelease.WHEN_FINISHED

    def withdraw_refused(self, min_s: float) -> list[str]:
        """Fail the transfers every receiver of which has answered BUSY (no room) for ``min_s`` seconds: the
        request runs again, its prompt's full blocks still cached here."""
        withdrawn = [rid for rid in self.sender.refused(min_s)
                     if self.sender.withdraw(rid, f"withdrawn: its decode instance had no room for {min_s:g} s "
                                                  "while the prefill instance needed its blocks")]
        return withdrawn

    def drop(self, request_id: str) -> None:
        """Forget this rank's legs of a transfer the driver withdrew."""
        self.sender.cancel(request_id)
        self._open.pop(request_id, None)

    # -- worker side ------------------------------------------------------------------------------------------

    def start_load_kv(self, step: StepKV) -> None:
        """Nothing loads here; open the pass's piece group when streaming layer by layer."""
        self._step = step
        self._group = self.sender.open_group(self._ready(step)) if self.layerwise else None

    def save_kv_layer(self, layer: int) -> None:
        if self._group is not None:
            self._group.send_layer(layer)

    def wait_for_save(self) -> None:
        step, group = self._step, self._group
        self._step = self._group = None
        if step is None:
            return
        if group is None:  # not layer by layer: every layer now
            group = self.sender.open_group(self._ready(step))
            for layer in range(self._model.num_hidden_layers):
                group.send_layer(layer)
        group.close()

    def get_finished(self) -> FinishedKV:
        events = self.sender.poll()
        failed = [KVFailure(f.request_id, str(f.error), f.error.retryable) for f in events.failed]
        for rid in [*events.done, *(f.request_id for f in failed)]:
            self._open.pop(rid, None)
        return FinishedKV(sent=list(events.done), failed=failed)

    def _ready(self, step: StepKV) -> dict[str, int]:
        """The blocks of each prompt to send after this pass (``KVSender.open_group``): its final ones, or, not
        layer by layer, none before its last chunk."""
        if self.layerwise:
            return dict(step.final_blocks)
        return {rid: n if n >= self._open.get(rid, n + 1) else 0 for rid, n in step.final_blocks.items()}


# -- the driver of a tensor-parallel instance -------------------------------------------------------------------


class TPTransferConnector(KVConnector):
    """Rank 0's connector on a tensor-parallel prefill instance: its own rank's :class:`TransferConnector`, the
    other ranks told of every scheduler-side decision, and a transfer finished once every rank's legs are (one
    that fails on any rank fails)."""

    def __init__(self, local: TransferConnector, runner: TPDriverRunner, group: TPGroup):
        self.local = local
        self._runner = runner
        self._group = group
        self._outcomes = FollowerOutcomes(group.size)  # transfers the other ranks are still sending
        self._sent_here: set[str] = set()  # done on this rank, waiting on the others

    @property
    def sender(self) -> KVSender:
        return self.local.sender

    @property
    def stats(self) -> TransferStats:
        return self.local.stats

    def connect(self, decode_id: str, rendezvous: Rendezvous, generation: int = 0, decode_tp: int = 1) -> None:
        """This rank's channels (the other ranks form theirs as the controller tells them)."""
        self.local.connect(decode_id, rendezvous, generation, decode_tp)

    def pending(self) -> int:
        """Transfers not yet acknowledged by every receiving rank."""
        return self.local.pending() + len(self._sent_here)

    # -- scheduler side ---------------------------------------------------------------------------------------

    def update_state_after_alloc(self, request: KVRequest, blocks: Sequence[int], num_external_tokens: int) -> None:
        self.local.update_state_after_alloc(request, blocks, num_external_tokens)  # raises: no rank is told
        peer = request.peer
        if peer is None:
            return
        decode_tp = peer.ranks if peer.ranks is not None else self.local.decode_tp(peer.instance_id)
        slot = self._outcomes.track(request.request_id)
        self._runner.call(BeginTransfer(request.request_id, request.num_tokens, tuple(blocks), peer.instance_id,
                                        decode_tp, peer.reserved, slot))

    def request_finished(self, request_id: str, hand_off: HandOff | None = None) -> BlockRelease:
        release = self.local.request_finished(request_id, hand_off)
        if request_id not in self._outcomes:
            return release
        if hand_off is not None:
            state = hand_off.sampler_state.hex()
            self._runner.call(FinishTransfer(request_id, hand_off.first_token, state, hand_off.state))
        return BlockRelease.WHEN_FINISHED

    def withdraw_refused(self, min_s: float) -> list[str]:
        """This rank's refused transfers withdrawn (its receivers stand for the decode instance's room), and every
        other rank told to drop its legs of them."""
        withdrawn = self.local.withdraw_refused(min_s)
        for rid in withdrawn:
            self._runner.call(WithdrawTransfer(rid))
        return withdrawn

    # -- worker side (this rank's; the others run theirs as told) ----------------------------------------------

    def start_load_kv(self, step: StepKV) -> None:
        if step.final_blocks:
            self._runner.call(SaveStep(dict(step.final_blocks)))
        self.local.start_load_kv(step)

    def save_kv_layer(self, layer: int) -> None:
        self.local.save_kv_layer(layer)

    def wait_for_save(self) -> None:
        self.local.wait_for_save()

    def get_finished(self) -> FinishedKV:
        """The transfers every rank has finished (this rank's now or earlier); a transfer any rank failed fails
        (its blocks are freed once; the other ranks' legs fail or drain on their own)."""
        here = self.local.get_finished()
        self._sent_here.update(here.sent)
        failed = list(here.failed)
        for f in failed:
            self._outcomes.forget(f.request_id)
        if not self._outcomes:
            return FinishedKV(failed=failed)
        self._runner.call(SyncTransfers())
        self._outcomes.absorb(exchange_outcomes(self._group, [], []))
        failed_here = {f.request_id for f in failed}
        for rid, why in self._outcomes.failures():
            self._outcomes.forget(rid)
            self._sent_here.discard(rid)
            if rid not in failed_here:
                failed.append(KVFailure(rid, why, True))
        sent = [rid for rid in self._sent_here if self._outcomes.all_done(rid)]
        for rid in sent:
            self._outcomes.forget(rid)
            self._sent_here.discard(rid)
        return FinishedKV(sent=sent, failed=failed)
