"""The Jinja sandbox every chat template compiles in, and its bounds on values.

Configured as transformers' `apply_chat_template` configures Jinja's
`ImmutableSandboxedEnvironment`, so trusted templates render the same text, with one more
bound: every string or list a template builds (operators, `~`, calls, filters) is held to
the rendering's output budget (`value_budget`), and the operations that multiply one value
into a huge one in a single C call (`*`, `**`, padding and `%`/`format` widths, `replace`,
`join`, `expandtabs`, `translate`, `indent`, `wordwrap`, `tojson(indent)`) are refused
before they run. Past a bound a `TemplateTooLarge` is raised.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Output (and per-value) limit when the caller gives none: more text than any context
# window holds. The server passes the longest prompt its context window can hold.
DEFAULT_MAX_OUTPUT_CHARS = 1 << 24
# Lists, tuples and dicts a template builds hold at most this many items (a sort of a longer
# one is a long uninterruptible C call).
MAX_ITEMS = 1 << 20
# Integers a template computes stay within this many bits (`2 ** 10 ** 9` never starts).
MAX_INT_BITS = 4096
# `tojson(indent=...)` multiplies every nested line; real templates indent by 2 or 4.
MAX_JSON_INDENT = 16

# Numbers written in a format string: widths, precisions and positions.
_FORMAT_NUMBER = re.compile(r"\d+")

_limits = threading.local()


class TemplateTooLarge(Exception):
    """A value or the output went past the budget (an Exception, so Jinja's constant
    folding at compile time gives up on it and leaves it to the bounded render)."""


@contextlib.contextmanager
def value_budget(max_chars: int) -> Iterator[None]:
    """Hold every value this thread's template builds, and its output, to `max_chars`."""
    previous_budget = getattr(_limits, "max_chars", None)
    _limits.max_chars = max_chars
    try:
        yield
    finally:
        if previous_budget is None:
            del _limits.max_chars
        else:
            _limits.max_chars = previous_budget


def _budget() -> int:
    return getattr(_limits, "max_chars", DEFAULT_MAX_OUTPUT_CHARS)


# ---- size checks ---------------------------------------------------------------------------


def _checked(value: Any) -> Any:
    """`value`, unless it is a string longer than the budget or a container past MAX_ITEMS."""
    if isinstance(value, str | bytes):
        if len(value) > getattr(_limits, "max_chars", DEFAULT_MAX_OUTPUT_CHARS):
            raise TemplateTooLarge(f"a string of {len(value)} characters")
    elif isinstance(value, list | tuple | dict | set | frozenset) and len(value) > MAX_ITEMS:
        raise TemplateTooLarge(f"a collection of {len(value)} items")
    return value


def _approx_len(value: Any) -> int:
    """About how many characters `str(value)` has (only used to bound amplification)."""
    if isinstance(value, str | bytes):
        return len(value)
    if isinstance(value, Mapping):
        return sum([_approx_len(k) + _approx_len(v) + 4 for k, v in value.items()]) + 2
    if isinstance(value, list | tuple | set | frozenset):
        return _items_len(value) + 2 * len(value) + 2
    if isinstance(value, int) and not isinstance(value, bool):
        return value.bit_length() // 3 + 2
    return 32


def _items_len(items: Iterable[Any]) -> int:
    return sum([len(i) if isinstance(i, str) else _approx_len(i) for i in items])


def _refuse_if_over(estimate: int) -> None:
    if estimate > _budget():
        raise TemplateTooLarge(f"a result of about {estimate} characters")


def _check_format(template: str, values: Sequence[Any]) -> None:
    """`template % values` or `template.format(...)`: widths plus every field at its
    longest argument."""
    numbers_in = _FORMAT_NUMBER.findall(template)
    if max(map(len, numbers_in), default=0) >= 12:
        raise TemplateTooLarge("a format width beyond any budget")
    fields = template.count("%") + template.count("{")
    longest = max([_approx_len(v) for v in values], default=0)
    _refuse_if_over(len(template) + sum(map(int, numbers_in)) + fields * longest)


def _format_values(args: Any) -> list[Any]:
    if isinstance(args, Mapping):
        return list(args.values())
    if isinstance(args, tuple):
        return list(args)
    return [args]


def _check_ints(args: Iterable[Any]) -> None:
    """No width, count or size argument beyond the budget (`ljust`, `center`, `zfill`, ...)."""
    for value in args:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _budget():
            raise TemplateTooLarge(f"an argument of {value}")


def _check_str_method(name: str, text: str, args: tuple, kwargs: dict) -> tuple:
    """Refuse a string method call whose result would pass the budget; returns the
    arguments to call it with (an iterable given to `join` is read into a list first)."""
    if name in ("format", "format_map"):
        values = _format_values(args[0]) if name == "format_map" and args else list(args)
        _check_format(text, [*values, *kwargs.values()])
    elif name == "replace" and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        matches = len(text) + 1 if not old else len(text) // len(old)
        _refuse_if_over(len(text) + matches * len(new))
    elif name == "join" and args:
        items = list(args[0])
        _refuse_if_over(len(text) * len(items) + _items_len(items))
        args = (items, *args[1:])
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(size, int):
            _refuse_if_over(len(text) + text.count("\t") * size)
    elif name == "translate" and args and isinstance(args[0], Mapping):
        longest = max([_approx_len(v) for v in args[0].values()], default=0)
        _refuse_if_over(len(text) * max(longest, 1))
    return args


