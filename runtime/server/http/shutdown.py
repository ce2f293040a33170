"""The graceful stop of `weft serve` (first SIGTERM/SIGINT): refuse new work with 503, let the
requests in flight finish for up to --shutdown-timeout seconds, then abort the rest."""

from __future__ import annotations

import asyncio
import logging

from weft.runtime.server.http.middleware import SHUTTING_DOWN
from weft.runtime.server.http.state import AppState

logger = logging.getLogger("weft.server")

SHUTDOWN_ABORT = "server shutting down"  # the message of the abort finish reason
ABORT_GRACE_S = 5.0  # after the abort: time for the aborted requests' last events to go out
POLL_S = 0.05


async def drain(state: AppState, timeout: float) -> None:
    """Returns once no HTTP request is in flight: finished within `timeout`, or aborted
    (finish reason {"type": "abort", "message": "server shutting down"}) after it."""
    state.draining = True
    manager = state.runtime.manager if state.runtime is not None else None
    if manager is not None:
        manager.stop_accepting(SHUTTING_DOWN)
    if state.in_flight:
        logger.info(
            "draining: %d requests in flight, up to %.1f s to finish", state.in_flight, timeout
        )
    if await _until_idle(state, timeout):
        return
    if manager is not None and manager.down is None:
        logger.warning(
            "shutdown timeout (%.1f s): aborting %d requests still running",
            timeout,
            state.in_flight,
        )
        manager.abort(abort_all=True, message=SHUTDOWN_ABORT)
    if not await _until_idle(state, ABORT_GRACE_S):
        logger.warning("%d requests did not end after the abort; closing them", state.in_flight)


async def _until_idle(state: AppState, timeout: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while state.in_flight > 0:
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(POLL_S)
    return True
