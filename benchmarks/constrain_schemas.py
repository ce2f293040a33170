"""Grammar backends on a folder of real-world JSON schemas: how many compile, how fast, and why not.

    python benchmarks/constrain_schemas.py DIR [--backends llguidance,llguidance:strict,outlines,xgrammar]
                                               [--timeout 10]

DIR holds one JSON schema per `*.json` file (for instance files of SchemaStore's catalog,
`src/schemas/json`). With SmolLM2's tokenizer, per backend: schemas compiled to the first mask
within the timeout, those of them compiled with keywords the backend reported as not enforced
(weft's default: enforce the rest and say so in `meta_info`), refusals split into timeouts and
the rest, and compile time median / p90 / max over the compiled ones. `llguidance:strict` is
OpenAI's `strict: true` (a keyword that cannot be enforced refuses the schema). The "either" row
counts schemas that the default backend or, failing it, outlines-core compiles. xgrammar is the
outside reference (it reports nothing it approximates).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

from constrain import load_tokenizer, quantile, weft_backend, xgrammar_backend
from weft.constrain import GrammarError, GrammarSpec


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
    base, _, option = name.partition(":")
    make = (
        xgrammar_backend(tok, timeout) if name == "xgrammar" else weft_backend(base, tok, timeout)
    )
    ok: dict[str, float] = {}
    unenforced: Counter[str] = Counter()
    refused: dict[str, str] = {}
    for file, schema in schemas:
        spec = GrammarSpec.json_schema(schema, strict=option == "strict")
        start = time.perf_counter()
        try:
            new = make(spec)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--backends", default="llguidance,llguidance:strict,outlines,xgrammar")
    ap.add_argument("--timeout", type=float, default=10.0, help="compile timeout, s")
    args = ap.parse_args()
    tok, schemas = load_tokenizer(), load_schemas(args.folder)
    results = [compile_all(name, tok, schemas, args.timeout) for name in args.backends.split(",")]
    by_name = {r["backend"]: r for r in results}
    print(f"{len(schemas)} schemas from {args.folder}; load average {os.getloadavg()[0]:.2f}")
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


if __name__ == "__main__":
    main()
