"""A request body read as JSON at the boundary: valid text, parsed, at most MAX_JSON_DEPTH levels
deep and free of lone surrogates, or a ValueError (a 400) saying what is wrong and where."""

from __future__ import annotations

import json
from typing import Any

from weft.runtime.text_checks import lone_surrogate, surrogate_message

# Arrays and objects nested deeper are refused (serde_json's default limit): everything behind
# the parser (pydantic, json.dumps of a schema, Jinja, the grammar compilers) recurses on depth.
MAX_JSON_DEPTH = 128
_SCALARS = {int, float, bool, type(None)}


def parse_json_body(raw: bytes) -> Any:
    """The body's JSON value; ValueError when the bytes are not text, not JSON, nested deeper
    than MAX_JSON_DEPTH or hold a string that is not valid Unicode (a lone surrogate)."""
    encoding = json.detect_encoding(raw)  # UTF-8 (with or without a BOM), or UTF-16/32
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError as e:
        raise ValueError(f"the request body is not valid {_name(encoding)} text: {e}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed JSON in the request body: {e}") from None
    except ValueError as e:  # an integer of more digits than Python converts (4,300)
        raise ValueError(
            f"the request body holds a number too long: {str(e).split(';')[0]}"
        ) from None
    except RecursionError:
        raise ValueError(_too_deep()) from None
    check_json_value(value)
    return value


def check_json_value(value: Any) -> None:
    """Walk a parsed JSON value without recursion: ValueError at the first string (key or
    value) with a lone surrogate, or at nesting deeper than MAX_JSON_DEPTH, naming its path."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            _check_string(item, path)
        elif isinstance(item, (list, dict)):
            if depth >= MAX_JSON_DEPTH:
                raise ValueError(_too_deep(path))
            if isinstance(item, dict):
                for key, child in item.items():
                    child_path = f"{path}.{key}" if path else str(key)
                    _check_string(key, f"{child_path} (a key)")
                    if type(child) not in _SCALARS:
                        stack.append((child, child_path, depth + 1))
            # NOTE: a list of numbers (token ids) is skipped in one C-level pass over its types
            elif not set(map(type, item)) <= _SCALARS:
                stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(item))


def _check_string(text: str, path: str) -> None:
    at = lone_surrogate(text)
    if at is not None:
        raise ValueError(surrogate_message(_shown(path) or "the request body", text, at))


def _too_deep(path: str = "") -> str:
    where = f" (at {_shown(path)})" if path else ""
    return f"the request body nests arrays or objects deeper than {MAX_JSON_DEPTH} levels{where}"


def _shown(path: str) -> str:
    """A path for a message: printable (keys may hold surrogates), at most 120 characters."""
    path = path.encode("utf-8", "backslashreplace").decode("utf-8")
    return path if len(path) <= 120 else path[:117] + "..."


def _name(encoding: str) -> str:
    return "UTF-8" if encoding.startswith("utf-8") else encoding.upper()
