"""The sending half of KV transfer (runs in the prefill worker).

Life of one transfer (one prompt; one *leg* per receiving decode rank):

    begin()        -> DESCRIPTOR to each receiver            (leg: hello)
    reply ACCEPT   -> pieces may flow, from the first block the receiver does not hold already
                                                             (leg: accepted)   BUSY -> re-ask later
    open_group()   -> PIECES frame per channel, then send_layer(i) after layer i is written
    flush()        -> pieces whose blocks were ready before the leg was accepted, all layers at once
    finish_prompt() -> FIRST_TOKEN frame to each receiver (the first token and the sampler's state)
    reply DONE     -> every byte is in the receiver's cache  (leg: done)
    all legs done and every send of the transfer completed (FIRST_TOKEN frames too) -> done; blocks may go

A *live* transfer (``begin(live=True)``: a running request migrating between decode instances) announces
the capacity reserved at the receiver, then sends its blocks in rounds as the owner reports them final
(``extend``), and ends with ``finish_prompt(num_tokens=..., state=...)`` after the last round.

Threads: the owner (prefill loop) posts every send, in protocol order; per channel, a reply thread
reads the receiver's frames and a completion thread waits for posted sends in FIFO order (gloo
completes a send once the peer has posted its recv). Threads only record events; the owner applies
them in :meth:`KVSender.poll`, which also enforces ``timeout_s``: a leg with no progress for that long
fails, its channel is aborted (the peer sees it at once) and the transfer is reported as a retryable
:class:`TransferError`.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass, field


from kv_transfer.blocks import send_region
from kv_transfer.channel import (DESCRIPTOR, FIRST_TOKEN, PIECES, PREFILL_RANK, REPLY, PairChannel, PendingSend,
                                  Rendezvous, TransferConfig)
from kv_transfer.descriptors import (KVFingerprint, PeerHello, Piece, PromptEnd, Reply, TransferDescriptor,
                                     decode_reply, encode)
from kv_transfer.errors import TransferError
from modeling.config import ModelConfig
from modeling.dtypes import DTYPE_NAMES
from modeling.heads import HeadRange, legs_from, plan_transfer, rank_peer_id
from modeling.kv_cache import PagedKVCache


@dataclass(frozen=True)
class LegTarget:
    """Where one leg goes: decode instance ``peer``, carrying global ``heads``; ``reserved``: the peer already
    holds room for the request (``TransferDescriptor.reserved``)."""

    peer: str
    heads: HeadRange
    reserved: bool = False


def leg_targets(config: ModelConfig, rank: int, tp: int, decode_id: str, decode_tp: int,
                reserved: bool) -> list[LegTarget]:
    """The legs sending rank ``rank`` of ``tp`` sends for one request to an instance of ``decode_tp`` ranks (the
    N x M plan of :mod:`modeling.heads`); ``reserved``: that instance holds room for the request already. May
    be empty: with replicated heads, some sending ranks send nothing."""
    legs = legs_from(plan_transfer(config.num_key_value_heads, tp, decode_tp), rank)
    return [LegTarget(rank_peer_id(decode_id, leg.dst_rank, decode_tp), leg.heads, reserved) for leg in legs]


@dataclass(frozen=True)
class TransferFailure:
    """A transfer that will not complete; its blocks have been (or are being) released."""

    request_id: str
    error: TransferError


@dataclass
class SenderEvents:
    done: list[str] = field(default_factory=list)  # request ids every receiver acknowledged, every send completed
    failed: list[TransferFailure] = field(default_factory=list)


@dataclass
class TransferStats:
    """Cumulative counts of one sender since it started (a restarted instance starts again at 0):
    transfers every receiver acknowledged, transfers that failed, the KV bytes the acknowledged ones
    carried (this sender's heads, K and V of every layer) and their seconds from ``begin`` to the last
    acknowledgement."""

    completed: int = 0
    failed: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class _Leg:
    request_id: str
    peer: str
    descriptor: TransferDescriptor
    heads_local: slice
    state: str = "hello"  # hello | busy | accepted | done | failed
    blocks_sent: int = 0  # counts the leading blocks the receiver held already (``skipped``)
    skipped: int = 0
    sends_pending: int = 0
    last_progress: float = field(default_factory=time.monotonic)
    retry_at: float = 0.0
    refused_since: float | None = None  # the receiver answered BUSY (no room) from then on, never accepting


@dataclass
class _Transfer:
    request_id: str
    num_tokens: int
    src_blocks: list[int]
    legs: list[_Leg]
    ready_blocks: int = 0
    started: float = field(default_factory=time.monotonic)
    live: bool = False  # blocks arrive in rounds (``extend``); a live leg idles between rounds
    ended: bool = False  # finish_prompt was sent


class _PeerLink:
    """A channel plus its reply and completion threads."""

    def __init__(self, channel: PairChannel, events: "queue.Queue[tuple]"):
        self.channel = channel
        self.events = events
        self.completions: "queue.Queue[tuple[PendingSend, _Leg | None] | None]" = queue.Queue()
        self._count_lock = threading.Lock()  # guards _Leg.sends_pending (owner and completion thread)
        name = channel.peer.instance_id
        threading.Thread(target=self._read_replies, name=f"kv-replies-{name}", daemon=True).start()
        threading.Thread(target=self._complete_sends, name=f"kv-sends-{name}", daemon=True).start()

    def _read_replies(self) -> None:
        try:
            while True:
                kind, payload = self.channel.recv_frame()
                if kind != REPLY:
                    raise TransferError(f"protocol error: unexpected frame kind {kind}", retryable=True)
                self.events.put(("reply", self.channel.peer.instance_id, decode_reply(payload)))
        except Exception as err:  # noqa: BLE001 - a malformed frame must fail the channel, not hang it
            failure = err if isinstance(err, TransferError) else TransferError(f"protocol error: {err!r}", True)
            self.channel.abort(str(failure))
            self.events.put(("broken", self.channel.peer.instance_id, failure, self.channel))

    def _complete_sends(self) -> None:
        while True:
            item = self.completions.get()
            if item is None:
                return
            pending, leg = item
            try:
                pending.wait()
            except TransferError as err:
                self.events.put(("broken", self.channel.peer.instance_id, err, self.channel))
                return
            if leg is not None:
                with self._count_lock:
                    leg.sends_pending -= 1
                leg.last_progress = time.monotonic()

    def post(self, pending: PendingSend, leg: _Leg | None) -> None:
        if leg is not None:
            with self._count_lock:
                leg.sends_pending += 1
        self.completions.put((pending, leg))


class KVSender:
    """Sends prompts' KV from one cache (or TP shard holding ``heads``) to decode instances."""

    def __init__(self, cache: PagedKVCache, instance_id: str, fingerprint: KVFingerprint, heads: HeadRange,
                 config: TransferConfig = TransferConfig(), role: str = "prefill"):
        """``role``: what this sender's instance is, as its peers' hellos name it (a decode instance sends
        KV when it migrates requests)."""
        fingerprint.check_cache(cache.spec, heads)
        self.cache = cache
        self.instance_id = instance_id
        self.role = role
        self.fingerprint = fingerprint
        self.heads = heads
        self.config = config
        self._links: dict[str, _PeerLink] = {}
        self._transfers: dict[str, _Transfer] = {}
        self._events: "queue.Queue[tuple]" = queue.Queue()
        self._stash = SenderEvents()  # events applied outside poll(), returned by the next poll()
        self._ids = itertools.count(1)
        self.stats = TransferStats()

    # -- pairs ------------------------------------------------------------------------------------

    def connect(self, decode_id: str, rendezvous: Rendezvous, generation: int = 0) -> PeerHello:
        """Form the pair channel to decode instance ``decode_id`` (blocks until it joins; the decode
        side calls :meth:`KVReceiver.connect` with this instance's id). Returns the peer's hello."""
        store = rendezvous.connect(self.config.connect_timeout_s)
        hello = PeerHello(self.instance_id, self.role, self.fingerprint, self.heads)
        channel = PairChannel.open(store, self.instance_id, decode_id, PREFILL_RANK, hello, self.cache.device,
                                   self.config, generation)
        self._links[decode_id] = _PeerLink(channel, self._events)
        return channel.peer

    def connected(self, decode_id: str) -> bool:
        link = self._links.get(decode_id)
        return link is not None and link.channel.broken is None

    # -- transfers --------------------------------------------------------------------------------

    def begin(self, request_id: str, num_tokens: int, src_blocks: list[int], targets: list[LegTarget],
              live: bool = False) -> None:
        """Announce a prompt's KV (``num_tokens`` positions in ``src_blocks``) to its receivers; ``live``:
        ``num_tokens`` is the capacity reserved at the receivers, and blocks follow through ``extend``.
        Raises TransferError (retryable) if a target has no working channel."""
        if request_id in self._transfers:
            raise ValueError(f"request_id: {request_id!r} is already transferring")
        if not targets:
            raise ValueError("targets: need at least one receiver")
        nblocks = -(-num_tokens // self.fingerprint.block_size)
        if not live and len(src_blocks) < nblocks:
            raise ValueError(f"src_blocks: {num_tokens} tokens need {nblocks} blocks, got {len(src_blocks)}")
        legs = []
        for t in targets:
            if not self.connected(t.peer):
                raise TransferError(f"no working channel to {t.peer}", retryable=True, request_id=request_id)
            desc = TransferDescriptor(request_id, next(self._ids), self.fingerprint, num_tokens, t.heads, t.reserved,
                                      live)
            legs.append(_Leg(request_id, t.peer, desc, self.heads.local(t.heads)))
        self._transfers[request_id] = _Transfer(request_id, num_tokens, list(src_blocks[:nblocks]), legs, live=live)
        for leg in legs:
            self._send_descriptor(leg)

    def open_group(self, ready: dict[str, int]) -> "StreamGroup":
        """Start one forward pass's worth of pieces. ``ready[request_id]``: how many of its blocks
        will hold final KV once this forward has written them (layer by layer). Call
        ``send_layer(i)`` after layer ``i`` is written, then ``close()``."""
        for rid, n in ready.items():
            tr = self._transfers.get(rid)
            if tr is not None:
                tr.ready_blocks = max(tr.ready_blocks, min(n, len(tr.src_blocks)))
        self._await_handshakes([rid for rid, n in ready.items() if n > 0])
        return StreamGroup(self, self._collect_pieces(list(ready)))

    def extend(self, request_id: str, src_blocks: list[int], ready_blocks: int) -> None:
        """Live transfer: the request's blocks now (earlier ones unchanged) and how many of them hold final
        KV; those not yet sent go out at the next ``flush`` / ``poll``."""
        tr = self._transfers[request_id]
        if not tr.live:
            raise ValueError(f"request_id: {request_id!r} is not a live transfer")
        if ready_blocks > len(src_blocks) or ready_blocks < tr.ready_blocks:
            raise ValueError(f"ready_blocks: must be in [{tr.ready_blocks}, {len(src_blocks)}], got {ready_blocks}")
        if ready_blocks > tr.legs[0].descriptor.num_blocks:
            raise ValueError(f"ready_blocks: {ready_blocks} exceeds the {tr.legs[0].descriptor.num_blocks} reserved")
        tr.src_blocks = list(src_blocks)
        tr.ready_blocks = ready_blocks

    def transferring(self, request_id: str) -> bool:
        """A transfer of ``request_id`` is under way here (not yet done, failed or cancelled)."""
        return request_id in self._transfers

    def caught_up(self, request_id: str) -> bool:
        """Every leg accepted, and every ready block sent and taken by its receiver (a live transfer
        between rounds: what is left to send is only what was written since)."""
        tr = self._transfers.get(request_id)
        return tr is not None and all(leg.state == "accepted" and leg.sends_pending == 0 and
                                      leg.blocks_sent >= tr.ready_blocks for leg in tr.legs)

    def refused(self, min_s: float) -> list[str]:
        """Transfers no receiver has accepted, every one of which has answered BUSY (no room) for at least
        ``min_s`` seconds, oldest first: their blocks wait on the receivers' room."""
        now = time.monotonic()
        return [rid for rid, tr in self._transfers.items()
                if all(leg.state in ("busy", "hello") and leg.refused_since is not None and
                       now - leg.refused_since >= min_s for leg in tr.legs)]

    def withdraw(self, request_id: str, reason: str) -> bool:
        """Fail a transfer no receiver has accepted (retryable: the request runs again), reported by the next
        ``poll``; False (nothing done) when one has accepted it, or it is not under way here."""
        tr = self._transfers.get(request_id)
        if tr is None or any(leg.state not in ("busy", "hello") for leg in tr.legs):
            return False
        self._fail(request_id, TransferError(reason, True, request_id), self._stash)
        return True

    def cancel(self, request_id: str) -> bool:
        """Forget a transfer here (its receivers are told by their owner, who drains what is in flight);
        the caller must keep the source blocks unchanged until the channel is done with posted sends, or
        accept that the receiver discards what they carry."""
        return self._transfers.pop(request_id, None) is not None

    def finish_prompt(self, request_id: str, first_token: int | None, sampler_state: bytes = b"",
                      num_tokens: int | None = None, state: str = "", extra=None) -> None:
        """The prompt's last chunk is computed: tell every receiver its first token (None: none) and the
        sampler's state after it. Each receiver hands the prompt to its owner only once this has arrived and
        the KV is complete, so every transfer ends with this call. A live transfer passes ``num_tokens``
        (positions sent; their blocks must have gone out: ``extend`` then ``flush`` first) and the owner's
        ``state``, and may send ``extra``, one more tensor (on the cache's device) the receiver hands over with
        the request. A transfer that already failed is ignored."""
        tr = self._transfers.get(request_id)
        if tr is None:
            return
        if tr.live:
            if num_tokens is None or -(-num_tokens // self.fingerprint.block_size) > tr.ready_blocks:
                raise ValueError(f"num_tokens: a live transfer ends with the positions sent "
                                 f"(at most {tr.ready_blocks} blocks), got {num_tokens}")
            tr.ended = True
        for leg in tr.legs:
            link = self._links[leg.peer]
            end = PromptEnd(request_id, leg.descriptor.transfer_id, first_token, sampler_state.hex(),
                            num_tokens if tr.live else None, state,
                            () if extra is None else tuple(extra.shape),
                            "" if extra is None else DTYPE_NAMES[extra.dtype])
            try:
                # counted in the leg's pending sends: the transfer is done only once this frame is sent
                link.post(link.channel.send_frame(FIRST_TOKEN, encode(end), wait=False), leg)
                if extra is not None:
                    link.post(link.channel.send_data(extra.contiguous().to(link.channel.device)), leg)
            except TransferError as err:
                self._events.put(("broken", leg.peer, err, link.channel))

    def flush(self) -> None:
        """Send, all layers at once, every accepted leg's ready blocks not yet sent."""
        group = StreamGroup(self, self._collect_pieces(list(self._transfers)))
        for layer in range(self.fingerprint.num_layers):
            group.send_layer(layer)
        group.close()

    def poll(self) -> SenderEvents:
        """Apply replies and failures, re-ask BUSY receivers, enforce timeouts, flush backlog.
        Call regularly from the owner thread; returns finished and failed transfers (forgotten here:
        the caller frees the blocks)."""
        out, self._stash = self._stash, SenderEvents()
        while True:
            try:
                self._apply(self._events.get_nowait(), out)
            except queue.Empty:
                break
        for tr in list(self._transfers.values()):
            self._complete_if_done(tr, out)
        self._check_deadlines(out)
        self._retry_busy()
        self.flush()
        return out

    def pending(self) -> int:
        """Transfers not yet finished."""
        return len(self._transfers)

    def close(self) -> None:
        """Abort every channel (pending transfers fail on both ends)."""
        for link in self._links.values():
            link.channel.abort("sender closed")
            link.completions.put(None)

    # -- internals --------------------------------------------------------------------------------

    def _apply(self, event: tuple, out: SenderEvents) -> None:
        if event[0] == "reply":
            self._on_reply(event[1], event[2], out)
        else:
            self._on_broken(event[1], event[2], out, event[3])

    def _await_handshakes(self, request_ids: list[str]) -> None:
        """Wait (at most ``handshake_wait_s``) for the replies to descriptors of requests the receiver holds
        room for already (it answers those at once), so a prompt whose only chunk is about to run can
        stream layer by layer instead of waiting for the next step. Events go to the next poll()."""
        deadline = time.monotonic() + self.config.handshake_wait_s
        while True:
            waiting = [leg for rid in request_ids if rid in self._transfers for leg in self._transfers[rid].legs
                       if leg.state == "hello" and leg.descriptor.reserved]
            left = deadline - time.monotonic()
            if not waiting or left <= 0:
                return
            try:
                self._apply(self._events.get(timeout=left), self._stash)
            except queue.Empty:
                return

    def _send_descriptor(self, leg: _Leg) -> None:
        link = self._links[leg.peer]
        leg.state = "hello"
        leg.last_progress = time.monotonic()
        try:
            link.post(link.channel.send_frame(DESCRIPTOR, encode(leg.descriptor), wait=False), None)
        except TransferError as err:
            self._events.put(("broken", leg.peer, err, link.channel))

    def _collect_pieces(self, request_ids: list[str]) -> dict[str, list[tuple[_Leg, Piece]]]:
        """Per peer, the (leg, piece) pairs covering each accepted leg's ready-but-unsent blocks."""
        by_peer: dict[str, list[tuple[_Leg, Piece]]] = {}
        for rid in request_ids:
            tr = self._transfers.get(rid)
            if tr is None:
                continue
            for leg in tr.legs:
                if leg.state == "accepted" and tr.ready_blocks > leg.blocks_sent:
                    piece = Piece(leg.descriptor.transfer_id, leg.blocks_sent, tr.ready_blocks - leg.blocks_sent)
                    by_peer.setdefault(leg.peer, []).append((leg, piece))
                    leg.blocks_sent = tr.ready_blocks
        return by_peer

    def _on_reply(self, peer: str, reply: Reply, out: SenderEvents) -> None:
        leg = self._find_leg(peer, reply.transfer_id)
        if leg is None:
            return  # a transfer that already failed here
        leg.last_progress = time.monotonic()
        if reply.kind == "accept":
            if leg.state != "accepted":  # the receiver's cached prefix: those blocks are not sent
                tr = self._transfers[leg.request_id]
                leg.skipped = min(max(0, reply.skip_blocks), len(tr.src_blocks) - 1)
                leg.blocks_sent = max(leg.blocks_sent, leg.skipped)
            leg.state = "accepted"
        elif reply.kind == "busy":
            leg.state = "busy"
            leg.retry_at = time.monotonic() + self.config.retry_interval_s
            if leg.refused_since is None:
                leg.refused_since = leg.last_progress
        elif reply.kind == "refuse":
            self._fail(leg.request_id, TransferError(f"refused by {peer}: {reply.reason}", reply.retryable,
                                                     leg.request_id), out)
        elif reply.kind == "done":
            leg.state = "done"
            self._complete_if_done(self._transfers[leg.request_id], out)

    def _complete_if_done(self, tr: _Transfer, out: SenderEvents) -> None:
        """Report ``tr`` done once every receiver acknowledged its KV and every send of it has completed. A
        receiver acknowledges the KV as soon as it is in its cache, which may be before the FIRST_TOKEN frame
        has reached it (a frame longer than FRAME_BYTES takes a second message, which gloo sends only once
        the receiver has read the first and posted a recv for the rest); and a send still posted when the
        pair closes (this instance shutting down once its transfers are done) is lost."""
        if all(lg.state == "done" and lg.sends_pending == 0 for lg in tr.legs):
            del self._transfers[tr.request_id]
            out.done.append(tr.request_id)
            self._count_done(tr)

    def _on_broken(self, peer: str, err: TransferError, out: SenderEvents, channel: PairChannel) -> None:
        link = self._links.get(peer)
        if link is None or link.channel is not channel:
            return  # an older channel to this peer (re-formed since): its transfers already failed
        channel.abort(str(err))
        for tr in list(self._transfers.values()):
            if any(leg.peer == peer for leg in tr.legs):
                self._fail(tr.request_id, TransferError(f"channel to {peer} failed: {err}", True, tr.request_id), out)

    def _check_deadlines(self, out: SenderEvents) -> None:
        now = time.monotonic()
        for tr in list(self._transfers.values()):
            for leg in tr.legs:
                # a live leg between rounds waits on its owner, not on the peer
                finished_sending = tr.ended if tr.live else leg.blocks_sent == len(tr.src_blocks)
                waiting_on_peer = leg.state == "hello" or (
                    leg.state == "accepted" and (leg.sends_pending > 0 or finished_sending))
                if waiting_on_peer and now - leg.last_progress > self.config.timeout_s:
                    channel = self._links[leg.peer].channel
                    channel.abort(f"no progress for {self.config.timeout_s}s")
                    self._on_broken(leg.peer, TransferError(
                        f"{leg.peer} made no progress for {self.config.timeout_s}s", True, tr.request_id), out, channel)
                    break

    def _retry_busy(self) -> None:
        now = time.monotonic()
        for tr in self._transfers.values():
            for leg in tr.legs:
                if leg.state == "busy" and now >= leg.retry_at:
                    self._send_descriptor(leg)

    def _fail(self, request_id: str, err: TransferError, out: SenderEvents) -> None:
        if self._transfers.pop(request_id, None) is not None:
            out.failed.append(TransferFailure(request_id, err))
            self.stats.failed += 1

    def _count_done(self, tr: _Transfer) -> None:
        kv = self.cache.kv  # [layers, 2, num_blocks, block_size, heads, D]
        per_block_head = kv.shape[3] * kv.shape[5] * kv.element_size() * 2 * kv.shape[0]  # K and V, every layer
        self.stats.completed += 1
        blocks = tr.ready_blocks if tr.live else len(tr.src_blocks)  # a live transfer sent only its ready blocks
        self.stats.bytes += sum((blocks - leg.skipped) * (leg.heads_local.stop - leg.heads_local.start)
                                for leg in tr.legs) * per_block_head
        self.stats.seconds += time.monotonic() - tr.started

    def _find_leg(self, peer: str, transfer_id: int) -> _Leg | None:
        for tr in self._transfers.values():
            for leg in tr.legs:
                if leg.peer == peer and leg.descriptor.transfer_id == transfer_id:
                    return leg
        return None


class StreamGroup:
    """Pieces of one forward pass, sent layer by layer (see :meth:`KVSender.open_group`).

    Wire order per channel: one PIECES frame, then for each layer, for each piece, K then V."""

    def __init__(self, sender: KVSender, pieces: dict[str, list[tuple[_Leg, Piece]]]):
        self.sender = sender
        self.pieces = pieces
        self.next_layer = 0
        for peer, items in pieces.items():
            link = sender._links[peer]
            try:
                link.post(link.channel.send_frame(PIECES, encode([p for _, p in items]), wait=False), None)
            except TransferError as err:
                sender._events.put(("broken", peer, err, link.channel))

    @property
    def empty(self) -> bool:
        return not self.pieces

    def send_layer(self, layer: int) -> None:
        """Post layer ``layer`` of every piece (its KV must be written). Layers go in order."""
        if layer != self.next_layer:
            raise ValueError(f"layer: expected {self.next_layer}, got {layer}")
        self.next_layer += 1
        kv = self.sender.cache.kv
        for peer, items in self.pieces.items():
            link = self.sender._links[peer]
            if link.channel.broken is not None:
                continue
            for leg, piece in items:
                tr = self.sender._transfers.get(leg.request_id)
                if tr is None:
                    continue
                blocks = tr.src_blocks[piece.block_start : piece.block_start + piece.block_count]
                try:
                    for kv_index in (0, 1):
                        link.post(send_region(link.channel, kv, layer, kv_index, blocks, leg.heads_local), leg)
                except TransferError as err:
                    self.sender._events.put(("broken", peer, err, link.channel))
                    break

    def close(self) -> None:
        """Check every layer went out; a half-sent group leaves the stream unusable, so abort."""
        if self.pieces and self.next_layer != self.sender.fingerprint.num_layers:
            for peer in self.pieces:
                channel = self.sender._links[peer].channel
                channel.abort("forward pass ended before every layer was sent")
                self.sender._events.put(("broken", peer, TransferError("incomplete piece group", True), channel))
