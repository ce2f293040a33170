"""Field checks shared by weft's frozen configs: unknown keyword names, and each field's value
against its annotated type."""

from __future__ import annotations

import types
import typing
from dataclasses import fields
from typing import Any, Literal


def check_known(cls: type, kwargs: dict[str, Any], what: str) -> None:
    unknown = sorted(set(kwargs) - {f.name for f in fields(cls)})
    if unknown:
        raise ValueError(f"unknown {what}(s): {', '.join(unknown)}")


def check_fields(config: Any) -> None:
    """Every field holds a value of its annotated type (a flag given "no" would otherwise read
    as true, and a number given as a string would fail later, far from its cause)."""
    hints = typing.get_type_hints(type(config))
    for f in fields(config):
        value, hint = getattr(config, f.name), hints[f.name]
        if not matches_hint(value, hint):
            raise ValueError(
                f"{f.name} must be {describe_hint(hint)}, got {value!r} ({type(value).__name__})"
            )


def matches_hint(value: Any, hint: Any) -> bool:
    """isinstance for the annotations EngineConfig uses (bool is not an int here; a Literal's
    values are checked by the field's own rule, with its own message)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(matches_hint(value, arg) for arg in typing.get_args(hint))
    if origin is Literal:
        return any(type(value) is type(arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint) if isinstance(hint, type) else True


def describe_hint(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_hint(arg) for arg in typing.get_args(hint))
    if origin is Literal:
        return "one of " + ", ".join(repr(arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return "None"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        hint, getattr(hint, "__name__", str(hint))
    )
