"""Structured output on the bundled model (which otherwise writes Python): greedy decoding under each kind of
grammar gives output that parses and validates (``jsonschema``), matchers roll back exactly, grammars are
compiled once per distinct spec, and a spec the engine cannot compile is an error naming the field."""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from controller.defaults import DEFAULT_MODEL_DIR  # noqa: E402
from modeling.attention import make_backend  # noqa: E402
from modeling.block_pool import BlockPool, BlockTable  # noqa: E402
from modeling.checkpoint import load_model  # noqa: E402
from modeling.errors import InvalidRequestError  # noqa: E402
from modeling.grammar import GrammarCompiler, StructuredOutput, constrain  # noqa: E402
from modeling.kv_cache import KVCacheSpec, PagedKVCache  # noqa: E402
from modeling.runner import ModelRunner, StepInput  # noqa: E402
from modeling.tokenizer import TextTokenizer  # noqa: E402

BLOCK = 16
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                      "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "enum_and_array": {"type": "object", "properties": {
        "level": {"enum": ["debug", "info", "error"]},
        "codes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1,
                  "maxItems": 4}},
        "required": ["level", "codes"], "additionalProperties": False},
    "number_range": {"type": "object", "properties": {
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "ok": {"type": "boolean"}}, "required": ["ratio", "ok"], "additionalProperties": False},
}


@pytest.fixture(scope="module")
def model():
    loaded = load_model(DEFAULT_MODEL_DIR, "float32", "cpu")
    mc = loaded.config
    cache = PagedKVCache(KVCacheSpec(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, BLOCK, torch.float32), 64)
    runner = ModelRunner(loaded.model, cache, make_backend("torch", "cpu", BLOCK))
    compiler = GrammarCompiler(os.path.join(DEFAULT_MODEL_DIR, "tokenizer.json"), mc.vocab_size,
                               loaded.eos_token_ids)
    return runner, compiler, TextTokenizer(DEFAULT_MODEL_DIR), loaded.eos_token_ids


