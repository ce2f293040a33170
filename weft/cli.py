"""The `weft` command line: `weft generate` (one-shot generation with the offline Engine)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from weft.runtime.config import EngineConfig


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    """One --flag per EngineConfig field, with its default shown."""
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true", help=f"(default: {default})")
        else:
            kind = {int: int, float: float}.get(type(default), str)
            if f.name in ("context_length", "page_size", "max_total_tokens", "kv_cache_bytes"):
                kind = int
            parser.add_argument(flag, type=kind, default=default, help=f"(default: {default})")


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}


def cmd_generate(args: argparse.Namespace) -> int:
    from weft.runtime.engine import Engine

    params = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
    }
    with Engine(**_engine_kwargs(args)) as engine:
        prompt = args.prompt
        if args.chat:
            prompt = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        if args.json:
            print(json.dumps(engine.generate(prompt, params), indent=2))
            return 0
        for chunk in engine.generate(prompt, params, stream=True):
            assert isinstance(chunk, dict)
            sys.stdout.write(chunk["text"])
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weft", description="weft: structured-generation runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt with the offline engine")
    gen.add_argument("prompt")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="print the whole result as JSON")
    _add_engine_options(gen)
    args = parser.parse_args(argv)
    try:
        return cmd_generate(args)
    except ValueError as exc:
        print(f"weft: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
