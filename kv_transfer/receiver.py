"""The receiving half of KV transfer (runs in the decode worker).

The decode worker owns the requests and their blocks; the receiver only asks it for room through a
:class:`BlockReserver` (``reserve`` / ``release_reservation``: the decode worker's ``GivenBlocks``, which hands
over the blocks its one allocation call granted, in ``decode_worker/kv_inbox.py``, or :class:`PoolReserver`
over a bare BlockPool), writes the bytes into the cache and reports which
prompts are complete (KV and the first token the prefill worker sampled, which ends every transfer) or
failed. Its ``_reservations`` are transfers in flight, not requests: the owner decides what a request is.

Threads: one per connected prefill instance reads its frames and writes KV straight into the reserved
blocks (gloo recv into the cache slab, or a staging copy when the blocks are scattered or the leg
carries part of this shard's heads). It never touches the pool: a descriptor of a request the owner has
reserved for (``TransferDescriptor.reserved``) is accepted at once into that reservation, found by the
request id (one that comes before the reservation is answered BUSY by poll); reservations asked for in a
handshake, completions and failures are applied by :meth:`KVReceiver.poll` in the owner's thread, which
also enforces ``timeout_s``. Block ids never leave the instance: senders name requests, not blocks.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kv_transfer.blocks import post_discard_region, post_recv_region
from kv_transfer.channel import (DECODE_RANK, DESCRIPTOR, FIRST_TOKEN, PIECES, REPLY, PairChannel, Rendezvous,
                                  TransferConfig)
from kv_transfer.descriptors import (KVFingerprint, PeerHello, Piece, PromptEnd, Reply, TransferDescriptor,
                                     decode_descriptor, decode_pieces, decode_prompt_end, encode)
from kv_transfer.errors import TransferError
from modeling.block_pool import BlockPool, BlockTable
from modeling.dtypes import DTYPES
from modeling.heads import HeadRange
from modeling.kv_cache import PagedKVCache


class BlockReserver(Protocol):
    """Who owns the receiving blocks (the decode worker)."""

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Blocks for ``num_tokens`` positions (at least), or None when there is no room."""
        ...

    def release_reservation(self, request_id: str) -> None:
        """Free a reservation whose transfer failed or was cancelled."""
        ...


class PoolReserver:
    """BlockReserver over a bare BlockPool (tests, benchmarks). Reserves ``extra_tokens`` more positions
    than asked (room to decode into). ``take`` hands a completed reservation's BlockTable to the
    caller, who then owns (and eventually frees) its blocks."""

    def __init__(self, pool: BlockPool, extra_tokens: int = 0):
        self.pool = pool
        self.extra_tokens = extra_tokens
        self.tables: dict[str, BlockTable] = {}

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        if request_id in self.tables:
            raise ValueError(f"request_id: {request_id!r} already holds a reservation")
        if not self.pool.can_allocate(self.pool.blocks_for_tokens(num_tokens + self.extra_tokens)):
            return None
        table = BlockTable(self.pool.block_size)
        table.ensure_capacity(self.pool, num_tokens + self.extra_tokens)
        self.tables[request_id] = table
        return list(table.blocks)

    def release_reservation(self, request_id: str) -> None:
        table = self.tables.pop(request_id, None)
        if table is not None:
            table.release(self.pool)

    def take(self, request_id: str) -> BlockTable:
        return self.tables.pop(request_id)


@dataclass(frozen=True)
class ReceivedKV:
    """A prompt whose KV is complete in ``block_ids`` (the whole reservation; the first
    ``ceil(num_tokens / block_size)`` hold the prompt), with the first token the prefill worker sampled
    (None: the sender had none) and the request's generator state after it (raw bytes; empty: none).
    Ownership of the blocks is now the caller's."""

    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token: int | None = None
    sampler_state: bytes = b""
    state: str = ""  # a live (migration) transfer: the request's state as the sender's owner encoded it
    extra: object = None  # the tensor the sender's owner sent with the end (``KVSender.finish_prompt``), or None


@dataclass(frozen=True)
class ReceiveFailure:
    """A transfer that failed; its reservation has been released."""

    request_id: str
    error: TransferError


@dataclass
class ReceiverEvents:
    completed: list[ReceivedKV] = field(default_factory=list)
    failed: list[ReceiveFailure] = field(default_factory=list)


