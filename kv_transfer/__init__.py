"""KV transfer: moves a prompt's paged KV from a prefill worker to a decode worker over torch.distributed.

Modules (each one job): ``descriptors`` (fingerprint, handshake descriptor, replies; JSON, no pickle),
``channel`` (2-rank gloo / NCCL pair groups from the controller's TCP store; control frames), ``blocks``
(one layer's K or V of some blocks on the wire), ``sender`` / ``receiver`` (the two halves), ``connector``
(the sending half as the prefill worker's KV connector, :mod:`modeling.kv_connector`; the receiving half's is
``decode_worker/kv_inbox.py``). The TP head ranges and the N-sender / M-receiver plan are
:mod:`modeling.heads` (re-exported here).

Protocol, per (prefill, decode) pair channel (rank 0 = prefill, rank 1 = decode):

1. on connect, both send a PeerHello (instance id, role, KVFingerprint, heads held); a mismatched
   fingerprint raises FingerprintMismatchError on both ends;
2. per prompt, the sender sends a TransferDescriptor (request id, fingerprint, num_tokens, heads,
   destination block ids reserved by the router, or none to have the receiver reserve now); the
   receiver answers ACCEPT, BUSY (no room: back-pressure, the sender re-asks later) or REFUSE (reason);
3. after ACCEPT, pieces flow: a PIECES frame naming (transfer, block range) pairs, then for each
   layer, for each piece, the K then V slab [n, block_size, heads, D]; the prefill worker posts layer
   i right after its forward wrote layer i (overlap with later layers), earlier chunks' full blocks in
   earlier steps;
4. after the prompt's last chunk the sender sends a FIRST_TOKEN frame (``PromptEnd``: the first token the
   prefill worker sampled and its generator's state); the receiver reports the prompt complete to its owner
   only once the KV is complete and this has arrived (``ReceivedKV.first_token``);
5. when a leg's last block is in the cache the receiver answers DONE; the sender then frees its blocks.
   A stalled or dead peer fails every
   transfer on the channel within ``TransferConfig.timeout_s`` on both ends (blocks released,
   TransferError(retryable=True) reported); the controller re-forms the pair with ``generation + 1``.

Threads: each side runs background threads per channel that only move bytes and record events; every
block-pool change happens in the owner's thread inside ``poll()``, which must be called regularly (the
worker loops do it every step) and also enforces the timeouts.

Decode-side API (KVReceiver; the decode worker, which owns the requests, is the BlockReserver):
``connect(prefill_id, rendezvous)``, ``reserve(request_id, num_tokens) -> list[int] | None``,
``poll() -> ReceiverEvents(completed=[ReceivedKV], failed=[ReceiveFailure])``, ``release(request_id)``.

Prefill-side API (KVSender, driven by ``connector.TransferConnector``): ``connect(decode_id, rendezvous)``,
``begin(request_id, num_tokens, src_blocks, [LegTarget])``, ``open_group(ready) -> StreamGroup``
(``send_layer(i)``, ``close()``), ``finish_prompt(request_id, first_token, sampler_state)``,
``poll() -> SenderEvents(done, failed)``.
"""

from kv_transfer.channel import PairChannel, Rendezvous, TransferConfig
from kv_transfer.descriptors import KVFingerprint, PeerHello, TransferDescriptor
from kv_transfer.errors import FingerprintMismatchError, TransferError
from kv_transfer.receiver import BlockReserver, KVReceiver, PoolReserver, ReceivedKV, ReceiveFailure, ReceiverEvents
from kv_transfer.sender import KVSender, LegTarget, SenderEvents, StreamGroup, TransferFailure, leg_targets
from modeling.heads import HeadRange, TransferLeg, plan_transfer, shard_heads

__all__ = [
    "BlockReserver", "FingerprintMismatchError", "HeadRange", "KVFingerprint", "KVReceiver", "KVSender",
    "LegTarget", "PairChannel", "PeerHello", "PoolReserver", "ReceiveFailure", "ReceivedKV", "ReceiverEvents",
    "Rendezvous", "SenderEvents", "StreamGroup", "TransferConfig", "TransferDescriptor", "TransferError",
    "TransferFailure", "TransferLeg", "leg_targets", "plan_transfer", "shard_heads",
]
