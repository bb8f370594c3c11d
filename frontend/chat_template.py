"""A checkpoint's chat template, rendered as ``transformers``' ``apply_chat_template`` renders it.

The template comes from ``chat_template.jinja`` in the checkpoint directory, else ``chat_template`` in
``tokenizer_config.json`` (a string, or a list of ``{"name", "template"}`` of which ``default`` is used).
It is rendered in jinja2's immutable sandbox with transformers' settings (``trim_blocks``,
``lstrip_blocks``, loop controls, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII
text, a ``{% generation %}`` block that renders its body), with the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...) as variables; the text is then tokenized without adding special
tokens, as ``apply_chat_template(tokenize=True)`` does. Templates are untrusted text: the sandbox refuses
attribute access outside plain data.
"""

from __future__ import annotations

import json
import os
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from modeling.checkpoint import read_json

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (the template raised, or there is no template)."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-token tracking): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _render(caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised: {"content": ..., ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """The compiled template of one checkpoint and the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str]):
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise ChatTemplateError(f"chat_template: not a valid jinja2 template (line {err.lineno}: {err.message})") from None
        self.special_tokens = special_tokens

    @classmethod
    def from_checkpoint(cls, directory: str) -> "ChatTemplate | None":
        """The checkpoint's template, or None where it has none."""
        cfg = read_json(directory, "tokenizer_config.json", required=False) or {}
        source = None
        path = os.path.join(directory, "chat_template.jinja")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                source = f.read()
        else:
            raw = cfg.get("chat_template")
            if isinstance(raw, list):
                named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
                raw = named.get("default")
            source = raw if isinstance(raw, str) and raw else None
        if source is None:
            return None
        special = {name: text for name in SPECIAL_TOKENS if (text := _token_text(cfg.get(name))) is not None}
        return cls(source, special)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
               documents: list | None = None) -> str:
        """The prompt text of ``messages`` (plain dicts: role, content, ...). ``tools`` and ``documents``
        are always defined (None when not given), as transformers defines them."""
        try:
            return self._template.render(messages=messages, tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.TemplateError as err:  # raise_exception(...) in the template, or a sandbox refusal
            raise ChatTemplateError(f"messages: the model's chat template refused them: {err}") from None
