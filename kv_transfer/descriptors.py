"""Messages of the KV transfer protocol: the KV fingerprint, the per-transfer descriptor sent in the
handshake, piece lists and replies. All are frozen dataclasses encoded as JSON (never pickle).

Block ids here are the *receiver's*; the sender's own block ids never leave the sender.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from kv_transfer.errors import FingerprintMismatchError
from modeling.config import ModelConfig
from modeling.dtypes import DTYPE_NAMES
from modeling.heads import HeadRange
from modeling.kv_cache import KVCacheSpec


@dataclass(frozen=True)
class KVFingerprint:
    """What two ends must agree on to exchange KV blocks. ``num_kv_heads`` is the model's total
    (a TP shard's cache holds a range of them)."""

    model_type: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    @staticmethod
    def of(config: ModelConfig, block_size: int, dtype: torch.dtype) -> "KVFingerprint":
        fp = config.fingerprint()
        return KVFingerprint(
            model_type=fp["model_type"], hidden_size=fp["hidden_size"], vocab_size=fp["vocab_size"],
            num_layers=fp["num_hidden_layers"], num_kv_heads=fp["num_key_value_heads"], head_dim=fp["head_dim"],
            block_size=block_size, dtype=DTYPE_NAMES[dtype],
        )

    def check_cache(self, spec: KVCacheSpec, heads: HeadRange) -> None:
        """Raise ValueError naming the field if a cache shard holding ``heads`` does not fit this layout."""
        expect = {"num_layers": self.num_layers, "num_kv_heads": heads.size, "head_dim": self.head_dim,
                  "block_size": self.block_size, "dtype": self.dtype}
        got = {"num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
               "block_size": spec.block_size, "dtype": DTYPE_NAMES.get(spec.dtype, str(spec.dtype))}
        for name, want in expect.items():
            if got[name] != want:
                raise ValueError(f"cache.{name}: expected {want} for heads [{heads.start}, {heads.end}), "
                                 f"got {got[name]}")
        if heads.end > self.num_kv_heads:
            raise ValueError(f"heads: [{heads.start}, {heads.end}) exceeds num_kv_heads ({self.num_kv_heads})")

    def require_same(self, other: "KVFingerprint", request_id: str | None = None) -> None:
        """Raise FingerprintMismatchError listing every field that differs (``ours`` vs ``theirs``)."""
        diffs = [f"{f.name}: ours {getattr(self, f.name)!r}, peer {getattr(other, f.name)!r}"
                 for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]
        if diffs:
            raise FingerprintMismatchError("KV layout mismatch, refusing transfer (" + "; ".join(diffs) + ")",
                                           request_id)


@dataclass(frozen=True)
class PeerHello:
    """Exchanged once when a pair channel forms: who is at the other end and its KV layout."""

    instance_id: str
    role: str  # "prefill" | "decode"
    fingerprint: KVFingerprint
    heads: HeadRange  # heads the peer's cache shard holds


@dataclass(frozen=True)
class TransferDescriptor:
    """Handshake of one transfer leg (sender -> receiver).

    ``reserved``: the receiving instance holds room for this request (its owner reserves it when the router
    places the request there, possibly while this descriptor is on its way), which the receiver finds by the
    request id and accepts at once (BUSY until the reservation exists); otherwise the receiver asks its owner
    for room when the descriptor arrives (BUSY when there is none).
    Block ids never travel: each side addresses only its own blocks.
    ``heads``: the global KV heads this leg carries (a sub-range of the receiver's shard).
    ``live``: a running request's KV moving between decode instances while it keeps decoding (migration):
    ``num_tokens`` is then the capacity reserved, blocks arrive in rounds as they fill, and the leg ends
    with a :class:`PromptEnd` that states how many positions were sent."""

    request_id: str
    transfer_id: int
    fingerprint: KVFingerprint
    num_tokens: int
    heads: HeadRange
    reserved: bool = False
    live: bool = False

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id: must not be empty")
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens: must be >= 1, got {self.num_tokens}")

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.fingerprint.block_size)


@dataclass(frozen=True)
class Piece:
    """Blocks ``[block_start, block_start + block_count)`` of transfer ``transfer_id`` (indices into
    the prompt's block list), for every layer."""

    transfer_id: int
    block_start: int
    block_count: int


