"""A model's chat template: OpenAI-style `messages` -> the prompt text the model was trained on.

The template is the Jinja2 source in the model directory's tokenizer_config.json (`chat_template`: a string, or a
list of {"name", "template"} of which "default" is used), else its chat_template.jinja file. It is rendered the way
Hugging Face tokenizers render it, so that a prompt built here equals transformers' `apply_chat_template`: a
sandboxed environment (templates come with downloaded models and must not reach Python objects), blocks that trim
the newline after them and strip the indentation before them, `loopcontrols`, a `tojson` that does not escape
HTML, the variables `messages`, `add_generation_prompt` and the tokenizer's special tokens (bos_token, eos_token,
...), and the helpers `raise_exception(message)` and `strftime_now(format)`.

The rendered text carries the special tokens as text (e.g. "<|bos|>"): encode it with special tokens parsed and no
extra BOS (`ChatTemplate.encode_options`).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from folio.serve.errors import InternalError, InvalidRequest

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's part in some templates (for training masks):
    rendering keeps its body as it is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; templates write JSON into prompts, which want it verbatim.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 — the name templates call it with
    return datetime.datetime.now().strftime(format)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None):
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ChatTemplate | None:
        """The model's template, or None when it has none (a base model: completions only)."""
        model_dir = Path(path)
        try:
            config = json.loads((model_dir / TOKENIZER_CONFIG_FILE).read_text(encoding="utf-8"))
        except FileNotFoundError:
            config = {}
        source = _pick_template(config.get("chat_template"))
        if source is None and (model_dir / TEMPLATE_FILE).is_file():
            source = (model_dir / TEMPLATE_FILE).read_text(encoding="utf-8")
        if source is None:
            return None
        return cls(source, _special_tokens(config))

    @cached_property
    def _compiled(self) -> jinja2.Template | str:
        """The compiled template, or the syntax error's message (the model directory's fault, reported per
        request rather than failing the replica: completions still work)."""
        try:
            return _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as error:
            return f"line {error.lineno}: {error.message}"

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt for `messages`. A template that refuses them (raise_exception, e.g. an unknown role or turns
        out of order) raises InvalidRequest naming `messages`."""
        template = self._compiled
        if isinstance(template, str):
            raise InternalError(f"the model's chat template is not valid Jinja2 ({template})")
        try:
            # tools and documents are None, not undefined, as transformers passes them: templates test `is none`.
            return template.render(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                                   tools=None, documents=None, **self.special_tokens)
        except jinja2.TemplateError as error:
            raise InvalidRequest("messages", f"the model's chat template refused them: {error}") from None
        except (TypeError, KeyError, ValueError, AttributeError) as error:
            # e.g. a message without the content the template concatenates
            raise InvalidRequest("messages", f"the model's chat template cannot render them: {error}") from None

    @staticmethod
    def encode_options() -> dict[str, Any]:
        """folio.Tokenizer.encode options for a rendered prompt: the template wrote the BOS and other special
        tokens as text."""
        return {"add_bos": False, "encode_special_tokens": True}


def _pick_template(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # named templates: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """tokenizer_config's special tokens as the text templates insert: a string, or an AddedToken's "content"."""
    tokens = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return tokens
