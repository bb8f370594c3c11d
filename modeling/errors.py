"""Error types raised by model loading and request validation.

Every message names where the problem is (a file and a field, or a request parameter) and what was
expected, so that a user can fix the input without reading our code.
"""

from __future__ import annotations


class MagicServeError(Exception):
    """Base class of all errors magicserve raises on purpose."""


class CheckpointError(MagicServeError):
    """A checkpoint directory is missing, corrupt, or describes a model we cannot run.

    The message has the form ``<file>: <field>: <reason>`` (field may be omitted).
    """

    def __init__(self, file: str, reason: str, field: str | None = None):
        self.file = file
        self.field = field
        self.reason = reason
        where = f"{file}: {field}" if field else file
        super().__init__(f"{where}: {reason}")


class InvalidRequestError(MagicServeError, ValueError):
    """A request or sampling parameter is out of range. ``field`` names the parameter."""

    def __init__(self, field: str, reason: str):
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


class OutOfBlocksError(MagicServeError):
    """The KV block pool cannot satisfy an allocation."""


class KVConnectorError(MagicServeError):
    """A KV connector cannot take a request's KV where it was asked to go (or come from). ``retryable``: the
    same request may succeed on another attempt or another peer; False for an error that will recur."""

    def __init__(self, message: str, retryable: bool):
        self.retryable = retryable
        super().__init__(message)
