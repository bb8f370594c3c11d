"""The OpenAI API's response shapes: whole responses, stream chunks and log-probabilities, for one parsed
request (``frontend/openai_protocol.py``). No torch, no HTTP.

Log-probabilities follow vLLM's rendering of the OpenAI schema:

* completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``; each position's
  ``top_logprobs`` maps the ``logprobs`` most likely tokens and the chosen one to their log-probabilities;
  with ``echo`` the prompt's positions come first (the first has ``null``), and ``text_offset`` advances by
  the length of each token's text;
* chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``
  with ``top_logprobs`` most likely tokens per position;
* vLLM's ``prompt_logprobs`` extension: per prompt position ``null`` (the first) or
  ``{"<token id>": {"logprob", "rank", "decoded_token"}}`` for the prompt's token and the most likely ones.

A token's text is decoded on its own (``TextTokenizer.token_texts``); ``-inf`` is reported as -9999.0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from frontend.openai_protocol import ParsedRequest
from frontend.tool_calls import ToolStream, parse_output, to_openai, tool_parser
from modeling.logprobs import TokenLogprob, cumulative
from modeling.tokenizer import TextTokenizer

MIN_LOGPROB = -9999.0  # what -inf becomes (JSON has no infinity)


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage object; with ``cached_tokens`` (the prompt tokens found cached rather than computed), its
    ``prompt_tokens_details`` too."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def model_list(model_name: str, created: int, max_model_len: int) -> dict:
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                        "owned_by": "magicserve", "root": model_name, "parent": None,
                                        "max_model_len": max_model_len}]}


@dataclass
class ChoiceResult:
    """One finished choice of a non-streamed response, as the router produced it."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def cumulative_logprob(self) -> float:
        return cumulative(self.logprobs)


def best_choices(choices: list[ChoiceResult], n: int) -> list[ChoiceResult]:
    """``best_of``: the ``n`` choices with the highest cumulative log-probability, renumbered 0..n-1."""
    best = sorted(choices, key=lambda c: c.cumulative_logprob, reverse=True)[:n]
    for i, c in enumerate(best):
        c.index = i
    return best


