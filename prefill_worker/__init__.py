"""Prefill worker: chunked prefill over a paged KV cache, handing each prompt's KV to kv_transfer.

Controller-facing API (``prefill_worker.worker.PrefillWorker``): ``connect(decode_id, rendezvous)``,
``add_request(PrefillRequest)``, ``step() -> PrefillStepOutput`` (first tokens, acknowledged transfers,
failures), ``abort(request_id)``, ``has_work()``. Messages are in :mod:`prefill_worker.messages` (no torch:
the router imports them).
"""
