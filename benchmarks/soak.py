"""Soak benchmark: minutes at saturation against `weft serve`, watching for errors, memory growth
and KV leaks.

    python benchmarks/soak.py --launch --model /path/to/model --minutes 2
    python benchmarks/soak.py --base-url http://127.0.0.1:30000 --minutes 30 --concurrency 64

Load: --concurrency workers, each sending its next request as soon as the last one ends, drawn
from a mix (--mix): plain /generate, streamed /generate, streamed /v1/chat/completions, grammar-
constrained /generate (a regex or a JSON schema), /v1/completions with n > 1, streams the client
drops after the first event (the server must abort them), and requests cancelled through
/abort_request. Every request must end in a 200 (an aborted one too); anything else is counted by
its status.
Every --idle-every seconds the workers pause and drain; once /server_info shows nothing running
or waiting, the KV accounting is read (free + evictable + protected must equal the pool, with
nothing protected) with the server's RSS (its process tree: psutil, or /proc). RSS is also
sampled every --sample-every seconds under load. Exit status 1 when a request failed, the KV
drifted or a checkpoint was not idle.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from serving import parse_sse_line
from serving_server import launched_server
from soak_report import IdlePoint, Outcome, summarize, text_tables, tree_rss, verdict

PROMPTS = (
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "Once upon a time, in a small village by the river,",
    "Explain what a radix tree is in one sentence.",
    "Translate 'good morning' into Spanish:",
)
REGEX = r"(yes|no)( [0-9]{1,3}){0,4}"
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}},
    "required": ["a", "b"],
}
DEFAULT_MIX = "plain=3,stream=3,chat_stream=2,constrained=2,n=1,disconnect=1,abort=1"

##### Requests #####
# Each sends one request of its kind and returns how it ended: "200", another status, or what
# went wrong in a 200 ("stream-error", "no-done", "bad-reply").


class Load:
    def __init__(self, client: httpx.AsyncClient, rng: random.Random, max_tokens: int) -> None:
        self.client, self.rng, self.max_tokens = client, rng, max_tokens
        self.count = 0

    def prompt(self) -> str:
        return f"{self.rng.choice(PROMPTS)} ({self.rng.randrange(10**6)})"

    def params(self, **over: Any) -> dict[str, Any]:
        return {"max_new_tokens": self.rng.randint(1, self.max_tokens), "temperature": 0.7, **over}

    async def plain(self) -> str:
        body = {"text": self.prompt(), "sampling_params": self.params()}
        r = await self.client.post("/generate", json=body)
        return _status(r, lambda j: isinstance(j.get("text"), str))

    async def stream(self) -> str:
        body = {"text": self.prompt(), "sampling_params": self.params(), "stream": True}
        return await self._sse("/generate", body)

    async def chat_stream(self) -> str:
        messages = [{"role": "user", "content": self.prompt()}]
        body = {"messages": messages, "max_tokens": self.rng.randint(1, self.max_tokens)}
        return await self._sse("/v1/chat/completions", {**body, "stream": True})

    async def constrained(self) -> str:
        grammar = {"regex": REGEX} if self.rng.random() < 0.5 else {"json_schema": SCHEMA}
        body = {"text": self.prompt(), "sampling_params": self.params(**grammar)}
        r = await self.client.post("/generate", json=body)
        return _status(r, lambda j: isinstance(j.get("text"), str))

    async def n(self) -> str:
        n = self.rng.randint(2, 3)
        body = {"prompt": self.prompt(), "n": n, "temperature": 0.8}
        body["max_tokens"] = self.rng.randint(1, self.max_tokens)
        r = await self.client.post("/v1/completions", json=body)
        return _status(r, lambda j: len(j.get("choices", ())) == n)

    async def disconnect(self) -> str:
        """A stream dropped after its first event: the server must abort and free it."""
        body = {"text": self.prompt(), "sampling_params": self.params(), "stream": True}
        async with self.client.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                return str(r.status_code)
            async for line in r.aiter_lines():
                event = parse_sse_line(line)
                if event is not None:
                    return "200" if event.kind != "error" else "stream-error"
        return "no-done"

    async def abort(self) -> str:
        """A long request cancelled by its rid: it still answers 200 (finish reason abort)."""
        self.count += 1
        rid = f"soak-{id(self)}-{self.count}"
        params = self.params(max_new_tokens=self.max_tokens * 4, ignore_eos=True)
        sent = asyncio.ensure_future(
            self.client.post(
                "/generate", json={"text": self.prompt(), "sampling_params": params, "rid": rid}
            )
        )
        await asyncio.sleep(self.rng.uniform(0.01, 0.3))
        cancel = await self.client.post("/abort_request", json={"rid": rid})
        if cancel.status_code != 200:
            sent.cancel()
            return f"abort_request {cancel.status_code}"
        return _status(
            await sent, lambda j: j["meta_info"]["finish_reason"]["type"] in ("abort", "length")
        )

    async def _sse(self, path: str, body: dict[str, Any]) -> str:
        async with self.client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return str(r.status_code)
            async for line in r.aiter_lines():
                event = parse_sse_line(line)
                if event is not None and event.kind != "data":
                    return "200" if event.kind == "done" else "stream-error"
        return "no-done"


def _status(r: httpx.Response, good: Callable[[Any], bool]) -> str:
    if r.status_code != 200:
        return str(r.status_code)
    try:
        return "200" if good(r.json()) else "bad-reply"
    except (ValueError, KeyError, TypeError):
        return "bad-reply"


async def timed(kind: str, send: Callable[[], Awaitable[str]]) -> Outcome:
    start = time.perf_counter()
    try:
        status = await send()
    except httpx.HTTPError as e:
        status = type(e).__name__
    return Outcome(kind, status, time.perf_counter() - start)


##### The soak #####


def parse_mix(text: str) -> dict[str, float]:
    """ "plain=3,stream=1" -> weights by kind; every kind must be one Load sends."""
    mix: dict[str, float] = {}
    for item in text.split(","):
        name, sep, weight = item.partition("=")
        if not sep or not hasattr(Load, name.strip()) or name.strip().startswith("_"):
            raise argparse.ArgumentTypeError(
                f"--mix: expected KIND=WEIGHT with a known kind, got {item!r}"
            )
        mix[name.strip()] = float(weight)
    if not mix or min(mix.values()) < 0 or sum(mix.values()) <= 0:
        raise argparse.ArgumentTypeError("--mix: weights must be >= 0 with a positive sum")
    return mix


async def soak(args: argparse.Namespace, url: str, pid: int | None) -> dict[str, Any]:
    outcomes: list[Outcome] = []
    rss: list[tuple[float, int]] = []
    idle: list[IdlePoint] = []
    kinds, weights = zip(*args.mix.items(), strict=True)
    gate, inflight = asyncio.Event(), [0]
    gate.set()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client:
        start = time.perf_counter()
        end = start + args.minutes * 60

        def clock() -> float:
            return time.perf_counter() - start

        async def worker(i: int) -> None:
            load = Load(client, random.Random(args.seed * 1000 + i), args.max_tokens)
            while time.perf_counter() < end:
                await gate.wait()
                kind = load.rng.choices(kinds, weights)[0]
                inflight[0] += 1
                try:
                    outcomes.append(await timed(kind, getattr(load, kind)))
                finally:
                    inflight[0] -= 1

        async def checkpoint() -> None:
            gate.clear()
            while inflight[0]:
                await asyncio.sleep(0.05)
            idle.append(await idle_point(client, pid, clock))
            p = idle[-1]
            print(
                f"[{clock():5.0f} s] {len(outcomes)} requests; idle point: running "
                f"{p.state['num_running']}, waiting {p.state['num_waiting']}, KV drift {p.drift}, "
                f"RSS {p.rss / 2**20:,.0f} MB",
                flush=True,
            )
            gate.set()

        async def checkpoints() -> None:
            while end - time.perf_counter() > args.idle_every:
                await asyncio.sleep(args.idle_every)
                if time.perf_counter() < end:  # the last one is taken after the workers stop
                    await checkpoint()

        async def sampler() -> None:
            while pid is not None:
                rss.append((clock(), tree_rss(pid)))
                await asyncio.sleep(args.sample_every)

        sampling = asyncio.ensure_future(sampler())
        await asyncio.gather(checkpoints(), *(worker(i) for i in range(args.concurrency)))
        duration = clock()
        await checkpoint()
        sampling.cancel()
    return summarize(outcomes, rss, idle, duration)


async def idle_point(
    client: httpx.AsyncClient, pid: int | None, clock: Callable[[], float], wait: float = 30.0
) -> IdlePoint:
    """The KV accounting once nothing runs or waits (aborts of dropped streams land a moment
    later); after `wait` seconds it is taken as it is, and the verdict says it was not idle."""
    deadline = time.perf_counter() + wait
    while True:
        info = (await client.get("/server_info")).json()
        state = info["internal_states"][0]
        if (
            state["num_running"] == 0 and state["num_waiting"] == 0
        ) or time.perf_counter() > deadline:
            return IdlePoint(clock(), tree_rss(pid) if pid is not None else 0, state)
        await asyncio.sleep(0.2)


def server_pid(url: str, given: int | None) -> int | None:
    """The server's front process (the parent of its scheduler), when it runs on this machine."""
    if given is not None:
        return given
    scheduler = httpx.get(f"{url}/server_info", timeout=10.0).json().get("scheduler_pid")
    try:
        stat = Path(f"/proc/{scheduler}/stat").read_text()
    except (OSError, TypeError):
        print("server RSS not measured: its processes are not on this machine (--server-pid)")
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


