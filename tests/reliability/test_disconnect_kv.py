"""Clients that leave mid-request: their requests are aborted, the KV pool is whole again once
idle (free + evictable + protected == total, nothing protected), each leaving is one log line
(no traceback), and the server serves the next request."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_support import long_context_copy, sse_events, start_tiny
from support import ServerProcess

LONG = 12000


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("disconnect")
    proc = start_tiny(long_context_copy(tiny_model_dir, folder), folder / "serve.log")
    try:
        yield proc
    finally:
        proc.stop()


def leave_mid_stream(url: str, path: str, body: dict[str, Any], events: int) -> None:
    """Read `events` events of a stream, then drop the connection."""
    with httpx.stream("POST", url + path, json=body, timeout=60) as resp:
        assert resp.status_code == 200
        got = 0
        for _ in sse_events(resp.iter_lines()):
            got += 1
            if got >= events:
                return


def leave_while_waiting(url: str, body: dict[str, Any]) -> None:
    """A non-streamed request given up after half a second (the client closes the socket)."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/generate", json=body, timeout=httpx.Timeout(60, read=0.5))


def kv_state(srv: ServerProcess) -> dict[str, Any]:
    state: dict[str, Any] = httpx.get(srv.url + "/server_info", timeout=30).json()
    return dict(state["internal_states"][0])


def test_many_disconnects_leave_the_kv_pool_whole(srv: ServerProcess) -> None:
    params = {"max_new_tokens": LONG, "ignore_eos": True}
    native = {"sampling_params": params, "stream": True}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": LONG,
            "ignore_eos": True, "stream": True}  # fmt: skip
    jobs: list[threading.Thread] = []
    for i in range(6):
        body = {**native, "text": f"Story number {i} begins"}
        jobs.append(threading.Thread(target=leave_mid_stream,
                                     args=(srv.url, "/generate", body, 2 + i)))  # fmt: skip
        jobs.append(threading.Thread(target=leave_mid_stream,
                                     args=(srv.url, "/v1/chat/completions", chat, 2 + i)))  # fmt: skip
    n_body = {"text": "Fan out", "sampling_params": {**params, "n": 3}, "stream": True}
    jobs.append(threading.Thread(target=leave_mid_stream, args=(srv.url, "/generate", n_body, 4)))
    for i in range(3):
        body = {"text": f"Unstreamed {i}", "sampling_params": params}
        jobs.append(threading.Thread(target=leave_while_waiting, args=(srv.url, body)))
    for job in jobs:
        job.start()
    for job in jobs:
        job.join(60)
    deadline = time.monotonic() + 20
    state = kv_state(srv)
    while (state["num_running"] or state["num_waiting"]) and time.monotonic() < deadline:
        time.sleep(0.2)
        state = kv_state(srv)
    assert state["num_running"] == 0 and state["num_waiting"] == 0, state
    total = state["free_tokens"] + state["evictable_tokens"] + state["protected_tokens"]
    assert total == state["max_total_tokens"] and state["protected_tokens"] == 0, state
    out = httpx.post(srv.url + "/generate", json={"text": "Hi", "sampling_params":
                     {"max_new_tokens": 4, "ignore_eos": True}}, timeout=60)  # fmt: skip
    assert out.status_code == 200 and out.json()["meta_info"]["completion_tokens"] == 4
    assert httpx.get(srv.url + "/health").status_code == 200
    log = srv.log_path.read_text()
    assert log.count("client disconnected: POST /generate") >= 3, log
    assert log.count("client disconnected mid-stream: POST /generate") >= 6, log
    assert log.count("client disconnected mid-stream: POST /v1/chat/completions") >= 6, log
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log


def test_usage_has_no_cache_report_unless_enabled(srv: ServerProcess) -> None:
    prompt = "Without --enable-cache-report the usage has no prompt_tokens_details. " * 2
    body = {"prompt": prompt, "max_tokens": 2}
    for _ in range(2):
        usage = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()["usage"]
        assert "prompt_tokens_details" not in usage, usage
