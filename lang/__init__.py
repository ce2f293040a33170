"""weft.lang: the frontend DSL (gen, select, fork, roles) and its backends."""

from __future__ import annotations

from weft.lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    gen,
    gen_int,
    gen_string,
    get_default_backend,
    get_server_info,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from weft.lang.backends import (
    Backend,
    BackendError,
    EngineBackend,
    FakeBackend,
    OpenAI,
    RuntimeEndpoint,
)
from weft.lang.chat_template import ChatTemplate, ChatTemplateError
from weft.lang.choices import (
    ChoicesDecision,
    ChoicesMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from weft.lang.interpreter import ProgramError
from weft.lang.program import Program, function
from weft.lang.state import ForkedStates, ProgramState
from weft.lang.tracer import TracerProgramState

__all__ = [
    "Backend",
    "BackendError",
    "ChatTemplate",
    "ChatTemplateError",
    "ChoicesDecision",
    "ChoicesMethod",
    "EngineBackend",
    "FakeBackend",
    "ForkedStates",
    "OpenAI",
    "Program",
    "ProgramError",
    "ProgramState",
    "RuntimeEndpoint",
    "TracerProgramState",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_default_backend",
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
