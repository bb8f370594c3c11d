"""Tokenizer (``tokenizer.json`` via the ``tokenizers`` library) and incremental detokenization."""

from __future__ import annotations

import os

from tokenizers import Tokenizer

from modeling.checkpoint import read_json
from modeling.errors import CheckpointError

TOKENIZER_FILE = "tokenizer.json"


class TextTokenizer:
    """Encodes prompts and decodes generated ids of one checkpoint."""

    def __init__(self, directory: str):
        path = os.path.join(directory, TOKENIZER_FILE)
        if not os.path.isfile(path):
            raise CheckpointError(path, "file not found")
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as err:  # the tokenizers library raises plain Exception subclasses
            raise CheckpointError(path, f"cannot parse tokenizer ({err})") from None
        cfg = read_json(directory, "tokenizer_config.json", required=False) or {}
        self.add_bos = bool(cfg.get("add_bos_token", False))
        bos = cfg.get("bos_token")
        if isinstance(bos, dict):
            bos = bos.get("content")
        self.bos_token_id = self._tok.token_to_id(bos) if isinstance(bos, str) else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` False leaves out the BOS the checkpoint would add
        (a rendered chat template writes its own)."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def stream(self) -> "IncrementalDecoder":
        return IncrementalDecoder(self)


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas.

    Byte-level BPE can split one UTF-8 character over several tokens; a delta is held back while the
    decoded tail ends in an incomplete character (U+FFFD), so no delta ever contains a broken one.
    """

    # Tokens re-decoded before the new ones, so that merges at the boundary decode in context.
    _CONTEXT = 4

    def __init__(self, tokenizer: TextTokenizer):
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._emitted = 0  # tokens whose text has been emitted
        self._context_start = 0

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; return the text they complete (possibly empty)."""
        self._ids.extend(new_ids)
        prefix = self._tokenizer.decode(self._ids[self._context_start : self._emitted])
        full = self._tokenizer.decode(self._ids[self._context_start :])
        if full.endswith("\ufffd") or len(full) < len(prefix):
            return ""
        self._emitted = len(self._ids)
        self._context_start = max(0, self._emitted - self._CONTEXT)
        return full[len(prefix) :]

    def flush(self) -> str:
        """Whatever is held back at the end of the stream."""
        prefix = self._tokenizer.decode(self._ids[self._context_start : self._emitted])
        full = self._tokenizer.decode(self._ids[self._context_start :])
        self._emitted = len(self._ids)
        return full[len(prefix) :] if full.startswith(prefix) else ""


def load_tokenizer_if_present(directory: str) -> TextTokenizer | None:
    """The checkpoint's tokenizer, or None when it has no tokenizer.json (token-id-only use)."""
    return TextTokenizer(directory) if os.path.isfile(os.path.join(directory, TOKENIZER_FILE)) else None