def _check_binop(operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        for seq, count in ((left, right), (right, left)):
            if isinstance(seq, str | bytes | list | tuple) and isinstance(count, int):
                _refuse_if_over(len(seq) * max(count, 0))
                if not isinstance(seq, str | bytes) and len(seq) * max(count, 0) > MAX_ITEMS:
                    raise TemplateTooLarge("a list of too many items")
        ints = isinstance(left, int) and isinstance(right, int)
        if ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateTooLarge("an integer of too many digits")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int):
        if abs(left) > 1 and right > 0 and left.bit_length() * right > MAX_INT_BITS:
            raise TemplateTooLarge("an integer of too many digits")
    elif operator == "%" and isinstance(left, str):
        _check_format(left, _format_values(right))


# Filters that can multiply their input, with the check to run on their arguments.
def _check_filter(name: str, args: tuple, kwargs: dict) -> tuple:
    value = args[0] if args else None
    if name == "join" and value is not None:
        # An iterable is read into a list first, so its length is known before joining.
        items = value if isinstance(value, str) else list(value)
        sep = args[1] if len(args) > 1 else kwargs.get("d", "")
        _refuse_if_over(_approx_len(sep) * len(items))
        _refuse_if_over(_approx_len(sep) * len(items) + _items_len(items))
        return (items, *args[1:])
    text = value if isinstance(value, str) else None
    if text is None:
        return args
    if name == "replace" and len(args) >= 3:
        return (text, *_check_str_method("replace", text, args[1:], kwargs))
    if name == "format":
        _check_format(text, [*args[1:], *kwargs.values()])
    elif name == "indent":
        width = args[1] if len(args) > 1 else kwargs.get("width", 4)
        pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        _refuse_if_over(len(text) + (text.count("\n") + 1) * pad)
    elif name == "wordwrap":
        width = args[1] if len(args) > 1 else kwargs.get("width", 79)
        wrap = args[3] if len(args) > 3 else kwargs.get("wrapstring") or "\n"
        if isinstance(width, int) and width > 0:
            _refuse_if_over(len(text) + (len(text) // width + 1) * _approx_len(wrap))
    return args


def _guard_filter(name: str, func: Callable) -> Callable:
    # Filters that get the environment or a context first keep it; the checks see the rest.
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        head, rest = args[:skip], args[skip:]
        _check_ints(rest[1:])
        _check_ints(kwargs.values())
        rest = _check_filter(name, rest, kwargs)
        return _checked(func(*head, *rest, **kwargs))

    return guarded


# ---- the environment -------------------------------------------------------------------------


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator, with every `~` concatenation held to the budget."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Any) -> None:
        self.write("environment.checked(")
        super().visit_Concat(node, frame)
        self.write(")")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders
    its body unchanged; the mask itself is never asked for here."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` for templates, without the class's attributes (as transformers does)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` refusing underscore names, which lead to CPython's internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes, got {name!r}"
            )


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with every operator, call and filter held to the budget."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        )
        self.filters["tojson"] = _tojson
        self.filters = {name: _guard_filter(name, f) for name, f in self.filters.items()}
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.globals["dict"] = _TemplateDict()
        self.globals["namespace"] = _TemplateNamespace

    def checked(self, value: Any) -> Any:
        return _checked(value)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        # `+` is the common case in templates (joining message parts): no check before it,
        # since a sum is at most twice the larger of two values already within the budget.
        if operator != "+":
            _check_binop(operator, left, right)
        return _checked(self.binop_table[operator](left, right))

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        _check_ints(args)
        _check_ints(kwargs.values())
        # str.format reaches here wrapped by the sandbox; the bound method is underneath.
        method = getattr(obj, "__wrapped__", obj)
        owner = getattr(method, "__self__", None)
        if isinstance(owner, str):
            args = _check_str_method(getattr(method, "__name__", ""), owner, args, kwargs)
        return _checked(super().call(context, obj, *args, **kwargs))


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter (Jinja's own escapes HTML), with the indent bounded.
    if isinstance(indent, int | str) and not isinstance(indent, bool):
        size = indent if isinstance(indent, int) else len(indent)
        if size > MAX_JSON_INDENT:
            raise TemplateTooLarge(f"tojson indent of {size}")
    if separators is not None and _approx_len(separators) > MAX_JSON_INDENT:
        raise TemplateTooLarge("tojson separators")
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=1)
def _environment() -> _BoundedSandbox:
    return _BoundedSandbox()


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    return _environment().from_string(source)
