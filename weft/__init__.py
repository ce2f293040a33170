"""weft: a structured-generation runtime with a frontend DSL (public face: re-exports only)."""

from __future__ import annotations

from weft._kernels_path import declare_kernels

declare_kernels()  # before anything imports weft.kernels (see weft/_kernels_path.py)

from weft.runtime.config import EngineConfig  # noqa: E402
from weft.runtime.sampling_params import SamplingParams  # noqa: E402
from weft.runtime.server.engine import Engine  # noqa: E402

from weft.lang import (  # noqa: E402  # isort: skip - the DSL imports the runtime above
    Backend,
    BackendError,
    ChoicesMethod,
    EngineBackend,
    ForkedStates,
    OpenAI,
    ProgramError,
    ProgramState,
    RuntimeEndpoint,
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_server_info,
    greedy_token_selection,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    token_length_normalized,
    unconditional_likelihood_normalized,
    user,
    user_begin,
    user_end,
)

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendError",
    "ChoicesMethod",
    "Engine",
    "EngineBackend",
    "EngineConfig",
    "ForkedStates",
    "OpenAI",
    "ProgramError",
    "ProgramState",
    "RuntimeEndpoint",
    "SamplingParams",
    "__version__",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_server_info",
    "greedy_token_selection",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
]
