"""The HTTP app: start-up in the background (/health is 503 until ready), the middlewares (auth, body
cap, shutdown), the error handlers (SGLang's shape on native routes, OpenAI's on /v1), the routers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from weft.runtime.server.generate_input import GenerateInput
from weft.runtime.server.http import metrics, native, openai_api, openai_chat
from weft.runtime.server.http.errors import (
    BadRequest,
    add_routing_error_handlers,
    describe_validation,
    error_response,
)
from weft.runtime.server.http.middleware import ApiKeyMiddleware, GuardMiddleware
from weft.runtime.server.http.state import AppState, ClientGone, ServerConfig
from weft.runtime.server.launch import start_runtime
from weft.runtime.server.tokenizer_manager import RuntimeDown, TokenizerManager

logger = logging.getLogger("weft.server")


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
    # added last, so outermost: a body too large or a request while draining never gets further
    app.add_middleware(GuardMiddleware, state=state, max_bytes=config.max_request_bytes)

    @app.exception_handler(ValueError)
    async def value_error(request: Request, exc: ValueError) -> JSONResponse:
        if isinstance(exc, BadRequest):
            return error_response(request, str(exc), exc.status, exc.param, exc.code)
        return error_response(request, str(exc), 400)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request, describe_validation(exc), 400)

    @app.exception_handler(RuntimeDown)
    async def runtime_down(request: Request, exc: RuntimeDown) -> JSONResponse:
        return error_response(request, str(exc), 503)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        logger.info("client disconnected: %s %s (its requests aborted)", request.method, exc)
        return Response(status_code=499)  # nobody reads it: nginx's "client closed request"

    add_routing_error_handlers(app)
    for routes in (native, openai_api, openai_chat, metrics):
        app.include_router(routes.router)
    return app


async def _start(state: AppState) -> None:
    try:
        engine = state.config.engine
        logger.info("loading %s", engine.model or "the packaged SmolLM2-135M-Instruct")
        state.runtime = await start_runtime(engine, state.config.limits)
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
    logger.info("warming up")
    obj = GenerateInput(input_ids=[0], sampling_params={"max_new_tokens": 1})
    async for _ in manager.generate(obj):
        pass
