"""`weft serve` process lifetime on a tiny model: 503 until ready, API key (never shown), SIGTERM
leaves no child, a bad model path. (A dead child: tests/reliability/test_child_kill.py.)"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from support import ServerProcess


def start(tiny_model_dir: Path, tmp_path: Path, *args: str) -> ServerProcess:
    return ServerProcess(["--model", str(tiny_model_dir), *args], tmp_path / "serve.log")


def children_of(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def test_health_503_until_ready_then_sigterm_leaves_nothing(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    srv = start(tiny_model_dir, tmp_path)
    codes: list[int] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            code = httpx.get(f"{srv.url}/health", timeout=2).status_code
        except httpx.HTTPError:
            time.sleep(0.05)
            continue
        codes.append(code)
        if code == 200:
            break
        time.sleep(0.05)
    assert codes and codes[-1] == 200
    assert 503 in codes, "the server answered before the model was loaded, so /health must say 503"
    kids = children_of(srv.proc.pid)
    assert len(kids) >= 2
    started = time.monotonic()
    assert srv.stop() == 0
    assert time.monotonic() - started < 15
    time.sleep(0.5)
    assert not [k for k in kids if k.is_running() and k.status() != psutil.STATUS_ZOMBIE]
    assert "ready: http://" in srv.log_path.read_text()


def test_api_key_is_enforced(tiny_model_dir: Path, tmp_path: Path) -> None:
    srv = start(tiny_model_dir, tmp_path, "--api-key", "sekrit")
    try:
        srv.wait_ready()
        body: dict[str, Any] = {"text": "Hi", "sampling_params": {"max_new_tokens": 1}}
        assert httpx.post(f"{srv.url}/generate", json=body).status_code == 401
        bad = httpx.post(f"{srv.url}/generate", json=body, headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401 and bad.json() == {"error": "Unauthorized"}
        assert httpx.get(f"{srv.url}/v1/models").status_code == 401
        good = httpx.post(
            f"{srv.url}/generate", json=body, headers={"Authorization": "Bearer sekrit"}, timeout=60
        )
        assert good.status_code == 200
        auth = {"Authorization": "Bearer sekrit"}
        for path in ("/server_info", "/get_server_info"):
            info = httpx.get(f"{srv.url}{path}", headers=auth, timeout=30)
            assert info.status_code == 200 and "sekrit" not in info.text
        basic = httpx.get(f"{srv.url}/v1/models", headers={"Authorization": "sekrit"})
        assert basic.status_code == 401  # only OpenAI's "Bearer <key>"
    finally:
        srv.stop()
    log = srv.log_path.read_text()
    assert "sekrit" not in log and "$WEFT_API_KEY" in log, log


def test_bad_model_path_exits_with_the_reason(tmp_path: Path) -> None:
    srv = ServerProcess(["--model", str(tmp_path / "nope")], tmp_path / "serve.log")
    with pytest.raises(RuntimeError, match="nothing exists"):
        srv.wait_ready(timeout=60)
    assert srv.stop() != 0
