"""Transfer outcomes across the ranks of a tensor-parallel instance.

Each rank of a TP prefill (decode) instance sends (receives) its own KV heads over its own pair channels,
so a prompt's transfer is complete only when every rank's legs are. The driver (rank 0) owns the blocks and
the request; it numbers each transfer with a small integer *slot* it tells the followers when the transfer
starts, and collects their outcomes in one all-gather of fixed-size int64 reports
(``[n_done, n_failed, done slots..., failed slots...]``) whenever it has transfers in flight. Outcomes that
do not fit one report wait for the next exchange.
"""

from __future__ import annotations

import itertools

import torch

from modeling.tp_group import TPGroup

REPORT_CAPACITY = 128  # outcomes of each kind one rank reports per exchange


def exchange_outcomes(group: TPGroup, done: list[int], failed: list[int]) -> list[tuple[list[int], list[int]]]:
    """Every rank calls this together. Sends (and removes from ``done`` / ``failed``) up to
    REPORT_CAPACITY slots of each; returns each rank's (done, failed) slots, in rank order."""
    nd, nf = min(len(done), REPORT_CAPACITY), min(len(failed), REPORT_CAPACITY)
    report = torch.zeros(2 + 2 * REPORT_CAPACITY, dtype=torch.int64)
    report[0], report[1] = nd, nf
    if nd:
        report[2 : 2 + nd] = torch.tensor(done[:nd])
    if nf:
        report[2 + REPORT_CAPACITY : 2 + REPORT_CAPACITY + nf] = torch.tensor(failed[:nf])
    del done[:nd], failed[:nf]
    out = []
    for r in group.all_gather_ctrl(report):
        n_done, n_failed = int(r[0]), int(r[1])
        out.append((r[2 : 2 + n_done].tolist(), r[2 + REPORT_CAPACITY : 2 + REPORT_CAPACITY + n_failed].tolist()))
    return out


class FollowerOutcomes:
    """Driver side: the slot of each transfer in flight and which follower ranks finished or failed it."""

    def __init__(self, size: int):
        self.size = size
        self._ids = itertools.count(1)
        self._slot: dict[str, int] = {}
        self._rid: dict[int, str] = {}
        self._done: dict[int, set[int]] = {}
        self._failed: dict[int, str] = {}

    def track(self, request_id: str) -> int:
        """A new transfer; its slot (tell the followers)."""
        slot = next(self._ids)
        self._slot[request_id] = slot
        self._rid[slot] = request_id
        self._done[slot] = set()
        return slot

    def forget(self, request_id: str) -> None:
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self._rid.pop(slot, None)
            self._done.pop(slot, None)
            self._failed.pop(slot, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def absorb(self, reports: list[tuple[list[int], list[int]]]) -> None:
        """Apply an exchange's reports (rank 0's own, if any, are ignored: the driver tracks its legs itself)."""
        for rank, (done, failed) in enumerate(reports):
            if rank == 0:
                continue
            for slot in done:
                if slot in self._done:
                    self._done[slot].add(rank)
            for slot in failed:
                if slot in self._rid:
                    self._failed.setdefault(slot, f"rank {rank}'s KV transfer failed")

    def all_done(self, request_id: str) -> bool:
        slot = self._slot.get(request_id)
        return slot is not None and len(self._done[slot]) == self.size - 1

    def failures(self) -> list[tuple[str, str]]:
        """(request id, reason) of tracked transfers a follower failed."""
        return [(self._rid[slot], why) for slot, why in self._failed.items()]
