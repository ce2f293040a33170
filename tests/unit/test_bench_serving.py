"""benchmarks/serving.py without a server: metric math, random workload, SSE parsing, load shape."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "serving.py"
sys.path.insert(0, str(_PATH.parent))  # the script imports its helper modules as top-level ones
_spec = importlib.util.spec_from_file_location("bench_serving", _PATH)
assert _spec is not None and _spec.loader is not None
bs = importlib.util.module_from_spec(_spec)
sys.modules["bench_serving"] = bs  # dataclasses resolve their module's annotations through here
_spec.loader.exec_module(bs)

import serving_report  # noqa: E402


def event(prompt: int, ids: list[int], finish: str | None = None, cached: int = 0) -> str:
    """One native SSE line, cumulative as `weft serve` sends it."""
    meta = {
        "id": "r1",
        "finish_reason": None if finish is None else {"type": finish, "length": len(ids)},
        "prompt_tokens": prompt,
        "completion_tokens": len(ids),
        "cached_tokens": cached,
        "e2e_latency": 0.1,
    }
    return "data: " + json.dumps({"text": "x" * len(ids), "output_ids": ids, "meta_info": meta})


def canned(*events: str) -> list[str]:
    """Events as aiter_lines yields them: each followed by a blank line."""
    return [line for e in events for line in (e, "")]


async def lines_of(items: list[str]) -> AsyncIterator[str]:
    for item in items:
        yield item


def clock_of(times: list[float]) -> Iterator[float]:
    return iter(times)


def read(lines: list[str], times: list[float], expected: int = 4, prompt: int = 3):
    res = bs.RequestResult(prompt, expected)
    it = clock_of(times)
    counted = asyncio.run(bs.read_events(lines_of(lines), res, 0.0, clock=lambda: next(it)))
    return res, counted


##### Metric math #####


def test_stats_ms_mean_median_p99_linear():
    s = serving_report.stats_ms([0.004, 0.001, 0.003, 0.002])
    assert s["mean"] == pytest.approx(2.5)
    assert s["median"] == pytest.approx(2.5)
    assert s["p99"] == pytest.approx(3.97)  # rank 0.99 * 3 = 2.97: 3 + 0.97 * (4 - 3)
    assert serving_report.stats_ms([0.010])["p99"] == pytest.approx(10.0)
    assert serving_report.stats_ms([]) == {"mean": None, "median": None, "p99": None}


def test_ttft_itl_tpot_from_event_times():
    res = bs.RequestResult(prompt_len=8, expected_len=5)
    for total, t in [(1, 0.5), (2, 0.6), (2, 0.65), (4, 0.8), (5, 1.0)]:  # (2, 0.65): no new token
        res.observe(total, t)
    res.e2e = 1.05
    assert res.ttft == 0.5 and res.output_len == 5
    assert res.itl == pytest.approx([0.1, 0.1, 0.1, 0.2])  # the 2-token event: 0.2 s split in two
    assert sum(res.itl) == pytest.approx(1.0 - res.ttft)
    assert res.tpot == pytest.approx((1.05 - 0.5) / 4)


def test_first_event_with_several_tokens_adds_zero_gaps():
    res = bs.RequestResult(prompt_len=8, expected_len=4)
    res.observe(3, 0.2)
    res.observe(4, 0.5)
    assert res.ttft == 0.2 and res.itl == pytest.approx([0.0, 0.0, 0.3])
    assert len(res.itl) == res.output_len - 1


def test_tpot_needs_two_tokens():
    res = bs.RequestResult(prompt_len=8, expected_len=1)
    res.observe(1, 0.3)
    res.e2e = 0.4
    assert res.tpot is None and res.itl == []


def test_summarize_counts_only_completed_requests():
    ok = bs.RequestResult(10, 4, ttft=0.1, e2e=1.0, itl=[0.3] * 3, output_len=4)
    ok2 = bs.RequestResult(20, 4, ttft=0.3, e2e=2.0, itl=[0.5] * 3, output_len=4, cached_tokens=5)
    bad = bs.RequestResult(30, 4, error="HTTP 400: too long", output_len=1, e2e=0.1)
    s = bs.summarize([ok, ok2, bad], duration=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["errors"] == {"HTTP 400: too long": 1}
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["input_throughput"] == pytest.approx(15.0)
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_throughput"] == pytest.approx(19.0)
    assert s["mean_concurrency"] == pytest.approx(1.5)
    assert s["cached_tokens"] == 5
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(((0.9 / 3) + (1.7 / 3)) / 2 * 1000)
    assert s["itl_ms"]["median"] == pytest.approx(400.0)
    assert s["e2e_ms"]["p99"] == pytest.approx(1990.0)


def test_markdown_table_with_and_without_peer():
    ok = bs.RequestResult(10, 4, ttft=0.1, e2e=1.0, itl=[0.3] * 3, output_len=4)
    served = bs.summarize([ok], 1.0)
    peer = bs.summarize([bs.RequestResult(10, 4, e2e=0.5, output_len=4)], 0.5)
    table = bs.markdown_table(
        [
            {"max_concurrency": 4, "server": served},
            {"max_concurrency": None, "server": served, "offline_peer": peer,
             "output_throughput_ratio": 0.5},
        ]
    )  # fmt: skip
    lines = table.splitlines()
    assert len({line.count("|") for line in lines[:4]}) == 1  # every row has every column
    assert lines[2].startswith("| 4 | 1 / 0 |") and lines[2].endswith("| n/a | n/a |")
    assert lines[3].startswith("| none |") and lines[3].endswith("| 8.0 | 0.50 |")


##### Workload #####


@settings(max_examples=50, deadline=None)
@given(
    num=st.integers(1, 20),
    input_len=st.integers(1, 300),
    output_len=st.integers(1, 100),
    ratio=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31),
)
def test_random_lengths_within_range_and_deterministic(num, input_len, output_len, ratio, seed):
    specs = bs.sample_requests(num, input_len, output_len, ratio, 1000, seed)
    assert len(specs) == num
    for s in specs:
        assert max(1, int(input_len * ratio)) <= s.prompt_len <= input_len
        assert max(1, int(output_len * ratio)) <= s.output_len <= output_len
        assert all(0 <= t < 1000 for t in s.input_ids)
    assert specs == bs.sample_requests(num, input_len, output_len, ratio, 1000, seed)


def test_fixed_lengths_and_seeds_differ():
    a = bs.sample_requests(8, 256, 64, 1.0, 49152, seed=0)
    assert {s.prompt_len for s in a} == {256} and {s.output_len for s in a} == {64}
    assert a != bs.sample_requests(8, 256, 64, 1.0, 49152, seed=1)
    spread = bs.sample_requests(200, 100, 10, 0.0, 50, seed=3)
    assert len({s.prompt_len for s in spread}) > 50  # ratio 0: lengths really vary
    with pytest.raises(ValueError, match="range_ratio"):
        bs.sample_requests(1, 10, 10, 1.5, 50, seed=0)


def test_lengths_file_in_order_and_cycling(tmp_path: Path) -> None:
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps({"prompt_output_lengths": [[5, 2], [3, 7], [9, 1]]}))
    pairs = bs.read_lengths(path)
    specs = bs.requests_of_lengths(pairs, 4, 0, 100, seed=0)
    assert [(s.prompt_len, s.output_len) for s in specs] == [(5, 2), (3, 7), (9, 1), (5, 2)]
    assert all(0 <= t < 100 for s in specs for t in s.input_ids)
    warm = bs.requests_of_lengths(pairs, 2, 4, 100, seed=1)  # after the measured ones
    assert [(s.prompt_len, s.output_len) for s in warm] == [(3, 7), (9, 1)]
    for bad in ({"prompt_output_lengths": [[5]]}, {"prompt_output_lengths": [[0, 3]]}, {}):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="prompt_output_lengths"):
            bs.read_lengths(path)
    with pytest.raises(ValueError, match="no .prompt, output. lengths"):
        bs.requests_of_lengths([], 1, 0, 100, seed=0)
    data = Path(__file__).resolve().parents[2] / "benchmarks/data/sharegpt-lengths.json"
    shipped = bs.read_lengths(data)  # the committed ShareGPT lengths
    assert len(shipped) == 1000 and all(n <= 1024 and n + m <= 2048 for n, m in shipped)


def test_arrival_gaps_poisson():
    assert bs.arrival_gaps(5, math.inf, 0) == [0.0] * 5
    gaps = bs.arrival_gaps(20000, 4.0, seed=7)
    assert gaps[0] == 0.0 and all(g >= 0 for g in gaps)
    assert sum(gaps) / (len(gaps) - 1) == pytest.approx(0.25, rel=0.03)
    assert gaps == bs.arrival_gaps(20000, 4.0, seed=7)


def test_run_load_respects_max_concurrency_and_order():
    specs = bs.sample_requests(12, 5, 3, 0.0, 100, seed=0)
    live = peak = 0

    async def send(spec):
        nonlocal live, peak
        live += 1
        peak = max(peak, live)
        await asyncio.sleep(0.01)
        live -= 1
        return bs.RequestResult(spec.prompt_len, spec.output_len)

    for limit, expected in [(3, 3), (None, 12)]:
        peak = 0
        results, duration = asyncio.run(bs.run_load(send, specs, math.inf, limit, seed=0))
        assert peak == expected and duration > 0
        assert [r.prompt_len for r in results] == [s.prompt_len for s in specs]


##### Server-sent events #####


def test_parse_sse_line_kinds():
    assert bs.parse_sse_line("") is None
    assert bs.parse_sse_line(": keep-alive") is None
    assert bs.parse_sse_line("event: message") is None
    assert bs.parse_sse_line("data: [DONE]").kind == "done"
    data = bs.parse_sse_line(event(3, [7, 8]))
    assert data.kind == "data" and data.payload["output_ids"] == [7, 8]
    err = bs.parse_sse_line('data: {"error": {"message": "prompt too long", "code": 400}}')
    assert err.kind == "error" and err.message == "prompt too long"
    assert bs.parse_sse_line("data: {not json").kind == "error"
    assert "malformed" in bs.parse_sse_line("data: [1, 2]").message


def test_canned_stream_timings_and_counts():
    lines = canned(
        event(3, [5]), event(3, [5, 6]), event(3, [5, 6, 7, 8]), event(3, [5, 6, 7, 8], "length")
    ) + ["data: [DONE]", ""]
    res, counted = read(lines, [0.2, 0.3, 0.5, 0.5])
    assert counted == 3 and res.ok
    assert res.ttft == pytest.approx(0.2) and res.output_len == 4
    assert res.itl == pytest.approx([0.1, 0.1, 0.1])
    res.check_counts(counted)
    assert res.ok


def test_canned_stream_with_error_event_then_done():
    err = 'data: {"error": {"message": "weft runtime is down: scheduler died"}}'
    res, _ = read(canned(event(3, [5]), err) + ["data: [DONE]", ""], [0.2])
    assert res.error == "weft runtime is down: scheduler died" and res.output_len == 1


def test_stream_without_done_fails():
    res, _ = read(canned(event(3, [5]), event(3, [5, 6])), [0.2, 0.3])
    assert res.error == "the stream ended without [DONE]"


@pytest.mark.parametrize(
    "prompt, out, message",
    [(4, 4, "counted 4 prompt tokens, 3 were sent"), (3, 2, "asked for 4 output tokens")],
)
def test_wrong_token_counts_fail(prompt, out, message):
    ids = list(range(out))
    res, counted = read(canned(event(prompt, ids, "length")) + ["data: [DONE]"], [0.2])
    res.check_counts(counted)
    assert message in res.error


def test_send_request_over_mock_transport():
    body = "\n\n".join([event(3, [1]), event(3, [1, 2], "length"), "data: [DONE]"]) + "\n\n"
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        if seen[-1]["sampling_params"]["max_new_tokens"] != 2:
            return httpx.Response(400, json={"error": {"message": "bad max_new_tokens"}})
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    async def go(spec):
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await bs.send_request(client, spec, temperature=0.0)

    res = asyncio.run(go(bs.RequestSpec([4, 5, 6], 2)))
    assert res.ok and res.output_len == 2 and res.ttft is not None and len(res.itl) == 1
    assert seen[0] == {
        "input_ids": [4, 5, 6],
        "sampling_params": {"max_new_tokens": 2, "ignore_eos": True, "temperature": 0.0},
        "stream": True,
    }
    bad = asyncio.run(go(bs.RequestSpec([4, 5, 6], 3)))
    assert bad.error.startswith("HTTP 400:") and "bad max_new_tokens" in bad.error


##### CLI #####


def test_cli_defaults_and_checks():
    args = bs.parse_args(["--max-concurrency", "1", "0", "16"])
    assert args.max_concurrency == [1, None, 16] and math.isinf(args.request_rate)
    assert args.base_url == "http://127.0.0.1:30000" and not args.launch
    for bad in (["--offline-peer"], ["--range-ratio", "2"], ["--launch", "--base-url", "x"]):
        with pytest.raises(SystemExit):
            bs.parse_args(bad)
