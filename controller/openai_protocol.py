"""The OpenAI API's request and response shapes: JSON bodies in, (prompt ids, SamplingParams) out,
and the response / stream-chunk objects back.

Validation is complete and names the parameter: a request the router sees has a known model, a
non-empty prompt within the limits, and sampling parameters that ``SamplingParams.validate`` accepts.
What magicserve does not implement is refused by name (``n`` > 1, ``logprobs``, ``echo``, penalties,
tools, ...), never ignored. Unknown parameters are refused as the OpenAI API refuses them. No torch, no
HTTP here (``controller/http_server.py`` serves it).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

from controller.chat_template import ChatTemplate, ChatTemplateError
from modeling.errors import InvalidRequestError
from modeling.params import SamplingParams
from modeling.tokenizer import TextTokenizer

COMPLETION_DEFAULT_MAX_TOKENS = 16  # the OpenAI completions API's default
MAX_STOP_SEQUENCES = 4
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "user",
           "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_k", "ignore_eos", "return_token_ids",
           "priority"}
COMPLETION_PARAMS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT_PARAMS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                         "parallel_tool_calls", "response_format", "add_generation_prompt"}


class OpenAIError(Exception):
    """An error as the OpenAI API reports it: HTTP ``status`` and ``{"error": {message, type, param, code}}``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             429: "rate_limit_error", 503: "service_unavailable", 504: "timeout", 500: "internal_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}


# gRPC status names (RouterError.code) -> HTTP status
ROUTER_STATUS = {"RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504, "ALREADY_EXISTS": 400,
                 "INVALID_ARGUMENT": 400}


