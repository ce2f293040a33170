"""Serving benchmark: a streaming load generator for `weft serve`, like SGLang's bench_serving.

    python benchmarks/serving.py --launch --max-concurrency 1 4 16 --offline-peer
    python benchmarks/serving.py --input-len 1024 --range-ratio 0.5 --output-file out.json
    python benchmarks/serving.py --base-url http://127.0.0.1:30000 --request-rate 2

Workload: random token ids sent to POST /generate as `input_ids` (so prompt lengths are exact),
greedy, `ignore_eos`, `max_new_tokens` = the output length. Lengths are uniform in
[range_ratio * len, len] (ratio 1 = fixed), deterministic per --seed, or taken in order from
--lengths-file (ShareGPT's: benchmarks/data/sharegpt-lengths.json, made by sharegpt_lengths.py).
Load: Poisson arrivals at --request-rate (inf = all at once) and/or at most --max-concurrency
requests in flight. Several --max-concurrency values run one after another on the same prompts,
each after warm-up requests and a prefix-cache flush.
Per request: TTFT = time to the first event with new tokens; ITL = the gaps between events with
new tokens, split evenly over the tokens of an event (extra tokens of the first event count as
gaps of 0); TPOT = (E2E - TTFT) / (output tokens - 1); E2E = time to [DONE]. A request fails on
a non-200 reply, an error event, a stream without [DONE], or token counts that differ from what
was sent and asked for.
--offline-peer (needs --launch): after the server stops, the same prompts at the same concurrency
go through `weft.Engine.async_generate` in this process (no HTTP, no streaming) with the server's
own engine settings; its throughput is the ceiling the served throughput is divided by.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np
from serving_report import markdown_table, report_run, summarize
from serving_server import launched_server, model_vocab_size, server_settings

Send = Callable[["RequestSpec"], Awaitable["RequestResult"]]

##### Workload #####


@dataclass(frozen=True)
class RequestSpec:
    input_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)


def sample_requests(
    num: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int, seed: int
) -> list[RequestSpec]:
    """Random prompts: lengths uniform in [max(1, ratio * len), len], ids uniform in the vocab."""
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range_ratio must be in [0, 1], got {range_ratio}")
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(max(1, int(input_len * range_ratio)), input_len + 1, size=num)
    out_lens = rng.integers(max(1, int(output_len * range_ratio)), output_len + 1, size=num)
    return [
        RequestSpec(rng.integers(0, vocab_size, size=int(n)).tolist(), int(m))
        for n, m in zip(in_lens, out_lens, strict=True)
    ]


def requests_of_lengths(
    lengths: list[tuple[int, int]], num: int, start: int, vocab_size: int, seed: int
) -> list[RequestSpec]:
    """Random prompts of the given (prompt, output) lengths, `num` of them from index `start`
    (cycling through the list)."""
    if not lengths:
        raise ValueError("no (prompt, output) lengths to take")
    rng = np.random.default_rng(seed)
    picked = [lengths[(start + i) % len(lengths)] for i in range(num)]
    return [RequestSpec(rng.integers(0, vocab_size, size=n).tolist(), m) for n, m in picked]


def read_lengths(path: Path) -> list[tuple[int, int]]:
    """The (prompt, output) pairs of a sharegpt_lengths.py file; ValueError if malformed."""
    pairs = json.loads(path.read_text()).get("prompt_output_lengths")
    if not isinstance(pairs, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(x, int) and x >= 1 for x in p)
        for p in pairs
    ):
        raise ValueError(f"{path}: expected prompt_output_lengths, a list of [prompt, output] >= 1")
    return [(n, m) for n, m in pairs]


def arrival_gaps(num: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: Poisson arrivals at `rate`/s, the first at once."""
    if math.isinf(rate):
        return [0.0] * num
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num)
    return [0.0, *gaps[1:].tolist()][:num]


##### Server-sent events #####


@dataclass(frozen=True)
class SSEEvent:
    kind: Literal["data", "error", "done"]
    payload: dict[str, Any]

    @property
    def message(self) -> str:
        err = self.payload.get("error", self.payload)
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)


