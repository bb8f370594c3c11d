"""A request continued where another instance left it (that instance died): what it streamed so far, and the
generator state a seeded sequence goes on from. Decode instances (``DecodeWorker.add_resume``) and colocated
ones (``ReferenceEngine.add_resume``) take the same :class:`ResumeRequest`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from modeling.errors import InvalidRequestError
from modeling.params import SamplingParams

if TYPE_CHECKING:  # the messages carry no torch: the router imports them
    import torch

    from modeling.sequence import Sequence


@dataclass(frozen=True)
class ResumedSequence:
    """One sequence of a resumed request: its index (0 .. n - 1), the tokens already streamed, the
    characters of its output text already streamed (``text_sent``) and the generator's state after its last
    token (``sampler_state``: seeded sampling; empty: a fresh generator)."""

    index: int
    output_ids: tuple[int, ...]
    text_sent: int
    sampler_state: bytes = b""

    def __post_init__(self) -> None:
        object.__setattr__(self, "output_ids", tuple(self.output_ids))


@dataclass(frozen=True)
class ResumeRequest:
    """A request to continue where another decode instance left it (that instance died): the prompt and, for
    each of its sequences still running, the tokens already streamed, whose KV this instance computes again
    (from its prefix cache, where it holds part of it)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    sequences: tuple[ResumedSequence, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))
        object.__setattr__(self, "sequences", tuple(self.sequences))

    def check_sequences(self) -> None:
        """Raises InvalidRequestError naming the field unless the sequences are one or more distinct indices of
        the request's ``n`` sequences, each with at least one token out."""
        n = self.params.num_sequences
        indices = [s.index for s in self.sequences]
        if not indices or len(set(indices)) != len(indices) or not all(0 <= i < n for i in indices):
            raise InvalidRequestError("sequences", f"one or more distinct sequence indices in [0, {n}), got {indices}")
        if not all(s.output_ids for s in self.sequences):
            raise InvalidRequestError("sequences.output_ids", "a resumed sequence has at least one token out")


def seeded_state(seq: Sequence) -> bytes:
    """The generator's state of a seeded sampling request (what a resume elsewhere continues from); empty for
    the others (greedy draws nothing; an unseeded request continues from any fresh generator)."""
    params = seq.sampler.params
    if params.seed is None or params.greedy:
        return b""
    return seq.sampler.generator.get_state().numpy().tobytes()


def generator_state(raw: bytes) -> torch.Tensor:
    """A ``torch.Generator`` state from the bytes another process sent."""
    import torch

    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)
