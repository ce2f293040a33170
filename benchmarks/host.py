"""Host-side costs on the CPU: grammar backends, tool-call parsing, stop regexes, model resolution.

    python benchmarks/host.py grammar [--backends llguidance,llguidance:no-prefetch,outlines,xgrammar]
    python benchmarks/host.py fill-profile           # where llguidance's mask-fill time goes
    python benchmarks/host.py schemas DIR            # a folder of real-world JSON schemas compiled
    python benchmarks/host.py grammar-e2e [--concurrency 1 8]   # decode time, packaged model
    python benchmarks/host.py tool-parser            # streamed tool-call parsing: us per character
    python benchmarks/host.py stop-regex             # a catastrophic stop regex, bounded
    python benchmarks/host.py resolve                # the packaged model: convert, then reuse

`grammar`, `fill-profile`, `schemas`: host_grammar.py. `grammar-e2e`: weft.Engine on the packaged
model, 8 corpus schemas as chat prompts (x3); decode time per output token (after each request's
first chunk) constrained (jump-forward on, then off) vs unconstrained with the same prompts and
output lengths, wave by wave; and the engine's own mask-fill figures. `tool-parser`: a JSON tool
call streamed one character at a time through ToolCallParser at growing lengths; the time per
character stays flat when each character is scanned once. `stop-regex`: a stop regex that
backtracks exponentially, searched under the matcher's time limit, against a plain one.
`resolve`: the packaged GGUF converted into a fresh cache folder, then resolved again (which only
hashes the file). Each prints a markdown table; times are medians where repeated.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

##### Tool calls, stop regexes, model resolution #####


def tool_parser(lengths: list[int], repeats: int) -> None:
    from weft.runtime.server.http.tool_formats import ANY_JSON
    from weft.runtime.server.http.tool_parser import ToolCallParser

    print("| characters | ms per stream | us per character |\n|---|---|---|")
    for n in lengths:
        text = json.dumps({"name": "weather", "parameters": {"city": "x" * n}})
        times = []
        for _ in range(repeats):
            parser = ToolCallParser("auto", frozenset({"weather"}), fmt=ANY_JSON)
            start = time.perf_counter()
            for ch in text:
                parser.feed(ch)
            calls = parser.finish()
            times.append(time.perf_counter() - start)
        assert len(calls) == 1, calls
        t = statistics.median(times)
        print(f"| {len(text):,} | {t * 1e3:.1f} | {t * 1e6 / len(text):.2f} |")


def stop_regex(repeats: int) -> None:
    from weft.runtime.stop import STOP_REGEX_TIMEOUT_S, StopMatcher, StopRegexTimeout

    print(f"the matcher's time limit per search: {STOP_REGEX_TIMEOUT_S * 1e3:.0f} ms")
    print("| stop regex | text | ms per search (median) | outcome |\n|---|---|---|---|")
    for pattern, text in (("(a|aa)+b", "a" * 60), ("END", "a" * 60 + "END")):
        times, outcome = [], ""
        for _ in range(repeats):
            matcher = StopMatcher(stop_regex=[pattern])
            start = time.perf_counter()
            try:
                outcome = "match" if matcher.search(text) is not None else "no match"
            except StopRegexTimeout:
                outcome = "StopRegexTimeout"
            times.append(time.perf_counter() - start)
        shown = pattern.replace("|", "\\|")
        print(
            f"| `{shown}` | {len(text)} chars | {statistics.median(times) * 1e3:.2f} | {outcome} |"
        )


def resolve() -> None:
    from weft.runtime.loader import resolve_model_path

    with tempfile.TemporaryDirectory(prefix="weft-resolve-") as cache:
        print("| call | s |\n|---|---|")
        for label in ("first: convert the packaged GGUF", "second: the folder reused"):
            start = time.perf_counter()
            resolve_model_path(None, Path(cache))
            print(f"| {label} | {time.perf_counter() - start:.2f} |")


##### Constrained decoding on the packaged model #####


E2E_SCHEMAS = (
    "person optional_fields nested_address const_string defs_ref format_date integer_bounds "
    "tool_call_weather"
).split()


def grammar_e2e(concurrency: list[int], max_new: int, repeats: int) -> None:
    """Decode time per output token on the packaged model: constrained vs unconstrained."""
    from host_grammar import DATA

    import weft

    entries = {e["name"]: e for e in json.loads((DATA / "schemas.json").read_text())}
    names = E2E_SCHEMAS * repeats
    schemas = [entries[name]["schema"] for name in names]
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print("| concurrency | run | output tokens | TPOT ms (mean over requests) | wall s |")
    print("|---|---|---|---|---|")
    greedy = {"temperature": 0.0, "max_new_tokens": max_new}
    constrained = [{**greedy, "json_schema": json.dumps(schema)} for schema in schemas]
    for jump_forward in (True, False):
        with weft.Engine(disable_jump_forward=not jump_forward) as engine:
            prompts = [_chat(engine, name, entries[name]["schema"]) for name in names]
            _wave(engine, prompts[:2], constrained[:2])  # warm-up: grammar tables, compiles
            label = "constrained" + ("" if jump_forward else ", no jump-forward")
            for c in concurrency:
                runs = {label: Run(), "unconstrained, same lengths": Run()}
                for i in range(0, len(prompts), c):  # NOTE: interleaved wave by wave (shared VM)
                    lens = runs[label].add(engine, prompts[i : i + c], constrained[i : i + c])
                    same = [{**greedy, "max_new_tokens": n, "ignore_eos": True} for n in lens]
                    again = runs["unconstrained, same lengths"].add(
                        engine, prompts[i : i + c], same
                    )
                    assert again == lens, (again, lens)
                for name, run in runs.items():
                    run.print(c, name)
            fills = engine.get_state()["mask_fill"]
            print(f"mask fill per constrained request and step, scheduler thread ({label}): "
                  f"{fills}", flush=True)  # fmt: skip
    print(f"load average after: {os.getloadavg()[0]:.2f}")


def _chat(engine: Any, name: str, schema: Any) -> str:
    text = f"Write a JSON value for {name}: {json.dumps(schema)}"
    messages = [{"role": "user", "content": text}]
    return str(
        engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )


class Run:
    """Output lengths, per-request TPOT and wall time, summed over waves."""

    def __init__(self) -> None:
        self.lens: list[int] = []
        self.tpots: list[float] = []
        self.wall = 0.0

    def add(self, engine: Any, prompts: list[str], params: list[dict[str, Any]]) -> list[int]:
        engine.flush_cache()
        start = time.perf_counter()
        lens, tpots = _wave(engine, prompts, params)
        self.wall += time.perf_counter() - start
        self.lens += lens
        self.tpots += tpots
        return lens

    def print(self, c: int, name: str) -> None:
        tpot = statistics.mean(self.tpots) * 1e3 if self.tpots else float("nan")
        print(f"| {c} | {name} | {sum(self.lens)} | {tpot:.1f} | {self.wall:.1f} |", flush=True)


def _wave(
    engine: Any, prompts: list[str], params: list[dict[str, Any]]
) -> tuple[list[int], list[float]]:
    """One wave of streamed requests at once: output lengths, and per request the seconds per
    output token after its first chunk."""
    firsts: dict[int, tuple[float, int]] = {}
    last: dict[int, tuple[float, int]] = {}
    for delta in engine.generate(prompts, params, stream=True):
        k, now = int(delta.get("index", 0)), time.perf_counter()
        n = last.get(k, (0.0, 0))[1] + len(delta["output_ids"])
        firsts.setdefault(k, (now, n))
        last[k] = (now, n)
    spans = [(last[k][0] - firsts[k][0], last[k][1] - firsts[k][1]) for k in sorted(last)]
    return [last[k][1] for k in sorted(last)], [dt / dn for dt, dn in spans if dn > 0]


##### CLI #####


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = ap.add_subparsers(dest="what", required=True)
    gr = sub.add_parser("grammar", help="grammar backends on the test corpus")
    gr.add_argument("--backends", default="llguidance,llguidance:no-prefetch,outlines,xgrammar")
    gr.add_argument("--step-gap-ms", type=float, default=1.0,
                    help="model-like torch work between an accept and the next fill (0: none)")  # fmt: skip
    gr.add_argument("--timeout", type=float, default=10.0, help="compile timeout, s")
    sub.add_parser("fill-profile", help="llguidance: first fill vs a repeat at the same state")
    sch = sub.add_parser("schemas", help="a folder of JSON schemas, one per *.json file")
    sch.add_argument("folder", type=Path)
    sch.add_argument("--backends", default="llguidance,llguidance:strict,outlines,xgrammar")
    sch.add_argument("--timeout", type=float, default=10.0, help="compile timeout, s")
    e2e = sub.add_parser("grammar-e2e", help="constrained vs unconstrained decode time")
    e2e.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    e2e.add_argument("--max-new-tokens", type=int, default=64)
    e2e.add_argument("--repeats", type=int, default=3, help="times the 8 prompts run")
    tp = sub.add_parser("tool-parser", help="streamed tool-call parsing, us per character")
    tp.add_argument("--lengths", type=int, nargs="+", default=[10_000, 40_000, 160_000])
    tp.add_argument("--repeats", type=int, default=3)
    sr = sub.add_parser("stop-regex", help="a catastrophic stop regex against a plain one")
    sr.add_argument("--repeats", type=int, default=5)
    sub.add_parser("resolve", help="the packaged model converted, then resolved again")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.what == "tool-parser":
        tool_parser(args.lengths, args.repeats)
    elif args.what == "stop-regex":
        stop_regex(args.repeats)
    elif args.what == "resolve":
        resolve()
    elif args.what == "grammar-e2e":
        grammar_e2e(args.concurrency, args.max_new_tokens, args.repeats)
    else:
        import host_grammar as hg

        if args.what == "schemas":
            hg.run_schemas(args.folder, args.backends.split(","), args.timeout)
            return
        tok, corpus = hg.load_tokenizer(), hg.load_corpus()
        if args.what == "fill-profile":
            hg.fill_profile(tok, corpus)
            return
        rows = [hg.bench(name, hg.make_backend(name, tok, args.timeout), corpus, tok,
                         args.step_gap_ms / 1e3) for name in args.backends.split(",")]  # fmt: skip
        hg.print_backends(rows, args.step_gap_ms)


if __name__ == "__main__":
    main()
