"""Chat templates: compiling a template in a sandboxed jinja2 environment configured like
transformers', picking one from a tokenizer config, and rendering a conversation with it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from datetime import datetime
from typing import Any

import jinja2

__all__ = ["ChatTemplateError", "compile_template", "pick_template", "render"]

# What one rendering may take: its time, and its output (this many characters plus
# OUTPUT_PER_INPUT per character of its messages, tools and documents). A template
# loops, multiplies or pads within these, or is stopped with ChatTemplateError.
TIME_BUDGET_S = 5.0
OUTPUT_BUDGET = 1 << 20
OUTPUT_PER_INPUT = 8


class ChatTemplateError(ValueError, jinja2.TemplateError):
    """A chat template that fails, is refused by the sandbox or passes its budget."""

    def __init__(self, message: str) -> None:
        ValueError.__init__(self, message)  # str() and jinja's .message: the message


class _Budget:
    def __init__(self, limit: int) -> None:
        self.deadline = time.monotonic() + TIME_BUDGET_S
        self.limit = limit

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(
                f"rendering took more than its {TIME_BUDGET_S:g} s budget (a runaway loop?)"
            )

    def size(self, n: int, what: str) -> None:
        if n > self.limit:
            raise ChatTemplateError(
                f"{what} of {n} characters passes the output budget of {self.limit}"
            )


_BUDGET: ContextVar[_Budget | None] = ContextVar("chat_template_budget", default=None)


def _tick() -> _Budget | None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.tick()
    return budget


def _sized(value: Any) -> int:
    return len(value) if isinstance(value, str | bytes | list | tuple | dict) else 0


def _check_args(budget: _Budget | None, args: Any, kwargs: Any) -> None:
    """A call or filter asked for a size past the budget (a width, a count, a range)."""
    if budget is None:
        return
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > budget.limit:
            budget.size(abs(v), "an argument")


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
    inputs = len(json.dumps([chat, _plain(tools), _plain(documents)], ensure_ascii=False))
    budget = _Budget(OUTPUT_BUDGET + OUTPUT_PER_INPUT * inputs)
    token = _BUDGET.set(budget)
    try:
        parts, total = [], 0
        for chunk in compiled.generate(
            messages=chat,
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **values,
        ):
            total += len(chunk)
            budget.size(total, "the rendered prompt")
            budget.tick()
            parts.append(chunk)
        return "".join(parts)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:  # the template's own raise_exception, the sandbox
        raise ChatTemplateError(f"{type(exc).__name__}: {exc.message or exc}") from None
    except (RecursionError, MemoryError, ArithmeticError, TypeError, ValueError) as exc:
        raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from None
    finally:
        _BUDGET.reset(token)


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
    import jinja2.ext
    import jinja2.nodes
    import jinja2.sandbox
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

    class _Bounded(ImmutableSandboxedEnvironment):
        """The sandbox, with every call, filter, range and size-making operator checked
        against the rendering's budget (time, and sizes before they are allocated)."""

        intercepted_binops = frozenset({"*", "**", "+"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            budget = _tick()
            if budget is not None:
                if operator == "*":
                    for seq, n in ((left, right), (right, left)):
                        if _sized(seq) and isinstance(n, int):
                            budget.size(_sized(seq) * max(n, 0), "a repeated value")
                elif operator == "**" and isinstance(right, int) and abs(right) > 1024:
                    raise ChatTemplateError(f"an exponent of {right} (at most 1024)")
                elif operator == "+":
                    budget.size(_sized(left) + _sized(right), "a joined value")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            budget = _tick()
            _check_args(budget, args, kwargs)
            out = super().call(__context, __obj, *args, **kwargs)
            if budget is not None:
                budget.size(_sized(out), "a call's result")
            return out

    def bounded_range(*args: int) -> Iterator[int]:
        r = range(*args)
        if len(r) > jinja2.sandbox.MAX_RANGE:
            raise ChatTemplateError(f"range of {len(r)} items (at most {jinja2.sandbox.MAX_RANGE})")
        for i, v in enumerate(r):
            if i % 256 == 0:
                _tick()
            yield v

    def bounded_filter(fn: Any) -> Any:
        """fn, checked against the budget. The wrapper takes the context (jinja then never
        runs it while compiling, on constants, where no budget applies) and hands fn
        what fn asks for."""
        wants = getattr(fn, "jinja_pass_arg", None)

        @jinja2.pass_context
        def wrapper(context: Any, *args: Any, **kwargs: Any) -> Any:
            budget = _tick()
            _check_args(budget, args[1:], kwargs)  # past the filtered value
            if wants is jinja2.utils._PassArg.context:
                args = (context, *args)
            elif wants is jinja2.utils._PassArg.eval_context:
                args = (context.eval_ctx, *args)
            elif wants is jinja2.utils._PassArg.environment:
                args = (context.environment, *args)
            out = fn(*args, **kwargs)
            if budget is not None:
                budget.size(_sized(out), "a filter's result")
            return out

        return wrapper

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

    env = _Bounded(
        trim_blocks=True,
        lstrip_blocks=True,
        optimized=False,  # no constant folding: a filter of constants would run unbounded
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.filters = {name: bounded_filter(fn) for name, fn in env.filters.items()}
    env.globals["range"] = bounded_range
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
