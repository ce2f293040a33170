"""What the routes share: ServerConfig, AppState (the runtime once started, the server's own
settings), and reading a request (its JSON body; waiting on it while the client stays)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from weft.runtime.config import EngineConfig
from weft.runtime.server.chat import load_chat_template
from weft.runtime.server.generate_input import no_tokenizer
from weft.runtime.server.http.metrics import Metrics
from weft.runtime.server.http.tool_parser import TOOL_CALL_PARSERS, ToolFormat
from weft.runtime.server.launch import Runtime
from weft.runtime.server.tokenizer_manager import RuntimeDown, TokenizerManager


@dataclass(frozen=True)
class ServerConfig:
    """HTTP-side options; the engine's own options are in `engine`."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None
    chat_template: str | None = None  # path of a Jinja file overriding the tokenizer's template
    incremental_streaming_output: bool = False  # native /generate streams deltas instead of totals
    enable_cache_report: bool = True  # usage.prompt_tokens_details.cached_tokens on /v1
    tool_call_parser: str = "auto"  # the tool-call format; auto: the chat template's

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                f"got {self.tool_call_parser!r}"
            )

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
        self.metrics = Metrics()
        # (the tool-call format, whether its markers are special tokens): set at the first
        # chat request with tools, once the tokenizer is known
        self.tool_format: tuple[ToolFormat, bool] | None = None

    @property
    def ready(self) -> bool:
        """/health's answer: up, warmed up, and no child process gone."""
        return self.warmed and self.runtime is not None and self.runtime.manager.down is None

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
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed JSON in the request body: {e}") from e
    except RecursionError:  # e.g. a json_schema object nested thousands of levels deep
        raise ValueError("the request body's JSON nests too deeply to read") from None


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
                raise asyncio.CancelledError("client disconnected")
    finally:
        if not task.done():
            task.cancel()
