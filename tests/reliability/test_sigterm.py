"""SIGTERM under load: new requests get 503 (and /health), requests in flight finish or end with
the shutdown abort after --shutdown-timeout, the server exits 0 leaving no child; a second
SIGTERM exits at once."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import httpx
from serve_support import Streamer, descendants, long_context_copy, start_tiny, wait_gone

SHUTDOWN_TIMEOUT = 2.0
LONG = 12000  # tokens: a stream that runs well past the shutdown timeout
SHUTDOWN_ABORT = {"type": "abort", "message": "server shutting down"}


def long_streams(url: str) -> list[Streamer]:
    params = {"max_new_tokens": LONG, "ignore_eos": True, "temperature": 0}
    native = {"text": "Once upon a time", "sampling_params": params, "stream": True}
    chat = {"messages": [{"role": "user", "content": "Tell me a story"}], "stream": True,
            "max_tokens": LONG, "ignore_eos": True}  # fmt: skip
    completion = {"prompt": "Once", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    return [
        Streamer(url, "/generate", native),
        Streamer(url, "/generate", {**native, "text": "In a land far away"}),
        Streamer(url, "/v1/chat/completions", chat),
        Streamer(url, "/v1/completions", completion),
    ]


def test_sigterm_drains_then_aborts_and_exits_0(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = long_context_copy(tiny_model_dir, tmp_path)
    srv = start_tiny(model, tmp_path / "serve.log", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT))
    try:
        kids = descendants(srv.proc.pid)
        streams = long_streams(srv.url)
        short_body = {"text": "Hi", "sampling_params": {"max_new_tokens": 20, "ignore_eos": True}}
        short = Streamer(srv.url, "/generate", {**short_body, "stream": True})
        for s in streams:
            s.start()
        assert all(s.started() for s in streams), [s.error for s in streams]
        short.start()
        assert short.started()
        srv.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        time.sleep(0.3)
        health = httpx.get(srv.url + "/health", timeout=10)
        refused = httpx.post(srv.url + "/generate", json=short_body, timeout=10)
        v1 = httpx.post(srv.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
        code = srv.proc.wait(SHUTDOWN_TIMEOUT + 20)
        took = time.monotonic() - sent
    finally:
        srv.stop()
    log = srv.log_path.read_text()
    assert code == 0, log
    assert took < SHUTDOWN_TIMEOUT + 10, (took, log)
    assert health.status_code == 503
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    assert v1.status_code == 503 and v1.json()["error"]["code"] == 503
    # in flight at SIGTERM: it finishes as usual within the timeout (it has 20 tokens to go) or,
    # on a machine busy enough to slow it past the timeout, ends with the shutdown abort
    short.join(10)
    reason = short.events[-1]["meta_info"]["finish_reason"]
    assert reason in ({"type": "length", "length": 20}, SHUTDOWN_ABORT), reason
    assert took >= SHUTDOWN_TIMEOUT  # the long streams were given the whole timeout
    for s in streams:
        s.join(10)
        assert s.error is None and s.status == 200, (s.path, s.error)
        last: dict[str, Any] = s.events[-1]
        if s.path == "/generate":
            reason = last["meta_info"]["finish_reason"]
            assert reason == SHUTDOWN_ABORT, reason
        else:
            finals = [c for e in s.events for c in e.get("choices", []) if c["finish_reason"]]
            assert [c["finish_reason"] for c in finals] == ["abort"], s.events[-3:]
    assert "shutdown timeout" in log and "Traceback" not in log, log
    assert not wait_gone(kids)


def test_second_sigterm_exits_at_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = long_context_copy(tiny_model_dir, tmp_path)
    srv = start_tiny(model, tmp_path / "serve.log", "--shutdown-timeout", "60")
    try:
        kids = descendants(srv.proc.pid)
        streams = long_streams(srv.url)[:2]
        for s in streams:
            s.start()
        assert all(s.started() for s in streams)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert srv.proc.poll() is None  # draining: up to 60 s for the streams
        srv.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        code = srv.proc.wait(15)
        took = time.monotonic() - sent
    finally:
        srv.stop()
    log = srv.log_path.read_text()
    assert code == 1 and took < 5, (code, took, log)
    assert "received SIGTERM again: exiting now (code 1)" in log
    assert not wait_gone(kids, timeout=5)