def constrained_greedy(model, prompt: str, output: StructuredOutput, max_tokens: int = 96) -> str:
    """Greedy decoding with the grammar's mask on every step, until the grammar ends (or EOS, or the limit)."""
    runner, compiler, tokenizer, eos = model
    matcher = compiler.matcher(output)
    pool = BlockPool(64, BLOCK)
    table = BlockTable(BLOCK)
    tokens = tokenizer.encode(prompt)
    table.ensure_capacity(pool, len(tokens))
    logits = runner.run([StepInput(tokens, 0, table.blocks)])[0]
    out = []
    for _ in range(max_tokens):
        token = int(torch.argmax(constrain(logits.unsqueeze(0), matcher.allowed().unsqueeze(0))[0]))
        if token in eos:
            break
        matcher.advance(token)
        out.append(token)
        if matcher.finished:
            break
        table.ensure_capacity(pool, len(tokens) + 1)
        logits = runner.run([StepInput([token], len(tokens), table.blocks)])[0]
        tokens.append(token)
    return tokenizer.decode(out)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_constrained_output_validates(model, name):
    text = constrained_greedy(model, "def config():\n    return ", StructuredOutput.json_schema(SCHEMAS[name]),
                              max_tokens=160)
    jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_json_object_choice_and_regex(model):
    _, compiler, tokenizer, eos = model
    matcher = compiler.matcher(StructuredOutput("json_object"))
    assert not matcher.allowed()[tokenizer.encode("'")[0]] and not matcher.allowed()[tokenizer.encode("[")[0]]
    for t in tokenizer.encode('{"a": [1, 2], "b": {"c": null}}'):
        matcher.advance(t)
    assert matcher.allowed()[eos[0]] and int(matcher.allowed().sum()) == 1  # complete: only EOS may follow
    options = ["apple", "banana split", "cherry"]
    assert constrained_greedy(model, "fruit = ", StructuredOutput.choice(options)) in options
    date = constrained_greedy(model, "when = '", StructuredOutput("regex", r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"))
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", date)


def test_a_matcher_rolls_back_to_the_mask_it_had(model):
    _, compiler, tokenizer, _ = model
    matcher = compiler.matcher(StructuredOutput.json_schema(SCHEMAS["enum_and_array"]))
    ids = tokenizer.encode('{"level": "info", "codes": [1')
    before = []
    for t in ids:
        before.append(matcher.allowed())
        assert before[-1][t], tokenizer.decode([t])  # the prefix is valid JSON for the schema
        matcher.advance(t)
    matcher.rollback(3)  # as after 3 rejected drafts
    assert torch.equal(matcher.allowed(), before[-3])
    with pytest.raises(ValueError, match="not allowed"):
        bad = tokenizer.encode("}")[0]
        matcher.advance(bad) if not matcher.allowed()[bad] else pytest.fail("'}' should be forbidden here")


def test_masks_along_a_draft_path_are_those_of_keeping_each_draft(model):
    """Grammar-aware verification: the masks at a draft path's positions equal a fresh matcher's after
    keeping the drafts before each; a forbidden draft ends the path (nothing after it can be kept: the rows
    after it allow everything, so arithmetic on them stays finite); the matcher is left as it was."""
    _, compiler, tokenizer, _ = model
    spec = StructuredOutput.json_schema(SCHEMAS["enum_and_array"])
    matcher = compiler.matcher(spec)
    prefix, drafts = tokenizer.encode('{"level"'), tokenizer.encode(': "info", "')
    for t in prefix:
        matcher.advance(t)
    start = matcher.allowed()
    masks = matcher.path_masks(drafts)
    assert torch.equal(matcher.allowed(), start)  # rolled back
    fresh = compiler.matcher(spec)
    for t in prefix:
        fresh.advance(t)
    for i, t in enumerate(drafts):
        assert torch.equal(masks[i], fresh.allowed()), i
        fresh.advance(t)
    assert torch.equal(masks[-1], fresh.allowed())
    bad = tokenizer.encode("}")[0]
    cut = matcher.path_masks(drafts[:2] + [bad] + drafts[2:])
    assert torch.equal(cut[:3], masks[:3]) and not cut[2][bad] and cut[3:].all()
    assert torch.equal(matcher.allowed(), start)
    # a token the mask leaves out ends the path even where the grammar could go on (here "co", a prefix of
    # the key "codes" the mask offers whole): decoding never samples it, so verification never keeps it
    co = tokenizer.encode("co")
    assert len(co) == 1 and not masks[-1][co[0]] and matcher.path_masks(drafts + co)[-1].all()


def test_grammars_are_compiled_once_and_bad_ones_name_the_field(model):
    _, compiler, _, _ = model
    before = compiler.compiled
    for field in ("response_format.json_schema.schema", "structured_outputs.json"):
        compiler.compile(StructuredOutput.json_schema({"type": "object", "properties": {"k": {"type": "string"}}},
                                                      field))
    assert compiler.compiled == before + 1  # the same schema, wherever the request gave it
    with pytest.raises(InvalidRequestError, match=r"(?s)structured_outputs.regex: cannot be compiled: .*unclosed group"):
        compiler.compile(StructuredOutput("regex", "a(b", "structured_outputs.regex"))
    with pytest.raises(InvalidRequestError, match="response_format.json_schema.schema: cannot be compiled: .*objectx"):
        compiler.compile(StructuredOutput.json_schema({"type": "objectx"}))
    with pytest.raises(InvalidRequestError, match="structured_outputs: unknown kind 'yaml'; allowed: json_object"):
        StructuredOutput("yaml", "a: 1")
    with pytest.raises(InvalidRequestError, match="structured_outputs.choice: must be a non-empty list"):
        StructuredOutput.choice([])


def test_a_number_ends_after_a_bounded_fraction(model):
    """A number schema without multipleOf is written with at most NUMBER_STEP's decimal places (a model that
    would extend "0.5666..." to max_tokens has to stop); a schema's own multipleOf wins."""
    from modeling.structured_output import NUMBER_STEP

    _, compiler, tokenizer, _ = model
    decimals = round(-math.log10(NUMBER_STEP))

    def accepts(schema, text):
        m = compiler.matcher(StructuredOutput.json_schema(schema))
        for t in tokenizer.encode(text):
            if not m.allowed()[t]:
                return False
            m.advance(t)
        return bool(m.allowed()[0])  # EOS: the number may end here

    number = {"type": "number", "minimum": 0, "maximum": 60}
    assert accepts(number, "0." + "5" * decimals) and not accepts(number, "0." + "5" * (decimals + 1))
    assert accepts({"type": "number", "multipleOf": 0.25}, "12.75") and not accepts({"type": "number", "multipleOf": 0.25}, "12.7")
