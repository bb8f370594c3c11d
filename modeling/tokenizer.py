"""Tokenizer (``tokenizer.json`` via the ``tokenizers`` library) and incremental detokenization.

Encoding gives the ids of ``transformers.AutoTokenizer.from_pretrained(dir)(text, add_special_tokens=...)``
(transformers 5.x, which the tests compare against) using only the ``tokenizers`` library:

* The special tokens put around a text come only from ``tokenizer.json``'s post-processor: Llama-3's
  TemplateProcessing adds ``<|begin_of_text|>``, a converted Llama-2's adds ``<s>``; a ByteLevel post-processor
  (Qwen2, the bundled model) or none adds nothing. transformers 5 drops ``add_bos_token`` / ``add_eos_token`` of
  ``tokenizer_config.json`` whenever a ``tokenizer.json`` exists, whatever the tokenizer class, so they change
  nothing here either (``add_bos_token: false`` with a template that adds BOS still adds it).
* The named special tokens of ``tokenizer_config.json`` (``bos_token``, ``eos_token``, ``unk_token``, ..., other
  ``*_token`` strings, ``extra_special_tokens`` / ``additional_special_tokens``) and its ``added_tokens_decoder``
  are registered as added tokens the way transformers registers them, so the literal text of a special token maps
  to its id: a chat template that writes ``<|begin_of_text|>`` itself, encoded with ``add_special_tokens=False``,
  gets exactly one BOS. ``split_special_tokens`` is honoured.
* transformers rebuilds the pipeline of some classes in code from the file's vocab and merges; we do the same
  for those in use: ``LlamaTokenizer(Fast)`` whose ``tokenizer.json`` is not ByteLevel (a Llama-3 file declared
  as LlamaTokenizer stays as written, as in transformers) gets Metaspace pre-tokenization with prepend scheme
  "first" (``legacy`` false, the default), "always" (``legacy`` true) or "never" (``add_prefix_space`` false), a
  byte-fallback BPE, no normalizer; ``Qwen2Tokenizer`` gets NFC, Qwen2's split regex and ByteLevel. Every other
  class (``PreTrainedTokenizerFast``, ...) uses ``tokenizer.json`` as written. Only ``tokenizer_config.json``'s
  ``tokenizer_class`` selects the class.
* Truncation and padding stored in ``tokenizer.json`` are turned off.

Decoding (``decode`` and ``stream``) follows vLLM's FastIncrementalDetokenizer (``vllm/v1/engine/detokenizer.py``),
what vLLM does for tokenizer.json-backed tokenizers:

* ``skip_special_tokens``: leave out the tokens registered as special (other added tokens stay), as the
  ``tokenizers`` decoder does; transformers' fast ``decode`` gives the same text.
* ``spaces_between_special_tokens``: only matters when ``skip_special_tokens`` is False. When it is False too,
  an added token (special or not) that directly follows another added token contributes its literal text,
  without the separator the decoder would put before it; decoders that join tokens with spaces (WordPiece, a
  tokenizer without decoder) put one there, ByteLevel and Metaspace decoders do not, so for those nothing changes.
  transformers' fast ``decode`` ignores this option.
* ``clean_up_tokenization_spaces`` is not applied (vLLM's fast path does not; transformers skips it for BPE).
* The text is that of the ids given, not primed with the prompt.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, NamedTuple

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from modeling.checkpoint import read_json
from modeling.errors import CheckpointError

TOKENIZER_FILE = "tokenizer.json"
# Texts longer than this are encoded through ``encode_batch``, which gives the same ids and releases the GIL
# (``encode`` holds it throughout: seconds for a few MB, during which a server's event loop would stall).
_GIL_FREE_CHARS = 1 << 16

# transformers' SPECIAL_TOKENS_ATTRIBUTES: named special tokens, whatever the value type
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_ADDED_TOKEN_FIELDS = ("single_word", "lstrip", "rstrip", "normalized", "special")
# transformers' Qwen2Tokenizer pre-tokenization regex (models/qwen2/tokenization_qwen2.py)
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


class TextTokenizer:
    """Encodes prompts and decodes generated ids of one checkpoint, as transformers and vLLM do (module doc)."""

    def __init__(self, directory: str):
        self._tok, cfg = _load_backend(directory)
        bos = _content(cfg.get("bos_token"))
        self.bos_token_id: int | None = self._tok.token_to_id(bos) if bos is not None else None
        # id -> literal text of every added token (special or not), for spaces_between_special_tokens
        self._added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
        self._prefix_ids = _added_prefix(self._tok)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def backend_json(self) -> str:
        """The tokenizer as loaded (``tokenizer.json`` after the adjustments above), serialised: what a grammar
        engine builds its token trie from."""
        return self._tok.to_str()

    @property
    def add_bos(self) -> bool:
        """Whether ``encode(text)`` (add_special_tokens=True) starts with the BOS token."""
        return self.bos_token_id is not None and self._prefix_ids[:1] == [self.bos_token_id]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, as transformers' ``tok(text, add_special_tokens=...).input_ids``.

        ``add_special_tokens`` False leaves out what the post-processor adds (BOS, EOS); special tokens written in
        the text (a rendered chat template writes its own BOS) map to their ids either way.
        """
        if len(text) > _GIL_FREE_CHARS:  # the batch call releases the GIL: a long text stalls no other thread
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        """Text of ``ids``; equals the concatenated deltas of ``stream`` with the same options (module doc)."""
        if skip_special_tokens or spaces_between_special_tokens:
            return self._decode_plain(ids, skip_special_tokens)
        decoder = self.stream(skip_special_tokens, spaces_between_special_tokens)
        return decoder.push(ids) + decoder.flush()

    def stream(self, skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> "IncrementalDecoder":
        """An incremental decoder of generated ids with these decode options."""
        return IncrementalDecoder(self, skip_special_tokens, spaces_between_special_tokens)

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's text on its own, as vLLM renders log-probability tokens
        (``convert_ids_list_to_tokens``): the token decoded alone, special tokens kept, with the leading spaces
        a Metaspace decoder strips from a piece that starts with its marker put back."""
        texts = [self._tok.decode([i], skip_special_tokens=False) for i in ids]
        marker = self._space_marker
        if marker is None:
            return texts
        out = []
        for i, text in zip(ids, texts):
            piece = self._tok.id_to_token(i) or ""
            markers = len(piece) - len(piece.lstrip(marker))
            missing = markers - (len(text) - len(text.lstrip(" ")))
            out.append(" " * missing + text if missing > 0 else text)
        return out

    @property
    def _space_marker(self) -> str | None:
        """The Metaspace pre-tokenizer's replacement character (SentencePiece-style vocabularies), if any."""
        if not hasattr(self, "_marker"):
            pre = json.loads(self._tok.to_str()).get("pre_tokenizer") or {}
            subs = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
            self._marker = next((p.get("replacement", "\u2581") for p in subs if p.get("type") == "Metaspace"), None)
        return self._marker

    def _decode_plain(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas.

    Byte-level BPE can split one UTF-8 character over several tokens; a delta is held back while the
    decoded tail ends in an incomplete character (U+FFFD), so no delta ever contains a broken one.
    Concatenated deltas (pushes, then ``flush``) equal ``TextTokenizer.decode`` of all ids with the same options.
    """

    # Tokens re-decoded before the new ones, so that merges at the boundary decode in context.
    _CONTEXT = 4

    def __init__(self, tokenizer: TextTokenizer, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # vLLM: skipping special tokens implies spaces between them (nothing is left to join)
        self._join_added = not (skip_special_tokens or spaces_between_special_tokens)
        self._ids: list[int] = []
        self._emitted = 0  # tokens whose text has been emitted
        self._context_start = 0

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; return the text they complete (possibly empty)."""
        pieces = []
        start = 0
        if self._join_added:
            added = self._tokenizer._added
            for i, token in enumerate(new_ids):
                previous = new_ids[i - 1] if i else (self._ids[-1] if self._ids else None)
                if token in added and previous in added:
                    pieces.append(self._advance(new_ids[start:i], force=True))
                    pieces.append(self._literal(token))
                    start = i + 1
        pieces.append(self._advance(new_ids[start:], force=False))
        return "".join(pieces)

    def flush(self) -> str:
        """Whatever is held back at the end of the stream."""
        return self._advance([], force=True)

    def _advance(self, new_ids: list[int], force: bool) -> str:
        """Append ``new_ids`` and emit the text decoded since the last emission, unless it ends mid-character
        (or shrank) and ``force`` is False."""
        self._ids.extend(new_ids)
        if self._emitted == len(self._ids):
            return ""
        prefix = self._decode(self._ids[self._context_start : self._emitted])
        # decoders treat the start of the text apart (Llama-2's strips one leading space): widen the context
        # while it decodes to nothing (only skipped tokens) so that the new text is never at the start
        while not prefix and self._context_start > 0:
            self._context_start = max(0, self._context_start - self._CONTEXT)
            prefix = self._decode(self._ids[self._context_start : self._emitted])
        full = self._decode(self._ids[self._context_start :])
        if not force and (full.endswith("\ufffd") or len(full) < len(prefix)):
            return ""
        self._emitted = len(self._ids)
        self._context_start = max(0, self._emitted - self._CONTEXT)
        return full[len(prefix) :] if not force or full.startswith(prefix) else ""

    def _literal(self, token: int) -> str:
        """Emit an added token that follows another one as its bare text (spaces_between_special_tokens=False)."""
        self._ids.append(token)
        self._emitted = len(self._ids)
        self._context_start = max(0, self._emitted - self._CONTEXT)
        return self._tokenizer._added[token]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer._decode_plain(ids, self._skip)


def load_tokenizer_if_present(directory: str) -> TextTokenizer | None:
    """The checkpoint's tokenizer, or None when it has no tokenizer.json (token-id-only use)."""
    return TextTokenizer(directory) if os.path.isfile(os.path.join(directory, TOKENIZER_FILE)) else None


# -- how transformers reads a checkpoint's tokenizer ---------------------------------------------------------


def _load_backend(directory: str) -> tuple[Tokenizer, dict[str, Any]]:
    """The backend tokenizer transformers would build from the checkpoint, and the tokenizer config (with the
    class's special-token defaults) it read."""
    path = os.path.join(directory, TOKENIZER_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(path, "file not found")
    try:
        with open(path, encoding="utf-8") as f:
            raw = f.read()
        tok = Tokenizer.from_str(raw)
    except Exception as err:  # the tokenizers library raises plain Exception subclasses
        raise CheckpointError(path, f"cannot parse tokenizer ({err})") from None
    cfg = _tokenizer_config(directory)
    file_added = tok.get_added_tokens_decoder()
    pipeline = _PIPELINES.get(_tokenizer_class(cfg, raw))
    if pipeline is not None:
        cfg = {**pipeline.defaults, **cfg}
        tok = pipeline.rebuild(tok, json.loads(raw)["model"], cfg)
    tok.no_truncation()
    tok.no_padding()
    _register_special_tokens(tok, cfg, file_added)
    if pipeline is not None and pipeline.after_specials is not None:
        pipeline.after_specials(tok, cfg)
    tok.encode_special_tokens = bool(cfg.get("split_special_tokens", False))
    return tok, cfg


def _tokenizer_config(directory: str) -> dict[str, Any]:
    """``tokenizer_config.json``; without an ``added_tokens_decoder`` there, ``special_tokens_map.json``'s entries
    override it (transformers' legacy path)."""
    cfg = dict(read_json(directory, "tokenizer_config.json", required=False) or {})
    if "added_tokens_decoder" not in cfg:
        for key, value in (read_json(directory, "special_tokens_map.json", required=False) or {}).items():
            if isinstance(value, dict) and key != "extra_special_tokens":
                value = {**value, "special": True}
            cfg[key] = value
    if "additional_special_tokens" in cfg and not cfg.get("extra_special_tokens"):
        cfg["extra_special_tokens"] = cfg.pop("additional_special_tokens")
    return cfg


def _tokenizer_class(cfg: dict[str, Any], raw_json: str) -> str:
    """The class transformers' AutoTokenizer picks, as far as the pipeline goes ("" for the generic one)."""
    name = cfg.get("tokenizer_class")
    if not isinstance(name, str):
        return ""
    name = name.removesuffix("Fast")
    # AutoTokenizer loads a ByteLevel tokenizer.json declared as LlamaTokenizer with the generic class
    if name == "LlamaTokenizer" and '"ByteLevel"' in raw_json:
        return ""
    return name


def _content(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _added_token(value: Any, special: bool | None = None) -> AddedToken | None:
    """An AddedToken from a config value (a string, or a dict of AddedToken fields)."""
    content = _content(value)
    if content is None:
        return None
    if isinstance(value, dict):
        flags = {k: bool(value[k]) for k in _ADDED_TOKEN_FIELDS if k in value}
    else:
        flags = {"special": True, "normalized": False}
    if special is not None:
        flags["special"] = special
    return AddedToken(content, **flags)


def _special_token_values(cfg: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """Config values of transformers' named (and model-specific ``*_token``) special tokens, and its extra ones."""
    named = [cfg[k] for k in _NAMED_SPECIAL if cfg.get(k) is not None]
    named += [v for k, v in cfg.items() if k.endswith("_token") and k not in _NAMED_SPECIAL and isinstance(v, str)]
    extra = cfg.get("extra_special_tokens")
    if isinstance(extra, dict):
        named += [v for v in extra.values() if isinstance(v, str)]
        extra = []
    return named, extra if isinstance(extra, list) else []


def _register_special_tokens(tok: Tokenizer, cfg: dict[str, Any], file_added: dict[int, AddedToken]) -> None:
    """What transformers' TokenizersBackend.__init__ adds to the backend: the added tokens it knows of (the
    config's ``added_tokens_decoder``, else tokenizer.json's) that differ from the backend's, then the special
    tokens the backend still lacks; a named special token is always added as special."""
    present = tok.get_added_tokens_decoder()
    if "added_tokens_decoder" in cfg:
        entries = sorted((int(i), t) for i, t in cfg["added_tokens_decoder"].items() if isinstance(t, dict))
        known = [t for t in (_added_token(e) for _, e in entries) if t is not None]
    else:
        known = [file_added[i] for i in sorted(file_added)]
    have = {repr(t) for t in present.values()}
    to_add = [t for t in known if repr(t) not in have]
    names = {t.content for t in present.values()} | {t.content for t in to_add}
    named, extra = (_tokens(values) for values in _special_token_values(cfg))
    for token in named + extra:
        if token.content not in names:
            to_add.append(token)
            names.add(token.content)
    named_contents = {t.content for t in named}
    to_add = [_added_token(_fields(t), special=True) if t.content in named_contents else t for t in to_add]
    if to_add:
        tok.add_tokens(to_add)


def _tokens(values: list[Any]) -> list[AddedToken]:
    return [t for t in map(_added_token, values) if t is not None]


def _fields(token: AddedToken) -> dict[str, Any]:
    return {"content": token.content, **{k: getattr(token, k) for k in _ADDED_TOKEN_FIELDS}}


def _added_prefix(tok: Tokenizer) -> list[int]:
    """Ids the post-processor puts before a single text."""
    probe = "a"
    bare = tok.encode(probe, add_special_tokens=False).ids
    full = tok.encode(probe, add_special_tokens=True).ids
    for k in range(len(full) - len(bare) + 1):
        if full[k : k + len(bare)] == bare:
            return full[:k]
    return []


def _bpe_parts(model: dict[str, Any]) -> tuple[dict[str, int], list[tuple[str, ...]]]:
    vocab = model.get("vocab", {})
    if isinstance(vocab, list):
        vocab = {(t[0] if isinstance(t, list) else t): i for i, t in enumerate(vocab)}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
    return vocab, merges


def _rebuilt(old: Tokenizer, model: models.Model) -> Tokenizer:
    """A fresh backend around ``model`` with ``old``'s post-processor; its added tokens are registered afresh."""
    tok = Tokenizer(model)
    tok.post_processor = old.post_processor
    return tok


def _llama_pipeline(old: Tokenizer, model: dict[str, Any], cfg: dict[str, Any]) -> Tokenizer:
    """transformers' LlamaTokenizer.__init__ (models/llama/tokenization_llama.py)."""
    if model.get("type") != "BPE":
        return old
    add_prefix_space = cfg.get("add_prefix_space")
    add_prefix_space = True if add_prefix_space is None else bool(add_prefix_space)
    scheme = ("always" if cfg.get("legacy", False) else "first") if add_prefix_space else "never"
    vocab, merges = _bpe_parts(model)
    tok = _rebuilt(old, models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _qwen2_pipeline(old: Tokenizer, model: dict[str, Any], cfg: dict[str, Any]) -> Tokenizer:
    """transformers' Qwen2Tokenizer.__init__ (models/qwen2/tokenization_qwen2.py)."""
    if model.get("type") != "BPE":
        return old
    vocab, merges = _bpe_parts(model)
    tok = _rebuilt(old, models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                                   continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                                   byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=bool(cfg.get("add_prefix_space") or False), use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def _qwen2_specials(tok: Tokenizer, cfg: dict[str, Any]) -> None:
    """Qwen2Tokenizer re-adds all its special tokens as plain special tokens after the generic registration."""
    named, extra = _special_token_values(cfg)
    tok.add_tokens([AddedToken(t.content, special=True) for t in _tokens(named + extra)])


class _ClassPipeline(NamedTuple):
    """What one of transformers' tokenizer classes does beyond the generic one."""

    rebuild: Callable[[Tokenizer, dict[str, Any], dict[str, Any]], Tokenizer]  # (file's backend, its model, config)
    defaults: dict[str, str]  # the class's special-token defaults, for keys the config leaves out
    after_specials: Callable[[Tokenizer, dict[str, Any]], None] | None = None


_PIPELINES = {
    "LlamaTokenizer": _ClassPipeline(_llama_pipeline, {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}),
    "Qwen2Tokenizer": _ClassPipeline(_qwen2_pipeline, {"unk_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                                                       "pad_token": "<|endoftext|>"}, _qwen2_specials),
}
