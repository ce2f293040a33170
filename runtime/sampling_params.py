"""SamplingParams: one request's sampling parameters, type- and range-checked at the boundary."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import regex

from weft.constrain.limits import DEFAULT_LIMITS
from weft.runtime.text_checks import check_text

GREEDY_TEMPERATURE = 1e-6  # a temperature in [0, GREEDY_TEMPERATURE) means greedy (argmax)
_SEED_LIMIT = 2**64  # torch generators take uint64 seeds
_INT_LIMIT = 2**64  # the IPC codec carries integers below this (uint64)


@dataclass(frozen=True)
class SamplingParams:
    """The sampling parameters of one request (sglang-api.md section (d)).

    Build it from user input with `from_dict`, which checks types and coerces JSON shapes (a str
    `stop`, str `logit_bias` keys, a dict `json_schema`). `__post_init__` checks every range rule,
    so a value decoded by msgspec on the scheduler side is checked again. Every check raises
    `ValueError` with a message that names the field (HTTP 400).
    """

    max_new_tokens: int | None = 128  # None: until the context limit
    min_new_tokens: int = 0  # EOS and stop-token ids are masked until this many tokens exist
    stop: tuple[str, ...] = ()  # matched on decoded text, trimmed unless no_stop_trim
    stop_token_ids: tuple[int, ...] = ()  # sorted, unique
    stop_regex: tuple[str, ...] = ()  # searched in the decoded output (re syntax, with a timeout)
    temperature: float = 1.0  # [0, 1e-6) is greedy: see is_greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: the whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    json_schema: str | None = None  # JSON text (a dict given to from_dict is json.dumps'ed)
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None  # JSON text: {"structures", "triggers"} or {"format"}
    # refuse schema keywords the grammar cannot enforce (json_schema, structural_tag schemas)
    strict_json_schema: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> additive bias; None when empty
    sampling_seed: int | None = None  # None: the engine's shared generator
    # reasoning tokens allowed before the end marker is forced (needs --reasoning-parser)
    thinking_budget: int | None = None

    def __post_init__(self) -> None:
        _check_ranges(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SamplingParams:
        """The user-facing constructor: JSON-shaped input in, a checked SamplingParams out.

        `None` (null) for a field means its default, except `max_new_tokens` (None: no limit).
        """
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling_params must be an object, got {d!r}")
        kwargs: dict[str, Any] = {}
        for name, value in d.items():
            coerce = _COERCE.get(name)
            if coerce is None:
                raise ValueError(
                    f"unknown sampling parameter {name!r}; accepted: {', '.join(_COERCE)}"
                )
            if value is None:
                if name == "max_new_tokens":
                    kwargs[name] = None
                continue
            kwargs[name] = coerce(name, value)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """All fields as a plain dict (for meta_info and logs); `from_dict` accepts it back."""
        return asdict(self)

    @property
    def is_greedy(self) -> bool:
        """Argmax decoding: the temperature is below GREEDY_TEMPERATURE."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def verify_vocab(self, vocab_size: int) -> None:
        """Reject token ids that the model's vocabulary does not have."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias)):
            for token_id in ids or ():
                if token_id >= vocab_size:
                    raise ValueError(
                        f"{name}: token id {token_id} is out of vocabulary (size {vocab_size})"
                    )


##### Internal Helper Functions #####


def _fmt(x: float) -> str:
    """A number as the user most likely wrote it: 0.0 -> '0', 0.5 -> '0.5'."""
    return str(int(x)) if math.isfinite(x) and x == int(x) else repr(x)


def _check_ranges(p: SamplingParams) -> None:
    if p.max_new_tokens is not None and p.max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be at least 0 (or null), got {p.max_new_tokens}")
    upper = math.inf if p.max_new_tokens is None else p.max_new_tokens
    if not 0 <= p.min_new_tokens <= upper:
        raise ValueError(
            f"min_new_tokens must be in [0, max_new_tokens], got {p.min_new_tokens} "
            f"(max_new_tokens={p.max_new_tokens})"
        )
    if not (math.isfinite(p.temperature) and p.temperature >= 0):
        raise ValueError(f"temperature must be finite and at least 0, got {_fmt(p.temperature)}")
    if not 0 < p.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {_fmt(p.top_p)}")
    if not (p.top_k == -1 or p.top_k >= 1):
        raise ValueError(f"top_k must be -1 (disabled) or at least 1, got {p.top_k}")
    if not 0 <= p.min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {_fmt(p.min_p)}")
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(p, name)
        if not -2 <= value <= 2:
            raise ValueError(f"{name} must be in [-2, 2], got {_fmt(value)}")
    if not 0 < p.repetition_penalty <= 2:
        raise ValueError(f"repetition_penalty must be in (0, 2], got {_fmt(p.repetition_penalty)}")
    if p.n < 1:
        raise ValueError(f"n must be at least 1, got {p.n}")
    if p.thinking_budget is not None and not 0 <= p.thinking_budget < _INT_LIMIT:
        raise ValueError(f"thinking_budget must be at least 0 (or null), got {p.thinking_budget}")
    # NOTE: max_new_tokens is held to the context length before it is sent (check_request)
    for name in ("min_new_tokens", "top_k", "n"):
        if getattr(p, name) >= _INT_LIMIT:
            raise ValueError(f"{name} is too large (at most 2**64 - 1), got {getattr(p, name)}")
    if any(s == "" for s in p.stop):
        raise ValueError("stop strings must be non-empty, got ''")
    for token_id in p.stop_token_ids:
        if token_id < 0:
            raise ValueError(f"stop_token_ids must be non-negative token ids, got {token_id}")
    for pattern in p.stop_regex:
        if pattern == "":
            raise ValueError("stop_regex patterns must be non-empty, got ''")
        try:
            regex.compile(pattern)
        except regex.error as e:
            raise ValueError(f"stop_regex pattern {pattern!r} does not compile: {e}") from None
    if p.json_schema is not None:
        DEFAULT_LIMITS.check_json_depth(p.json_schema, "json_schema")  # before json.loads recurses
        try:
            json.loads(p.json_schema)
        except ValueError as e:
            raise ValueError(f"json_schema must be valid JSON text: {e}") from None
    if sum(g is not None for g in (p.regex, p.json_schema, p.ebnf)) > 1:
        raise ValueError("Only one of regex, json_schema, or ebnf can be set.")
    if p.structural_tag is not None:
        if any(g is not None for g in (p.regex, p.json_schema, p.ebnf)):
            raise ValueError("structural_tag cannot be combined with regex, json_schema or ebnf")
        DEFAULT_LIMITS.check_json_depth(p.structural_tag, "structural_tag")
        try:
            json.loads(p.structural_tag)
        except ValueError as e:
            raise ValueError(f"structural_tag must be valid JSON text: {e}") from None
    if p.strict_json_schema and p.json_schema is None and p.structural_tag is None:
        raise ValueError("strict_json_schema needs a json_schema or structural_tag to apply to")
    for token_id, bias in (p.logit_bias or {}).items():
        if token_id < 0:
            raise ValueError(f"logit_bias token ids must be non-negative, got {token_id}")
        if not math.isfinite(bias):
            raise ValueError(f"logit_bias for token {token_id} must be finite, got {_fmt(bias)}")
    if p.sampling_seed is not None and not 0 <= p.sampling_seed < _SEED_LIMIT:
        raise ValueError(f"sampling_seed must be in [0, 2**64), got {p.sampling_seed}")


def _as_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    return v


def _as_float(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be a number, got {v!r}")
    try:
        return float(v)
    except OverflowError:
        raise ValueError(f"{name} is out of range, got {v!r}") from None


def _as_bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"{name} must be true or false, got {v!r}")
    return v


def _as_str(name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"{name} must be a string, got {v!r}")
    return check_text(v, name)


def _as_strs(name: str, v: Any) -> tuple[str, ...]:
    items = (v,) if isinstance(v, str) else v
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise ValueError(f"{name} must be a string or a list of strings, got {v!r}")
    return tuple(check_text(s, name) for s in items)


def _as_token_ids(name: str, v: Any) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple, set, frozenset)):
        raise ValueError(f"{name} must be a list of token ids, got {v!r}")
    return tuple(sorted({_as_int(name, t) for t in v}))


def _as_json_schema(name: str, v: Any) -> str:
    if isinstance(v, Mapping):
        try:
            return json.dumps(v)
        except RecursionError:
            raise ValueError(f"{name} nests too deeply to read") from None
    if not isinstance(v, str):
        raise ValueError(f"{name} must be a JSON string or an object, got {v!r}")
    return check_text(v, name)


def _as_logit_bias(name: str, v: Any) -> dict[int, float] | None:
    if not isinstance(v, Mapping):
        raise ValueError(f"{name} must be an object mapping token ids to biases, got {v!r}")
    bias: dict[int, float] = {}
    for key, value in v.items():
        if isinstance(key, str) and re.fullmatch(r"-?\d+", key.strip()):
            key = int(key)
        if isinstance(key, bool) or not isinstance(key, int):
            raise ValueError(f"{name} keys must be token ids, got {key!r}")
        bias[key] = _as_float(f"{name}[{key}]", value)
    return bias or None


# field name -> coercer, in declaration order (the order of the "accepted" list in errors)
_COERCE: dict[str, Callable[[str, Any], Any]] = {
    "max_new_tokens": _as_int,
    "min_new_tokens": _as_int,
    "stop": _as_strs,
    "stop_token_ids": _as_token_ids,
    "stop_regex": _as_strs,
    "temperature": _as_float,
    "top_p": _as_float,
    "top_k": _as_int,
    "min_p": _as_float,
    "frequency_penalty": _as_float,
    "presence_penalty": _as_float,
    "repetition_penalty": _as_float,
    "n": _as_int,
    "json_schema": _as_json_schema,
    "regex": _as_str,
    "ebnf": _as_str,
    "structural_tag": _as_json_schema,
    "strict_json_schema": _as_bool,
    "ignore_eos": _as_bool,
    "skip_special_tokens": _as_bool,
    "spaces_between_special_tokens": _as_bool,
    "no_stop_trim": _as_bool,
    "logit_bias": _as_logit_bias,
    "sampling_seed": _as_int,
    "thinking_budget": _as_int,
}
assert list(_COERCE) == [f.name for f in fields(SamplingParams)], "keep _COERCE in field order"
