"""Response plumbing shared by the routes: the unenforced-keywords header, held streams, OpenAI SSE."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from contextlib import aclosing
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from weft.runtime.server.http.state import until_done_or_disconnect
from weft.runtime.server.output import ReqState
from weft.runtime.server.tokenizer_manager import RuntimeDown, TokenizerManager

UNENFORCED_HEADER = "X-Weft-Unenforced-Keywords"

logger = logging.getLogger("weft.server")

T = TypeVar("T")


def unenforced_headers(metas: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """{X-Weft-Unenforced-Keywords: "minimum,uniqueItems"} from results' meta_info (the keywords
    of every result, in first-seen order), or {} when every schema was enforced in full."""
    keywords: dict[str, None] = {}
    for meta in metas:
        for keyword in meta.get("unenforced_keywords") or ():
            keywords[_header_safe(str(keyword))] = None
    return {UNENFORCED_HEADER: ",".join(keywords)} if keywords else {}


async def held_stream(
    request: Request, manager: TokenizerManager, states: list[ReqState]
) -> tuple[AsyncGenerator[dict[str, Any], None], dict[str, str]]:
    """The requests' result stream, held until its first event, and the headers it implies.

    A streamed response sends its status and headers before its first byte. Waiting for the first
    event (the first token, after the grammar compiled) lets a refused request answer with a real
    400 and lets the header list the unenforced keywords. The first event speaks for every
    request only when they all share one schema (always so on /v1); otherwise the header is left
    out and each event's meta_info tells."""

    def abort_all() -> None:
        for s in states:
            manager.abort(s.rid)

    first, events = await hold_until_first(request, manager.results(states, stream=True), abort_all)
    shared = len({s.spec.params.json_schema for s in states}) == 1
    return events, unenforced_headers([first["meta_info"]] if first and shared else [])


async def hold_until_first(
    request: Request, events: AsyncGenerator[T, None], on_disconnect: Callable[[], None]
) -> tuple[T | None, AsyncGenerator[T, None]]:
    """(the stream's first event, the whole stream again with that event); a client that leaves
    while waiting gets `on_disconnect()` called, as with a non-streamed request."""

    async def first() -> T | None:
        try:
            return await events.__anext__()
        except StopAsyncIteration:
            return None

    # NOTE: on an error or a disconnect the generator has already ended (raised, or cancelled
    # inside its wait, which runs its own clean-up: the requests are aborted).
    head = await until_done_or_disconnect(request, first(), on_disconnect)
    return head, _replay(head, events)


def log_stream_disconnect(path: str) -> None:
    """One line for a client that left mid-stream (the stream's clean-up aborts its requests)."""
    logger.info("client disconnected mid-stream: POST %s (its requests aborted)", path)


def openai_stream(
    chunks: AsyncGenerator[dict[str, Any], None], headers: dict[str, str], path: str
) -> StreamingResponse:
    events = _openai_sse(chunks, path)
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


async def _openai_sse(
    chunks: AsyncGenerator[dict[str, Any], None], path: str
) -> AsyncGenerator[bytes, None]:
    """SSE framing; an error after the stream started is sent as an OpenAI error event."""
    try:
        async with aclosing(chunks) as events:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n".encode()
    except (RuntimeDown, ValueError) as e:
        code = 503 if isinstance(e, RuntimeDown) else 400
        kind = "internal_error" if code >= 500 else "invalid_request_error"
        err = {"message": str(e), "type": kind, "param": None, "code": code}
        yield f"data: {json.dumps({'error': err})}\n\n".encode()
    except (asyncio.CancelledError, GeneratorExit):
        log_stream_disconnect(path)
        raise
    yield b"data: [DONE]\n\n"


async def _replay(head: T | None, rest: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
    async with aclosing(rest):
        if head is None:
            return
        yield head
        async for event in rest:
            yield event


def _header_safe(keyword: str) -> str:
    """Header values are latin-1 text without commas here: anything else becomes '?'."""
    return "".join(c if " " <= c <= "~" and c != "," else "?" for c in keyword)
