"""A model's chat template rendered as transformers' `apply_chat_template(tokenize=False)` renders it
(transformers 5's utils/chat_template_utils.py), on jinja2 alone: the API and frontend processes render
prompts without importing transformers (1.5-2 s of CPU at each process's start).

The same sandbox and extensions (trim_blocks, lstrip_blocks, loop controls, `{% generation %}`), the
same globals (raise_exception, strftime_now, a dict without attribute access, a namespace without
underscore names), tojson without HTML escaping, and the same data preparation: keys whose value is
None dropped, everything rebuilt from plain JSON types, a message's reasoning under each name the
families' templates read. tests/test_chat_template_render.py holds the two equal on every published
template in tests/data/chat_templates.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")   # the first is what templates read; gpt-oss's read thinking


def render(template: str | Mapping[str, str], messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
           add_generation_prompt: bool = False, special_tokens: Mapping[str, str] | None = None, /,
           **kwargs: Any) -> str:
    """The conversation as the template writes it; `special_tokens` (bos_token, eos_token, ...) are variables
    beside `kwargs` (any name: the parameters before are positional), which replace them. Raises jinja2's
    errors (and ValueError) as transformers does."""
    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
    data = {k: _plain(v) for k, v in {**(special_tokens or {}), **kwargs}.items()}
    return _compiled(pick(template, tools)).render(messages=_alias_reasoning(_plain(chat)), tools=_plain(tools),
                                                   documents=None, add_generation_prompt=add_generation_prompt, **data)


def pick(template: str | Mapping[str, str], tools: list[dict[str, Any]] | None) -> str:
    """A checkpoint's named templates: "tool_use" for a request with tools where there is one, else "default"."""
    if isinstance(template, str):
        return template
    if tools is not None and "tool_use" in template:
        return template["tool_use"]
    if "default" in template:
        return template["default"]
    raise ValueError(f"the model has chat templates {sorted(template)} and none named 'default'")


def _alias_reasoning(chat: list[Any]) -> list[Any]:
    out = []
    for m in chat:
        if isinstance(m, dict) and (r := next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)) is not None:
            m = {"thinking": r, **m, "reasoning_content": r}
        out.append(m)
    return out


def _plain(value: Any) -> Any:
    """Plain JSON types only (a subclass's methods are more than the sandbox knows of); anything else a
    placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's tokens with it; rendered as its body."""
    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace without underscore-prefixed names (a way towards CPython's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:   # jinja's signature trick: `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not store {name!r} on a namespace")


class _Dict:
    """`dict(...)` for templates, without the type's attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt), dict=_Dict(),
                       namespace=_Namespace)
    return env.from_string(template)
