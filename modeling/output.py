"""Turning sampled tokens into streamed text: detokenization, stop strings, finish bookkeeping.

Shared by the reference engine and the decode worker so both stream exactly the same text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modeling.sequence import FinishReason, Sequence, find_stop_string
from modeling.tokenizer import IncrementalDecoder, TextTokenizer


@dataclass
class OutputStream:
    """Text state of one request. Text that could still be the start of a stop string is held back
    until it cannot be, so a client never receives characters that a stop string later removes (with
    ``include_stop``, the stop string stays in the text and nothing needs holding back). Stop strings are
    looked for once more than ``min_tokens`` tokens are out."""

    stops: tuple[str, ...]
    decoder: IncrementalDecoder | None
    include_stop: bool = False
    min_tokens: int = 0
    text: str = ""  # decoded output so far, cut at a stop string
    sent: int = 0  # characters of ``text`` already emitted
    tokens: int = 0  # tokens pushed so far
    _holdback: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._holdback = 0 if self.include_stop else max((len(s) for s in self.stops), default=1) - 1

    @staticmethod
    def for_sequence(seq: Sequence, tokenizer: TextTokenizer | None) -> "OutputStream":
        p = seq.sampler.params
        decoder = None if tokenizer is None else tokenizer.stream(
            skip_special_tokens=p.skip_special_tokens, spaces_between_special_tokens=p.spaces_between_special_tokens)
        return OutputStream(p.stop, decoder, p.include_stop_str_in_output, p.min_tokens)

    def push(self, tokens: list[int], reason: FinishReason | None) -> tuple[str, FinishReason | None]:
        """Add tokens (the last may carry a finish reason); return (new text, final finish reason).

        A stop string found in the text finishes the request (reason STOP) and cuts the text there."""
        if self.decoder is None:
            return "", reason
        delta = self.decoder.push(tokens)
        self.tokens += len(tokens)
        if reason is not None:
            delta += self.decoder.flush()
        full = self.text + delta
        stop_at, stop_len = (find_stop_string(full, self.stops, len(delta)) if self.tokens > self.min_tokens
                             else (-1, 0))
        if stop_at >= 0:
            full = full[:stop_at + (stop_len if self.include_stop else 0)]
            reason = FinishReason.STOP
        self.text = full
        hold = 0 if reason is not None else self._holdback
        emit_upto = max(self.sent, len(full) - hold)
        new_text = full[self.sent : emit_upto]
        self.sent = emit_upto
        return new_text, reason