@dataclass(frozen=True)
class PromptEnd:
    """Sender -> receiver, once per leg, ending it. After a prompt's last chunk: the first token the prefill
    worker sampled (None: none, e.g. a transfer without generation) and the request's generator state after
    it (hex of ``torch.Generator.get_state()`` bytes), so the decode side continues the same random stream.
    After a live leg's last round: ``num_tokens``, the positions whose KV was sent, and ``state``, the
    request's state as its owner encoded it (opaque here). The receiver hands the request over only once
    its KV is complete and this has arrived."""

    request_id: str
    transfer_id: int
    first_token: int | None = None
    sampler_state: str = ""
    num_tokens: int | None = None
    state: str = ""
    extra_shape: tuple[int, ...] = ()  # a tensor the owner sends right after this frame (its shape; () none)
    extra_dtype: str = ""


@dataclass(frozen=True)
class Reply:
    """Receiver -> sender about one transfer: ACCEPT (room is there: send; ``skip_blocks``: the receiver
    holds the KV of the first that many blocks already, from its prefix cache, so the sender starts after
    them), BUSY (no room now: retry later or elsewhere), REFUSE (with the reason), DONE (all bytes are in the
    cache: the sender may free its blocks)."""

    kind: str
    transfer_id: int
    reason: str = ""
    retryable: bool = False
    skip_blocks: int = 0

    KINDS = ("accept", "busy", "refuse", "done")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ValueError(f"kind: unknown {self.kind!r}; allowed: {', '.join(self.KINDS)}")


# -- JSON codec ------------------------------------------------------------------------------------

def encode(obj: Any) -> bytes:
    """A protocol dataclass (or a list of them) -> UTF-8 JSON bytes."""
    if isinstance(obj, list):
        return json.dumps([asdict(o) for o in obj], separators=(",", ":")).encode()
    return json.dumps(asdict(obj), separators=(",", ":")).encode()


def decode_hello(data: bytes) -> PeerHello:
    raw = json.loads(data)
    return PeerHello(raw["instance_id"], raw["role"], KVFingerprint(**raw["fingerprint"]), HeadRange(**raw["heads"]))


def decode_descriptor(data: bytes) -> TransferDescriptor:
    raw = json.loads(data)
    return TransferDescriptor(
        request_id=str(raw["request_id"]), transfer_id=int(raw["transfer_id"]),
        fingerprint=KVFingerprint(**raw["fingerprint"]), num_tokens=int(raw["num_tokens"]),
        heads=HeadRange(**raw["heads"]), reserved=bool(raw.get("reserved", False)), live=bool(raw.get("live", False)),
    )


def decode_pieces(data: bytes) -> list[Piece]:
    return [Piece(int(p["transfer_id"]), int(p["block_start"]), int(p["block_count"])) for p in json.loads(data)]


def decode_prompt_end(data: bytes) -> PromptEnd:
    raw = json.loads(data)
    token = raw.get("first_token")
    state = str(raw.get("sampler_state", ""))
    bytes.fromhex(state)  # malformed hex fails the frame here, not the decode worker later
    num_tokens = raw.get("num_tokens")
    if num_tokens is not None and (isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1):
        raise ValueError(f"num_tokens: must be a positive integer or null, got {num_tokens!r}")
    shape = raw.get("extra_shape", [])
    dtype = str(raw.get("extra_dtype", ""))
    if not isinstance(shape, list) or len(shape) > 8 or \
            any(isinstance(d, bool) or not isinstance(d, int) or not 0 < d < 1 << 31 for d in shape):
        raise ValueError(f"extra_shape: expected up to 8 positive dimensions, got {shape!r}")
    if shape and dtype not in DTYPE_NAMES.values():
        raise ValueError(f"extra_dtype: must be one of {', '.join(DTYPE_NAMES.values())}, got {dtype!r}")
    return PromptEnd(str(raw["request_id"]), int(raw["transfer_id"]), None if token is None else int(token), state,
                     num_tokens, str(raw.get("state", "")), tuple(shape), dtype if shape else "")


def decode_reply(data: bytes) -> Reply:
    raw = json.loads(data)
    return Reply(raw["kind"], int(raw["transfer_id"]), raw.get("reason", ""), bool(raw.get("retryable", False)),
                 int(raw.get("skip_blocks", 0)))
