"""A child process (scheduler or detokenizer) killed mid-request: the requests in flight get a 503
(streamed: an error event with code 503; not streamed: HTTP 503), the server exits with code 1
and a log line naming the child, and no process is left behind."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from serve_support import Streamer, descendants, long_context_copy, start_tiny, wait_gone

LONG = 12000


@pytest.mark.parametrize("victim", ["scheduler", "detokenizer"])
def test_killed_child_gives_503_and_a_clean_exit(
    tiny_model_dir: Path, tmp_path: Path, victim: str
) -> None:
    model = long_context_copy(tiny_model_dir, tmp_path)
    srv = start_tiny(model, tmp_path / "serve.log")
    try:
        scheduler_pid = httpx.get(srv.url + "/server_info", timeout=10).json()["scheduler_pid"]
        kids = descendants(srv.proc.pid)
        runtime = [k for k in kids if "weft.runtime.ipc.child_main" in " ".join(k.cmdline())]
        others = [k for k in runtime if k.pid != scheduler_pid]
        target = psutil.Process(scheduler_pid) if victim == "scheduler" else others[0]
        params = {"max_new_tokens": LONG, "ignore_eos": True}
        native = Streamer(srv.url, "/generate", {"text": "Hi", "sampling_params": params,
                                                 "stream": True})  # fmt: skip
        chat = Streamer(srv.url, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": LONG,
            "ignore_eos": True, "stream": True})  # fmt: skip
        plain: dict[str, Any] = {}

        def unstreamed() -> None:
            body = {"text": "Hello", "sampling_params": params}
            plain["resp"] = httpx.post(srv.url + "/generate", json=body, timeout=60)

        worker = threading.Thread(target=unstreamed)
        native.start()
        chat.start()
        worker.start()
        assert native.started() and chat.started()
        target.kill()
        code = srv.proc.wait(30)
        native.join(10)
        chat.join(10)
        worker.join(10)
    finally:
        srv.stop()
    log = srv.log_path.read_text()
    assert code == 1, log
    assert f"the {victim} process exited with code -9" in log, log
    for stream in (native, chat):
        assert stream.error is None, stream.error
        err = stream.events[-1]["error"]
        assert err["code"] == 503 and "runtime is down" in err["message"], err
    resp = plain["resp"]
    assert resp.status_code == 503, resp.text
    assert f"{victim} process exited" in resp.json()["error"]["message"]
    assert not wait_gone(kids)
