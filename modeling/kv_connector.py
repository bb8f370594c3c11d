"""The KV connector: the seam through which KV leaves or enters an instance's paged cache (vLLM v1's
``distributed/kv_transfer/kv_connector/v1/base.py``), so that a new place KV goes to or comes from (the
decode instance a prompt was prefilled for, a host or disk tier, a cluster KV store) plugs in without
changing the workers.

A connector has two sides, one object per rank (:class:`KVConnector` is both):

* the **scheduler side** (:class:`KVConnectorScheduler`), called by whoever owns the requests and their blocks
  (a worker's driver loop, on rank 0): how many tokens of a request can come from outside
  (``get_num_new_matched_tokens``), what to do once its blocks are allocated (``update_state_after_alloc``),
  and, when its computation ends, whether its blocks may be freed now or only once the connector is done
  with them (``request_finished``);
* the **worker side** (:class:`KVConnectorWorker`), which moves the bytes: the worker calls
  ``start_load_kv`` before each forward pass with what the pass means for the connector (:class:`StepKV`),
  the model runner calls the :class:`LayerHook` methods inside the pass (``wait_for_layer_load`` before a
  layer reads the cache, ``save_kv_layer`` once a layer's KV is written), the worker calls ``wait_for_save``
  after the pass and ``get_finished`` once per step to learn which requests' KV finished leaving or arriving
  (and which failed).

On a tensor-parallel instance every rank has its own worker side (each holds its own KV heads); the driver's
scheduler side tells the other ranks' what it decided.

Implementations: the prefill -> decode stream (``kv_transfer/connector.py``, the sending side) and the
decode instance's inbox of incoming prompts (``decode_worker/kv_inbox.py``, the receiving side).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, Protocol, TypeVar

from modeling.kv_cache import PagedKVCache


class LayerHook(Protocol):
    """What the model runner calls per layer of a forward pass (``ModelRunner.forward(..., kv_hook=...)``).

    Eagerly, for each layer ``i`` in order: ``wait_for_layer_load(i)``, the layer's cache write, then
    ``save_kv_layer(i)`` (layer ``i``'s KV for this step is final from then on), then its attention. A compiled
    step cannot call back inside the pass: the runner calls ``wait_for_layer_load`` for every layer before it
    and ``save_kv_layer`` for every layer after it. Either way each method sees every layer exactly once per
    pass, in order."""

    def wait_for_layer_load(self, layer: int) -> None: ...

    def save_kv_layer(self, layer: int) -> None: ...


class LayerHooks:
    """Several layer hooks as one: each method calls every hook's, in the order given (a tier load's before the
    connector's, so a layer's loaded KV is in before the connector sends it)."""

    def __init__(self, *hooks: LayerHook):
        self.hooks = hooks

    def wait_for_layer_load(self, layer: int) -> None:
        for hook in self.hooks:
            hook.wait_for_layer_load(layer)

    def save_kv_layer(self, layer: int) -> None:
        for hook in self.hooks:
            hook.save_kv_layer(layer)


class BlockRelease(Enum):
    """``request_finished``'s answer: when the owner may free the request's blocks."""

    NOW = "now"  # the connector holds nothing of them
    WHEN_FINISHED = "when_finished"  # KV still leaving or arriving: free them once get_finished reports it


@dataclass(frozen=True)
class KVPeer:
    """The instance a request's KV goes to (or comes from). ``reserved``: it holds room for the request
    already; ``ranks``: its tensor-parallel degree when the caller knows it (None: as the connector learned
    when it connected)."""

    instance_id: str
    reserved: bool = False
    ranks: int | None = None


@dataclass(frozen=True)
class KVRequest:
    """What a connector is told of a request: its id, the positions its KV covers, and the peer the KV goes to
    or comes from (None: none beyond this instance)."""

    request_id: str
    num_tokens: int
    peer: KVPeer | None = None


@dataclass(frozen=True)
class ExternalTokens:
    """``get_num_new_matched_tokens``'s answer: ``num_tokens`` beyond those computed here can come from
    outside (None: not known yet, ask again later); ``asynchronous``: they arrive between steps (the request
    waits for them), not inside the next forward pass."""

    num_tokens: int | None
    asynchronous: bool = False


@dataclass(frozen=True)
class HandOff:
    """How a request's computation here ended, for a connector that hands it on: the first token (None: none)
    and the sampler's state after it, and the owner's own ``state`` (opaque to the connector)."""

    first_token: int | None
    sampler_state: bytes = b""
    state: str = ""


@dataclass(frozen=True)
class StepKV:
    """What one forward pass means for the connector: ``final_blocks[request_id]`` is how many of the request's
    blocks (from its first) hold final KV once the pass has written them; requests absent or at 0 have none
    yet."""

    final_blocks: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class KVFailure:
    """A request whose KV will not finish leaving or arriving; its blocks are (or will be) released."""

    request_id: str
    reason: str
    retryable: bool


ReceivedT = TypeVar("ReceivedT")


@dataclass
class FinishedKV(Generic[ReceivedT]):
    """``get_finished``'s answer since the last call: requests whose KV finished leaving (their blocks may go),
    requests whose KV finished arriving (what the receiving side hands its owner), and failures."""

    sent: list[str] = field(default_factory=list)
    received: list[ReceivedT] = field(default_factory=list)
    failed: list[KVFailure] = field(default_factory=list)


class KVConnectorScheduler(ABC):
    """The scheduler side: called by the owner of requests and blocks, in its own thread."""

    def get_num_new_matched_tokens(self, request: KVRequest, num_computed_tokens: int) -> ExternalTokens:
        """Called before the request's blocks are allocated, with the tokens computed (or cached) here: how many
        more can come from outside. Free of side effects; may be called again for the same request. By
        default none."""
        return ExternalTokens(0)

    @abstractmethod
    def update_state_after_alloc(self, request: KVRequest, blocks: Sequence[int], num_external_tokens: int) -> None:
        """Called once the request's ``blocks`` (its whole block table, in order) are allocated, before its
        first forward pass: ``num_external_tokens`` (the last of its ``num_tokens`` positions) are to come from
        outside, the rest are computed here. Raises :class:`~modeling.errors.KVConnectorError`, having
        registered nothing, when the KV cannot go (or come) where asked."""

    @abstractmethod
    def request_finished(self, request_id: str, hand_off: HandOff | None = None) -> BlockRelease:
        """Called once when the request's computation here ends (``hand_off``: how, for a peer that continues
        it) or it is dropped (None): whether its blocks may be freed now or only once ``get_finished`` reports
        the request."""

    def withdraw_refused(self, min_s: float) -> list[str]:
        """Called when a waiting request lacks blocks and nothing runs: give up the hand-offs whose peers have
        had no room for them for ``min_s`` seconds or more, so their blocks go (each reported failed, retryable,
        by ``get_finished``); the requests given up. By default none (a connector whose hand-offs never wait)."""
        return []


class KVConnectorWorker(ABC):
    """The worker side: moves bytes between the paged cache and wherever the connector keeps or sends KV.
    Called by the worker's loop around each forward pass, and by the model runner inside it (a
    :class:`LayerHook`)."""

    def register_kv_cache(self, cache: PagedKVCache) -> None:
        """Called once by the worker, with the cache its runner writes (this rank's KV heads)."""

    def start_load_kv(self, step: StepKV) -> None:
        """Called by the worker before a forward pass, with what the pass means for the connector: start
        loading what the pass will read (maybe asynchronously) and prepare its saves."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Called by the model runner before layer ``layer`` reads the cache: return once its loads are in."""

    @abstractmethod
    def save_kv_layer(self, layer: int) -> None:
        """Called by the model runner once layer ``layer``'s KV of the pass is written: start saving (sending)
        the layer's KV of the step's final blocks, maybe asynchronously."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Called by the worker after the forward pass: every save of the pass is posted (an asynchronous save
        keeps its source blocks until ``get_finished`` reports the request)."""

    @abstractmethod
    def get_finished(self) -> FinishedKV:
        """Called by the worker once per step: requests whose KV finished leaving or arriving, and failures
        (each reported once)."""


class KVConnector(KVConnectorScheduler, KVConnectorWorker, ABC):
    """Both sides of one connector on one rank (the worker's driver uses both; another rank of a
    tensor-parallel instance only the worker side)."""
