"""The OpenAI API's request shapes: JSON bodies in, (prompt ids, SamplingParams) out. Response and
stream-chunk objects are built by ``frontend/openai_output.py``.

Validation is complete and names the parameter: a request the router sees has a known model, a
non-empty prompt within the limits, and sampling parameters that ``SamplingParams.validate`` accepts.
vLLM's sampling surface is served (penalties, min_p, min_tokens, logit_bias, stop_token_ids, n, best_of,
logprobs, echo, prompt_logprobs, ...). Parameters vLLM accepts that magicserve does not implement are
refused by name (``UNSUPPORTED``), never ignored; unknown parameters are refused as the OpenAI API refuses
them. No torch, no HTTP here (``frontend/http_server.py`` serves it).
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from dataclasses import dataclass
from typing import Callable

from frontend.chat_template import ChatTemplate, ChatTemplateError
from frontend.tool_calls import ToolRequest, history_message, parse_tools
from modeling.errors import InvalidRequestError
from modeling.params import MAX_LOGPROBS, SamplingParams
from modeling.request_check import check_token_ids
from modeling.structured_output import (GUIDED_PARAMS, StructuredOutput, constraint_of, from_response_format,
                                        from_structured_outputs)
from modeling.tokenizer import TextTokenizer

COMPLETION_DEFAULT_MAX_TOKENS = 16  # the OpenAI completions API's default
MAX_STOP_SEQUENCES = 4
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

# parameters both routes serve
_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "user",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs", "top_k", "min_p",
           "min_tokens", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
           "spaces_between_special_tokens", "prompt_logprobs", "add_special_tokens", "return_token_ids",
           "return_tokens_as_token_ids", "priority", "structured_outputs", "guided_json", "guided_regex",
           "guided_choice", "guided_grammar"}
COMPLETION_PARAMS = _COMMON | {"prompt", "echo", "best_of", "suffix", "response_format"}
CHAT_PARAMS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                         "parallel_tool_calls", "response_format", "add_generation_prompt"}
# vLLM's parameters magicserve does not implement: refused by name when given a value other than the default
UNSUPPORTED = {
    "use_beam_search": False, "length_penalty": 1.0, "allowed_token_ids": None, "bad_words": None,
    "truncate_prompt_tokens": None, "truncation_side": None, "logprob_token_ids": None, "prompt_embeds": None,
    "guided_decoding_backend": None, "guided_whitespace_pattern": None,
    "watermarking": None, "request_id": None, "session_id": None, "return_token_offsets": False,
    "routed_experts_prompt_start": None, "mm_payload": None, "return_mm_kwargs": False, "cache_salt": None,
    "kv_transfer_params": None, "ec_transfer_params": None, "vllm_xargs": None, "repetition_detection": None,
    "thinking_token_budget": None, "stream_interval": None, "echo": False, "continue_final_message": False,
    "documents": None, "chat_template": None, "chat_template_kwargs": None, "media_io_kwargs": None,
    "mm_processor_kwargs": None, "return_prompt_text": False, "reasoning_effort": None, "include_reasoning": None,
    "functions": None, "function_call": None, "logits_processors": None,
}


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


def unsupported(param: str, reason: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {reason}", param=param, code="unsupported_parameter")


@dataclass(frozen=True)
class ParsedRequest:
    """A validated completion or chat request: what the router runs (``prompt_ids``, ``params``) and how
    the response is shaped."""

    kind: str  # "completion" | "chat"
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool = False  # vLLM's extension: each choice (and chunk) carries its token ids
    priority: int = 0  # the router's priority (higher first); the API's ``priority`` is vLLM's (lower first)
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    echo: bool = False  # completions: the prompt comes back before the output (its log-probabilities too)
    prompt_text: str = ""  # the prompt as text (echo)
    logprobs: int | None = None  # top log-probabilities per output position (chat: top_logprobs); None: off
    return_prompt_logprobs: bool = False  # vLLM's prompt_logprobs extension, returned as asked
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: log-probability tokens as "token_id:N"
    tools: ToolRequest | None = None  # chat: the request's tools and tool_choice (None: no tool calling)
    tool_parser: str | None = None  # chat with tool_choice auto: how calls are found in the output

    @property
    def n(self) -> int:
        return self.params.n


def _number(body: dict, name: str, lo: float, hi: float, default: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise invalid(name, f"must be a number, got {v!r}")
    if v > hi or v < lo or (lo_open and v == lo):
        raise invalid(name, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v:g}")
    return float(v)


def _integer(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(name, f"must be an integer, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise invalid(name, f"must be in [{lo}, {hi}], got {v}" if hi is not None else f"must be >= {lo}, got {v}")
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
        raise unsupported(name, what)


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
    # compiles (validates) a grammar against the model's vocabulary, raising InvalidRequestError; None: the
    # workers alone check it (a bad grammar then fails the request when it is admitted)
    grammar_check: Callable[[StructuredOutput], object] | None = None
    # how tool calls are found in free output (tool_choice auto; frontend/tool_calls.py); None: auto refused
    tool_parser: str | None = "hermes"

    # -- requests ---------------------------------------------------------------------------------

    def completion(self, body) -> ParsedRequest:
        body = self._check_body(body, COMPLETION_PARAMS)
        _refuse_unless(body, "suffix", ("",), "suffix (insertion) is not supported")
        echo = _flag(body, "echo")
        ids, text = self._completion_prompt(body.get("prompt"), _flag(body, "add_special_tokens", True))
        logprobs = _integer(body, "logprobs", 0, MAX_LOGPROBS)
        max_tokens = _integer(body, "max_tokens")
        if max_tokens == 0 and not echo:
            raise invalid("max_tokens", "must be >= 1 (0 only with echo: true, which returns the prompt alone)")
        extras = {"logprobs": logprobs, "echo": echo, "prompt_text": text if echo else "",
                  "structured": self._structured(body)}
        return self._parsed("completion", body, ids, max_tokens, "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS, extras)

    def chat(self, body) -> ParsedRequest:
        body = self._check_body(body, CHAT_PARAMS)
        structured = self._structured(body)
        tools = self._tools(body, structured)
        if tools is not None and tools.constraint() is not None:
            structured = self._checked(tools.constraint())
        logprobs = _flag(body, "logprobs")
        top = _integer(body, "top_logprobs", 0, MAX_LOGPROBS)
        if top is not None and not logprobs:
            raise invalid("top_logprobs", "needs logprobs: true")
        messages = self._messages(body.get("messages"))
        if self.chat_template is None:
            raise invalid("messages", "the model has no chat template (chat_template in tokenizer_config.json or "
                                      "chat_template.jinja); use /v1/completions")
        try:
            text = self.chat_template.render(messages, _flag(body, "add_generation_prompt", True),
                                             tools=tools.template_tools() if tools is not None else None)
        except ChatTemplateError as err:
            raise invalid("messages", str(err).split(": ", 1)[-1]) from None
        # the rendered template writes its own special tokens (add_special_tokens false, as vLLM's default)
        ids = self._limit(self.tokenizer.encode(text, add_special_tokens=_flag(body, "add_special_tokens")),
                          "messages")
        name, value = (("max_completion_tokens", body["max_completion_tokens"])
                       if body.get("max_completion_tokens") is not None else ("max_tokens", body.get("max_tokens")))
        default = max(1, min(self.max_tokens, self.max_model_len - len(ids)))
        value = _integer({name: value}, name)
        parsed = self._parsed("chat", body, ids, value, name, default,
                              {"logprobs": (top or 0) if logprobs else None, "structured": structured})
        return dataclasses.replace(parsed, tools=tools, tool_parser=self.tool_parser) if tools is not None else parsed

    def _tools(self, body: dict, structured: StructuredOutput | None) -> ToolRequest | None:
        """``tools``, ``tool_choice`` and ``parallel_tool_calls``: the request's tool calling, or None."""
        try:
            tools = parse_tools(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))
        except InvalidRequestError as err:
            raise invalid(err.field, err.reason) from None
        if tools is None:
            return None
        if tools.choice == "auto" and self.tool_parser is None:
            raise invalid("tool_choice", "\"auto\" needs a tool-call parser (server.tool_call_parser); use "
                                         "\"required\", a named function, or \"none\"")
        if tools.constraint() is not None and structured is not None:
            raise invalid("tool_choice", f"\"{tools.choice}\" constrains the output to a tool call: it cannot be "
                                         "combined with response_format or structured_outputs")
        return tools

    def _check_body(self, body, allowed: set[str]) -> dict:
        if not isinstance(body, dict):
            raise OpenAIError(400, "request body: expected a JSON object", param=None, code="invalid_json")
        for name in sorted(set(body) - allowed):
            if name in UNSUPPORTED:
                if body[name] is None or body[name] == UNSUPPORTED[name]:
                    continue  # the default: nothing asked of us
                raise unsupported(name, "is not supported by magicserve (see docs/http_api.md for what is)")
            raise OpenAIError(400, f"{name}: unrecognized request argument; supported: {', '.join(sorted(allowed))}",
                              param=name, code="unknown_parameter")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise invalid("model", "required: the served model's id (GET /v1/models)")
        if model != self.model_name:
            raise OpenAIError(404, f"model: {model!r} is not served here; this server serves {self.model_name!r}",
                              param="model", code="model_not_found")
        if body.get("user") is not None and not isinstance(body["user"], str):
            raise invalid("user", f"must be a string, got {body['user']!r}")
        return body

    def _completion_prompt(self, prompt, add_special_tokens: bool) -> tuple[list[int], str]:
        """(token ids, the prompt's text: as given, or the ids decoded)."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise invalid("prompt", "must not be empty")
            return self._limit(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens), "prompt"), prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            try:
                ids = check_token_ids(prompt, self.vocab_size, "prompt")
            except InvalidRequestError as err:
                raise invalid(err.field, err.reason) from None
            ids = self._limit(ids, "prompt")
            return ids, self.tokenizer.decode(ids, skip_special_tokens=False)
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
            if role == "tool" or (role == "assistant" and m.get("tool_calls")):
                try:
                    out.append(history_message(m, where))
                except InvalidRequestError as err:
                    raise invalid(err.field, err.reason) from None
                continue
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

    def _parsed(self, kind: str, body: dict, ids: list[int], max_tokens: int | None, max_name: str, default: int,
                extras: dict) -> ParsedRequest:
        if max_tokens is None:
            max_tokens = default
        low = 0 if extras.get("echo") else 1
        if not low <= max_tokens <= self.max_tokens:
            raise invalid(max_name, f"must be in [{low}, {self.max_tokens}], got {max_tokens}")
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
        include_usage, continuous = self._stream_options(body, stream)
        n = _integer(body, "n", 1) or 1
        best_of = _integer(body, "best_of", 1)
        if best_of is not None and best_of != n and stream:
            raise invalid("best_of", "cannot be streamed: best_of > n picks its choices once all have finished")
        echo = extras.get("echo", False)
        logprobs = extras.get("logprobs")
        prompt_logprobs = _integer(body, "prompt_logprobs", 0, MAX_LOGPROBS)
        if prompt_logprobs is not None and stream:
            raise invalid("prompt_logprobs", "is not available when stream is true")
        # echo scores the prompt with as many top log-probabilities as the output's (vLLM's rule)
        internal_prompt_logprobs = prompt_logprobs if prompt_logprobs is not None else (
            logprobs if echo and logprobs is not None else None)
        stop_ids = body.get("stop_token_ids") or []
        if not isinstance(stop_ids, list):
            raise invalid("stop_token_ids", f"must be a list of token ids, got {stop_ids!r}")
        params = SamplingParams(
            max_tokens=max_tokens, temperature=_number(body, "temperature", 0.0, 2.0, 1.0),
            top_p=_number(body, "top_p", 0.0, 1.0, 1.0, lo_open=True), top_k=max(0, top_k or 0),
            seed=_integer(body, "seed"), stop=tuple(stop), stop_token_ids=tuple(stop_ids),
            ignore_eos=_flag(body, "ignore_eos"),
            presence_penalty=_number(body, "presence_penalty", -2.0, 2.0, 0.0),
            frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0, 0.0),
            repetition_penalty=_number(body, "repetition_penalty", 0.0, 10.0, 1.0, lo_open=True),
            min_p=_number(body, "min_p", 0.0, 1.0, 0.0), min_tokens=_integer(body, "min_tokens", 0) or 0,
            logit_bias=self._logit_bias(body.get("logit_bias")),
            include_stop_str_in_output=_flag(body, "include_stop_str_in_output"),
            logprobs=logprobs,
            prompt_logprobs=internal_prompt_logprobs,
            skip_special_tokens=_flag(body, "skip_special_tokens", True),
            spaces_between_special_tokens=_flag(body, "spaces_between_special_tokens", True),
            n=n, best_of=best_of, structured=extras.get("structured"))
        try:
            params = params.with_ranking_logprobs().validate(self.vocab_size)
        except InvalidRequestError as err:
            raise invalid(err.field, err.reason) from None
        priority = _integer(body, "priority") or 0
        if not -(1 << 31) <= priority < 1 << 31:
            raise invalid("priority", f"must be a 32-bit integer, got {priority}")
        return ParsedRequest(kind, body["model"], ids, params, stream, include_usage, _flag(body, "return_token_ids"),
                             -priority, continuous, echo, extras.get("prompt_text", ""), logprobs,
                             prompt_logprobs is not None, _flag(body, "return_tokens_as_token_ids"))

    def _structured(self, body: dict) -> StructuredOutput | None:
        """The output constraint of ``response_format``, ``structured_outputs`` or a ``guided_*`` parameter
        (at most one of them), compiled once here so that a grammar the engine refuses is a 400 naming the
        part of it before anything is admitted."""
        given = [name for name in ("response_format", "structured_outputs", *GUIDED_PARAMS)
                 if body.get(name) is not None and body[name] != {"type": "text"}]
        if len(given) > 1:
            raise invalid(given[1], f"cannot be combined with {given[0]}: give one output constraint")
        if not given:
            return None
        name = given[0]
        try:
            if name == "response_format":
                out = from_response_format(body[name])
            elif name == "structured_outputs":
                out = from_structured_outputs(body[name])
            else:
                out = constraint_of(GUIDED_PARAMS[name], body[name], name)
        except InvalidRequestError as err:
            raise invalid(err.field, err.reason) from None
        return None if out is None else self._checked(out)

    def _checked(self, out: StructuredOutput) -> StructuredOutput:
        """``out`` once the engine compiled it (a 400 naming where it was given otherwise)."""
        if self.grammar_check is not None:
            try:
                self.grammar_check(out)
            except InvalidRequestError as err:
                raise invalid(err.field, err.reason) from None
        return out

    @staticmethod
    def _stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
        """(include_usage, continuous_usage_stats) from ``stream_options``."""
        options = body.get("stream_options")
        if options is None:
            return False, False
        if not stream:
            raise invalid("stream_options", "only allowed when stream is true")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise invalid("stream_options", "must be an object with include_usage and continuous_usage_stats")
        return _flag(options, "include_usage"), _flag(options, "continuous_usage_stats")

    def _logit_bias(self, bias) -> dict[int, float]:
        """OpenAI's ``{"token id": bias}`` (keys are strings in JSON) -> {id: bias}."""
        if bias is None:
            return {}
        if not isinstance(bias, dict):
            raise invalid("logit_bias", f"must be an object mapping token ids to biases, got {bias!r}")
        out = {}
        for key, value in bias.items():
            try:
                tok = int(key)
            except (TypeError, ValueError):
                raise invalid("logit_bias", f"keys must be token ids, got {key!r}") from None
            if not 0 <= tok < self.vocab_size:
                raise invalid("logit_bias", f"token ids must be in [0, {self.vocab_size}), got {tok}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise invalid(f"logit_bias[{key}]", f"must be a number in [-100, 100], got {value!r}")
            out[tok] = float(value)
        return out

    # -- responses --------------------------------------------------------------------------------

    @staticmethod
    def new_id(kind: str) -> str:
        return ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex

