"""Tool calling on plain objects: the request's tools validated, the schemas forced calls are generated
under, the output parsed into calls whole and streamed (the same calls either way), and assistant / tool
messages of the conversation normalised for chat templates."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from controller.config import TOOL_PARSERS
from frontend.tool_calls import (ToolCall, ToolStream, history_message, parse_output, parse_tools, to_openai,
                                 tool_parser)
from modeling.errors import InvalidRequestError

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]


def tools(choice=None, parallel=None):
    return parse_tools(TOOLS, choice, parallel)


def fn(**function):
    return [{"type": "function", "function": function}]


# -- the request ------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw, choice, field", [
    ({"type": "function"}, None, "tools"),
    ([{"type": "code", "function": {"name": "f"}}], None, "tools[0].type"),
    ([{"type": "function"}], None, "tools[0].function"),
    ([{"type": "function", "function": {"name": "f"}, "extra": 1}], None, "tools[0].extra"),
    (fn(name="a b"), None, "tools[0].function.name"),
    (fn(name="x" * 65), None, "tools[0].function.name"),
    (fn(name="f", description=3), None, "tools[0].function.description"),
    (fn(name="f", parameters=[]), None, "tools[0].function.parameters"),
    (fn(name="f", strict="yes"), None, "tools[0].function.strict"),
    (fn(name="f", examples=[]), None, "tools[0].function.examples"),
    (fn(name="f") + fn(name="f"), None, "tools[1].function.name"),
    (fn(name="f") * 129, None, "tools"),
    (None, "required", "tool_choice"),
    ([], {"type": "function", "function": {"name": "f"}}, "tool_choice"),
    (TOOLS, "any", "tool_choice"),
    (TOOLS, 3, "tool_choice"),
    (TOOLS, {"type": "tool", "function": {"name": "now"}}, "tool_choice.type"),
    (TOOLS, {"type": "function"}, "tool_choice.function.name"),
    (TOOLS, {"type": "function", "function": {"name": "later"}}, "tool_choice.function.name"),
])
def test_invalid_tools_name_the_field(raw, choice, field):
    with pytest.raises(InvalidRequestError) as err:
        parse_tools(raw, choice, None)
    assert err.value.field == field and err.value.reason


def test_parse_tools_defaults():
    assert parse_tools(None, None, None) is None and parse_tools([], "none", None) is None
    assert parse_tools(None, "auto", None) is None
    with pytest.raises(InvalidRequestError, match="parallel_tool_calls"):
        parse_tools(TOOLS, None, "no")
    req = tools()
    assert (req.choice, req.named, req.parallel) == ("auto", None, True)
    assert [t.name for t in req.tools] == ["get_weather", "now"]
    assert tools("none").choice == "none" and tools(parallel=False).parallel is False
    named = tools({"type": "function", "function": {"name": "now"}})
    assert (named.choice, named.named) == ("named", "now")
    assert req.template_tools() == [TOOLS[0], {"type": "function", "function": {
        "name": "now", "parameters": {"type": "object", "properties": {}}}}]


def test_constraints():
    assert tools().constraint() is None and tools("none").constraint() is None
    named = tools({"type": "function", "function": {"name": "get_weather"}}).constraint()
    assert (named.kind, named.field, json.loads(named.spec)) == ("json_schema", "tool_choice", WEATHER)
    assert list(json.loads(named.spec)["properties"]) == ["city", "days"]  # key order kept
    for parallel, max_items in ((True, None), (False, 1)):
        schema = json.loads(tools("required", parallel).constraint().spec)
        assert (schema["type"], schema["minItems"], schema.get("maxItems")) == ("array", 1, max_items)
        assert len(schema["items"]["anyOf"]) == 2
        good = [{"name": "get_weather", "parameters": {"city": "Paris"}}]
        jsonschema.validate(good, schema)
        bad = [[], [{"name": "get_weather", "parameters": {"days": 2}}], [{"name": "later", "parameters": {}}],
               [{"name": "now"}], [{"name": "now", "parameters": {}, "extra": 1}]]
        for instance in bad + ([good * 2] if not parallel else []):
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(instance, schema)
        if parallel:
            jsonschema.validate(good + [{"name": "now", "parameters": {}}], schema)


def test_required_schema_hoists_definitions():
    ref = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}
    schema = json.loads(parse_tools(fn(name="f", parameters=ref), "required", None).constraint().spec)
    assert schema["$defs"] == {"P": {"type": "integer"}}
    jsonschema.validate([{"name": "f", "parameters": {"p": 1}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"p": "x"}}], schema)
    clash = {**ref, "$defs": {"P": {"type": "string"}}}
    with pytest.raises(InvalidRequestError, match=r"tools\[1\].function.parameters.\$defs.P"):
        parse_tools(fn(name="f", parameters=ref) + fn(name="g", parameters=clash), "required", None).constraint()


# -- the output -------------------------------------------------------------------------------------


def calls(out):
    return [(c.name, json.loads(c.arguments)) for c in out.calls]


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HERMES_NOW = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'


def test_hermes_parse():
    hermes = tool_parser("hermes")
    out = hermes.parse(HERMES_CALL)
    assert out.content is None and calls(out) == [("get_weather", {"city": "Paris"})]
    assert out.calls[0].arguments == '{"city": "Paris"}' and out.calls[0].id.startswith("call_")
    out = hermes.parse("Let me check.\n\n" + HERMES_CALL + "\n" + HERMES_NOW + "\n")
    assert out.content == "Let me check." and [n for n, _ in calls(out)] == ["get_weather", "now"]
    bad = "<tool_call>\n{\"name\": 3}\n</tool_call>"
    out = hermes.parse("Hi " + bad + "\n" + HERMES_NOW)
    assert out.content == "Hi " + bad and calls(out) == [("now", {})]
    assert hermes.parse("Sure.\n" + HERMES_NOW + "\n\n" + HERMES_NOW + "\nDone.\n").content == "Sure.\nDone.\n"
    assert hermes.parse("no calls here ").content == "no calls here "
    assert hermes.parse("x <tool_call>{\"name\": ").content == "x <tool_call>{\"name\": "  # unclosed, not a call
    assert calls(hermes.parse(HERMES_NOW[:-len("</tool_call>")])) == [("now", {})]  # closing tag cut off
    assert calls(hermes.parse('<tool_call>{"name": "unknown", "arguments": {"a": "é"}}</tool_call>')) == \
        [("unknown", {"a": "é"})]  # not among the tools: kept


def test_llama3_parse():
    llama = tool_parser("llama3_json")
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert calls(llama.parse(one)) == [("get_weather", {"city": "Paris"})]
    out = llama.parse('<|python_tag|>' + one + '; {"name": "now", "arguments": {}}')
    assert out.content is None and [n for n, _ in calls(out)] == ["get_weather", "now"]
    for text in ("The weather is fine.", '{"name": "x"}', one + " and more", '{"name": "get_weather", "param'):
        out = llama.parse(text)
        assert (out.content, out.calls) == (text, [])
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        tool_parser("mistral")


def test_every_parser_a_config_may_name_exists():
    for name in TOOL_PARSERS:
        assert tool_parser(name) is not None


def test_named_and_required_output():
    named = tools({"type": "function", "function": {"name": "get_weather"}})
    out = parse_output(named, '{"city": "Paris"}')
    assert out.content is None and calls(out) == [("get_weather", {"city": "Paris"})]
    required = tools("required")
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "now", "parameters": {}}]'
    assert calls(parse_output(required, text)) == [("get_weather", {"city": "Oslo"}), ("now", {})]
    assert calls(parse_output(tools("required", False), text)) == [("get_weather", {"city": "Oslo"})]
    assert calls(parse_output(required, text[:70])) == [("get_weather", {"city": "Oslo"})]  # cut short
    assert parse_output(tools("none"), HERMES_CALL).content == HERMES_CALL
    call = ToolCall("now", "{}")
    assert to_openai(call) == {"id": call.id, "type": "function", "function": {"name": "now", "arguments": "{}"}}


def stream(request, parser, text, rng):
    s = ToolStream(request, parser)
    deltas, i = [], 0
    while i < len(text):
        n = rng.randint(1, 3)
        deltas += s.feed(text[i:i + n])
        i += n
    deltas += s.finish()
    content, args, names = "", {}, {}
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            if "id" in c:
                assert c["type"] == "function" and c["id"].startswith("call_") and c["index"] == len(names)
                names[c["index"]] = c["function"]["name"]
            args[c["index"]] = args.get(c["index"], "") + c["function"]["arguments"]
    assert s.called == bool(names)
    return content or None, [(names[i], args[i]) for i in sorted(names)]


CASES = [
    ("auto", "hermes", ["", HERMES_CALL, "Sure.\n" + HERMES_CALL + "\n\n" + HERMES_NOW + "\n", "plain text\n",
                        "a <tool_ b <tool_call>{bad}</tool_call> c\n" + HERMES_NOW + " tail ",
                        "<tool_call>\n" + HERMES_NOW[11:-12], "x <tool_call> {\"name\"", "ends with <tool_c",
                        " \n" + HERMES_NOW + " \n" + HERMES_NOW + "\n then\n" + HERMES_CALL + "\n"]),
    ("auto", "llama3_json", ['{"name": "now", "parameters": {}}', ' <|python_tag|>{"name": "now", "parameters": {}}'
                             '; {"name": "get_weather", "parameters": {"city": "Rome"}}', "Hello, world.",
                             "<|python", '{"oops": 1} ', "  <b>bold</b>"]),
    ("required", None, ['[{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}, '
                        '{"name": "now", "parameters": {}}]', '[{"name": "now", "parameters": {}}, {"na']),
    ({"type": "function", "function": {"name": "get_weather"}}, None, ['{"city": "Paris", "days": 3}', "", '{"ci']),
    ("none", None, [HERMES_CALL, "hi"]),
]


@pytest.mark.parametrize("choice, parser, texts", CASES)
@pytest.mark.parametrize("parallel", [True, False])
def test_streaming_matches_whole_output(choice, parser, texts, parallel):
    request = tools(choice, parallel)
    p = tool_parser(parser) if parser else None
    rng = random.Random(0)
    for text in texts:
        whole = parse_output(request, text, p)
        expect = (whole.content, [(c.name, c.arguments) for c in whole.calls])
        for _ in range(20):
            assert stream(request, p, text, rng) == expect, text


def test_partial_tag_is_held_then_released():
    s = ToolStream(tools(), tool_parser("hermes"))
    assert s.feed("Hi <tool_") == [{"content": "Hi"}]  # the space waits too: it is dropped before a call
    assert s.feed("box>") == [{"content": " <tool_box>"}]
    assert s.feed("<tool_call") == []
    assert s.feed('>{"name": "now"}</tool_call>')[0]["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"}
    assert s.feed("\n") == [] and s.finish() == [] and s.called


def test_named_stream_sends_header_first():
    s = ToolStream(tools({"type": "function", "function": {"name": "now"}}), None)
    first = s.feed("{")
    assert first[0]["tool_calls"][0]["function"] == {"name": "now", "arguments": ""}
    assert first[1] == {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}
    assert s.feed("}") == [{"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}] and s.finish() == []


# -- the conversation -------------------------------------------------------------------------------


def test_history_messages():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    m = history_message({"role": "assistant", "content": None, "tool_calls": [call]}, "messages[1]")
    assert m == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    empty = {"id": "c", "function": {"name": "now", "arguments": ""}}
    assert history_message({"role": "assistant", "tool_calls": [empty]}, "m")["tool_calls"][0]["function"] == \
        {"name": "now", "arguments": {}}
    assert history_message({"role": "assistant", "content": "hi", "tool_calls": []}, "m") == \
        {"role": "assistant", "content": "hi"}
    tool = {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "5C"}], "name": "w"}
    assert history_message(tool, "m") == {"role": "tool", "tool_call_id": "call_1", "content": "5C", "name": "w"}


@pytest.mark.parametrize("message, field", [
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                           "function": {"name": "f", "arguments": "{bad"}}]},
     "messages[2].tool_calls[0].function.arguments"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}]},
     "messages[2].tool_calls[0].function.arguments"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}]},
     "messages[2].tool_calls[0].function.arguments"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
     "messages[2].tool_calls[0].id"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]},
     "messages[2].tool_calls[0].function.name"),
    ({"role": "assistant", "tool_calls": "f()"}, "messages[2].tool_calls"),
    ({"role": "assistant"}, "messages[2].content"),
    ({"role": "tool", "content": "5C"}, "messages[2].tool_call_id"),
    ({"role": "tool", "tool_call_id": "c"}, "messages[2].content"),
    ({"role": "user", "content": "hi"}, "messages[2].role"),
])
def test_history_errors_name_the_field(message, field):
    with pytest.raises(InvalidRequestError) as err:
        history_message(message, "messages[2]")
    assert err.value.field == field
