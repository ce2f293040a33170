"""Serving benchmark: launching `weft serve` on a free port, stopping it, reading its settings."""

from __future__ import annotations

import contextlib
import json
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

SERVER_KEYS = (
    *("version", "model", "dtype", "device", "page_size", "context_length"),
    *("max_total_num_tokens", "max_running_requests", "max_prefill_tokens"),
    *("chunked_prefill_size", "schedule_policy", "disable_radix_cache", "attention_backend"),
    "incremental_streaming_output",
)


@contextlib.contextmanager
def launched_server(
    model: str | None, extra: str | None, log: Path, timeout: float
) -> Iterator[str]:
    """`python -m weft serve` on a free port until /health is 200; SIGTERM on the way out."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "weft", "serve", "--port", str(port), *shlex.split(extra or "")]
    cmd += ["--model", model] if model else []
    print(f"launching: {shlex.join(cmd)} (log: {log})", flush=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        start = time.perf_counter()
        while not _healthy(url):
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the server exited with code {proc.returncode}:\n{tail}")
            if time.perf_counter() - start > timeout:
                raise RuntimeError(f"the server was not healthy after {timeout:.0f} s (see {log})")
            time.sleep(0.5)
        print(f"server ready after {time.perf_counter() - start:.1f} s", flush=True)
        yield url
    finally:
        _stop(proc)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        print(f"the server had already exited with code {proc.returncode}")
        return
    start = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(30)
        print(f"server stopped by SIGTERM in {time.perf_counter() - start:.1f} s (exit {code})")
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        print("the server ignored SIGTERM for 30 s: killed")


def server_settings(url: str) -> dict[str, Any]:
    info = httpx.get(f"{url}/server_info", timeout=10.0).json()
    model = httpx.get(f"{url}/model_info", timeout=10.0).json()
    key = {k: info.get(k) for k in SERVER_KEYS} | {"model_path": model.get("model_path")}
    return {"key": key, "full": info}


def model_vocab_size(model_path: str) -> int:
    """vocab_size from the served model's config.json (so the server must run on this machine)."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        raise SystemExit(f"cannot read {config}: pass --vocab-size")
    return int(json.loads(config.read_text())["vocab_size"])