def _with_calls(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish reason for a choice that stopped having made tool calls."""
    return "tool_calls" if called and reason == "stop" else reason


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class ResponseBuilder:
    """Builds the response objects of one request. Streaming keeps, per choice, whether the prompt was
    echoed and the next ``text_offset``."""

    def __init__(self, req: ParsedRequest, tokenizer: TextTokenizer, rid: str, created: int):
        self.req = req
        self.tokenizer = tokenizer
        self.rid = rid
        self.created = created
        self._offsets: dict[int, int] = {}
        self._echoed: set[int] = set()
        self._parser = tool_parser(req.tool_parser) if req.tools is not None and req.tool_parser else None
        self._tool_streams: dict[int, ToolStream] = {}

    @property
    def _object(self) -> str:
        return "text_completion" if self.req.kind == "completion" else "chat.completion"

    # -- whole responses --------------------------------------------------------------------------

    def response(self, choices: list[ChoiceResult], prompt_tokens: int, completion_tokens: int,
                 prompt_logprobs: list[TokenLogprob | None] | None = None, cached_tokens: int | None = None) -> dict:
        """The whole (non-streamed) response object."""
        req = self.req
        out_choices = []
        for c in sorted(choices, key=lambda c: c.index):
            if req.kind == "completion":
                ids, lps, text = c.token_ids, c.logprobs, c.text
                if req.echo:
                    ids, text = self._echo_ids(c.token_ids), req.prompt_text + c.text
                    lps = list(prompt_logprobs or [None] * len(req.prompt_ids)) + list(c.logprobs)
                choice = {"index": c.index, "text": text, "logprobs": self._completion_logprobs(c.index, ids, lps),
                          "finish_reason": c.finish_reason}
                if req.return_prompt_logprobs:
                    choice["prompt_logprobs"] = self.prompt_logprobs(prompt_logprobs)
            else:
                message, reason = self._message(c)
                choice = {"index": c.index, "message": message,
                          "logprobs": self._chat_logprobs(c.token_ids, c.logprobs), "finish_reason": reason}
            if req.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
            out_choices.append(choice)
        body = {"id": self.rid, "object": self._object, "created": self.created, "model": req.model,
                "choices": out_choices, "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
        if req.kind == "chat" and req.return_prompt_logprobs:
            body["prompt_logprobs"] = self.prompt_logprobs(prompt_logprobs)
        return body

    def _message(self, c: ChoiceResult) -> tuple[dict, str | None]:
        """A chat choice's message and finish reason: with tools, the calls found in (or forced on) the
        output, and ``"tool_calls"`` for a choice that stopped with calls."""
        if self.req.tools is None:
            return {"role": "assistant", "content": c.text}, c.finish_reason
        parsed = parse_output(self.req.tools, c.text, self._parser)
        message = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            message["tool_calls"] = [to_openai(call) for call in parsed.calls]
        return message, _with_calls(c.finish_reason, bool(parsed.calls))

    # -- streams ----------------------------------------------------------------------------------

    def tool_deltas(self, index: int, text: str) -> list[dict]:
        """A chat choice's stream deltas for its next text, with tools (content, tool-call pieces)."""
        return self._tool_stream(index).feed(text)

    def tool_finish(self, index: int, reason: str) -> tuple[list[dict], str]:
        """The deltas still held when a chat choice ends, and its finish reason."""
        stream = self._tool_stream(index)
        deltas = stream.finish()
        return deltas, _with_calls(reason, stream.called)

    def _tool_stream(self, index: int) -> ToolStream:
        if index not in self._tool_streams:
            self._tool_streams[index] = ToolStream(self.req.tools, self._parser)
        return self._tool_streams[index]

    def chunk(self, index: int, text: str | None, token_ids: list[int] = (), logprobs=(), reason: str | None = None,
              first: bool = False, prompt_logprobs=None, usage_so_far: dict | None = None,
              delta: dict | None = None) -> dict:
        """One streamed chunk of choice ``index``: a text delta with its token ids and log-probabilities, or
        (``reason`` set) the choice's last chunk. The chat stream's first chunk of a choice carries the
        assistant role; with ``echo``, the completion stream's first chunk of a choice carries the prompt.
        ``delta`` (chat): the delta object itself, in place of the text's (tool calls)."""
        req = self.req
        if req.kind == "completion":
            ids, lps, text = list(token_ids), list(logprobs), text or ""
            if req.echo and index not in self._echoed:
                self._echoed.add(index)
                ids, text = self._echo_ids(ids), req.prompt_text + text
                lps = list(prompt_logprobs or [None] * len(req.prompt_ids)) + lps
            choice = {"index": index, "text": text, "logprobs": self._completion_logprobs(index, ids, lps),
                      "finish_reason": reason}
            obj = "text_completion"
        else:
            if delta is None:
                delta = {} if text is None else {"content": text}
            if first:
                delta = {"role": "assistant", **delta}
            choice = {"index": index, "delta": delta, "logprobs": self._chat_logprobs(list(token_ids), list(logprobs)),
                      "finish_reason": reason}
            obj = "chat.completion.chunk"
        if req.return_token_ids:
            choice["token_ids"] = list(token_ids)
        out = {"id": self.rid, "object": obj, "created": self.created, "model": req.model, "choices": [choice]}
        if usage_so_far is not None:
            out["usage"] = usage_so_far
        elif req.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
        """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
        obj = "text_completion" if self.req.kind == "completion" else "chat.completion.chunk"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.req.model, "choices": [],
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}

    # -- log-probabilities ------------------------------------------------------------------------

    def _echo_ids(self, ids: list[int]) -> list[int]:
        return list(self.req.prompt_ids) + list(ids)

    def _texts(self, ids: list[int]) -> list[str]:
        if self.req.tokens_as_ids:
            return [f"token_id:{i}" for i in ids]
        return self.tokenizer.token_texts(ids)

    def _completion_logprobs(self, index: int, ids: list[int], lps: list[TokenLogprob | None]) -> dict | None:
        if self.req.logprobs is None:
            return None
        texts = self._texts(ids)
        wanted = sorted({t for lp in lps if lp is not None for t, _ in lp.top[: self.req.logprobs]})
        names = dict(zip(wanted, self._texts(wanted)))
        out = {"tokens": texts, "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = self._offsets.get(index, 0)
        for text, lp in zip(texts, lps):
            out["text_offset"].append(offset)
            offset += len(text)
            if lp is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_clamp(lp.logprob))
            top = {}
            for tok, value in lp.top[: self.req.logprobs]:
                top[names[tok]] = _clamp(value)
            top.setdefault(text, _clamp(lp.logprob))  # the chosen token is always listed
            out["top_logprobs"].append(top)
        self._offsets[index] = offset
        return out

    def _chat_logprobs(self, ids: list[int], lps: list[TokenLogprob]) -> dict | None:
        if self.req.logprobs is None:
            return None
        texts = self._texts(ids)
        wanted = sorted({t for lp in lps for t, _ in lp.top[: self.req.logprobs]})
        names = dict(zip(wanted, self._texts(wanted)))
        content = []
        for text, lp in zip(texts, lps):
            top = [{"token": names[t], "logprob": _clamp(v), "bytes": list(names[t].encode("utf-8"))}
                   for t, v in lp.top[: self.req.logprobs]]
            content.append({"token": text, "logprob": _clamp(lp.logprob), "bytes": list(text.encode("utf-8")),
                            "top_logprobs": top})
        return {"content": content}

    def prompt_logprobs(self, lps: list[TokenLogprob | None] | None) -> list | None:
        """vLLM's ``prompt_logprobs``: per prompt position null or {token id: {logprob, rank, decoded_token}}."""
        if lps is None:
            return None
        out: list = []
        for tok, lp in zip(self.req.prompt_ids, lps):
            if lp is None:
                out.append(None)
                continue
            entries = {tok: (lp.logprob, lp.rank)}
            for rank, (t, v) in enumerate(lp.top, start=1):
                entries.setdefault(t, (v, rank))
            texts = self._texts(list(entries))
            out.append({str(t): {"logprob": _clamp(v), "rank": r, "decoded_token": text}
                        for (t, (v, r)), text in zip(entries.items(), texts)})
        return out
