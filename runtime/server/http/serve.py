"""`weft serve`: run the HTTP server (uvicorn) until SIGINT/SIGTERM or a child process dies."""

from __future__ import annotations

import contextlib
import gc
import logging
import signal
import sys
from collections.abc import Iterator

import uvicorn

from weft.runtime.server.http.app import create_app
from weft.runtime.server.http.state import ServerConfig

logger = logging.getLogger("weft.server")


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s [weft] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    for name in ("weft.server", "weft.runtime.server.launch", "weft.runtime.loader"):
        logging.getLogger(name).setLevel(min(logging.INFO, logging.getLogger().level))


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown, so the process would die by
    the signal; we stop on them ourselves and exit 0 (1 when the runtime failed)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        def stop(signum: int, frame: object) -> None:
            logger.info("received %s: shutting down", signal.Signals(signum).name)
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True

        old = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)


def run_server(config: ServerConfig) -> int:
    """Serve until stopped; the exit code is 0 for a requested stop, 1 if the runtime failed."""
    setup_logging(config.engine.log_level)
    app = create_app(config)
    server = _Server(
        uvicorn.Config(app, host=config.host, port=config.port, log_level="warning", lifespan="on")
    )
    state = app.state.weft

    def stop(reason: str) -> None:
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
    url = f"http://{config.host}:{config.port}"
    auth = f' -H "Authorization: Bearer {config.api_key}"' if config.api_key else ""
    key = config.api_key or "none"
    print(
        f"\nweft is serving {config.model_name} at {url}\n"
        f"  curl {url}/generate{auth} -H 'Content-Type: application/json' "
        f"""-d '{{"text": "The capital of France is", "sampling_params": {{"max_new_tokens": 16}}}}'\n"""
        f"  python -c \"from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key='{key}'); "
        f"print(c.chat.completions.create(model='{config.model_name}', "
        f"messages=[{{'role': 'user', 'content': 'Hi!'}}]).choices[0].message.content)\"\n",
        file=sys.stderr,
        flush=True,
    )
