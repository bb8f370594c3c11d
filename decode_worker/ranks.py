"""The driver's handle on the other ranks of a tensor-parallel decode instance (``decode_worker/tp_rank.py``
runs them): each acts on its own KV heads when told, and they report outcomes together."""

from __future__ import annotations

from typing import Any

from kv_transfer.rank_sync import exchange_outcomes
from modeling.tp_group import TPGroup
from modeling.tp_runner import TPDriverRunner


class FollowerRanks:
    """Ranks 1 .. size - 1 of the instance rank 0 drives."""

    def __init__(self, runner: TPDriverRunner, group: TPGroup):
        self._runner = runner
        self._group = group

    @property
    def size(self) -> int:
        """Ranks in the instance, the driver included."""
        return self._group.size

    def call(self, action: Any) -> None:
        """Every follower runs ``action`` (a frozen dataclass of one of the types ``DecodeRankFollower``
        registers: ``decode_worker/kv_inbox.py``'s and ``decode_worker/migration_sender.py``'s)."""
        self._runner.call(action)

    def barrier(self) -> None:
        """Wait until every rank got here."""
        self._group.barrier()

    def exchange(self) -> list[tuple[list[int], list[int]]]:
        """Each rank's (done, failed) slots, in rank order (the driver's own, first, are empty); every
        follower takes part after a ``call`` that tells it to (``SyncKV``, ``SyncMigrations``)."""
        return exchange_outcomes(self._group, [], [])
