"""Errors a KV transfer raises or reports. Each says whether retrying elsewhere can help."""

from __future__ import annotations

from modeling.errors import KVConnectorError


class TransferError(KVConnectorError):
    """A KV transfer failed (the transfer connector's :class:`~modeling.errors.KVConnectorError`).
    ``retryable``: the same request may succeed on another attempt or another peer (peer died, stalled, no
    room); False for a configuration error that will fail again."""

    def __init__(self, message: str, retryable: bool, request_id: str | None = None):
        self.request_id = request_id
        prefix = f"request {request_id!r}: " if request_id is not None else ""
        super().__init__(prefix + message, retryable)


class FingerprintMismatchError(TransferError):
    """The two ends disagree on the KV layout (model, dtype, layers, heads, head size, block size)."""

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message, retryable=False, request_id=request_id)
