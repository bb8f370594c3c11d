"""Prefill worker: chunked prefill over a paged KV cache, handing each prompt's KV to kv_transfer.

Controller-facing API (:class:`PrefillWorker`): ``connect(decode_id, rendezvous)``,
``add_request(PrefillRequest)``, ``step() -> PrefillStepOutput`` (first tokens, acknowledged transfers,
failures), ``abort(request_id)``, ``has_work()``. Messages are in :mod:`prefill_worker.messages`.
"""

from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.messages import FirstToken, KVDestination, PrefillFailure, PrefillRequest, PrefillStepOutput
from prefill_worker.worker import PrefillWorker

__all__ = ["FirstToken", "KVDestination", "PrefillFailure", "PrefillRequest", "PrefillStepOutput", "PrefillWorker",
           "PrefillWorkerConfig"]