##### CLI #####


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--base-url", default="http://127.0.0.1:30000", help="a running weft serve")
    where.add_argument(
        "--launch", action="store_true", help="start `python -m weft serve` for the run"
    )
    ap.add_argument("--model", help="--launch: the model (default: the packaged SmolLM2)")
    ap.add_argument("--server-args", help="--launch: more `weft serve` options, as one string")
    ap.add_argument("--server-log", help="--launch: the server's log (default: a temp file)")
    ap.add_argument("--server-pid", type=int, help="the server's process (default: found)")
    ap.add_argument("--minutes", type=float, default=5.0, help="length of the soak (default: 5)")
    ap.add_argument("--concurrency", type=int, default=32, help="workers (default: 32)")
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens, 1..N (default: 32)")
    ap.add_argument(
        "--mix", type=parse_mix, default=parse_mix(DEFAULT_MIX), help=f"default: {DEFAULT_MIX}"
    )
    ap.add_argument(
        "--idle-every", type=float, default=30.0, help="seconds between idle checkpoints"
    )
    ap.add_argument("--sample-every", type=float, default=2.0, help="seconds between RSS samples")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a request may take")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-file", help="write the command and the results here as JSON")
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.concurrency < 1 or args.max_tokens < 1:
        ap.error("--minutes must be > 0, --concurrency and --max-tokens >= 1")
    if args.idle_every <= 0 or args.sample_every <= 0:
        ap.error("--idle-every and --sample-every must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    with contextlib.ExitStack() as stack:
        url = args.base_url.rstrip("/")
        if args.launch:
            log = args.server_log or tempfile.mkstemp(prefix="weft-soak-", suffix=".log")[1]
            url = stack.enter_context(
                launched_server(args.model, args.server_args, Path(log), 600.0)
            )
        pid = server_pid(url, args.server_pid)
        summary = asyncio.run(soak(args, url, pid))
    problems = verdict(summary)
    print("\n" + text_tables(summary))
    print("\n" + ("PASS" if not problems else "FAIL:\n  " + "\n  ".join(problems)))
    if args.output_file:
        report = {
            "command": shlex.join(["python", "benchmarks/soak.py", *argv]),
            "date": datetime.now().astimezone().isoformat(timespec="seconds"),
            "args": vars(args),
            "summary": summary,
            "problems": problems,
        }
        Path(args.output_file).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.output_file}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
