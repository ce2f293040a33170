"""gen() parameters: per-gen overrides (None = inherit), run() defaults, and their resolution."""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

# dtype -> (regex, extra stop strings); sglang-api.md a.4
INT_REGEX = r"[-+]?[0-9]+[ \n]*"
FLOAT_REGEX = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
STR_REGEX = r"\"[\w\d\s]*\""
BOOL_REGEX = r"(True|False)"
_DTYPES: dict[str, tuple[str, tuple[str, ...]]] = {
    "int": (INT_REGEX, (" ", "\n")),
    "float": (FLOAT_REGEX, (" ", "\n")),
    "str": (STR_REGEX, ()),
    "bool": (BOOL_REGEX, ()),
}


@dataclass(frozen=True)
class GenParams:
    """What one gen() asked for; None means "inherit the run() default"."""

    max_tokens: int | None = None
    min_tokens: int | None = None
    n: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    stop_regex: tuple[str, ...] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    dtype: str | None = None  # "int" | "float" | "str" | "bool": becomes a regex
    regex: str | None = None
    json_schema: str | None = None  # JSON text
    schema_model: Any = None  # the pydantic class json_schema came from (for s.parsed)
    lora: str | None = None  # the LoRA adapter's name (the server's lora_path)


@dataclass(frozen=True)
class SamplingArgs:
    """One gen's resolved parameters: run() defaults overridden by the gen's own."""

    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stop_regex: tuple[str, ...] = ()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    ignore_eos: bool = False
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool = False
    regex: str | None = None
    json_schema: str | None = None
    lora: str | None = None  # LoRA adapter name: sent as the request's lora_path, not sampled

    def sampling_params(self) -> dict[str, Any]:
        """The native /generate `sampling_params` (grammar fields only when set)."""
        out: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "min_new_tokens": self.min_new_tokens,
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "ignore_eos": self.ignore_eos,
        }
        for key in ("stop", "stop_token_ids", "stop_regex"):
            if getattr(self, key):
                out[key] = list(getattr(self, key))
        for key in ("regex", "json_schema"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def logprob_fields(self) -> dict[str, Any]:
        """The top-level logprob fields of a native /generate request (only when asked)."""
        if not self.return_logprob:
            return {}
        out: dict[str, Any] = {"return_logprob": True}
        if self.logprob_start_len is not None:
            out["logprob_start_len"] = self.logprob_start_len
        if self.top_logprobs_num is not None:
            out["top_logprobs_num"] = self.top_logprobs_num
        if self.return_text_in_logprobs:
            out["return_text_in_logprobs"] = True
        return out


_GEN_TO_ARGS = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
_NOT_ARGS = {"dtype", "schema_model"}


def resolve(defaults: SamplingArgs, params: GenParams, end_of_turn: str | None) -> SamplingArgs:
    """Defaults, overridden by every non-None gen argument; dtype becomes a regex; inside an
    assistant turn the chat template's end-of-turn string is added to the stops."""
    changes: dict[str, Any] = {}
    for f in fields(GenParams):
        value = getattr(params, f.name)
        if value is None or f.name in _NOT_ARGS:
            continue
        changes[_GEN_TO_ARGS.get(f.name, f.name)] = value
    args = replace(defaults, **changes)
    if params.dtype is not None:
        regex, stops = _DTYPES[params.dtype]
        if params.regex is not None:
            warnings.warn(
                f"gen: dtype={params.dtype} overrides regex={params.regex!r}", stacklevel=2
            )
        args = replace(args, regex=regex, stop=_union(args.stop, stops))
    if end_of_turn:
        args = replace(args, stop=_union(args.stop, (end_of_turn,)))
    return args


##### Argument checks (at the gen() call) #####


def as_strs(name: str, value: str | Sequence[str] | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    items = (value,) if isinstance(value, str) else tuple(value)
    if not all(isinstance(s, str) and s for s in items):
        raise ValueError(f"gen: {name} must be a non-empty string or a list of them, got {value!r}")
    return items


def as_ids(name: str, value: Sequence[int] | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    items = tuple(value)
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in items):
        raise ValueError(f"gen: {name} must be a list of token ids, got {value!r}")
    return items


def as_lora(where: str, lora: Any) -> str | None:
    """A LoRA adapter's name (as the server knows it), or None for the base model."""
    if lora is not None and not (isinstance(lora, str) and lora):
        raise ValueError(f"{where}: lora must be an adapter's name (a non-empty str), got {lora!r}")
    return lora


def check_regex(regex: str | None) -> str | None:
    """Compile on the client so a bad pattern fails at the gen() call (re.error)."""
    if regex is not None:
        re.compile(regex)
    return regex


def as_dtype(dtype: Any) -> str | None:
    if dtype is None:
        return None
    name = dtype.__name__ if isinstance(dtype, type) else dtype
    if name not in _DTYPES:
        raise ValueError(
            f"gen: dtype must be int, float, str or bool (or their names), got {dtype!r}"
        )
    return str(name)


def is_pydantic_model(value: Any) -> bool:
    return isinstance(value, type) and hasattr(value, "model_json_schema")


def _closed(schema: dict[str, Any], model: Any) -> dict[str, Any]:
    """Objects of a pydantic model take no extra properties unless the model allows them
    (pydantic ignores extras on parsing, so generating them would only waste tokens)."""
    if getattr(model, "model_config", {}).get("extra") == "allow":
        return schema

    def close(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node:
                node.setdefault("additionalProperties", False)
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    return schema


def as_json_schema(schema: Any) -> tuple[str | None, Any]:
    """(JSON text of the schema, the pydantic class it came from or None)."""
    if schema is None:
        return None, None
    if is_pydantic_model(schema):
        return json.dumps(_closed(schema.model_json_schema(), schema)), schema
    if isinstance(schema, dict):
        return json.dumps(schema), None
    if isinstance(schema, str):
        try:
            json.loads(schema)
        except ValueError as e:
            raise ValueError(f"gen: json_schema is not valid JSON text: {e}") from None
        return schema, None
    raise TypeError(
        "gen: json_schema must be a JSON string, a dict, or a pydantic model class, "
        f"got {type(schema).__name__}"
    )


def _union(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    return a + tuple(s for s in b if s not in a)
