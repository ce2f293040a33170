"""The HTTP app: ServerConfig, start-up in the background (/health is 503 until ready), auth,
error shapes (SGLang's on native routes, OpenAI's on /v1), and the routers."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from weft.runtime.config import EngineConfig
from weft.runtime.server.chat import load_chat_template
from weft.runtime.server.http.metrics import Metrics
from weft.runtime.server.http.tool_parser import TOOL_CALL_PARSERS, ToolFormat
from weft.runtime.server.launch import Runtime, start_runtime
from weft.runtime.server.tokenizer_manager import RuntimeDown, TokenizerManager

logger = logging.getLogger("weft.server")

OPEN_PATHS = {"/health"}  # answered without the API key


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


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>`. A plain ASGI middleware: Starlette's
    BaseHTTPMiddleware would hide client disconnects from the routes (no abort on disconnect)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = dict(scope.get("headers") or [])
            if headers.get(b"authorization", b"") != self.expected:
                response = JSONResponse({"error": "Unauthorized"}, status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BadRequest(ValueError):
    """A ValueError with a status code other than 400 (404 unknown model, 413, ...)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def create_app(config: ServerConfig, start: bool = True) -> FastAPI:
    state = AppState(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.ensure_future(_start(state)) if start else None
        try:
            yield
        finally:
            if task is not None and not task.done():
                task.cancel()
            if state.runtime is not None:
                await state.runtime.close()

    app = FastAPI(title="weft", lifespan=lifespan)
    app.state.weft = state

    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)

    @app.exception_handler(ValueError)
    async def value_error(request: Request, exc: ValueError) -> JSONResponse:
        status = exc.status if isinstance(exc, BadRequest) else 400
        param = exc.param if isinstance(exc, BadRequest) else None
        return error_response(request, str(exc), status, param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request, _describe_validation(exc), 400)

    @app.exception_handler(RuntimeDown)
    async def runtime_down(request: Request, exc: RuntimeDown) -> JSONResponse:
        return error_response(request, str(exc), 503)

    from weft.runtime.server.http import metrics, native, openai_api

    app.include_router(native.router)
    app.include_router(openai_api.router)
    app.include_router(metrics.router)
    return app


async def _start(state: AppState) -> None:
    try:
        engine = state.config.engine
        logger.info("loading %s", engine.model or "the packaged SmolLM2-135M-Instruct")
        state.runtime = await start_runtime(engine)
        state.runtime.manager.observers.append(state.metrics.observe)
        info = state.runtime.server_info
        logger.info(
            "KV pool: %d tokens (page size %d); model loaded in %.1f s",
            info["max_total_tokens"],
            info["page_size"],
            info.get("load_seconds", 0.0),
        )
        await _warm_up(state.runtime.manager)
        for hook in state.on_ready:
            hook(state)
        cfg = state.config
        logger.info("ready: http://%s:%d (model %s)", cfg.host, cfg.port, cfg.model_name)
        state.warmed = True
    except Exception as e:
        state.startup_error = f"{type(e).__name__}: {e}"
        _fatal(state, f"weft failed to start: {state.startup_error}")
        return
    while state.runtime.manager.down is None:
        await asyncio.sleep(0.5)
    _fatal(state, f"shutting down: {state.runtime.manager.down}")


def _fatal(state: AppState, reason: str) -> None:
    logger.error(reason)
    state.exit_code = 1
    for hook in state.on_fatal:
        hook(reason)


async def _warm_up(manager: TokenizerManager) -> None:
    from weft.runtime.server.generate_input import GenerateInput

    logger.info("warming up")
    obj = GenerateInput(input_ids=[0], sampling_params={"max_new_tokens": 1})
    async for _ in manager.generate(obj):
        pass


def is_openai_path(request: Request) -> bool:
    return request.url.path.startswith("/v1/")


def error_response(
    request: Request, message: str, status: int, param: str | None = None
) -> JSONResponse:
    if is_openai_path(request):
        kind = "invalid_request_error" if status < 500 else "internal_error"
        body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    else:
        body = {"error": {"message": message}}
    return JSONResponse(body, status_code=status)


def _describe_validation(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


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
