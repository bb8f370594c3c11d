"""Structured output: the grammars a request may constrain its output to, compiled once per distinct one,
and each sequence's matcher (which tokens may come next; advanced by every token kept, rolled back with
rejected drafts, so speculation can propose and verify under the same masks).

The engine is llguidance (``llguidance`` on PyPI): a Rust matcher with no Python dependencies (xgrammar
pulls transformers and, on Linux, triton into every install), one abi3 wheel for every Python from 3.9, a
token mask in about a millisecond on CPU for JSON schemas over a small vocabulary, and the rollback that
speculative decoding needs. It compiles JSON schemas, regular expressions and Lark grammars; the kinds
requests name (OpenAI's ``response_format``, vLLM's ``structured_outputs``) map onto those:

    json_object   any JSON object
    json_schema   a JSON schema (``response_format.json_schema.schema``)
    regex         a regular expression the whole output matches
    choice        exactly one of the given strings
    grammar       a Lark grammar (llguidance's dialect; GBNF is converted)

Torch enters only where a mask meets logits (:meth:`GrammarMatcher.apply`); the module is imported only by
requests that ask for structured output.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass

import torch

from modeling.errors import InvalidRequestError

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# JSON as ``json.dumps`` writes it (", " and ": ", no other whitespace): a model free to put whitespace between
# tokens can loop on it forever (a small one does); a schema's own "x-guidance" options override these
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match: ``kind`` (one of ``KINDS``) and its ``spec`` as text (the JSON
    schema serialised, the regex, the choices as a JSON list, the grammar; empty for ``json_object``).
    ``field`` names where the request gave it, for errors (e.g. ``response_format.json_schema.schema``)."""

    kind: str
    spec: str = ""
    field: str = "structured_outputs"

    @staticmethod
    def json_schema(schema: dict, field: str = "response_format.json_schema.schema") -> "StructuredOutput":
        if not isinstance(schema, dict):
            raise InvalidRequestError(field, f"must be a JSON object (a JSON schema), got {type(schema).__name__}")
        # key order kept: properties are generated in the order the schema lists them
        return StructuredOutput("json_schema", json.dumps(schema, separators=(",", ":")), field)

    @staticmethod
    def choice(options: list, field: str = "structured_outputs.choice") -> "StructuredOutput":
        if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
            raise InvalidRequestError(field, f"must be a non-empty list of non-empty strings, got {options!r}")
        return StructuredOutput("choice", json.dumps(options), field)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(self.field, f"unknown kind {self.kind!r}; allowed: {', '.join(KINDS)}")
        if self.kind != "json_object" and not self.spec:
            raise InvalidRequestError(self.field, f"a {self.kind} needs its specification")

    def grammar(self) -> str:
        """The llguidance grammar text."""
        from llguidance import LLMatcher, gbnf_to_lark

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_LAYOUT)
        if self.kind == "json_schema":
            try:
                return LLMatcher.grammar_from_json_schema(self.spec, JSON_LAYOUT)
            except ValueError as err:
                raise InvalidRequestError(self.field, f"not a JSON schema: {err}") from None
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            return LLMatcher.grammar_from_regex("|".join(re.escape(o) for o in json.loads(self.spec)))
        lark = self.spec
        if "::=" in lark:  # GBNF (llama.cpp's, vLLM's default grammar syntax)
            try:
                lark = gbnf_to_lark(lark)
            except Exception as err:  # noqa: BLE001 - any conversion failure is the request's grammar
                raise InvalidRequestError(self.field, f"not a valid GBNF grammar: {err}") from None
        return LLMatcher.grammar_from_lark(lark)


class GrammarCompiler:
    """The grammars of one model's vocabulary: each distinct ``StructuredOutput`` is compiled (validated) once
    and kept (least recently used out beyond ``cache_size``); ``matcher`` gives a sequence its own matcher."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int], cache_size: int = 256):
        from llguidance import LLTokenizer

        self.vocab_size = vocab_size
        self.tokenizer = LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)
        self.cache_size = cache_size
        self._grammars: OrderedDict[StructuredOutput, str] = OrderedDict()
        self.compiled = 0  # grammars compiled (cache misses)

    def compile(self, output: StructuredOutput) -> str:
        """The validated grammar of ``output``; raises InvalidRequestError naming the request's field and the
        part the engine could not compile."""
        from llguidance import LLMatcher

        key = StructuredOutput(output.kind, output.spec)  # where the request gave it does not change the grammar
        grammar = self._grammars.get(key)
        if grammar is not None:
            self._grammars.move_to_end(key)
            return grammar
        grammar = output.grammar()
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise InvalidRequestError(output.field, f"cannot be compiled: {messages[0].strip()}")
        self._grammars[key] = grammar
        self.compiled += 1
        if len(self._grammars) > self.cache_size:
            self._grammars.popitem(last=False)
        return grammar

    def matcher(self, output: StructuredOutput) -> "GrammarMatcher":
        from llguidance import LLMatcher

        return GrammarMatcher(LLMatcher(self.tokenizer, self.compile(output)), self.vocab_size)


class GrammarMatcher:
    """One sequence's position in its grammar. ``allowed`` / ``apply``: the tokens that may come next;
    ``advance``: a token was kept; ``rollback``: the last n kept tokens were undone (rejected drafts)."""

    def __init__(self, matcher, vocab_size: int):
        self._m = matcher
        self.vocab_size = vocab_size
        self._bits = torch.arange(32, dtype=torch.int32)

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (the sequence ends)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error() if self._m.is_error() else ""

    def allowed(self) -> torch.Tensor:
        """Bool [vocab_size]: the tokens the grammar allows next (EOS once it may end)."""
        words = torch.frombuffer(bytearray(self._m.compute_bitmask()), dtype=torch.int32)
        bits = ((words.unsqueeze(1) >> self._bits) & 1).flatten()
        return bits[: self.vocab_size].bool()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [V] (or [1, V]) with every token the grammar forbids next at -inf (in place)."""
        mask = self.allowed().to(logits.device)
        logits.masked_fill_(~mask.view(*([1] * (logits.dim() - 1)), -1), float("-inf"))
        return logits

    def path_masks(self, tokens: list[int]) -> torch.Tensor:
        """Bool [len(tokens) + 1, vocab_size]: the mask before each of ``tokens`` and after the last, as if each
        were kept in turn (a verification pass's k + 1 positions over k drafts: the drafts are checked, and
        the recovered or bonus token sampled, under the masks of their positions). From the first token the
        grammar forbids on, the later masks are all False (nothing after it can be kept). The matcher ends
        where it started."""
        masks = torch.zeros(len(tokens) + 1, self.vocab_size, dtype=torch.bool)
        kept = 0
        for i, token in enumerate(tokens):
            masks[i] = self.allowed()
            if not masks[i][token] or not self._m.consume_token(int(token)):
                break
            kept += 1
        else:
            masks[len(tokens)] = self.allowed()
        self.rollback(kept)
        return masks

    def advance(self, token: int) -> None:
        """Keep ``token``; raises ValueError (naming the grammar's complaint) for one it forbids."""
        if not self._m.consume_token(int(token)):
            raise ValueError(f"token {token} is not allowed here: {self._m.get_error()}")

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` kept tokens."""
        if num_tokens and not self._m.rollback(int(num_tokens)):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._m.get_error()}")