def parse_sse_line(line: str) -> SSEEvent | None:
    """One line of an SSE stream: a data, error or [DONE] event; None for anything else."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    if data == "[DONE]":
        return SSEEvent("done", {})
    try:
        obj = json.loads(data)
    except json.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict):
        return SSEEvent("error", {"error": {"message": f"malformed event: {data[:200]}"}})
    return SSEEvent("error" if "error" in obj else "data", obj)


##### Per-request metrics #####


@dataclass
class RequestResult:
    """Times in seconds from the request's send; `itl` has one entry per token after the first."""

    prompt_len: int
    expected_len: int
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_len: int = 0
    cached_tokens: int = 0
    error: str | None = None
    last_token_at: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_len < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)

    def observe(self, total_tokens: int, t: float) -> None:
        """An event at time t brought the output to `total_tokens` tokens."""
        new = total_tokens - self.output_len
        if new <= 0:
            return
        if self.last_token_at is None:
            self.ttft = t
            self.itl += [0.0] * (new - 1)
        else:
            self.itl += [(t - self.last_token_at) / new] * new
        self.output_len, self.last_token_at = total_tokens, t

    def fail(self, message: str) -> None:
        self.error = self.error or message

    def check_counts(self, prompt_tokens: int | None) -> None:
        if prompt_tokens != self.prompt_len:
            self.fail(f"server counted {prompt_tokens} prompt tokens, {self.prompt_len} were sent")
        elif self.output_len != self.expected_len:
            self.fail(
                f"asked for {self.expected_len} output tokens (ignore_eos), got {self.output_len}"
            )


def native_payload(spec: RequestSpec, temperature: float) -> dict[str, Any]:
    params = {"max_new_tokens": spec.output_len, "ignore_eos": True, "temperature": temperature}
    return {"input_ids": spec.input_ids, "sampling_params": params, "stream": True}


async def send_request(
    client: httpx.AsyncClient, spec: RequestSpec, temperature: float
) -> RequestResult:
    """POST /generate with stream=true and time its events."""
    res = RequestResult(spec.prompt_len, spec.output_len)
    start = time.perf_counter()
    prompt_tokens = None
    try:
        async with client.stream("POST", "/generate", json=native_payload(spec, temperature)) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")
                res.fail(f"HTTP {r.status_code}: {body[:300]}")
            else:
                prompt_tokens = await read_events(r.aiter_lines(), res, start)
    except httpx.HTTPError as e:
        res.fail(f"{type(e).__name__}: {e!r}")
    except (KeyError, TypeError, ValueError) as e:  # an event without the fields we read
        res.fail(f"unexpected event: {type(e).__name__}: {e}")
    res.e2e = time.perf_counter() - start
    res.check_counts(prompt_tokens)
    return res


async def read_events(
    lines: AsyncIterator[str],
    res: RequestResult,
    start: float,
    clock: Callable[[], float] = time.perf_counter,
) -> int | None:
    """Feed one native stream into `res` until [DONE]; the prompt tokens the server counted."""
    prompt_tokens = None
    async for line in lines:
        event = parse_sse_line(line)
        if event is None:
            continue
        if event.kind == "done":
            return prompt_tokens
        if event.kind == "error":
            res.fail(event.message)
            continue
        meta = event.payload["meta_info"]  # totals so far, in cumulative and incremental mode
        res.observe(int(meta["completion_tokens"]), clock() - start)
        prompt_tokens, res.cached_tokens = int(meta["prompt_tokens"]), int(meta["cached_tokens"])
    res.fail("the stream ended without [DONE]")
    return prompt_tokens


async def run_load(
    send: Send, specs: list[RequestSpec], rate: float, max_concurrency: int | None, seed: int
) -> tuple[list[RequestResult], float]:
    """Send every spec (Poisson arrivals, at most max_concurrency in flight); results, wall time."""
    sem = asyncio.Semaphore(max_concurrency or len(specs) or 1)

    async def one(spec: RequestSpec) -> RequestResult:
        async with sem:
            return await send(spec)

    start = time.perf_counter()
    tasks = []
    for spec, gap in zip(specs, arrival_gaps(len(specs), rate, seed), strict=True):
        await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(spec)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


