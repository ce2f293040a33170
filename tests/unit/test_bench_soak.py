"""benchmarks/soak.py without a server: the report (outcomes, RSS trend, KV drift, verdict), the
process-tree RSS, and the whole soak loop against a fake server."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import soak  # noqa: E402
import soak_report as sr  # noqa: E402

STATE = {
    "num_running": 0,
    "num_waiting": 0,
    "max_total_tokens": 1000,
    "free_tokens": 900,
    "evictable_tokens": 100,
    "protected_tokens": 0,
}


def point(t: float, rss_mb: float, **over: int) -> sr.IdlePoint:
    return sr.IdlePoint(t, int(rss_mb * sr.MB), {**STATE, **over})


def test_summary_counts_statuses_latencies_rss_and_kv() -> None:
    outcomes = [
        sr.Outcome("plain", "200", 0.1),
        sr.Outcome("plain", "200", 0.3),
        sr.Outcome("plain", "500", 9.0),  # failed: not in the latencies
        sr.Outcome("stream", "stream-error", 0.2),
        sr.Outcome("stream", "200", 0.2),
    ]
    rss = [(0.0, 100 * sr.MB), (60.0, 130 * sr.MB), (120.0, 110 * sr.MB)]
    idle = [point(30, 100), point(90, 101), point(150, 102)]  # +1 MB a minute at idle
    s = sr.summarize(outcomes, rss, idle, duration=10.0)
    assert s["requests"] == 5 and s["ok"] == 3 and s["requests_per_s"] == 0.5
    assert s["errors_by_status"] == {"500": 1, "stream-error": 1}
    plain = s["kinds"]["plain"]
    assert plain["sent"] == 3 and plain["statuses"] == {"200": 2, "500": 1}
    assert plain["p50_ms"] == pytest.approx(200.0)
    assert s["rss_mb"]["first"] == 100 and s["rss_mb"]["last"] == 110 and s["rss_mb"]["max"] == 130
    assert s["rss_mb"]["idle_slope_mb_per_min"] == pytest.approx(1.0)
    assert s["kv"] == {**s["kv"], "idle_points": 3, "max_abs_drift": 0, "all_clean": True}
    assert sr.verdict(s) == ["1 request(s) ended in 500", "1 request(s) ended in stream-error"]
    table = sr.text_tables(s)
    assert "5 requests in 10 s" in table and "500: 1" in table and "1.00 MB/min" in table


@pytest.mark.parametrize(
    ("over", "drift", "problem"),
    [
        ({"free_tokens": 890}, -10, "KV not conserved"),  # 10 slots leaked
        ({"protected_tokens": 5, "free_tokens": 895}, 0, "KV not conserved"),  # locked at idle
        ({"num_running": 1}, 0, "not idle"),
    ],
)
def test_verdict_flags_kv_drift_and_busy_checkpoints(
    over: dict[str, int], drift: int, problem: str
) -> None:
    bad = point(60, 100, **over)
    assert bad.drift == drift and not bad.clean
    s = sr.summarize([sr.Outcome("plain", "200", 0.1)], [], [point(30, 100), bad], 60.0)
    assert not s["kv"]["all_clean"]
    assert [p for p in sr.verdict(s) if problem in p]
    assert sr.verdict(sr.summarize([], [], [point(30, 100)], 60.0)) == []
    assert "no idle checkpoint" in sr.verdict(sr.summarize([], [], [], 60.0))[0]


def test_tree_rss_sums_the_children_with_and_without_psutil() -> None:
    parent = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 5
        while len(_children(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        alone = int(Path(f"/proc/{parent.pid}/statm").read_text().split()[1])
        alone *= os.sysconf("SC_PAGE_SIZE")
        via_proc = sr._proc_tree_rss(parent.pid)
        assert via_proc > alone
        assert sr.tree_rss(parent.pid) == pytest.approx(via_proc, rel=0.05)
    finally:
        parent.kill()
        parent.wait()


def _children(pid: int) -> list[str]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return path.read_text().split() if path.exists() else []


def test_mix_parsing() -> None:
    assert soak.parse_mix("plain=2, abort=0.5") == {"plain": 2.0, "abort": 0.5}
    for bad in ("plain", "teleport=1", "_sse=1", "plain=-1", "plain=0"):
        with pytest.raises(argparse.ArgumentTypeError):
            soak.parse_mix(bad)


class FakeServer:
    """Answers every route the soak uses, after 5 ms; `leak` KV slots are missing at idle."""

    def __init__(self, leak: int = 0) -> None:
        self.leak, self.paths = leak, set[str]()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0.005)
        path = request.url.path
        self.paths.add(path)
        body = json.loads(request.content) if request.content else {}
        meta = {"finish_reason": {"type": "abort" if "rid" in body else "length"}}
        if path == "/server_info":
            free = STATE["free_tokens"] - self.leak
            return httpx.Response(200, json={"internal_states": [{**STATE, "free_tokens": free}]})
        if path == "/abort_request":
            return httpx.Response(200)
        if body.get("stream"):
            sse = 'data: {"text": "x", "meta_info": {}}\n\ndata: [DONE]\n\n'
            return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})
        if path == "/v1/completions":
            return httpx.Response(200, json={"choices": [{}] * body["n"]})
        return httpx.Response(200, json={"text": "x", "meta_info": meta})


def run_soak(server: FakeServer, **over: Any) -> dict[str, Any]:
    args = soak.parse_args(["--minutes", "0.02", "--concurrency", "3", "--idle-every", "0.5"])
    for k, v in over.items():
        setattr(args, k, v)
    transport = httpx.MockTransport(server)
    real = httpx.AsyncClient

    def client(**kw: Any) -> httpx.AsyncClient:
        return real(transport=transport, **kw)

    soak.httpx.AsyncClient = client  # type: ignore[assignment]
    try:
        return asyncio.run(soak.soak(args, "http://fake", os.getpid()))
    finally:
        soak.httpx.AsyncClient = real  # type: ignore[misc]


def test_the_soak_loop_sends_every_kind_and_checks_idle_points() -> None:
    server = FakeServer()
    s = run_soak(server)
    assert set(s["kinds"]) == {
        "plain",
        "stream",
        "chat_stream",
        "constrained",
        "n",
        "disconnect",
        "abort",
    }
    assert s["errors_by_status"] == {} and s["ok"] == s["requests"] > 20
    assert s["kv"]["idle_points"] >= 2 and s["kv"]["all_clean"]  # periodic ones and the last
    assert s["rss_mb"]["first"] and sr.verdict(s) == []
    assert {
        "/generate",
        "/v1/chat/completions",
        "/v1/completions",
        "/abort_request",
    } <= server.paths


def test_the_soak_loop_reports_a_kv_leak() -> None:
    s = run_soak(FakeServer(leak=7), mix={"plain": 1.0})
    assert s["kv"]["max_abs_drift"] == 7 and not s["kv"]["all_clean"]
    assert any("KV not conserved" in p for p in sr.verdict(s))
