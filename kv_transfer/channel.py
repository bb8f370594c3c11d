"""Point-to-point channels between one prefill instance and one decode instance.

Each (prefill, decode) pair gets its own 2-rank process group built straight from the controller's
TCP store (``PrefixStore(f"pair/{prefill}/{decode}/{generation}", store)``), so pairs form, break and
re-form independently, without a global world. Rank 0 is the prefill side, rank 1 the decode side.

* control frames (handshakes, piece lists, replies) always go over gloo, as one fixed-size uint8
  message: an int64 header ``[MAGIC, kind, payload_len, 0]`` and the JSON payload (no pickle);
* KV data goes over gloo on CPU, and over NCCL when both ends' caches are on CUDA.

gloo semantics this module relies on (torch 2.x): a ``wait(timeout)`` that times out closes the pair
for good, and a peer that dies makes pending and later operations raise promptly ("Connection closed
by peer"). So a timed wait is used only where a timeout means the transfer has failed, and
:meth:`PairChannel.abort` closes the pair on purpose (waking any thread blocked on it).
"""

from __future__ import annotations

import datetime
import re
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from kv_transfer.descriptors import PeerHello, decode_hello, encode
from kv_transfer.errors import TransferError
from modeling.instance_config import Problems, one_of, positive, raise_first

BACKENDS = ("auto", "gloo", "nccl")

PREFILL_RANK = 0
DECODE_RANK = 1

MAGIC = 0x4B56_5846  # "KVXF"
# frame kinds
HELLO, DESCRIPTOR, PIECES, REPLY, FIRST_TOKEN = 1, 2, 3, 4, 5
_CTRL_TAG, _DATA_TAG, _ABORT_TAG = 0, 1, 7
# A control frame is one message of this size: int64 [MAGIC, kind, payload_len, 0], then the payload.
FRAME_BYTES = 16384
_HEADER_BYTES = 32
# gloo closes a pair whose operation outlives the group timeout: make idle waits effectively unbounded.
_IDLE_TIMEOUT = datetime.timedelta(days=30)


@dataclass(frozen=True)
class Rendezvous:
    """Where pair channels meet: the controller's TCP store (``host:port``)."""

    host: str
    port: int

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("rendezvous.host: must not be empty")
        if not 0 < self.port < 65536:
            raise ValueError(f"rendezvous.port: must be in (0, 65536), got {self.port}")

    def connect(self, timeout_s: float = 60.0) -> TCPStore:
        """A client handle on the store."""
        return TCPStore(self.host, self.port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                        wait_for_workers=False)

    @staticmethod
    def host_store(host: str = "127.0.0.1", port: int = 0) -> tuple[TCPStore, "Rendezvous"]:
        """Start the store (controller side); keep the returned TCPStore alive while pairs form."""
        store = TCPStore(host, port, is_master=True, wait_for_workers=False)
        return store, Rendezvous(host, store.port)


@dataclass(frozen=True)
class TransferConfig:
    """How KV moves between instances (the ``kv_transfer:`` section of the cluster YAML).

    ``backend``: what carries the KV bytes: ``nccl`` (GPU to GPU; both ends' caches must be on CUDA), ``gloo``
    (over TCP; a CUDA cache is staged through host memory) or ``auto`` (NCCL when both caches are on CUDA, else
    gloo); control frames always go over gloo. ``timeout_s``: a transfer with no progress for this long fails
    (retryable) and both ends free its blocks (it must exceed the longest prefill step); ``retry_interval_s``:
    how often a sender re-asks a receiver that answered BUSY; ``connect_timeout_s``: how long forming a pair may
    wait for the peer; ``handshake_wait_s``: how long a forward pass may wait for the ACCEPT of a prompt whose
    blocks were reserved by the router, so that its KV streams during that very pass. ``rendezvous_host``: where
    the controller's store listens (pairs and tensor-parallel groups meet there); ``interface_host``: the
    address this host's gloo binds to (empty: ``rendezvous_host``)."""

    backend: str = "auto"
    timeout_s: float = 30.0
    retry_interval_s: float = 0.05
    connect_timeout_s: float = 60.0
    handshake_wait_s: float = 0.05
    rendezvous_host: str = "127.0.0.1"
    interface_host: str = ""

    def __post_init__(self) -> None:
        raise_first(self.check())

    def check(self) -> Problems:
        errs = one_of("backend", self.backend, BACKENDS)
        errs += positive(self, ("timeout_s", "retry_interval_s", "connect_timeout_s", "handshake_wait_s"))
        if not self.rendezvous_host:
            errs.append(("rendezvous_host", "must not be empty"))
        return errs

    @property
    def bind_host(self) -> str:
        return self.interface_host or self.rendezvous_host


