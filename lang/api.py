"""The DSL's public primitives: gen, select, roles, and the default backend. They only build IR."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

from weft.lang.backends.base import Backend
from weft.lang.choices import ChoicesMethod, token_length_normalized
from weft.lang.ir import Gen, Node, RoleBegin, RoleEnd, Select, to_node
from weft.lang.params import (
    GenParams,
    as_dtype,
    as_ids,
    as_json_schema,
    as_lora,
    as_strs,
    check_regex,
)


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    stop_regex: str | Sequence[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: Sequence[str] | None = None,
    choices_method: ChoicesMethod | None = None,
    regex: str | None = None,
    json_schema: Any = None,
    lora: str | None = None,
) -> Node:
    """A generation stored in `s[name]`. Every argument left None inherits run()'s default.

    `choices=[...]` makes it a select. `regex` is compiled here (re.error at the call);
    `json_schema` is a JSON string, a dict, or a pydantic model class (then `s.parsed(name)`
    gives the validated object); `dtype` (int/float/str/bool) becomes a regex. `lora` names
    the LoRA adapter to generate with (sent as the request's lora_path; run(lora=...) sets the
    program's default)."""
    if choices is not None:
        return select(
            name,
            choices,
            temperature=0.0 if temperature is None else temperature,
            choices_method=choices_method or token_length_normalized,
            lora=lora,
        )
    if n is not None and n < 1:
        raise ValueError(f"gen: n must be at least 1, got {n}")
    schema, model = as_json_schema(json_schema)
    params = GenParams(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        n=n,
        stop=as_strs("stop", stop),
        stop_token_ids=as_ids("stop_token_ids", stop_token_ids),
        stop_regex=as_strs("stop_regex", stop_regex),
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        ignore_eos=ignore_eos,
        return_logprob=return_logprob,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs,
        dtype=as_dtype(dtype),
        regex=check_regex(regex),
        json_schema=schema,
        schema_model=model,
        lora=as_lora("gen", lora),
    )
    if sum(x is not None for x in (params.regex, params.json_schema)) > 1:
        raise ValueError("gen: give at most one of regex and json_schema")
    if params.dtype is not None and params.json_schema is not None:
        raise ValueError("gen: dtype and json_schema cannot be combined")
    return Gen(name, params)


def gen_int(name: str | None = None, **kwargs: Any) -> Node:
    """gen(dtype=int): an integer (as text)."""
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Node:
    """gen(dtype=str): a double-quoted string of words."""
    return gen(name, dtype=str, **kwargs)


def select(
    name: str | None = None,
    choices: Sequence[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesMethod = token_length_normalized,
    lora: str | None = None,
) -> Node:
    """Append exactly one of `choices`: the one the model scores best as a continuation
    (token-length-normalized logprob by default; ties go to the first), scored under the LoRA
    adapter `lora` (None: the program's default, run(lora=...))."""
    if not choices or isinstance(choices, str):
        raise ValueError(f"select: choices must be a non-empty list of strings, got {choices!r}")
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"select: every choice must be a non-empty string, got {list(choices)!r}")
    if not isinstance(choices_method, ChoicesMethod):
        raise TypeError(
            "select: choices_method must be one of weft's choices methods "
            "(token_length_normalized, greedy_token_selection, unconditional_likelihood_normalized)"
        )
    return Select(name, tuple(choices), temperature, choices_method, as_lora("select", lora))


##### Roles #####


def _role(role: str, expr: Any) -> Node:
    inner = [] if expr is None else [to_node(expr)]
    return to_node([RoleBegin(role), *inner, RoleEnd(role)])


def system(expr: Any = None) -> Node:
    return _role("system", expr)


def user(expr: Any = None) -> Node:
    return _role("user", expr)


def assistant(expr: Any = None) -> Node:
    return _role("assistant", expr)


def system_begin() -> Node:
    return RoleBegin("system")


def system_end() -> Node:
    return RoleEnd("system")


def user_begin() -> Node:
    return RoleBegin("user")


def user_end() -> Node:
    return RoleEnd("user")


def assistant_begin() -> Node:
    return RoleBegin("assistant")


def assistant_end() -> Node:
    return RoleEnd("assistant")


##### The default backend #####

_default: Backend | None = None
_default_lock = threading.RLock()
_wrapped: weakref.WeakKeyDictionary[Any, Backend] = weakref.WeakKeyDictionary()


def as_backend(backend: Any) -> Backend:
    """A Backend as is; a weft.Engine wrapped in an EngineBackend."""
    if isinstance(backend, Backend):
        return backend
    from weft.runtime.server.engine import Engine

    if isinstance(backend, Engine):
        from weft.lang.backends.engine import EngineBackend

        with _default_lock:  # one wrapper per engine, so its chat template is cut once
            if backend not in _wrapped:
                _wrapped[backend] = EngineBackend(backend)
            return _wrapped[backend]
    raise TypeError(
        f"expected a backend (weft.RuntimeEndpoint, weft.OpenAI, EngineBackend) or a "
        f"weft.Engine, got {type(backend).__name__}"
    )


def set_default_backend(backend: Any) -> None:
    """The backend programs run on when run() is not given one (None clears it)."""
    global _default
    with _default_lock:
        _default = None if backend is None else as_backend(backend)


def get_default_backend() -> Backend | None:
    return _default


def resolve_backend(backend: Any = None) -> Backend:
    if backend is not None:
        return as_backend(backend)
    if _default is None:
        raise RuntimeError(
            "no backend to run this program on: pass backend=... to run(), or call "
            "weft.set_default_backend(weft.RuntimeEndpoint(url)) (or a weft.Engine) first"
        )
    return _default


def flush_cache(backend: Any = None) -> bool:
    return resolve_backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict[str, Any]:
    return resolve_backend(backend).get_server_info()
