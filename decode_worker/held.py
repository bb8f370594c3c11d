"""A request a decode instance holds (no torch): one record per sequence, from its reservation to its finish."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the record carries no torch
    from modeling.output import OutputStream
    from modeling.sequence import Sequence


@dataclass
class HeldRequest:
    """A sequence this instance holds; ``seq.status`` says where it is (``waiting_for_kv``, ``prefilling``,
    ``running``, ``waiting``, ``migrating``). ``fork_blocks``: for the first sequence of a request of n > 1
    until its prompt is computed, the blocks reserved with it for its further sequences' own."""

    seq: Sequence
    stream: OutputStream
    fork_blocks: list[int] = field(default_factory=list)
    first_token_at: float | None = None  # time.time() when the client got its first token (its TPOT counts from it)
    steps_here: int = 0  # decode steps this instance ran for the sequence ...
    tokens_here: int = 0  # ... and the tokens they gave it (its pace's tokens per step)
    late: bool = False  # prefilled here past its TTFT SLO: after every queued prompt that is not (``LocalPrefill``)