def data_backend(backend: str, peer_backend: str, device: str, peer_device: str) -> str:
    """What carries a pair's KV bytes (``nccl`` or ``gloo``), given each end's ``kv_transfer.backend`` and
    cache device type; TransferError (not retryable) when the ends disagree or NCCL cannot connect them."""
    if {backend, peer_backend} == {"gloo", "nccl"}:
        raise TransferError(f"kv_transfer.backend: this end says {backend}, its peer {peer_backend}", retryable=False)
    if "nccl" in (backend, peer_backend):
        if device != "cuda" or peer_device != "cuda":
            raise TransferError(f"kv_transfer.backend: nccl needs both caches on CUDA; they are on {device} and "
                                f"{peer_device} (use auto or gloo)", retryable=False)
        return "nccl"
    if "gloo" in (backend, peer_backend):
        return "gloo"
    return "nccl" if device == peer_device == "cuda" else "gloo"


def pair_prefix(prefill_id: str, decode_id: str, generation: int = 0) -> str:
    return f"pair/{prefill_id}/{decode_id}/{generation}"


class PairChannel:
    """One formed pair. Sends are serialised by a lock (a frame is two messages); each direction's
    receives are posted by a single thread, so messages are consumed in the order they were sent."""

    def __init__(self, ctrl: ProcessGroupGloo, data: dist.ProcessGroup, rank: int, device: torch.device,
                 peer: PeerHello, config: TransferConfig):
        self.ctrl = ctrl
        self.data = data
        self.rank = rank
        self.peer_rank = 1 - rank
        self.device = device  # where data tensors live (the cache's device)
        self.peer = peer
        self.config = config
        self.broken: str | None = None  # why the channel is unusable, once it is
        self.store: dist.Store | None = None  # the client store the groups were built from (kept alive)
        self._send_lock = threading.Lock()
        self._next_frame: tuple[dist.Work, torch.Tensor] | None = None  # pre-posted frame recv (one reader)
        self._timeout = datetime.timedelta(seconds=config.timeout_s)

    # -- forming ----------------------------------------------------------------------------------

    @staticmethod
    def open(store: TCPStore, prefill_id: str, decode_id: str, rank: int, hello: PeerHello,
             device: torch.device, config: TransferConfig, generation: int = 0) -> "PairChannel":
        """Form the pair (blocks until the peer joins) and exchange :class:`PeerHello`.

        Raises FingerprintMismatchError on both ends if their KV layouts differ."""
        prefix = PrefixStore(pair_prefix(prefill_id, decode_id, generation), store)
        device = torch.device(device)
        prefix.set(f"device/{rank}", f"{device.type}/{config.backend}")
        prefix.wait([f"device/{1 - rank}"], datetime.timedelta(seconds=config.connect_timeout_s))
        peer_device, peer_backend = prefix.get(f"device/{1 - rank}").decode().split("/")
        use_nccl = data_backend(config.backend, peer_backend, device.type, peer_device) == "nccl"
        opts = ProcessGroupGloo._Options()
        opts._timeout = _IDLE_TIMEOUT
        opts._devices = [ProcessGroupGloo.create_device(hostname=config.bind_host)]
        ctrl = ProcessGroupGloo(PrefixStore("gloo", prefix), rank, 2, opts)
        data: dist.ProcessGroup = _nccl_group(PrefixStore("nccl", prefix), rank, device) if use_nccl else ctrl
        # gloo carries host tensors: a CUDA cache's regions are staged through host memory (kv_transfer/blocks.py)
        chan = PairChannel(ctrl, data, rank, device if use_nccl else torch.device("cpu"), hello, config)
        chan.store = store
        # gloo: a send completes once the peer posts the matching recv, so post ours, then receive.
        sent = chan.send_frame(HELLO, encode(hello), wait=False)
        kind, payload = chan.recv_frame(timeout_s=config.connect_timeout_s)
        sent.wait()
        if kind != HELLO:
            chan.abort("protocol error: expected HELLO")
            raise TransferError(f"peer sent frame kind {kind} before HELLO", retryable=True)
        chan.peer = decode_hello(payload)
        try:
            hello.fingerprint.require_same(chan.peer.fingerprint)
        except TransferError:
            chan.broken = "fingerprint mismatch"
            raise
        return chan

    # -- control frames ---------------------------------------------------------------------------

    def send_frame(self, kind: int, payload: bytes, wait: bool = True) -> "PendingSend":
        """Send a control frame. gloo completes a send only once the peer has posted the matching recv;
        with ``wait=False`` the caller waits on the returned handle later.

        A frame is one fixed-size uint8 message (header + payload): a receiver can keep its recv
        posted ahead of time, which saves a round trip per frame. Payloads longer than the fixed part
        continue in a second message."""
        self._check()
        frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
        frame[:_HEADER_BYTES].view(torch.int64).copy_(torch.tensor([MAGIC, kind, len(payload), 0]))
        inline = payload[: FRAME_BYTES - _HEADER_BYTES]
        if inline:
            frame[_HEADER_BYTES : _HEADER_BYTES + len(inline)] = torch.frombuffer(bytearray(inline), dtype=torch.uint8)
        tensors = [frame]
        if len(payload) > len(inline):
            tensors.append(torch.frombuffer(bytearray(payload[len(inline):]), dtype=torch.uint8))
        with self._send_lock:
            works = [self._post(self.ctrl.send, t, _CTRL_TAG) for t in tensors]
        pending = PendingSend(self, works, tensors)
        if wait:
            pending.wait()
        return pending

    def recv_frame(self, timeout_s: float | None = None) -> tuple[int, bytes]:
        """Next control frame (kind, payload). ``timeout_s`` None waits while the peer is alive;
        a timeout breaks the channel (gloo closes the pair)."""
        self._check()
        timeout = _IDLE_TIMEOUT if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        work, frame = self._next_frame if self._next_frame is not None else self._post_frame_recv()
        self._next_frame = None
        self._wait(work, timeout)
        magic, kind, length, _ = frame[:_HEADER_BYTES].view(torch.int64).tolist()
        if magic != MAGIC or not 0 <= length < 1 << 40:
            self.abort("protocol error: bad frame header")
            raise TransferError("protocol error: bad frame header", retryable=True)
        inline = min(length, FRAME_BYTES - _HEADER_BYTES)
        payload = frame[_HEADER_BYTES : _HEADER_BYTES + inline].numpy().tobytes()
        if length > inline:
            rest = torch.empty(length - inline, dtype=torch.uint8)
            self._wait(self.ctrl.recv([rest], self.peer_rank, _CTRL_TAG), self._timeout)
            payload += rest.numpy().tobytes()
        try:
            self._next_frame = self._post_frame_recv()  # the peer's next frame need not wait for us
        except RuntimeError:  # the peer already closed the pair (e.g. it refused our HELLO): this frame
            self._next_frame = None  # still counts, and the next recv_frame reports the closed pair
        return kind, payload

    def _post_frame_recv(self) -> tuple[dist.Work, torch.Tensor]:
        frame = torch.empty(FRAME_BYTES, dtype=torch.uint8)
        return self.ctrl.recv([frame], self.peer_rank, _CTRL_TAG), frame

    # -- data -------------------------------------------------------------------------------------

    def send_data(self, tensor: torch.Tensor) -> "PendingSend":
        """Post a contiguous tensor (kept alive by the returned handle until it is waited on)."""
        self._check()
        with self._send_lock:
            work = self._post(self.data.send, tensor, _DATA_TAG)
        return PendingSend(self, [work], [tensor])

    def recv_data(self, tensor: torch.Tensor) -> None:
        """Receive into a contiguous tensor, failing the channel if it takes longer than the timeout."""
        self.wait_recv(self.post_recv(tensor))

    def post_recv(self, tensor: torch.Tensor) -> dist.Work:
        """Post a receive into a contiguous tensor without waiting (gloo: posting early lets the
        sender's matching send start at once; waiting one by one costs a round trip per message)."""
        self._check()
        return self.data.recv([tensor], self.peer_rank, _DATA_TAG)

    def wait_recv(self, work: dist.Work) -> None:
        """Wait for a posted receive, failing the channel after the timeout."""
        self._wait(work, self._timeout)

    # -- failure ----------------------------------------------------------------------------------

    def abort(self, reason: str) -> None:
        """Break the channel on purpose: closes the pair, so the peer and any thread blocked on it
        get an error now. Idempotent."""
        if self.broken is not None:
            return
        self.broken = reason
        try:
            # A timed-out wait makes gloo close the pair (see module docstring).
            self.ctrl.recv([torch.zeros(1)], self.peer_rank, _ABORT_TAG).wait(datetime.timedelta(milliseconds=1))
        except RuntimeError:
            pass
        if self.data is not self.ctrl and hasattr(self.data, "abort"):
            self.data.abort()

    def _check(self) -> None:
        if self.broken is not None:
            raise TransferError(f"channel to {self.peer.instance_id} is broken ({self.broken})", retryable=True)

    def _wait(self, work: dist.Work, timeout: datetime.timedelta) -> None:
        try:
            work.wait(timeout)
        except RuntimeError as err:
            raise self._failed(err) from None

    def _post(self, op, tensor: torch.Tensor, tag: int) -> dist.Work:
        """Post a send; a pair that is already closed raises here, at the post, not at the wait."""
        try:
            return op([tensor], self.peer_rank, tag)
        except RuntimeError as err:
            raise self._failed(err) from None

    def _failed(self, err: RuntimeError) -> TransferError:
        """Mark the channel broken by a gloo error and return the TransferError to raise."""
        if self.broken is None:
            # gloo messages start with "[<source file>:<line>] "; keep the part that says what happened
            what = re.sub(r"^\[[^\]]*\]\s*", "", str(err).splitlines()[0])[:200]
            self.broken = f"peer {self.peer.instance_id} failed or stalled: {what}"
        return TransferError(self.broken, retryable=True)


def _nccl_group(store: dist.Store, rank: int, device: torch.device) -> dist.ProcessGroup:
    """A 2-rank NCCL group on ``device`` (CUDA only; not exercised by CPU CI)."""
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = True
    pg = dist.ProcessGroupNCCL(store, rank, 2, opts)
    torch.cuda.set_device(device)
    return pg


class PendingSend:
    """Posted sends and the tensors they read (kept alive until :meth:`wait` returns)."""

    def __init__(self, channel: PairChannel, works: list[dist.Work], tensors: list[torch.Tensor]):
        self.channel = channel
        self.works = works
        self.tensors = tensors

    def wait(self) -> None:
        """Block until the peer has taken the data; TransferError (retryable) after the timeout."""
        for w in self.works:
            self.channel._wait(w, self.channel._timeout)
        self.tensors = []
