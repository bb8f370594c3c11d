"""The sequences of one request (``n`` / ``best_of`` > 1): how they are named and how they start (no torch).

One prompt is prefilled once; its first tokens are sampled together from the last prompt position (sequence
i with its own generator: seeded ``seed + i`` when the request has a seed, as vLLM seeds them), and the
sequences then decode side by side, sharing the prompt's full KV blocks (``BlockTable.fork``). Sequence 0
keeps the request's id; sequence i > 0 runs under ``sequence_id(request id, i)``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

_SEP = "#"  # never in a request id (gRPC allows letters, digits, '.', '_', '-'; HTTP ids are generated)


def sequence_id(request_id: str, index: int) -> str:
    """The id a request's sequence ``index`` runs under on a worker."""
    return request_id if index == 0 else f"{request_id}{_SEP}{index}"


def split_sequence_id(seq_id: str) -> tuple[str, int]:
    """(request id, sequence index) of a worker-side sequence id."""
    rid, sep, index = seq_id.rpartition(_SEP)
    return (rid, int(index)) if sep and index.isdigit() else (seq_id, 0)


def fork_seed(seed: int | None, index: int) -> int | None:
    """Sequence ``index``'s seed (None: a random one)."""
    return None if seed is None else seed + index


@dataclass(frozen=True)
class ForkStart:
    """How sequence ``index`` > 0 of a request starts on its decode instance: its first token and its
    generator's state after drawing it."""

    index: int
    token: int
    sampler_state: bytes


@dataclass(frozen=True)
class SequenceStarts:
    """What the end of a prompt's KV transfer carries besides the first token (``PromptEnd.state``): how the
    further sequences start (``forks``, sequences 1 .. n-1 in order) and, by sequence index, the characters of
    each first token's text the client already has from the prefill instance (``text_sent``; missing: 0). The
    decode instance continues each sequence after them: at the next position, the next character."""

    forks: tuple[ForkStart, ...] = ()
    text_sent: tuple[int, ...] = ()
    first_token_at: float | None = None  # time.time() when the prefill instance sampled the first tokens

    def sent(self, index: int) -> int:
        return self.text_sent[index] if index < len(self.text_sent) else 0


def encode_starts(starts: SequenceStarts) -> str:
    """``starts`` as the KV transfer's end carries them, '' when there is nothing to carry."""
    if not starts.forks and not any(starts.text_sent) and starts.first_token_at is None:
        return ""
    return json.dumps({"forks": [[f.index, f.token, f.sampler_state.hex()] for f in starts.forks],
                       "text_sent": list(starts.text_sent), "first_token_at": starts.first_token_at},
                      separators=(",", ":"))


def decode_starts(text: str) -> SequenceStarts:
    """Inverse of :func:`encode_starts`; raises ValueError on a malformed text."""
    if not text:
        return SequenceStarts()
    try:
        raw = json.loads(text)
        forks = tuple(ForkStart(int(i), int(t), bytes.fromhex(s)) for i, t, s in raw["forks"])
        sent = tuple(int(c) for c in raw["text_sent"])
        at = raw.get("first_token_at")
        at = None if at is None else float(at)
    except (TypeError, ValueError, KeyError) as err:
        raise ValueError(f"malformed sequence starts: {err}") from None
    if [f.index for f in forks] != list(range(1, len(forks) + 1)):
        raise ValueError("sequence starts must number 1 .. n - 1 in order")
    if any(c < 0 for c in sent):
        raise ValueError("text_sent must be non-negative character counts")
    if at is not None and not math.isfinite(at):
        raise ValueError("first_token_at must be a finite time or null")
    return SequenceStarts(forks, sent, at)
