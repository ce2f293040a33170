"""What the routes share: ServerConfig, AppState (the runtime once started, the server's own
settings), and reading a request (its JSON body; waiting on it while the client stays)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from weft.runtime.config import EngineConfig
from weft.runtime.server.chat import load_chat_template
from weft.runtime.server.generate_input import no_tokenizer
from weft.runtime.server.http.body import parse_json_body
from weft.runtime.server.http.metrics import Metrics
from weft.runtime.server.http.tool_parser import TOOL_CALL_PARSERS, ToolFormat
from weft.runtime.server.launch import Runtime
from weft.runtime.server.limits import RequestLimits
from weft.runtime.server.tokenizer_manager import RuntimeDown, TokenizerManager

LARGE_BODY_BYTES = 1 << 20  # JSON bodies from this size are parsed on a thread


@dataclass(frozen=True)
class ServerConfig:
    """HTTP-side options; the engine's own options are in `engine`."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = field(default=None, repr=False)  # never shown (logs, reprs)
    served_model_name: str | None = None
    chat_template: str | None = None  # path of a Jinja file overriding the tokenizer's template
    incremental_streaming_output: bool = False  # native /generate streams deltas instead of totals
    enable_cache_report: bool = False  # usage.prompt_tokens_details.cached_tokens on /v1
    tool_call_parser: str = "auto"  # the tool-call format; auto: the chat template's
    # limits (README "Limits"): over one is a 4xx before any work is queued
    max_top_logprobs: int = 20  # top_logprobs_num / OpenAI logprobs / top_logprobs
    max_n: int = 128  # samples per prompt (n, sampling_params.n)
    max_request_bytes: int = 32 << 20  # request body size; more is a 413
    shutdown_timeout: float = 30.0  # seconds in-flight requests may finish after SIGTERM

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        self.limits  # noqa: B018 - validates max_top_logprobs and max_n
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                f"got {self.tool_call_parser!r}"
            )

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(max_top_logprobs=self.max_top_logprobs, max_n=self.max_n)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model or "SmolLM2-135M-Instruct"


class AppState:
    """What the routes share: the runtime once started, and the server's own settings."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.runtime: Runtime | None = None
        self.startup_error: str | None = None
        self.chat_template = load_chat_template(config.chat_template)
        self.started_at = time.time()
        self.on_ready: list[Any] = []  # callables run once the runtime is up (metrics, ...)
        self.warmed = False  # the warm-up request and the on_ready hooks are done
        self.on_fatal: list[Any] = []  # called with the reason when start-up fails or a child dies
        self.exit_code = 0
        self.draining = False  # SIGTERM: new requests get 503, in-flight ones finish
        self.in_flight = 0  # HTTP requests being served (counted by the guard middleware)
        self.metrics = Metrics()
        # (the tool-call format, whether its markers are special tokens): set at the first
        # chat request with tools, once the tokenizer is known
        self.tool_format: tuple[ToolFormat, bool] | None = None

    @property
    def ready(self) -> bool:
        """/health's answer: up, warmed up, not shutting down, and no child process gone."""
        return (
            self.warmed
            and not self.draining
            and self.runtime is not None
            and self.runtime.manager.down is None
        )

    @property
    def manager(self) -> TokenizerManager:
        if self.runtime is None:
            raise RuntimeDown("the server is still starting")
        return self.runtime.manager

    @property
    def rt(self) -> Runtime:
        if self.runtime is None:
            raise RuntimeDown("the server is still starting")
        return self.runtime

    def tokenizer_for(self, what: str) -> Any:
        """The runtime's tokenizer, which `what` needs: a 400 naming skip_tokenizer_init when the
        runtime has none."""
        tokenizer = self.rt.tokenizer
        if tokenizer is None:
            raise no_tokenizer(what)
        return tokenizer


class ClientGone(Exception):
    """The client disconnected before its response was ready (its requests were aborted)."""


def state_of(request: Request) -> AppState:
    state: AppState = request.app.state.weft
    return state


async def read_json(request: Request, strict: bool = False) -> Any:
    """The request body as JSON; ValueError with a clear message when it is not.

    strict (the OpenAI routes): the Content-Type must say JSON; the native routes, like SGLang's,
    accept any (curl -d sends form-encoded by default)."""
    ctype = request.headers.get("content-type", "")
    if strict and "json" not in ctype:
        raise ValueError(f"Content-Type must be application/json, got {ctype!r}")
    raw = await request.body()
    if not raw:
        raise ValueError("the request body is empty: send a JSON object")
    if len(raw) < LARGE_BODY_BYTES:
        return parse_json_body(raw)
    return await asyncio.to_thread(parse_json_body, raw)  # not on the event loop


async def until_done_or_disconnect(request: Request, coro: Any, on_disconnect: Any) -> Any:
    """Await `coro`, calling `on_disconnect()` and giving up if the client goes away first."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=1.0)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                on_disconnect()
                raise ClientGone(request.url.path)
    finally:
        if not task.done():
            task.cancel()
