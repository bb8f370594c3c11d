"""Tool calling as the OpenAI Chat Completions API defines it and vLLM serves it: the request's ``tools`` /
``tool_choice`` / ``parallel_tool_calls`` validated (:func:`parse_tools`), the grammar a forced call is
generated under (:meth:`ToolRequest.constraint`), the model's output turned into tool calls whole
(:func:`parse_output`) or as stream deltas (:class:`ToolStream`), and assistant / tool messages of the
conversation normalised for the chat template (:func:`history_message`).

How the output becomes calls depends on ``tool_choice``:

    none      the output is content
    named     the output is the arguments object of the named function (generated under its schema)
    required  the output is a JSON array ``[{"name": ..., "parameters": {...}}, ...]`` (generated under a
              schema that admits only the request's tools)
    auto      a tool-call parser (:func:`tool_parser`) finds the calls the model wrote in its free text:
              ``hermes`` (Qwen, Hermes: ``<tool_call>{...}</tool_call>`` blocks) or ``llama3_json``
              (Llama 3.1 / 3.2: the whole output is ``{"name": ..., "parameters": {...}}``, several
              separated by ``; ``)

The streamed and the whole-output paths give the same calls (names and arguments) and the same content;
only the call ids differ. A call to a function the request did not offer is returned as the model wrote
it (the client decides what to do with it). A choice with calls finishes with ``finish_reason``
``"tool_calls"`` (:attr:`ToolStream.called`, ``ParsedToolOutput.calls``), whichever ``tool_choice`` made
them. No torch, no HTTP here.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from modeling.errors import InvalidRequestError
from modeling.structured_output import StructuredOutput

MAX_TOOLS = 128
TOOL_CHOICES = ("none", "auto", "required")
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}", re.ASCII)
_TOOL_KEYS = ("type", "function")
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")
_DEFAULT_PARAMETERS = {"type": "object", "properties": {}}
_NAMED_SHAPE = '{"type": "function", "function": {"name": ...}}'


def _kind(v) -> str:
    return "null" if v is None else type(v).__name__


def _dumps(obj) -> str:
    """JSON text as the arguments of a call carry it (``json.dumps`` layout, non-ASCII kept)."""
    return json.dumps(obj, ensure_ascii=False)


def new_call_id() -> str:
    """A fresh tool-call id: ``call_`` and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


# -- the request ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    """One function the model may call. ``parameters`` is its JSON schema (an object with no properties
    where the request gave none); ``description`` and ``strict`` are None where not given."""

    name: str
    parameters: dict
    description: str | None = None
    strict: bool | None = None

    def template(self) -> dict:
        """The tool as chat templates receive it: ``{"type": "function", "function": {...}}``."""
        function: dict = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    """A request's validated tools. ``choice`` is ``none`` (tools shown to the model, no calls parsed),
    ``auto`` (the model decides), ``required`` (at least one call) or ``named`` (a call of ``named``).
    ``parallel`` false allows at most one call."""

    tools: tuple[Tool, ...]
    choice: str
    named: str | None = None
    parallel: bool = True

    def tool(self, name: str) -> Tool | None:
        """The offered tool called ``name``, or None."""
        return next((t for t in self.tools if t.name == name), None)

    def template_tools(self) -> list[dict]:
        """The tools as ``apply_chat_template(tools=...)`` receives them (the OpenAI dicts)."""
        return [t.template() for t in self.tools]

    def constraint(self) -> StructuredOutput | None:
        """What the output must match: the named function's parameters schema (``named``: the output is
        the arguments object), a JSON array of ``{"name", "parameters"}`` calls of the offered tools
        (``required``; one call at most unless ``parallel``), or None (``none``, ``auto``)."""
        if self.choice == "named":
            return StructuredOutput.json_schema(self.tool(self.named).parameters, field="tool_choice")
        if self.choice != "required":
            return None
        defs: dict[str, dict] = {}
        items = []
        for i, t in enumerate(self.tools):
            params = dict(t.parameters)
            # "#/$defs/..." references resolve against the document's root: the definitions move there
            for key in ("$defs", "definitions"):
                if not isinstance(params.get(key), dict):
                    continue
                for name, schema in params.pop(key).items():
                    if defs.setdefault(key, {}).setdefault(name, schema) != schema:
                        raise InvalidRequestError(f"tools[{i}].function.parameters.{key}.{name}",
                                                  "differs from another tool's definition of the same name; "
                                                  "rename one (tool_choice \"required\" combines the schemas)")
            items.append({"type": "object",
                          "properties": {"name": {"type": "string", "enum": [t.name]}, "parameters": params},
                          "required": ["name", "parameters"], "additionalProperties": False})
        schema: dict = {"type": "array", "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        schema["items"] = {"type": "object", "anyOf": items}
        schema.update(defs)
        return StructuredOutput.json_schema(schema, field="tool_choice")


def _tool(raw, i: int) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(raw, dict):
        raise InvalidRequestError(where, f"must be an object {{\"type\": \"function\", \"function\": {{...}}}}, "
                                         f"got {_kind(raw)}")
    for key in raw:
        if key not in _TOOL_KEYS:
            raise InvalidRequestError(f"{where}.{key}", f"unrecognized; allowed: {', '.join(_TOOL_KEYS)}")
    if raw.get("type") != "function":
        raise InvalidRequestError(f"{where}.type", f"must be \"function\", got {raw.get('type')!r}")
    fn = raw.get("function")
    if not isinstance(fn, dict):
        raise InvalidRequestError(f"{where}.function", f"required: an object with name, description, parameters; "
                                                       f"got {_kind(fn)}")
    where += ".function"
    for key in fn:
        if key not in _FUNCTION_KEYS:
            raise InvalidRequestError(f"{where}.{key}", f"unrecognized; allowed: {', '.join(_FUNCTION_KEYS)}")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequestError(f"{where}.name", f"must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -, "
                                                   f"got {name!r}")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError(f"{where}.description", f"must be a string, got {_kind(description)}")
    parameters = fn.get("parameters")
    if parameters is None:
        parameters = dict(_DEFAULT_PARAMETERS)
    elif not isinstance(parameters, dict):
        raise InvalidRequestError(f"{where}.parameters", f"must be a JSON schema object, got {_kind(parameters)}")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError(f"{where}.strict", f"must be true or false, got {strict!r}")
    return Tool(name, parameters, description, strict)


def parse_tools(tools, tool_choice, parallel_tool_calls) -> ToolRequest | None:
    """The request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` validated.

    None where there is nothing to call: no tools (None or empty) and ``tool_choice`` None, ``"none"`` or
    ``"auto"``. ``tool_choice`` None means ``"auto"`` when tools are given. Tools with choice ``"none"``
    still give a ``ToolRequest``: the chat template shows them to the model, as vLLM does.
    Raises ``InvalidRequestError`` naming the parameter (e.g. ``tools[0].function.name``)."""
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise InvalidRequestError("tools", f"must be a list of {{\"type\": \"function\", \"function\": {{...}}}} "
                                           f"objects, got {_kind(tools)}")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    parsed = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(tools):
        t = _tool(raw, i)
        if t.name in seen:
            raise InvalidRequestError(f"tools[{i}].function.name", f"duplicate: tools[{seen[t.name]}] has the "
                                                                   f"name {t.name!r} too")
        seen[t.name] = i
        parsed.append(t)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequestError("parallel_tool_calls", f"must be true or false, got {parallel_tool_calls!r}")
    parallel = parallel_tool_calls is not False
    named = None
    if tool_choice is None:
        choice = "auto" if parsed else "none"
    elif isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise InvalidRequestError("tool_choice", f"must be \"none\", \"auto\", \"required\" or {_NAMED_SHAPE}, "
                                                     f"got {tool_choice!r}")
        choice = tool_choice
    elif isinstance(tool_choice, dict):
        if tool_choice.get("type") != "function":
            raise InvalidRequestError("tool_choice.type", f"must be \"function\", got {tool_choice.get('type')!r}")
        fn = tool_choice.get("function")
        named = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(named, str):
            raise InvalidRequestError("tool_choice.function.name", f"required: the name of one of tools; "
                                                                   f"the shape is {_NAMED_SHAPE}")
        choice = "named"
    else:
        raise InvalidRequestError("tool_choice", f"must be \"none\", \"auto\", \"required\" or {_NAMED_SHAPE}, "
                                                 f"got {_kind(tool_choice)}")
    if not parsed:
        if choice in ("required", "named"):
            raise InvalidRequestError("tool_choice", f"{'a named function' if named else repr(choice)} needs tools; "
                                                     f"the request gives none")
        return None
    if named is not None and named not in seen:
        raise InvalidRequestError("tool_choice.function.name", f"{named!r} is not among tools; they are "
                                                               f"{', '.join(t.name for t in parsed)}")
    return ToolRequest(tuple(parsed), choice, named, parallel)


# -- the output -------------------------------------------------------------------------------------


@dataclass
class ToolCall:
    """One call the model made: the function's ``name`` and its ``arguments`` as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)


@dataclass
class ParsedToolOutput:
    """A whole output split into ``content`` (None where there is none) and tool ``calls``."""

    content: str | None
    calls: list[ToolCall]


def to_openai(call: ToolCall) -> dict:
    """The call as the OpenAI API's message carries it in ``tool_calls``."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


# a parser's findings in output order: ("content", text) or ("call", name, arguments)
Event = tuple


class ToolParser:
    """Finds the tool calls a model wrote in its free text (``tool_choice`` auto). ``parse`` reads a whole
    output; ``scanner`` gives an incremental reader of one output, for streaming."""

    name = ""

    def parse(self, text: str) -> ParsedToolOutput:
        raise NotImplementedError

    def scanner(self) -> "_Scanner":
        raise NotImplementedError


class _Scanner:
    """An incremental reader: ``feed`` the output's text as it comes, then ``finish``; both return events."""

    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        raise NotImplementedError


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _hermes_call(body: str) -> Event | None:
    """The call in a ``<tool_call>`` block's body, or None where it is not ``{"name": str, "arguments": {}}``
    (``arguments`` may be absent: no arguments)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    return ("call", obj["name"], _dumps(args)) if isinstance(args, dict) else None


def _held_prefix(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could begin ``tag`` (and so must wait for more text)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _content(pieces: list) -> str | None:
    """Content from text pieces and calls in output order: the text without the whitespace that touches a
    call (the line breaks around a ``<tool_call>`` block), except that text before a call and text after it
    stay apart by the whitespace that preceded the call. None where nothing is left."""
    merged: list = []
    for p in pieces:
        if isinstance(p, str) and merged and isinstance(merged[-1], str):
            merged[-1] += p
        else:
            merged.append(p)
    out, gap = "", ""
    for i, p in enumerate(merged):
        if not isinstance(p, str):
            continue
        core = p.lstrip() if i > 0 else p  # a str after the first follows a call
        last = i + 1 == len(merged)
        if not last:
            core = core.rstrip()
        if core:
            out += (gap if out else "") + core
            if not last:
                gap = p[len(p.rstrip()):]
    return out or None


class HermesParser(ToolParser):
    """Hermes / Qwen tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks,
    any number. Content is the text outside the blocks (see ``_content`` for the whitespace). A block that
    is not such an object stays in the content; an unclosed final block is a call where its body is one
    (a stop string may have cut the closing tag), else content."""

    name = "hermes"

    def parse(self, text: str) -> ParsedToolOutput:
        pieces: list = []  # text (str) and calls (ToolCall)
        pos = 0
        while True:
            start = text.find(_OPEN, pos)
            if start < 0:
                pieces.append(text[pos:])
                break
            pieces.append(text[pos:start])
            end = text.find(_CLOSE, start + len(_OPEN))
            stop = len(text) if end < 0 else end
            event = _hermes_call(text[start + len(_OPEN):stop])
            if event is None:
                pieces.append(text[start:stop if end < 0 else end + len(_CLOSE)])
            else:
                pieces.append(ToolCall(event[1], event[2]))
            if end < 0:
                break
            pos = end + len(_CLOSE)
        return ParsedToolOutput(_content(pieces), [p for p in pieces if isinstance(p, ToolCall)])

    def scanner(self) -> _Scanner:
        return _HermesScanner()


class _HermesScanner(_Scanner):
    def __init__(self):
        self.buf = ""
        self.inside = False  # in a block: buf is its body so far

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        searched = len(self.buf)  # the tags cannot end before what was already searched
        self.buf += text
        while True:
            if not self.inside:
                start = self.buf.find(_OPEN)
                if start < 0:
                    keep = len(self.buf) - _held_prefix(self.buf, _OPEN)
                    if keep:
                        events.append(("content", self.buf[:keep]))
                        self.buf = self.buf[keep:]
                    return events
                if start:
                    events.append(("content", self.buf[:start]))
                self.buf, self.inside, searched = self.buf[start + len(_OPEN):], True, 0
            else:
                end = self.buf.find(_CLOSE, max(0, searched - len(_CLOSE) + 1))
                if end < 0:
                    return events
                body, self.buf, self.inside, searched = self.buf[:end], self.buf[end + len(_CLOSE):], False, 0
                events.append(_hermes_call(body) or ("content", _OPEN + body + _CLOSE))

    def finish(self) -> list[Event]:
        buf, self.buf = self.buf, ""
        if self.inside:
            self.inside = False
            return [_hermes_call(buf) or ("content", _OPEN + buf)]
        return [("content", buf)] if buf else []


_PYTHON_TAG = "<|python_tag|>"


def _llama3_calls(text: str) -> list[Event] | None:
    """The calls of a Llama 3 JSON tool-calling output, or None where the output is not one: optionally
    ``<|python_tag|>``, then ``{"name": str, "parameters": {...}}`` objects (``arguments`` accepted for
    ``parameters``) separated by ``;``."""
    s = text.lstrip()
    if s.startswith(_PYTHON_TAG):
        s = s[len(_PYTHON_TAG):]
    elif not s.startswith("{"):
        return None
    decoder = json.JSONDecoder()
    calls: list[Event] = []
    i = 0
    while True:
        i = len(s) - len(s[i:].lstrip())
        try:
            obj, i = decoder.raw_decode(s, i)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args = obj["parameters"] if "parameters" in obj else obj.get("arguments")
        if not isinstance(args, dict):
            return None
        calls.append(("call", obj["name"], _dumps(args)))
        rest = s[i:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:]
            if rest.strip():
                i = len(s) - len(rest)
                continue
        return calls if not rest.strip() else None


class Llama3JsonParser(ToolParser):
    """Llama 3.1 / 3.2 JSON tool calls: the whole output (``<|python_tag|>`` first, optionally) is
    ``{"name": ..., "parameters": {...}}``, or several of them separated by ``; ``. Any other output is
    content, as written."""

    name = "llama3_json"

    def parse(self, text: str) -> ParsedToolOutput:
        events = _llama3_calls(text)
        if events is None:
            return ParsedToolOutput(text or None, [])
        return ParsedToolOutput(None, [ToolCall(e[1], e[2]) for e in events])

    def scanner(self) -> _Scanner:
        return _Llama3Scanner()


class _Llama3Scanner(_Scanner):
    """Content streams through unless the output opens like a call (``{`` or ``<|python_tag|>`` after
    whitespace): then it is held whole and read at the end."""

    def __init__(self):
        self.buf = ""
        self.mode = ""  # "" undecided, "content", "call"

    def feed(self, text: str) -> list[Event]:
        if self.mode == "content":
            return [("content", text)] if text else []
        self.buf += text
        s = self.buf.lstrip()
        if self.mode == "call" or not s or _PYTHON_TAG.startswith(s):
            return []
        if s.startswith("{") or s.startswith(_PYTHON_TAG):
            self.mode = "call"
            return []
        self.mode, buf, self.buf = "content", self.buf, ""
        return [("content", buf)]

    def finish(self) -> list[Event]:
        buf, self.buf = self.buf, ""
        calls = _llama3_calls(buf) if self.mode == "call" else None
        return calls if calls is not None else ([("content", buf)] if buf else [])


_PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def tool_parser(name: str) -> ToolParser:
    """The tool-call parser called ``name`` (one of ``controller.config.TOOL_PARSERS``, the names a config may
    give); ValueError for any other name."""
    if name not in _PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; allowed: {', '.join(_PARSERS)}")
    return _PARSERS[name]()


class _ArrayScanner(_Scanner):
    """The calls of a ``tool_choice`` "required" output, ``[{"name": ..., "parameters": {...}}, ...]``, each
    as soon as its element is complete. An element of another shape is no call; reading stops at text
    that cannot continue the array."""

    START, FIRST, ITEM, SEP, DONE = range(5)

    def __init__(self):
        self.buf = ""
        self.pos = 0
        self.state = self.START
        self.decoder = json.JSONDecoder()

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        self.buf += text
        buf = self.buf
        while self.state != self.DONE:
            i = len(buf) - len(buf[self.pos:].lstrip())
            if i == len(buf):
                break
            c = buf[i]
            if self.state == self.START:
                self.pos, self.state = (i + 1, self.FIRST) if c == "[" else (i, self.DONE)
            elif self.state == self.SEP:
                self.pos, self.state = (i + 1, self.ITEM) if c == "," else (i, self.DONE)
            elif c != "{":  # "]", or anything that is not an object
                self.state = self.DONE
            elif "}" not in buf[i:]:  # an object ends in "}": not complete yet
                break
            else:
                try:
                    obj, self.pos = self.decoder.raw_decode(buf, i)
                except ValueError:
                    break  # incomplete
                self.state = self.SEP
                if (isinstance(obj, dict) and isinstance(obj.get("name"), str)
                        and isinstance(obj.get("parameters"), dict)):
                    events.append(("call", obj["name"], _dumps(obj["parameters"])))
        return events

    def finish(self) -> list[Event]:
        return []


def parse_output(request: ToolRequest | None, text: str, parser: ToolParser | None = None) -> ParsedToolOutput:
    """A whole output as the response's message carries it: content and tool calls.

    ``named``: the text is the arguments, as generated (a cut-short output is returned as it is, as OpenAI
    does); ``required``: one call per complete element of the array; ``auto``: what ``parser`` finds (no
    parser: the text is content); ``none`` or no request: the text is content. Without ``parallel``, calls
    after the first are dropped."""
    choice = request.choice if request is not None else "none"
    if choice == "named":
        return ParsedToolOutput(None, [ToolCall(request.named, text)])
    if choice == "required":
        out = ParsedToolOutput(None, [ToolCall(e[1], e[2]) for e in _ArrayScanner().feed(text)])
    elif choice == "auto" and parser is not None:
        out = parser.parse(text)
    else:
        return ParsedToolOutput(text or None, [])
    if not request.parallel:
        del out.calls[1:]
    return out


class ToolStream:
    """One choice's streamed output turned into the OpenAI ``delta`` objects to send: ``{"content": ...}``
    and ``{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}`` (a call's first
    delta carries its id, type, name and the arguments so far; later ones ``{"index", "function":
    {"arguments": more}}``). The deltas carry what :func:`parse_output` gives for the whole text.

    ``named``: the call's header at the first output, then each text as more arguments. ``required``:
    each call whole once its array element is complete. ``auto``: content as it comes, except text that
    may begin a call, held until the parser knows; calls whole once complete. ``none``: content."""

    def __init__(self, request: ToolRequest | None, parser: ToolParser | None = None):
        self.choice = request.choice if request is not None else "none"
        self.request = request
        self.calls: list[ToolCall] = []
        self.scanner: _Scanner | None = None
        if self.choice == "required":
            self.scanner = _ArrayScanner()
        elif self.choice == "auto" and parser is not None:
            self.scanner = parser.scanner()
        self._started = False  # any content sent
        self._after_call = False  # the last thing read was a call: whitespace that follows is dropped
        self._space = ""  # whitespace held back until content follows (it is dropped if none does)

    @property
    def called(self) -> bool:
        """Whether any tool call was sent (the choice then finishes with ``"tool_calls"``)."""
        return bool(self.calls)

    def feed(self, delta_text: str) -> list[dict]:
        """The deltas for the next piece of output text (possibly none)."""
        if self.choice == "named":
            out = []
            if not self.calls:
                out.append(self._call(self.request.named, ""))
            if delta_text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta_text}}]})
            return out
        if self.scanner is None:
            return [{"content": delta_text}] if delta_text else []
        return self._events(self.scanner.feed(delta_text))

    def finish(self) -> list[dict]:
        """The deltas for what is still held once the output has ended."""
        if self.choice == "named":
            return [self._call(self.request.named, "")] if not self.calls else []
        if self.scanner is None:
            return []
        out = self._events(self.scanner.finish())
        space, self._space = self._space, ""
        if space and not self._after_call:
            out.append({"content": space})
        return out

    def _call(self, name: str, arguments: str) -> dict:
        call = ToolCall(name, arguments)
        self.calls.append(call)
        return {"tool_calls": [{"index": len(self.calls) - 1, "id": call.id, "type": "function",
                                "function": {"name": name, "arguments": arguments}}]}

    def _events(self, events: list[Event]) -> list[dict]:
        out: list[dict] = []
        for event in events:
            if event[0] == "call":
                # whitespace around a call is not content, except what separates content before the call
                # from content after it (the rule of _content): held until such content comes
                if not self._started:
                    self._space = ""
                self._after_call = True
                if self.request.parallel or not self.calls:
                    out.append(self._call(event[1], event[2]))
                continue
            text = event[1]
            if self._after_call:
                text = text.lstrip()
                if not text:
                    continue
                self._after_call = False
            body = text.rstrip()
            if not body:
                self._space += text
                continue
            out.append({"content": self._space + body})
            self._space, self._started = text[len(body):], True
        return out


# -- the conversation -------------------------------------------------------------------------------


def _text(content, where: str) -> str:
    if isinstance(content, list):  # content parts: text only
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"{where}[{j}]", "only {\"type\": \"text\", \"text\": ...} parts are "
                                                           "supported")
            texts.append(part["text"])
        return "".join(texts)
    if not isinstance(content, str):
        raise InvalidRequestError(where, f"must be a string or a list of text parts, got {_kind(content)}")
    return content


def _history_call(raw, where: str) -> dict:
    if not isinstance(raw, dict):
        raise InvalidRequestError(where, f"must be an object {{\"id\", \"type\": \"function\", \"function\": "
                                         f"{{\"name\", \"arguments\"}}}}, got {_kind(raw)}")
    if not isinstance(raw.get("id"), str) or not raw["id"]:
        raise InvalidRequestError(f"{where}.id", f"required: the call's id (a string), got {raw.get('id')!r}")
    if raw.get("type", "function") != "function":
        raise InvalidRequestError(f"{where}.type", f"must be \"function\", got {raw.get('type')!r}")
    fn = raw.get("function")
    if not isinstance(fn, dict):
        raise InvalidRequestError(f"{where}.function", f"required: an object with name and arguments, "
                                                       f"got {_kind(fn)}")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise InvalidRequestError(f"{where}.function.name", f"required: the function's name, got {fn.get('name')!r}")
    arguments = fn.get("arguments")
    if not isinstance(arguments, str):
        raise InvalidRequestError(f"{where}.function.arguments", f"must be a string of JSON, got {_kind(arguments)}")
    try:
        args = json.loads(arguments) if arguments.strip() else {}  # empty: no arguments, as vLLM reads it
    except ValueError as err:
        raise InvalidRequestError(f"{where}.function.arguments", f"not valid JSON ({err})") from None
    if not isinstance(args, dict):
        raise InvalidRequestError(f"{where}.function.arguments", f"must be a JSON object, got {_kind(args)}")
    return {"id": raw["id"], "type": "function", "function": {"name": fn["name"], "arguments": args}}


def history_message(m: dict, where: str) -> dict:
    """An ``assistant`` or ``tool`` message of the conversation, validated and as chat templates take it.

    An assistant message's ``tool_calls`` keep their ids and carry ``arguments`` parsed into an object
    (transformers' templates read them as one); its content may then be null or absent (it becomes "").
    A tool message needs ``tool_call_id`` and content. Content may be text parts; ``name`` is kept.
    ``where`` names the message in errors (``messages[3]``)."""
    if not isinstance(m, dict):
        raise InvalidRequestError(where, f"must be an object with role and content, got {_kind(m)}")
    role = m.get("role")
    out: dict = {"role": role}
    if role == "assistant":
        calls = m.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise InvalidRequestError(f"{where}.tool_calls", f"must be a list of tool calls, got {_kind(calls)}")
        content = m.get("content")
        if content is None and not calls:
            raise InvalidRequestError(f"{where}.content", "required when the message has no tool_calls")
        out["content"] = "" if content is None else _text(content, f"{where}.content")
        if calls:
            out["tool_calls"] = [_history_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    elif role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidRequestError(f"{where}.tool_call_id", f"required: the id of the call this answers, "
                                                               f"got {call_id!r}")
        out["tool_call_id"] = call_id
        out["content"] = _text(m.get("content"), f"{where}.content")
    else:
        raise InvalidRequestError(f"{where}.role", f"must be \"assistant\" or \"tool\" here, got {role!r}")
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out
