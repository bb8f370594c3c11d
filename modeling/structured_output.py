"""What a request's output must match (OpenAI's ``response_format``, vLLM's ``structured_outputs``, a tool
call's arguments), as plain data: no torch here, so the router and the request parsers carry it. The
grammar text is made by llguidance (imported only when a grammar is built); ``modeling/grammar.py``
compiles it against a vocabulary and gives each sequence its matcher.

    json_object   any JSON object
    json_schema   a JSON schema (``response_format.json_schema.schema``)
    regex         a regular expression the whole output matches
    choice        exactly one of the given strings
    grammar       a Lark grammar (llguidance's dialect; GBNF is converted)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from modeling.errors import InvalidRequestError

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# JSON as ``json.dumps`` writes it (", " and ": ", no other whitespace): a model free to put whitespace between
# tokens can loop on it forever (a small one does); a schema's own "x-guidance" options override these
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A number the schema gives no multipleOf is written with at most this many decimal places (and no exponent):
# a model can otherwise extend a fraction without end ("0.56666..." until max_tokens), and digits past a
# double's precision carry nothing. A schema's own multipleOf wins.
NUMBER_STEP = 1e-9
_NOT_SCHEMAS = ("enum", "const", "default", "examples", "required")  # keys whose values are data, not schemas


def bounded_numbers(schema):
    """``schema`` (parsed JSON) with ``multipleOf: NUMBER_STEP`` on every number schema that has none."""
    if isinstance(schema, list):
        return [bounded_numbers(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _NOT_SCHEMAS else bounded_numbers(v)) for k, v in schema.items()}
    kinds = out.get("type")
    if (kinds == "number" or (isinstance(kinds, list) and "number" in kinds)) and "multipleOf" not in out:
        out["multipleOf"] = NUMBER_STEP
    return out


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
                return LLMatcher.grammar_from_json_schema(bounded_numbers(json.loads(self.spec)), JSON_LAYOUT)
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


# vLLM's ``structured_outputs`` keys (and the older ``guided_*`` request parameters) -> kinds
STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
                           "grammar": "grammar"}
GUIDED_PARAMS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def from_structured_outputs(value, field: str = "structured_outputs") -> StructuredOutput:
    """vLLM's ``structured_outputs`` object: exactly one of ``json`` (a schema, as an object or its JSON
    text), ``json_object`` (true), ``regex``, ``choice`` (a list of strings), ``grammar``."""
    if not isinstance(value, dict):
        raise InvalidRequestError(field, f"must be an object with one of {', '.join(STRUCTURED_OUTPUTS_KEYS)}")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(STRUCTURED_OUTPUTS_KEYS))
    if unknown:
        raise InvalidRequestError(f"{field}.{unknown[0]}", "is not supported; supported: "
                                  + ", ".join(STRUCTURED_OUTPUTS_KEYS))
    if len(given) != 1:
        raise InvalidRequestError(field, f"give exactly one of {', '.join(STRUCTURED_OUTPUTS_KEYS)}, got "
                                  f"{sorted(given) or 'none'}")
    key, spec = next(iter(given.items()))
    return constraint_of(key, spec, f"{field}.{key}")


def constraint_of(key: str, spec, where: str) -> StructuredOutput:
    """One ``structured_outputs`` entry (``key`` one of its keys) given at ``where``."""
    if key == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError as err:
                raise InvalidRequestError(where, f"not valid JSON: {err}") from None
        return StructuredOutput.json_schema(spec, where)
    if key == "json_object":
        if spec is not True:
            raise InvalidRequestError(where, f"must be true, got {spec!r}")
        return StructuredOutput("json_object", "", where)
    if key == "choice":
        return StructuredOutput.choice(spec, where)
    if not isinstance(spec, str) or not spec:
        raise InvalidRequestError(where, f"must be a non-empty string, got {spec!r}")
    return StructuredOutput(STRUCTURED_OUTPUTS_KEYS[key], spec, where)


def from_response_format(value, field: str = "response_format") -> StructuredOutput | None:
    """OpenAI's ``response_format``: ``{"type": "text"}`` (None: free text), ``{"type": "json_object"}``, or
    ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}``."""
    if value is None:
        return None
    kinds = ("text", "json_object", "json_schema")
    if not isinstance(value, dict) or value.get("type") not in kinds:
        raise InvalidRequestError(f"{field}.type", f"must be one of {', '.join(kinds)}, got "
                                  f"{value.get('type') if isinstance(value, dict) else value!r}")
    kind = value["type"]
    extra = sorted(set(value) - {"type", "json_schema"} if kind == "json_schema" else set(value) - {"type"})
    if extra:
        raise InvalidRequestError(f"{field}.{extra[0]}", f"is not a field of a {kind} response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object", "", field)
    js = value.get("json_schema")
    where = f"{field}.json_schema"
    if not isinstance(js, dict):
        raise InvalidRequestError(where, "required: an object with name and schema")
    extra = sorted(set(js) - {"name", "schema", "strict", "description"})
    if extra:
        raise InvalidRequestError(f"{where}.{extra[0]}", "unknown; allowed: name, schema, strict, description")
    name = js.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise InvalidRequestError(f"{where}.name", f"required: 1-64 letters, digits, '_' or '-', got {name!r}")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise InvalidRequestError(f"{where}.strict", f"must be a boolean, got {js['strict']!r}")
    if js.get("description") is not None and not isinstance(js["description"], str):
        raise InvalidRequestError(f"{where}.description", "must be a string")
    schema = js.get("schema", {"type": "object"})  # OpenAI: no schema means any object
    return StructuredOutput.json_schema(schema, f"{where}.schema")