##### Runs #####


async def bench_server(
    args: argparse.Namespace, url: str, specs: list[RequestSpec], warmup: list[RequestSpec]
) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=10.0)
    runs = []
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:

        async def send(spec: RequestSpec) -> RequestResult:
            return await send_request(client, spec, args.temperature)

        for conc in args.max_concurrency:
            results, _ = await run_load(send, warmup, math.inf, conc, args.seed)
            if any(not r.ok for r in results):
                raise SystemExit(f"warm-up failed: {next(r.error for r in results if r.error)}")
            if not args.no_flush_cache:
                (await client.post("/flush_cache", params={"timeout": 30})).raise_for_status()
            load = os.getloadavg()[0]  # other work on the machine skews every figure
            results, duration = await run_load(send, specs, args.request_rate, conc, args.seed)
            summary = summarize(results, duration, load)
            report_run(f"served, max concurrency {conc or 'none'}", summary)
            state = (await client.get("/server_info")).json()["internal_states"][0]
            runs.append({"max_concurrency": conc, "server": summary, "server_state_after": state})
    return runs


def bench_offline(
    args: argparse.Namespace,
    engine_options: dict[str, Any],
    specs: list[RequestSpec],
    warmup: list[RequestSpec],
    runs: list[dict[str, Any]],
) -> None:
    """The same runs through weft.Engine.async_generate in this process; adds `offline_peer`."""
    import weft

    engine = weft.Engine(**engine_options)

    async def send(spec: RequestSpec) -> RequestResult:
        res, start = RequestResult(spec.prompt_len, spec.output_len), time.perf_counter()
        params = native_payload(spec, args.temperature)["sampling_params"]
        out = await engine.async_generate(input_ids=spec.input_ids, sampling_params=params)
        assert isinstance(out, dict)
        res.e2e, meta = time.perf_counter() - start, out["meta_info"]
        res.output_len, res.cached_tokens = meta["completion_tokens"], meta["cached_tokens"]
        res.check_counts(meta["prompt_tokens"])
        return res

    try:
        for run in runs:
            conc = run["max_concurrency"]
            asyncio.run(run_load(send, warmup, math.inf, conc, args.seed))
            if not args.no_flush_cache and not engine.flush_cache():
                raise RuntimeError("the offline engine did not flush its cache")
            load = os.getloadavg()[0]
            peer = summarize(
                *asyncio.run(run_load(send, specs, args.request_rate, conc, args.seed)), load
            )
            report_run(f"offline weft.Engine, max concurrency {conc or 'none'}", peer)
            ratio = run["server"]["output_throughput"] / max(peer["output_throughput"], 1e-9)
            run |= {"offline_peer": peer, "output_throughput_ratio": ratio}
    finally:
        engine.shutdown()


def engine_options(server_info: dict[str, Any]) -> dict[str, Any]:
    """The server's engine settings (server_info echoes every EngineConfig field)."""
    from weft import EngineConfig

    return {f.name: server_info[f.name] for f in fields(EngineConfig) if f.name in server_info}


