"""Helpers of the `weft serve` reliability tests: a tiny-model server, its child processes, and
streaming requests that can be cut or watched from a thread."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from support import ServerProcess


def start_tiny(tiny_model_dir: Path, log: Path, *args: str) -> ServerProcess:
    """A ready `weft serve` on the tiny model (stopped by the caller)."""
    srv = ServerProcess(["--model", str(tiny_model_dir), *args], log)
    try:
        srv.wait_ready()
    except BaseException:
        srv.stop()
        raise
    return srv


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running (a zombie is gone: only its parent's wait is missing)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(procs: list[psutil.Process], timeout: float = 10.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while alive(procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(procs)


def sse_events(lines: Any) -> Any:
    """The JSON events of an SSE line iterator (up to [DONE])."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            return
        yield json.loads(data)


class Streamer(threading.Thread):
    """POST a streaming request in a thread; `events` fill in as they come, `status` is the
    HTTP status, `error` any transport error; started() returns once the first event is in."""

    def __init__(self, url: str, path: str, body: dict[str, Any], timeout: float = 120.0) -> None:
        super().__init__(daemon=True)
        self.url, self.path, self.body, self.timeout = url, path, body, timeout
        self.events: list[dict[str, Any]] = []
        self.status: int | None = None
        self.error: BaseException | None = None
        self.first = threading.Event()
        self.ended_at: float | None = None

    def run(self) -> None:
        try:
            with httpx.stream(
                "POST", self.url + self.path, json=self.body, timeout=self.timeout
            ) as resp:
                self.status = resp.status_code
                if resp.status_code != 200:
                    resp.read()
                    self.events.append(resp.json())
                    return
                for event in sse_events(resp.iter_lines()):
                    self.events.append(event)
                    self.first.set()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            self.error = e
        finally:
            self.ended_at = time.monotonic()
            self.first.set()

    def started(self, timeout: float = 60.0) -> bool:
        return self.first.wait(timeout) and bool(self.events)


def long_context_copy(tiny_model_dir: Path, dest: Path, context: int = 16384) -> Path:
    """The tiny model with a longer context (its weights do not depend on it): requests that
    stream for many seconds, long enough to be in flight when the test acts."""
    import shutil

    folder = dest / "tiny-long"
    if not folder.exists():
        shutil.copytree(tiny_model_dir, folder)
        config = json.loads((folder / "config.json").read_text())
        config["max_position_embeddings"] = context
        (folder / "config.json").write_text(json.dumps(config))
    return folder
