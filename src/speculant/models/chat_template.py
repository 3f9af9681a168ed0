"""Chat templates: compiling a template in a sandboxed jinja2 environment configured like
transformers', picking one from a tokenizer config, and rendering a conversation with it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

__all__ = ["compile_template", "pick_template", "render"]

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def render(
    compiled: Any,
    messages: list[dict[str, str]],
    *,
    special_tokens_map: Mapping[str, str],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None,
    documents: list[dict[str, Any]] | None,
    variables: Mapping[str, Any],
) -> str:
    """Render ``messages`` with a template from `compile_template`; ``variables`` (on top of
    the special tokens) become template variables."""
    chat = _alias_reasoning_fields(
        [{k: _plain(v) for k, v in m.items() if v is not None} for m in _plain(list(messages))]
    )
    values: dict[str, Any] = dict(special_tokens_map)
    values.update(_plain(dict(variables)))
    rendered: str = compiled.render(
        messages=chat,
        tools=_plain(tools),
        documents=_plain(documents),
        add_generation_prompt=add_generation_prompt,
        **values,
    )
    return rendered


def _plain(value: Any) -> Any:
    """Rebuild template inputs from plain JSON types (as transformers does for the sandbox)."""
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


def _alias_reasoning_fields(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for message in chat:
        reasoning = next(
            (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def compile_template(template: str) -> Any:
    """Compile a chat template in a sandboxed jinja2 env configured like transformers'."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationTag(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text; we only render it.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_render", [], [])
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class _TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class _Namespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's signature trick)
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                _Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            _Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot set underscore attributes on a namespace: {name!r}"
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env.from_string(template)


def pick_template(value: Any, tools: bool = False) -> str | None:
    """A template string from a ``chat_template`` config value (str or list of named ones)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        named = {str(k): str(v) for k, v in value.items()}
    elif isinstance(value, list):
        named = {
            str(t.get("name")): str(t.get("template"))
            for t in value
            if isinstance(t, Mapping) and "template" in t
        }
    else:
        return None
    if tools and "tool_use" in named:
        return named["tool_use"]
    if "default" in named:
        return named["default"]
    return next(iter(named.values()), None)
