"""`weft serve`: run the HTTP server (uvicorn) until a signal or a child process's death stops it.

The first SIGTERM/SIGINT drains (new requests get 503, those in flight get --shutdown-timeout
seconds, then are aborted) and exits 0; a second one exits at once with code 1, its child
processes terminated."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

import uvicorn

from weft.runtime.server.http.app import create_app
from weft.runtime.server.http.shutdown import drain
from weft.runtime.server.http.state import AppState, ServerConfig

logger = logging.getLogger("weft.server")

FORCED_EXIT_CODE = 1  # a second signal: the exit is not clean (requests cut, no drain)
CONNECTION_CLOSE_S = 3.0  # uvicorn's wait for connections once the drain is done
FORCED_CHILD_GRACE_S = 1.0  # a second signal: children get this long after SIGTERM, then SIGKILL


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s [weft] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    for name in ("weft.server", "weft.runtime.server.launch", "weft.runtime.loader"):
        logging.getLogger(name).setLevel(min(logging.INFO, logging.getLogger().level))


class _Server(uvicorn.Server):
    """uvicorn's own handling of SIGINT/SIGTERM closes the listening socket at once (new requests
    see a refused connection, not a 503), waits without limit for open connections and re-raises
    the signal; we drain first (weft.runtime.server.http.shutdown) and exit 0."""

    def __init__(self, config: uvicorn.Config, state: AppState, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self.signals = 0
        self.drain_task: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()

        def on_signal(signum: int, frame: object) -> None:
            name = signal.Signals(signum).name
            self.signals += 1
            if self.signals > 1:
                logger.error(
                    "received %s again: exiting now (code %d), child processes terminated",
                    name,
                    FORCED_EXIT_CODE,
                )
                self._exit_now()
            logger.info(
                "received %s: shutting down (no new requests; those in flight have %.1f s; "
                "a second signal exits at once)",
                name,
                self.shutdown_timeout,
            )
            loop.call_soon_threadsafe(self._start_drain)

        old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def _start_drain(self) -> None:
        if self.drain_task is None:
            self.drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await drain(self.state, self.shutdown_timeout)
        finally:
            self.should_exit = True

    def _exit_now(self) -> None:
        runtime = self.state.runtime
        if runtime is not None:
            runtime.children.shutdown(grace=FORCED_CHILD_GRACE_S)
        logging.shutdown()
        os._exit(FORCED_EXIT_CODE)


def run_server(config: ServerConfig) -> int:
    """Serve until stopped; the exit code is 0 for a requested stop, 1 if the runtime failed."""
    setup_logging(config.engine.log_level)
    app = create_app(config)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level="warning",
        lifespan="on",
        timeout_graceful_shutdown=int(CONNECTION_CLOSE_S),
    )
    state: AppState = app.state.weft
    server = _Server(uv_config, state, config.shutdown_timeout)

    def stop(reason: Any) -> None:
        server.should_exit = True

    state.on_fatal.append(stop)
    state.on_ready.append(lambda _s: _freeze_startup_objects())
    state.on_ready.append(lambda _s: _print_examples(config))
    server.run()
    return int(state.exit_code)


def _freeze_startup_objects() -> None:
    """What the server holds once ready (the app, the tokenizer, transformers' modules) lives as
    long as the process; frozen, the collector's full passes no longer walk it, and they stall
    every stream the event loop serves while they run."""
    gc.collect()
    gc.freeze()
    logger.debug("gc: %d objects frozen after start-up", gc.get_freeze_count())


def _print_examples(config: ServerConfig) -> None:
    """How to call the server; with --api-key, the key is never printed (read from the shell)."""
    url = f"http://{config.host}:{config.port}"
    auth = ' -H "Authorization: Bearer $WEFT_API_KEY"' if config.api_key else ""
    # with a key, the openai client reads it from OPENAI_API_KEY, set from the shell's variable
    key = "" if config.api_key else ", api_key='none'"
    env = "OPENAI_API_KEY=$WEFT_API_KEY " if config.api_key else ""
    note = "  (export WEFT_API_KEY=<the --api-key value> first)\n" if config.api_key else ""
    print(
        f"\nweft is serving {config.model_name} at {url}\n{note}"
        f"  curl {url}/generate{auth} -H 'Content-Type: application/json' "
        f"""-d '{{"text": "The capital of France is", "sampling_params": {{"max_new_tokens": 16}}}}'\n"""
        f'  {env}python -c "from openai import OpenAI; '
        f"c = OpenAI(base_url='{url}/v1'{key}); "
        f"print(c.chat.completions.create(model='{config.model_name}', "
        f"messages=[{{'role': 'user', 'content': 'Hi!'}}]).choices[0].message.content)\"\n",
        file=sys.stderr,
        flush=True,
    )
