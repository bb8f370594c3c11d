"""Live migration of a running request between decode instances: the state that moves with its KV, and
when the source stops copying in rounds (no torch here).

The source keeps decoding the request while its KV goes to the destination in rounds (each round sends the
blocks filled since the previous one: only positions whose KV is final, so a sent block never changes).
Once the destination has taken every block sent so far, or the request is about to outgrow the room
reserved for it there, the source stops the request and sends what is left: the last, partly filled
blocks, the :class:`MigrationState` and, with a draft model, that model's own cache (its window's blocks,
``DraftModelDrafter.export_state``). The pause the client sees is that stop-and-copy, which does not grow
with the sequence length. The router decides the outcome (see ``controller/migrations.py``): the source
frees its copy only once the router has committed the request to the destination.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class MigrationState:
    """What the destination needs beside the KV to continue a request exactly where the source stopped.

    ``output_ids``: tokens generated so far (the prompt comes with the request); ``num_computed``: positions
    whose KV was sent (every token but the last); ``sampler_state``: hex of the generator's state, so seeded
    sampling continues the same random stream; ``text_sent``: characters of the output text already streamed
    (text held back for a possible stop string is streamed by the destination). With a draft model, where
    its cache's blocks sit (``draft``: tokens cached, table entries, evicted entries; the KV itself follows
    the state on the channel), so the destination drafts exactly as the source would have."""

    output_ids: tuple[int, ...]
    num_computed: int
    sampler_state: str
    text_sent: int
    draft: tuple[int, int, tuple[int, ...]] | None = None
    first_token_at: float | None = None  # time.time() when the client got the request's first token

    def __post_init__(self) -> None:
        object.__setattr__(self, "output_ids", tuple(self.output_ids))
        if self.draft is not None:
            computed, entries, evicted = self.draft
            evicted = tuple(evicted)
            ints = [computed, entries, *evicted]
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in ints) or \
                    any(e >= entries for e in evicted):
                raise ValueError(f"draft: expected (computed, entries, evicted entries < entries), got {self.draft!r}")
            object.__setattr__(self, "draft", (computed, entries, evicted))
        if not self.output_ids:
            raise ValueError("output_ids: a migrating request has generated at least one token")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.output_ids):
            raise ValueError("output_ids: must be non-negative integers")
        for name in ("num_computed", "text_sent"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be a non-negative integer, got {value!r}")
        bytes.fromhex(self.sampler_state)
        if self.first_token_at is not None and (isinstance(self.first_token_at, bool) or
                                                not isinstance(self.first_token_at, (int, float)) or
                                                not math.isfinite(self.first_token_at)):
            raise ValueError(f"first_token_at: must be a finite time or null, got {self.first_token_at!r}")

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @staticmethod
    def decode(text: str) -> "MigrationState":
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("migration state: expected a JSON object")
        draft = raw.get("draft")
        if draft is not None and (not isinstance(draft, list) or len(draft) != 3 or not isinstance(draft[2], list)):
            raise ValueError(f"draft: expected [computed, entries, [evicted...]], got {draft!r}")
        return MigrationState(tuple(raw["output_ids"]), raw["num_computed"], str(raw["sampler_state"]),
                              raw["text_sent"], None if draft is None else (draft[0], draft[1], tuple(draft[2])),
                              raw.get("first_token_at"))


@dataclass
class OutgoingMigration:
    """A request this instance is migrating away, while it still decodes here (or, once ``stopped``, while
    the router decides)."""

    request_id: str
    capacity_tokens: int  # positions reserved at the destination
    rounds: int = 0  # rounds of blocks sent
    blocks_sent: int = 0
    stopped: bool = False  # no longer decoding here; the last blocks and the state are on their way
    failed: bool = False  # the transfer failed: nothing more is sent, the router aborts the migration
    slot: int = 0  # tensor parallel: its number in the ranks' reports (``kv_transfer/rank_sync.py``)
    ranks_caught_up: bool = True  # tensor parallel: every other rank's destination took all it was sent


def should_stop(caught_up: bool, rounds: int, num_tokens: int, step_tokens: int, capacity_tokens: int) -> bool:
    """Stop the request and copy the rest now? Yes once the destination has taken every block of at least
    one round (what is left is only what was written since), or when one more step could outgrow the
    ``capacity_tokens`` reserved there (``step_tokens``: the most positions one step may add)."""
    return (caught_up and rounds >= 1) or num_tokens + step_tokens >= capacity_tokens


def headroom_tokens(max_k: int, block_size: int, steps: int = 16) -> int:
    """Positions reserved at a destination beyond the request's current length: room for ``steps`` steps
    of the largest speculation while the rounds run, rounded up to whole blocks."""
    tokens = steps * (max_k + 1)
    return -(-tokens // block_size) * block_size
