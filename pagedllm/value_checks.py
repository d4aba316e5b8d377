"""Checks of single values a user hands the engine: integers within the engine's 64-bit
types, finite floats, valid Unicode, and JSON-like documents bounded in depth.

A leaf every layer may import: `SamplingParams` checks its own fields with these, the
input processor and structured-output validation check prompts and specs, and the server
walks each request body with `check_json_value` before any field reaches the engine, so
the offline engine and the server refuse the same values the same way.
"""

from __future__ import annotations

import json
import math
import operator
from typing import Any

from pagedllm.errors import InvalidRequestError

# The engine keeps integers in int64 (numpy, torch, msgspec between processes).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# The widest integer any field accepts: seeds may use the whole unsigned 64-bit range.
UINT64_MAX = 2**64 - 1
# Error messages show at most this much of a path into a document, or of a key in it.
_MAX_SHOWN_PATH_PARTS = 8
_MAX_SHOWN_KEY_CHARS = 64


def check_int(name: str, value: Any, low: int = INT64_MIN, high: int = INT64_MAX) -> int:
    """`value` as an int within [low, high]; anything with `__index__` (numpy ints) counts."""
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {short_repr(value)}") from None
    if not low <= number <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {short_repr(value)}")
    return number


def check_float(
    name: str,
    value: Any,
    low: float = -math.inf,
    high: float = math.inf,
    *,
    low_open: bool = False,
) -> float:
    """`value` as a finite float within [low, high] ((low, high] with `low_open`)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        try:
            value = float(value)  # numpy floats, Decimal
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a number, got {short_repr(value)}") from None
    number = float(value)
    above_low = low < number if low_open else low <= number
    if not (math.isfinite(number) and above_low and number <= high):
        if high == math.inf:
            interval = f"{'>' if low_open else '>='} {low:g}"
        else:
            interval = f"in {'(' if low_open else '['}{low:g}, {high:g}]"
        raise ValueError(f"{name} must be a finite number {interval}, got {number}")
    return number


def lone_surrogate_at(text: str) -> int | None:
    """Where `text` holds a lone UTF-16 surrogate (JSON's "\\ud800"), which no encoder or
    tokenizer accepts; None for valid Unicode."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return error.start
    return None


def check_text(name: str, value: Any) -> str:
    """`value` as a string of valid Unicode."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    position = lone_surrogate_at(value)
    if position is not None:
        raise ValueError(
            f"{name}: not valid Unicode (a lone surrogate {value[position]!a} at character "
            f"{position})"
        )
    return value


def check_json_value(value: Any, max_depth: int, name: str = "", param: str | None = None) -> int:
    """Walk a JSON-like document (dicts, lists, strings, numbers): refuse nesting deeper than
    `max_depth` containers, strings and keys that are not valid Unicode, integers outside the
    64-bit range and NaN or infinite floats. Returns the depth (0 for a scalar).

    Iterative, so a deep document cannot exhaust the stack. The error names the path to the
    value (`name.key.0...`); its param is `param`, or that path when `param` is None.
    """
    deepest = 0
    # Only containers are pushed, with their path; scalars are checked where they sit, so
    # a long list of numbers costs one loop and no tuples.
    stack: list[tuple[Any, int, tuple]] = [(value, 1, ())]
    if not isinstance(value, dict | list | tuple):
        _check_scalar(value, (), name, param)
        return 0
    while stack:
        container, depth, path = stack.pop()
        if depth > max_depth:
            shown = _format_path(name, path)
            raise InvalidRequestError(
                f"{shown}: nested more than {max_depth} levels deep",
                param if param is not None else _format_path(name, path[:1]),
            )
        deepest = max(deepest, depth)
        if not isinstance(container, dict) and _plain_list(container):
            continue
        items = container.items() if isinstance(container, dict) else enumerate(container)
        for key, item in items:
            if type(key) is str and not key.isascii() and lone_surrogate_at(key) is not None:
                where = _format_path(name, path)
                raise InvalidRequestError(
                    f"{where}: a key is not valid Unicode (it holds a lone surrogate)",
                    param if param is not None else where,
                )
            if isinstance(item, dict | list | tuple):
                stack.append((item, depth + 1, (*path, key)))
            elif type(item) is not str or not item.isascii():
                _check_scalar(item, (*path, key), name, param)
    return deepest


def _plain_list(items: list | tuple) -> bool:
    """True for a list of in-range integers or ASCII strings (token ids, prompts), checked
    in C loops; anything else is walked item by item."""
    kinds = set(map(type, items))
    if kinds <= {int, bool}:
        return not items or (min(items) >= INT64_MIN and max(items) <= UINT64_MAX)
    return kinds == {str} and all(map(str.isascii, items))


def _check_scalar(value: Any, path: tuple, name: str, param: str | None) -> None:
    problem = None
    if isinstance(value, str):
        position = lone_surrogate_at(value)
        if position is not None:
            problem = f"not valid Unicode (a lone surrogate at character {position})"
    elif isinstance(value, bool) or value is None:
        return
    elif isinstance(value, int):
        if not INT64_MIN <= value <= UINT64_MAX:
            problem = "an integer outside the 64-bit range"
    elif isinstance(value, float) and not math.isfinite(value):
        problem = f"{value} is not a finite number (JSON has no NaN or Infinity)"
    if problem is not None:
        where = _format_path(name, path)
        raise InvalidRequestError(f"{where}: {problem}", param if param is not None else where)


def _format_path(name: str, path: tuple) -> str:
    """`name.key.0...` with long paths and keys cut, and never a lone surrogate (the text
    goes back to the client as JSON, which must encode)."""
    parts = [name] if name else []
    for key in path[:_MAX_SHOWN_PATH_PARTS]:
        text = str(key)
        if len(text) > _MAX_SHOWN_KEY_CHARS:
            text = text[:_MAX_SHOWN_KEY_CHARS] + "..."
        parts.append(text.encode("utf-8", "backslashreplace").decode("utf-8"))
    if len(path) > _MAX_SHOWN_PATH_PARTS:
        parts.append("...")
    return ".".join(parts) or "body"


def short_repr(value: Any) -> str:
    """repr for an error message: short, and safe for ints too long to print."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**40 else "a huge integer"
    return text if len(text) <= 80 else text[:77] + "..."


def json_object(name: str, value: Any) -> dict:
    """A dict given as itself or as its JSON text (a flag's value), else a ValueError
    naming `name`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{name} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict (or its JSON), got {type(value).__name__}")
    return value


def check_known_keys(what: str, keys, known) -> None:
    """Every one of `keys` is in `known`, else a ValueError listing the unknown ones (as
    "unknown {what}(s)") and the known ones."""
    unknown = sorted(map(str, set(keys) - set(known)))
    if unknown:
        raise ValueError(
            f"unknown {what}(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
