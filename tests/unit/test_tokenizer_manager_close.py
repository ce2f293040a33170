"""TokenizerManager after close(): cancelled requests' aborts go nowhere, quietly."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path
from typing import Any

from weft.runtime.server.tokenizer_manager import TokenizerManager


def test_abort_after_close_sends_nothing_and_leaves_no_failed_future(tmp_path: Path) -> None:
    errors: list[dict[str, Any]] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        folder = tmp_path
        tm = TokenizerManager(
            tokenizer=None,
            info=None,  # type: ignore[arg-type]
            max_total_tokens=1,
            scheduler_addr=f"ipc://{folder}/scheduler",
            listen_addr=f"ipc://{folder}/inbox",
            check_children=lambda: None,
        )
        tm.abort("before-close")  # a live socket: queued for the scheduler, no error
        await tm.close()
        tm.abort("after-close")  # e.g. a request cancelled by the server's shutdown
        tm.abort(abort_all=True)
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(main())
    assert errors == []