##### CLI #####


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )

    def opt(group: Any, flag: str, default: Any, text: str, **kw: Any) -> None:
        shown = "" if default is None or isinstance(default, bool) else " (default: %(default)s)"
        if isinstance(default, bool):
            kw["action"] = "store_true"
        group.add_argument(flag, default=default, help=text + shown, **kw)

    srv = ap.add_argument_group("server")
    where = srv.add_mutually_exclusive_group()
    opt(where, "--base-url", "http://127.0.0.1:30000", "a running weft serve")
    opt(where, "--launch", False, "start `python -m weft serve` on a free port for the run")
    opt(srv, "--model", None, "--launch: the model (default: the packaged SmolLM2)")
    opt(srv, "--server-args", None, "--launch: more `weft serve` options, as one string")
    opt(srv, "--server-log", None, "--launch: the server's log file (default: a temp file)")
    opt(srv, "--launch-timeout", 600.0, "--launch: seconds to wait for /health", type=float)
    work = ap.add_argument_group("workload")
    opt(work, "--num-prompts", 16, "requests per run", type=int)
    opt(work, "--input-len", 256, "prompt tokens", type=int)
    opt(work, "--output-len", 64, "output tokens (ignore_eos)", type=int)
    opt(work, "--range-ratio", 1.0, "lengths uniform in [ratio * len, len]; 1 = fixed", type=float)
    opt(
        work,
        "--lengths-file",
        None,
        "(prompt, output) lengths in order instead (replaces "
        "--input-len, --output-len, --range-ratio)",
        type=Path,
    )
    opt(work, "--vocab-size", None, "ids from [0, N) (default: the model's config.json)", type=int)
    opt(work, "--temperature", 0.0, "sampling temperature", type=float)
    opt(work, "--seed", 0, "seed of the prompts and the arrival times", type=int)
    load = ap.add_argument_group("load")
    opt(load, "--request-rate", math.inf, "Poisson arrivals/s; inf = all at once", type=float)
    opt(load, "--max-concurrency", [0], "0 = no limit; N M ... = a run each", type=int, nargs="+")
    opt(load, "--warmup-requests", 1, "unmeasured requests before each run", type=int)
    opt(load, "--no-flush-cache", False, "keep the prefix cache between runs")
    opt(load, "--timeout", 300.0, "seconds a stream may stay silent before it fails", type=float)
    out = ap.add_argument_group("output")
    opt(out, "--offline-peer", False, "--launch: then run weft.Engine offline on the same load")
    opt(out, "--output-file", None, "write the command, settings and results here as JSON")
    args = ap.parse_args(argv)
    if args.offline_peer and not args.launch:
        ap.error("--offline-peer needs --launch: the peer must have the machine to itself")
    if min(args.num_prompts, args.input_len, args.output_len) < 1 or args.warmup_requests < 0:
        ap.error("--num-prompts, --input-len and --output-len must be >= 1, --warmup-requests >= 0")
    if not 0 <= args.range_ratio <= 1 or args.request_rate <= 0 or min(args.max_concurrency) < 0:
        ap.error("need 0 <= --range-ratio <= 1, --request-rate > 0 and --max-concurrency >= 0")
    args.max_concurrency = [c or None for c in args.max_concurrency]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    report: dict[str, Any] = {
        "command": shlex.join(["python", "benchmarks/serving.py", *argv]),
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "client": {"python": platform.python_version(), "platform": platform.platform()},
        "cpu_count": os.cpu_count(),
        "args": {k: None if v == math.inf else v for k, v in vars(args).items()},
    }
    with contextlib.ExitStack() as stack:
        url = args.base_url.rstrip("/")
        if args.launch:
            log = args.server_log or tempfile.mkstemp(prefix="weft-serve-", suffix=".log")[1]
            server = launched_server(args.model, args.server_args, Path(log), args.launch_timeout)
            url = stack.enter_context(server)
        info = server_settings(url)
        print(f"server settings: {json.dumps(info['key'])}", flush=True)
        vocab = args.vocab_size or model_vocab_size(str(info["key"]["model_path"]))
        if args.lengths_file is not None:
            pairs = read_lengths(args.lengths_file)
            specs = requests_of_lengths(pairs, args.num_prompts, 0, vocab, args.seed)
            warmup = requests_of_lengths(pairs, args.warmup_requests, args.num_prompts, vocab,
                                         args.seed + 1)  # fmt: skip
        else:
            shape = (args.input_len, args.output_len, args.range_ratio, vocab)
            specs = sample_requests(args.num_prompts, *shape, args.seed)
            warmup = sample_requests(args.warmup_requests, *shape, args.seed + 1)
        runs = asyncio.run(bench_server(args, url, specs, warmup))
    if args.offline_peer:
        bench_offline(args, engine_options(info["full"]), specs, warmup, runs)
    table = markdown_table(runs)
    print(f"\n{table}")
    report |= {"vocab_size": vocab, "server_info": info, "runs": runs, "table": table}
    if args.output_file:
        Path(args.output_file).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.output_file}")
    return 1 if any(run["server"]["failed"] for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