@dataclass
class _Reservation:
    request_id: str
    num_tokens: int
    block_ids: list[int]
    have_blocks: int = 0  # leading blocks whose KV is here already (a cached prefix): not sent
    heads_done: int = 0  # KV heads of this shard whose legs completed
    state: str = "reserved"  # reserved | receiving | complete | failed | cancelled
    inflight: int = 0  # piece groups with receives posted into these blocks: never free while > 0
    error: TransferError | None = None
    last_progress: float = field(default_factory=time.monotonic)
    legs: set = field(default_factory=set)  # (channel, transfer_id): legs are keyed by channel object


@dataclass
class _RLeg:
    """One incoming leg as the reading thread tracks it (lives until its channel closes)."""

    reservation: _Reservation | None  # None: released, data is drained
    descriptor: TransferDescriptor
    blocks_received: int = 0


class KVReceiver:
    """Receives prompts' KV into a cache (or TP shard holding ``heads``) for one decode instance.

    API for the decode worker (all from its own thread):

    * ``connect(prefill_id, rendezvous)`` — form the pair with a prefill instance (blocks until it joins);
    * ``reserve(request_id, num_tokens, have_blocks=0) -> list[int] | None`` — reserve via the BlockReserver
      and expect this request's KV there (None: no room; the router waits or picks another instance); the
      first ``have_blocks`` blocks already hold their KV (a cached prefix): senders start after them;
    * ``poll() -> ReceiverEvents`` — completed prompts (KV and first token: admit them) and failed ones
      (already released);
    * ``release(request_id)`` — drop a reservation (cancelled request); bytes still in flight are drained.
    """

    def __init__(self, cache: PagedKVCache, reserver: BlockReserver, instance_id: str, fingerprint: KVFingerprint,
                 heads: HeadRange, config: TransferConfig = TransferConfig()):
        fingerprint.check_cache(cache.spec, heads)
        self.cache = cache
        self.reserver = reserver
        self.instance_id = instance_id
        self.fingerprint = fingerprint
        self.heads = heads
        self.config = config
        self._lock = threading.Lock()  # guards _reservations and _legs
        self._reservations: dict[str, _Reservation] = {}
        self._legs: dict[tuple[str, int], _RLeg] = {}
        self._channels: dict[str, PairChannel] = {}
        self._handshakes: "queue.Queue[tuple[str, TransferDescriptor]]" = queue.Queue()
        self._ends: dict[str, tuple[PromptEnd, float]] = {}  # request id -> its PromptEnd, when it arrived
        self._extras: dict[str, torch.Tensor] = {}  # request id -> the tensor sent with its PromptEnd
        self.num_busy = 0  # handshakes answered BUSY (no room yet, or the owner's reservation not made yet)

    # -- owner API --------------------------------------------------------------------------------

    def connect(self, prefill_id: str, rendezvous: Rendezvous, generation: int = 0) -> PeerHello:
        """Form the pair with prefill instance ``prefill_id`` and start reading from it."""
        store = rendezvous.connect(self.config.connect_timeout_s)
        hello = PeerHello(self.instance_id, "decode", self.fingerprint, self.heads)
        channel = PairChannel.open(store, prefill_id, self.instance_id, DECODE_RANK, hello, self.cache.device,
                                   self.config, generation)
        self._channels[prefill_id] = channel
        threading.Thread(target=self._read_loop, args=(prefill_id, channel), name=f"kv-recv-{prefill_id}",
                         daemon=True).start()
        return channel.peer

    def reserve(self, request_id: str, num_tokens: int, have_blocks: int = 0) -> list[int] | None:
        with self._lock:
            if request_id in self._reservations:
                raise ValueError(f"request_id: {request_id!r} already holds a reservation")
        need = -(-num_tokens // self.fingerprint.block_size)
        if not 0 <= have_blocks < need:
            raise ValueError(f"have_blocks: must be in [0, {need}) for {num_tokens} tokens, got {have_blocks}")
        blocks = self.reserver.reserve(request_id, num_tokens)
        if blocks is None:
            return None
        if len(blocks) < need:
            self.reserver.release_reservation(request_id)
            raise ValueError(f"reserver returned {len(blocks)} blocks, {num_tokens} tokens need {need}")
        with self._lock:
            self._reservations[request_id] = _Reservation(request_id, num_tokens, list(blocks), have_blocks)
        return list(blocks)

    def release(self, request_id: str) -> None:
        with self._lock:
            self._ends.pop(request_id, None)
            self._extras.pop(request_id, None)
            res = self._reservations.get(request_id)
            if res is None:
                return
            for key in res.legs:
                if key in self._legs:
                    self._legs[key].reservation = None  # later pieces are drained, not written
            if res.inflight:  # receives are posted into its blocks: poll() frees them once they end
                res.state = "cancelled"
                return
            del self._reservations[request_id]
        self.reserver.release_reservation(request_id)

    def poll(self) -> ReceiverEvents:
        """Answer pending handshakes, hand over completed prompts, release failed ones, enforce timeouts."""
        out = ReceiverEvents()
        self._answer_handshakes()
        now = time.monotonic()
        cancelled = []
        with self._lock:
            for res in list(self._reservations.values()):
                if res.inflight:
                    if res.state == "receiving" and now - res.last_progress > self.config.timeout_s:
                        for ch, _ in res.legs:
                            ch.abort(f"transfer of {res.request_id} stalled")
                    continue
                if res.state == "cancelled":
                    del self._reservations[res.request_id]
                    cancelled.append(res.request_id)
                    continue
                if res.state == "receiving" and now - res.last_progress > self.config.timeout_s:
                    res.state = "failed"
                    res.error = TransferError(f"no KV received for {self.config.timeout_s}s", True, res.request_id)
                    for ch, _ in res.legs:
                        ch.abort(f"transfer of {res.request_id} stalled")
                if res.state == "complete" and res.request_id not in self._ends and \
                        now - res.last_progress > self.config.timeout_s:
                    res.state = "failed"
                    res.error = TransferError(f"KV complete but no first token for {self.config.timeout_s}s", True,
                                              res.request_id)
                if res.state == "complete" and res.request_id in self._ends:
                    del self._reservations[res.request_id]
                    end, _ = self._ends.pop(res.request_id)
                    num_tokens = res.num_tokens if end.num_tokens is None else end.num_tokens
                    out.completed.append(ReceivedKV(res.request_id, tuple(res.block_ids), num_tokens,
                                                    end.first_token, bytes.fromhex(end.sampler_state), end.state,
                                                    self._extras.pop(res.request_id, None)))
                elif res.state == "failed":
                    del self._reservations[res.request_id]
                    self._ends.pop(res.request_id, None)
                    self._extras.pop(res.request_id, None)
                    out.failed.append(ReceiveFailure(res.request_id, res.error))
            # ends of transfers that never got (or lost) a reservation here
            for rid in [r for r, (_, t) in self._ends.items()
                        if r not in self._reservations and now - t > self.config.timeout_s]:
                del self._ends[rid]
                self._extras.pop(rid, None)
        for rid in cancelled + [f.request_id for f in out.failed]:
            self.reserver.release_reservation(rid)
        return out

    def reserved(self) -> list[str]:
        """Request ids holding a reservation that is not yet handed over."""
        with self._lock:
            return list(self._reservations)

    def arriving(self) -> set[str]:
        """Request ids whose KV has begun to arrive and is not handed over yet (its sender is computing or has
        computed the prompt: the first token may come at any moment)."""
        with self._lock:
            return {rid for rid, res in self._reservations.items() if res.state in ("receiving", "complete")}

    def close(self) -> None:
        for ch in self._channels.values():
            ch.abort("receiver closed")

    # -- handshakes -------------------------------------------------------------------------------

    def _on_descriptor(self, peer: str, channel: PairChannel, desc: TransferDescriptor) -> None:
        """Reading thread: validate; accept into the owner's reservation for the request now, or queue for
        poll() to ask the owner for room."""
        try:
            self.fingerprint.require_same(desc.fingerprint, desc.request_id)
            if not self.heads.contains(desc.heads):
                raise TransferError(f"heads [{desc.heads.start}, {desc.heads.end}) are not in this shard "
                                    f"[{self.heads.start}, {self.heads.end})", False, desc.request_id)
        except TransferError as err:
            self._reply(channel, Reply("refuse", desc.transfer_id, reason=str(err), retryable=err.retryable))
            return
        with self._lock:
            res = self._reservations.get(desc.request_id)
            if not desc.reserved or res is None:  # poll() asks the owner for room, or says BUSY until it holds it
                self._handshakes.put((channel, desc))
                return
            problem = self._check_reservation(res, desc)
            if problem is None:
                self._register_leg(channel, res, desc)
        if problem is not None:
            self._reply(channel, Reply("refuse", desc.transfer_id, reason=problem, retryable=False))
        else:
            self._reply(channel, Reply("accept", desc.transfer_id, skip_blocks=res.have_blocks))

    def _check_reservation(self, res: _Reservation | None, desc: TransferDescriptor) -> str | None:
        if res is None or res.state not in ("reserved", "receiving"):
            return f"request {desc.request_id!r}: no reservation on {self.instance_id}"
        if desc.num_tokens != res.num_tokens:
            return f"request {desc.request_id!r}: num_tokens {desc.num_tokens} != reserved {res.num_tokens}"
        for key in res.legs:
            other = self._legs.get(key)
            if other is not None and other.descriptor.heads.intersect(desc.heads) is not None:
                return f"request {desc.request_id!r}: heads [{desc.heads.start}, {desc.heads.end}) already in transfer"
        return None

    def _register_leg(self, channel: PairChannel, res: _Reservation, desc: TransferDescriptor) -> None:
        """Under the lock."""
        res.state = "receiving"
        res.last_progress = time.monotonic()
        res.legs.add((channel, desc.transfer_id))
        self._legs[(channel, desc.transfer_id)] = _RLeg(res, desc, blocks_received=res.have_blocks)

    def _answer_handshakes(self) -> None:
        """Owner thread: reserve for descriptors of requests not reserved for yet (BUSY when full); a
        descriptor that says the owner reserved for its request, but came before the reservation did (the
        router contacts both instances at once), is answered BUSY: the sender asks again shortly."""
        while True:
            try:
                channel, desc = self._handshakes.get_nowait()
            except queue.Empty:
                return
            with self._lock:
                res = self._reservations.get(desc.request_id)
            if res is None and desc.reserved:
                self.num_busy += 1
                self._reply(channel, Reply("busy", desc.transfer_id, retryable=True))
                continue
            if res is None:
                try:
                    blocks = self.reserve(desc.request_id, desc.num_tokens)
                except ValueError as err:  # e.g. the request id is already live on this worker
                    self._reply(channel, Reply("refuse", desc.transfer_id, reason=str(err)))
                    continue
                if blocks is None:
                    self.num_busy += 1
                    self._reply(channel, Reply("busy", desc.transfer_id, retryable=True))
                    continue
                with self._lock:
                    res = self._reservations[desc.request_id]
            with self._lock:
                problem = self._check_reservation(res, desc)
                if problem is None:
                    self._register_leg(channel, res, desc)
            if problem is None:
                self._reply(channel, Reply("accept", desc.transfer_id, skip_blocks=res.have_blocks))
            else:
                self._reply(channel, Reply("refuse", desc.transfer_id, reason=problem))

    def _reply(self, channel: PairChannel, reply: Reply) -> None:
        try:
            channel.send_frame(REPLY, encode(reply))
        except TransferError:
            pass  # the reading thread sees the broken channel and fails its legs

    # -- the reading thread -----------------------------------------------------------------------

    def _read_loop(self, peer: str, channel: PairChannel) -> None:
        try:
            while True:
                kind, payload = channel.recv_frame()
                if kind == DESCRIPTOR:
                    self._on_descriptor(peer, channel, decode_descriptor(payload))
                elif kind == PIECES:
                    self._receive_group(peer, channel, decode_pieces(payload))
                elif kind == FIRST_TOKEN:
                    end = decode_prompt_end(payload)
                    extra = None
                    if end.extra_shape:  # the tensor follows the frame on the data path
                        extra = torch.empty(end.extra_shape, dtype=DTYPES[end.extra_dtype], device=channel.device)
                        channel.recv_data(extra)
                        extra = extra.to(self.cache.device)  # staged in host memory when gloo carried it
                    with self._lock:
                        if extra is not None:
                            self._extras[end.request_id] = extra
                        self._ends[end.request_id] = (end, time.monotonic())
                        leg = self._legs.get((channel, end.transfer_id))
                    if leg is not None and leg.descriptor.live:
                        self._end_live_leg(peer, channel, leg, end)
                else:
                    raise TransferError(f"protocol error: unexpected frame kind {kind}", retryable=True)
        except TransferError as err:
            channel.abort(str(err))
            self._fail_channel(peer, channel, err)
        except Exception as err:  # noqa: BLE001 - a malformed frame must fail the channel, not hang it
            failure = TransferError(f"protocol error from {peer}: {err!r}", retryable=True)
            channel.abort(str(failure))
            self._fail_channel(peer, channel, failure)

    def _receive_group(self, peer: str, channel: PairChannel, pieces: list[Piece]) -> None:
        """Receive each layer of each piece (wire order: layer-major, K then V), then acknowledge legs."""
        with self._lock:
            legs = [self._legs.get((channel, p.transfer_id)) for p in pieces]
        for leg, p in zip(legs, pieces):
            if leg is None or p.block_start != leg.blocks_received or \
                    p.block_start + p.block_count > leg.descriptor.num_blocks:
                raise TransferError(f"protocol error: unexpected piece {p}", retryable=True)
        # Post every receive of the group first (the sender posts its sends layer by layer as the
        # forward pass writes them), then wait in wire order: layer-major, piece, K then V.
        with self._lock:
            targets = [leg.reservation if leg.reservation is not None and leg.reservation.state == "receiving"
                       else None for leg in legs]
            for res in {id(r): r for r in targets if r is not None}.values():
                res.inflight += 1
        try:
            self._receive_pieces(channel, legs, pieces, targets)
        finally:
            with self._lock:
                for res in {id(r): r for r in targets if r is not None}.values():
                    res.inflight -= 1
        for leg, p in zip(legs, pieces):
            leg.blocks_received += p.block_count
            if leg.blocks_received == leg.descriptor.num_blocks and not leg.descriptor.live:
                self._finish_leg(peer, channel, leg)

    def _end_live_leg(self, peer: str, channel: PairChannel, leg: _RLeg, end: PromptEnd) -> None:
        """A live leg's end: every block holding its ``num_tokens`` positions came before it (frames and
        their data arrive in order on the channel)."""
        need = -(-(end.num_tokens or 0) // self.fingerprint.block_size)
        if end.num_tokens is None or leg.blocks_received < need or end.num_tokens > leg.descriptor.num_tokens:
            raise TransferError(f"protocol error: live transfer of {end.request_id!r} ended at "
                                f"{end.num_tokens} positions with {leg.blocks_received} blocks received", True)
        self._finish_leg(peer, channel, leg)

    def _receive_pieces(self, channel: PairChannel, legs: list[_RLeg], pieces: list[Piece],
                        targets: list[_Reservation | None]) -> None:
        kv = self.cache.kv
        posted = []
        for layer in range(self.fingerprint.num_layers):
            for leg, p, res in zip(legs, pieces, targets):
                for kv_index in (0, 1):
                    if res is None:
                        region = post_discard_region(channel, kv, p.block_count, leg.descriptor.heads.size)
                    else:
                        blocks = res.block_ids[p.block_start : p.block_start + p.block_count]
                        heads = self.heads.local(leg.descriptor.heads)
                        region = post_recv_region(channel, kv, layer, kv_index, blocks, heads)
                    posted.append((res, region))
        for res, (work, finish) in posted:
            channel.wait_recv(work)
            finish()
            if res is not None:
                res.last_progress = time.monotonic()
        if kv.device.type == "cuda":  # NCCL receives are stream-ordered: make the bytes final before DONE
            torch.cuda.current_stream(kv.device).synchronize()

    def _finish_leg(self, peer: str, channel: PairChannel, leg: _RLeg) -> None:
        # DONE first: once the owner sees the prompt complete it may act on it (even exit); the
        # sender must not be left waiting for an acknowledgement of bytes that did arrive.
        self._reply(channel, Reply("done", leg.descriptor.transfer_id))
        with self._lock:
            self._legs.pop((channel, leg.descriptor.transfer_id), None)
            res = leg.reservation
            if res is not None and res.state == "receiving":
                res.heads_done += leg.descriptor.heads.size
                if res.heads_done == self.heads.size:
                    res.state = "complete"

    def _fail_channel(self, peer: str, channel: PairChannel, err: TransferError) -> None:
        with self._lock:
            for key in [k for k in self._legs if k[0] is channel]:
                res = self._legs.pop(key).reservation
                if res is not None and res.state in ("reserved", "receiving"):
                    res.state = "failed"
                    res.error = TransferError(f"transfer from {peer} failed: {err}", True, res.request_id)