def invalid(param: str, reason: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {reason}", param=param, code="invalid_value")


@dataclass(frozen=True)
class ParsedRequest:
    """A validated completion or chat request."""

    kind: str  # "completion" | "chat"
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool = False  # vLLM's extension: each choice (and chunk) carries its token ids
    priority: int = 0  # the router's priority (higher first); the API's ``priority`` is vLLM's (lower first)


def _number(body: dict, name: str, lo: float, hi: float, default: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise invalid(name, f"must be a number, got {v!r}")
    if v > hi or v < lo or (lo_open and v == lo):
        raise invalid(name, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v:g}")
    return float(v)


def _integer(body: dict, name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(name, f"must be an integer, got {v!r}")
    return v


def _flag(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(name, f"must be true or false, got {v!r}")
    return v


def _refuse_unless(body: dict, name: str, allowed, what: str) -> None:
    """Refuse ``name`` unless absent or one of ``allowed`` (the values magicserve implements)."""
    v = body.get(name)
    if v is not None and v not in allowed:
        raise OpenAIError(400, f"{name}: {what}", param=name, code="unsupported_parameter")


@dataclass(frozen=True)
class OpenAIProtocol:
    """Turns OpenAI request bodies into router inputs for one served model (``chat_template`` None: the
    model has none, and chat requests are refused)."""

    model_name: str
    tokenizer: TextTokenizer
    chat_template: ChatTemplate | None
    vocab_size: int
    max_prompt_tokens: int
    max_tokens: int
    max_model_len: int

    # -- requests ---------------------------------------------------------------------------------

    def completion(self, body) -> ParsedRequest:
        body = self._check_body(body, COMPLETION_PARAMS)
        _refuse_unless(body, "echo", (False,), "echo is not supported")
        _refuse_unless(body, "best_of", (1,), "only best_of 1 is supported")
        _refuse_unless(body, "suffix", ("",), "suffix (insertion) is not supported")
        _refuse_unless(body, "logprobs", (), "logprobs are not supported; leave it out or null")
        ids = self._completion_prompt(body.get("prompt"))
        return self._parsed("completion", body, ids, body.get("max_tokens"), "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)

    def chat(self, body) -> ParsedRequest:
        body = self._check_body(body, CHAT_PARAMS)
        _refuse_unless(body, "logprobs", (False,), "logprobs are not supported; leave it out or false")
        _refuse_unless(body, "top_logprobs", (), "logprobs are not supported; leave top_logprobs out")
        _refuse_unless(body, "tools", ([],), "tool calling is not supported")
        _refuse_unless(body, "tool_choice", ("none",), "tool calling is not supported")
        _refuse_unless(body, "response_format", ({"type": "text"},), "only response_format {\"type\": \"text\"} is supported")
        messages = self._messages(body.get("messages"))
        if self.chat_template is None:
            raise invalid("messages", "the model has no chat template (chat_template in tokenizer_config.json or "
                                      "chat_template.jinja); use /v1/completions")
        try:
            text = self.chat_template.render(messages, _flag(body, "add_generation_prompt", True))
        except ChatTemplateError as err:
            raise invalid("messages", str(err).split(": ", 1)[-1]) from None
        ids = self._limit(self.tokenizer.encode(text, add_special_tokens=False), "messages")
        name, value = (("max_completion_tokens", body["max_completion_tokens"])
                       if body.get("max_completion_tokens") is not None else ("max_tokens", body.get("max_tokens")))
        default = max(1, min(self.max_tokens, self.max_model_len - len(ids)))
        return self._parsed("chat", body, ids, value, name, default)

    def _check_body(self, body, allowed: set[str]) -> dict:
        if not isinstance(body, dict):
            raise OpenAIError(400, "request body: expected a JSON object", param=None, code="invalid_json")
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise OpenAIError(400, f"{unknown[0]}: unrecognized request argument; supported: {', '.join(sorted(allowed))}",
                              param=unknown[0], code="unknown_parameter")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise invalid("model", "required: the served model's id (GET /v1/models)")
        if model != self.model_name:
            raise OpenAIError(404, f"model: {model!r} is not served here; this server serves {self.model_name!r}",
                              param="model", code="model_not_found")
        _refuse_unless(body, "n", (1,), "only n 1 is supported; send several requests for several choices")
        for name in ("presence_penalty", "frequency_penalty"):
            _refuse_unless(body, name, (0, 0.0), f"{name} is not supported (only 0)")
        _refuse_unless(body, "logit_bias", ({},), "logit_bias is not supported")
        if body.get("user") is not None and not isinstance(body["user"], str):
            raise invalid("user", f"must be a string, got {body['user']!r}")
        return body

    def _completion_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise invalid("prompt", "must not be empty")
            return self._limit(self.tokenizer.encode(prompt), "prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            for i, t in enumerate(prompt):
                if not 0 <= t < self.vocab_size:
                    raise invalid(f"prompt[{i}]", f"token ids must be in [0, {self.vocab_size}), got {t}")
            return self._limit(list(prompt), "prompt")
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise invalid("prompt", "batches of several prompts are not supported; send one request per prompt")
        raise invalid("prompt", "required: a string, or a non-empty list of token ids")

    def _messages(self, messages) -> list[dict]:
        if not isinstance(messages, list) or not messages:
            raise invalid("messages", "required: a non-empty list of {role, content} objects")
        out = []
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise invalid(where, "must be an object with role and content")
            role = m.get("role")
            if role not in CHAT_ROLES:
                raise invalid(f"{where}.role", f"must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                texts = []
                for j, part in enumerate(content):
                    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise invalid(f"{where}.content[{j}]", "only {\"type\": \"text\", \"text\": ...} parts are supported")
                    texts.append(part["text"])
                content = "".join(texts)
            if not isinstance(content, str):
                raise invalid(f"{where}.content", "must be a string or a list of text parts")
            msg = {"role": role, "content": content}
            if isinstance(m.get("name"), str):
                msg["name"] = m["name"]
            out.append(msg)
        return out

    def _limit(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise invalid(param, "encodes to no tokens")
        if len(ids) > self.max_prompt_tokens:
            raise invalid(param, f"{len(ids)} tokens exceed the limit of {self.max_prompt_tokens}")
        return ids

    def _parsed(self, kind: str, body: dict, ids: list[int], max_tokens, max_name: str, default: int) -> ParsedRequest:
        max_tokens = _integer({max_name: max_tokens}, max_name)
        if max_tokens is None:
            max_tokens = default
        if not 1 <= max_tokens <= self.max_tokens:
            raise invalid(max_name, f"must be in [1, {self.max_tokens}], got {max_tokens}")
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is None:
            stop = []
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP_SEQUENCES:
            raise invalid("stop", f"must be a non-empty string or a list of up to {MAX_STOP_SEQUENCES} of them")
        top_k = _integer(body, "top_k")
        if top_k is not None and top_k < -1:
            raise invalid("top_k", f"must be >= 1, or 0 / -1 for no limit, got {top_k}")
        stream = _flag(body, "stream")
        options = body.get("stream_options")
        if options is not None:
            if not stream:
                raise invalid("stream_options", "only allowed when stream is true")
            if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
                raise invalid("stream_options", "must be an object with include_usage")
        include_usage = _flag(options or {}, "include_usage") if options else False
        params = SamplingParams(
            max_tokens=max_tokens, temperature=_number(body, "temperature", 0.0, 2.0, 1.0),
            top_p=_number(body, "top_p", 0.0, 1.0, 1.0, lo_open=True), top_k=max(0, top_k or 0),
            seed=_integer(body, "seed"), stop=tuple(stop), ignore_eos=_flag(body, "ignore_eos"))
        try:
            params = params.validate(self.vocab_size)
        except InvalidRequestError as err:
            raise invalid(err.field, err.reason) from None
        priority = _integer(body, "priority") or 0
        if not -(1 << 31) <= priority < 1 << 31:
            raise invalid("priority", f"must be a 32-bit integer, got {priority}")
        return ParsedRequest(kind, body["model"], ids, params, stream, include_usage, _flag(body, "return_token_ids"),
                             -priority)

    # -- responses --------------------------------------------------------------------------------

    @staticmethod
    def new_id(kind: str) -> str:
        return ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(req: ParsedRequest, rid: str, created: int, text: str, reason: str, prompt_tokens: int,
             completion_tokens: int, token_ids: list[int] | None = None) -> dict:
    """The whole (non-streamed) response object."""
    if req.kind == "completion":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": reason}
        obj = "chat.completion"
    if req.return_token_ids:
        choice["token_ids"] = list(token_ids or [])
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens)}


def chunk(req: ParsedRequest, rid: str, created: int, text: str | None, reason: str | None = None,
          first: bool = False, token_ids: list[int] | None = None) -> dict:
    """One streamed chunk: a text delta, or (``reason`` set) the choice's last chunk. The chat stream's
    first chunk carries the assistant role."""
    if req.kind == "completion":
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    else:
        delta = {} if text is None else {"content": text}
        if first:
            delta = {"role": "assistant", **delta}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        obj = "chat.completion.chunk"
    if req.return_token_ids:
        choice["token_ids"] = list(token_ids or [])
    out = {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice]}
    if req.include_usage:
        out["usage"] = None
    return out


def usage_chunk(req: ParsedRequest, rid: str, created: int, prompt_tokens: int, completion_tokens: int) -> dict:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def model_list(model_name: str, created: int, max_model_len: int) -> dict:
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                        "owned_by": "magicserve", "max_model_len": max_model_len}]}


def now() -> int:
    return int(time.time())
