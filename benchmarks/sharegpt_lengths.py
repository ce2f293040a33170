"""ShareGPT's prompt and output lengths in tokens, for serving benchmarks on machines without the
120 MB file (the GPU): `serving.py --lengths-file` sends random ids of these lengths.

    python benchmarks/sharegpt_lengths.py --num 1000 --out benchmarks/data/sharegpt-lengths.json

As SGLang's bench_serving samples ShareGPT: a conversation's first turn is the prompt and its
second the output; pairs with fewer than 2 tokens on either side, a prompt over 1024 tokens or
prompt + output over 2048 are skipped. Conversations in file order (MODELS.md), counted in the
tokens of --tokenizer (default: Qwen2.5-Coder-1.5B's, a 151k-entry BPE like Llama 3's 128k one).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

MODELS = Path.home() / ".cache/weft-models"
MAX_PROMPT, MAX_TOTAL, MIN_LEN = 1024, 2048, 2


def pairs(path: Path, count: Callable[[str], int]) -> Iterator[tuple[int, int]]:
    """(prompt tokens, output tokens) of each usable conversation, in file order."""
    with path.open(encoding="utf-8") as f:
        for line in f:
            turns = json.loads(line).get("conversations") or []
            if len(turns) < 2:
                continue
            n, m = count(turns[0].get("value", "")), count(turns[1].get("value", ""))
            if n < MIN_LEN or m < MIN_LEN or n > MAX_PROMPT or n + m > MAX_TOTAL:
                continue
            yield n, m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--sharegpt", type=Path, default=MODELS / "sharegpt.jsonl")
    ap.add_argument("--tokenizer", default=str(MODELS / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
                    help="a model (HF folder or .gguf) whose tokenizer counts")  # fmt: skip
    ap.add_argument("--num", type=int, default=1000)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    from weft.runtime.loader import load_tokenizer, resolve_model_path

    tok = load_tokenizer(resolve_model_path(args.tokenizer, Path.home() / ".cache/weft"))
    got = []
    for pair in pairs(args.sharegpt, lambda text: len(tok.encode(text, add_special_tokens=False))):
        got.append(pair)
        if len(got) == args.num:
            break
    if not got:
        raise SystemExit(f"no usable conversation in {args.sharegpt}")
    cmd = shlex.join(["python", "benchmarks/sharegpt_lengths.py", *(argv or sys.argv[1:])])
    doc = {"command": cmd, "source": args.sharegpt.name, "tokenizer": Path(args.tokenizer).name,
           "prompt_output_lengths": got}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    n, m = sum(p for p, _ in got), sum(o for _, o in got)
    print(
        f"{len(got)} pairs: mean prompt {n / len(got):.0f}, mean output {m / len(got):.0f} tokens"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
