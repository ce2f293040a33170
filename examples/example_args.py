"""Shared command line of the examples: which backend to run on, and how long gens may be."""

from __future__ import annotations

import argparse

import weft


def setup(description: str, max_tokens: int) -> tuple[weft.Backend, int]:
    """Parse --url / --model / --max-tokens, make the backend the default, and return it.

    By default the example starts an in-process Engine on the packaged SmolLM2-135M-Instruct;
    --url uses a running `weft serve` (or SGLang) server instead; --model loads another model.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", help="a running server, e.g. http://127.0.0.1:30000")
    parser.add_argument("--model", help="a model folder or .gguf file for the in-process Engine")
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help="longest gen")
    args = parser.parse_args()
    if args.url and args.model:
        parser.error("give --url or --model, not both")
    backend: weft.Backend
    if args.url:
        backend = weft.RuntimeEndpoint(args.url)
    else:
        backend = weft.EngineBackend(model=args.model)
    weft.set_default_backend(backend)
    return backend, args.max_tokens
