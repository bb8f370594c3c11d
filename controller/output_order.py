"""Putting a request's output back in order (no torch, no Ray).

Every piece of output a worker reports is numbered by where it sits in its sequence: ``position``, the output
position of its first token id, and ``text_offset``, the characters of the sequence's text before its text.
Pieces reach the router from several places (the prefill instance's first token, the decode instance's
steps, both ends of a live migration), each polled on its own, so they may overlap or arrive early. An
:class:`OutputOrder` emits each token and character exactly once, in order: what was emitted already is cut
off, a piece that starts past what was emitted waits until the gap before it is filled.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol


class OutputPiece(Protocol):
    """What the order needs of a piece (``decode_worker.messages.TokenDelta`` is one)."""

    token_ids: list[int]
    text: str
    logprobs: tuple  # one per token id, or empty
    finished: bool
    index: int
    position: int
    text_offset: int
    prompt_logprobs: tuple | None  # the prompt's, on the piece that carries them


@dataclass
class _Sequence:
    tokens: int = 0  # token ids emitted
    chars: int = 0  # characters of text emitted
    token_ids: list = field(default_factory=list)  # the ids emitted, in order
    waiting: list = field(default_factory=list)  # pieces that start past what was emitted


class OutputOrder:
    """One request's emitted output, per sequence index."""

    def __init__(self) -> None:
        self._seqs: dict[int, _Sequence] = {}

    def emitted_tokens(self, index: int | None = None) -> int:
        """Token ids emitted for sequence ``index`` (None: all sequences)."""
        if index is None:
            return sum(s.tokens for s in self._seqs.values())
        return self._seqs[index].tokens if index in self._seqs else 0

    def emitted(self, index: int = 0) -> tuple[list[int], int]:
        """(the token ids emitted for sequence ``index``, the characters of its text emitted)."""
        seq = self._seqs.get(index)
        return ([], 0) if seq is None else (list(seq.token_ids), seq.chars)

    def accept(self, piece: OutputPiece) -> list:
        """The pieces to emit now, in order, each cut to what was not emitted before (a piece with nothing
        new is left out unless it finishes its sequence or carries the prompt's log-probabilities)."""
        seq = self._seqs.setdefault(piece.index, _Sequence())
        seq.waiting.append(piece)
        out = []
        progress = True
        while progress:
            progress = False
            for p in list(seq.waiting):
                if p.position > seq.tokens or p.text_offset > seq.chars:
                    continue  # a gap before it: wait
                seq.waiting.remove(p)
                progress = True
                cut = self._cut(seq, p)
                if cut is not None:
                    out.append(cut)
        return out

    @staticmethod
    def _cut(seq: _Sequence, p: OutputPiece):
        skip_ids = seq.tokens - p.position
        skip_chars = seq.chars - p.text_offset
        ids, text = list(p.token_ids[skip_ids:]), p.text[skip_chars:]
        logprobs = tuple(p.logprobs[skip_ids:])
        seq.token_ids.extend(ids)
        seq.tokens = max(seq.tokens, p.position + len(p.token_ids))
        seq.chars = max(seq.chars, p.text_offset + len(p.text))
        if not ids and not text and not p.finished and p.prompt_logprobs is None:
            return None
        if len(ids) == len(p.token_ids) and len(text) == len(p.text):
            return p
        return replace(p, token_ids=ids, text=text, logprobs=logprobs, position=p.position + skip_ids,
                       text_offset=p.text_offset + skip_chars)
