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

A mask meets logits in :func:`constrain`. llguidance itself is imported only when a request asks for
structured output (a compiler is built, ``compiler_for``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from functools import lru_cache

import torch

from modeling.errors import InvalidRequestError
from modeling.structured_output import StructuredOutput  # noqa: F401 - re-exported (the grammars' input)


_mask_seconds = [0.0]  # this process's time computing masks (a worker process serves one instance)


def mask_seconds() -> float:
    """Seconds this process has spent computing grammar masks (``GrammarMatcher.allowed``)."""
    return _mask_seconds[0]


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
    """One sequence's position in its grammar. ``allowed``: the tokens that may come next (``constrain``
    applies them to logits); ``advance``: a token was kept; ``rollback``: the last n kept tokens were undone
    (rejected drafts).
    A token is consumed only after the mask allowed it: a refused one would leave the engine in an error
    state that no rollback undoes."""

    def __init__(self, matcher, vocab_size: int):
        self._m = matcher
        self.vocab_size = vocab_size
        self._bits = torch.arange(32, dtype=torch.int32)

    def copy(self) -> "GrammarMatcher":
        """An independent matcher at the same position (a forked sequence, ``n`` > 1)."""
        return GrammarMatcher(self._m.deep_copy(), self.vocab_size)

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more than EOS (the sequence ends)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error() if self._m.is_error() else ""

    def allowed(self) -> torch.Tensor:
        """Bool [vocab_size]: the tokens the grammar allows next (EOS once it may end; EOS alone once finished)."""
        t0 = time.perf_counter()
        words = torch.frombuffer(bytearray(self._m.compute_bitmask()), dtype=torch.int32)
        bits = ((words.unsqueeze(1) >> self._bits) & 1).flatten()[: self.vocab_size].bool()
        _mask_seconds[0] += time.perf_counter() - t0
        return bits

    def path_masks(self, tokens: list[int]) -> torch.Tensor:
        """Bool [len(tokens) + 1, vocab_size]: the mask before each of ``tokens`` and after the last, as if each
        were kept in turn (a verification pass's k + 1 positions over k drafts: the drafts are checked, and
        the recovered or bonus token sampled, under the masks of their positions). The matcher ends where it
        started. See :class:`DraftPath` for the rows past a token the grammar forbids."""
        path = DraftPath(self)
        for token in tokens:
            path.next_mask()
            path.keep(token)
        return path.close()

    def advance(self, token: int) -> None:
        """Keep ``token``; raises ValueError for one the grammar forbids here (the matcher is then unusable)."""
        if not self._m.consume_token(int(token)):
            raise ValueError(f"token {token} is not allowed here: {self._m.get_error()}")

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` kept tokens."""
        if num_tokens and not self._m.rollback(int(num_tokens)):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._m.get_error()}")


class DraftPath:
    """A matcher walked along one sequence's speculated tokens during a step, then returned to where it
    started. Call ``next_mask`` before each position's token is chosen (or checked) and ``keep`` with it;
    ``close`` adds the mask after the last token and gives all of them, [positions + 1, V].

    Rows after a token the grammar forbids (a target-only-masked draft), or after the grammar finished, are
    all True: nothing at or after such a position is ever kept (the forbidden draft is rejected there; a
    finished grammar ends the sequence), and an all-allowed row keeps the arithmetic on them finite."""

    def __init__(self, matcher: GrammarMatcher):
        self.matcher = matcher
        self._rows: list[torch.Tensor | None] = []
        self._kept = 0
        self._off = False  # the path left the grammar (a forbidden token) or the grammar finished

    def next_mask(self) -> torch.Tensor | None:
        """The mask at the next position, or None past the grammar."""
        row = None if self._off else self.matcher.allowed()
        self._rows.append(row)
        return row

    def keep(self, token: int) -> None:
        """``token`` is the path's token at the position of the last ``next_mask``."""
        row = self._rows[-1]
        if row is None or self.matcher.finished or not bool(row[token]):
            self._off = True
            return
        self.matcher.advance(token)
        self._kept += 1

    def close(self) -> torch.Tensor:
        self.next_mask()
        self.matcher.rollback(self._kept)
        everything = torch.ones(self.matcher.vocab_size, dtype=torch.bool)
        return torch.stack([everything if r is None else r for r in self._rows])


def constrain(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """``logits`` [N, V] with the tokens ``masks`` [N, V] forbids at -inf (a new tensor). A row whose allowed
    tokens were all at -inf already (``min_tokens`` holding back the EOS that alone ends a grammar) keeps the
    grammar's tokens at equal logits: the grammar wins, and no row is left without a token to pick."""
    masks = masks.to(logits.device)
    out = logits.masked_fill(~masks, float("-inf"))
    dead = torch.isneginf(out).all(dim=-1)
    if bool(dead.any()):
        out[dead] = torch.zeros_like(out[dead]).masked_fill(~masks[dead], float("-inf"))
    return out


@lru_cache(maxsize=8)
def compiler_for(directory: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> GrammarCompiler:
    """The process's compiler for the checkpoint at ``directory`` (its tokenizer as magicserve loads it)."""
    from modeling.tokenizer import TextTokenizer

    return GrammarCompiler(TextTokenizer(directory).backend_json(), vocab_size, list(eos_token_ids))
