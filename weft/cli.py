"""The `weft` command line: `weft serve` (HTTP server) and `weft generate` (one-shot, offline)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import typing
from typing import Any

from weft.runtime.config import EngineConfig, TuningConfig
from weft.runtime.server.http.tool_parser import TOOL_CALL_PARSERS

_HELP = {
    "model": "HF folder or .gguf file; none = the packaged SmolLM2-135M-Instruct",
    "tokenizer": "tokenizer folder, if not the model's (a model folder without one, with "
    "--load-format dummy: a synthetic byte-level tokenizer of the config's vocabulary)",
    "skip_tokenizer_init": "load no tokenizer: requests send input_ids and get output_ids, no text "
    "(stop strings, grammars and chat are refused)",
    "load_format": "auto (read weights) or dummy (random weights of the config's shape)",
    "quantization": "gguf: a GGUF file's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K blocks stay "
    "quantized in memory (implied by a .gguf --model; with --load-format dummy, random blocks in "
    "llama.cpp's Q4_K_M layout); fp8: FP8 W8A8 weights (an FP8 checkpoint, or quantized at load)",
    "dequantize": "convert a .gguf model to full precision at load instead of keeping its blocks",
    "dtype": "auto = float32 on CPU, bfloat16 on CUDA",
    "device": "auto, cpu or cuda",
    "seed": "seed of dummy weights and unseeded sampling",
    "context_length": "override the model's context length",
    "page_size": "tokens per KV page; none = 1 on CPU, 16 on CUDA",
    "max_total_tokens": "KV pool size in tokens (overrides the memory budget)",
    "kv_cache_bytes": "CPU memory budget of the KV pool in bytes; none = 1 GiB",
    "mem_fraction": "GPU memory fraction for weights + KV pool",
    "max_running_requests": "most requests decoding at once",
    "tp_size": "tensor parallelism: ranks (GPUs, or gloo processes on CPU) sharing the model",
    "max_prefill_tokens": "token budget of one prefill batch",
    "chunked_prefill_size": "prefill long prompts in chunks of this many tokens; 0 = off",
    "enable_mixed_chunk": "prefill steps also decode one token of each running request",
    "schedule_policy": "fcfs or lpm (longest cached prefix first)",
    "schedule_conservativeness": "scales the new-token ratio (and its floor): above 1 admits "
    "fewer requests and retracts less, below 1 more",
    "init_new_token_ratio": "share of its remaining max_new_tokens a running request without "
    "ignore_eos is first expected to use, when admission predicts the KV pool's peak",
    "min_new_token_ratio_factor": "the floor the ratio decays to, as a fraction of its start",
    "new_token_ratio_decay_steps": "decode steps without retraction for the ratio to decay from "
    "its start to its floor",
    "retract_decode_steps": "on a retraction the ratio rises to the running requests' decoded "
    "share of max_new_tokens plus this many tokens each",
    "disable_radix_cache": "turn prefix caching off",
    "swa_full_tokens_ratio": "hybrid sliding-window pool: SWA tokens (windowed layers' KV) per "
    "full token (global layers' KV); lower holds more tokens in the same memory",
    "disable_hybrid_swa_memory": "windowed layers keep every token's KV, as global layers do",
    "attention_backend": "auto (triton on CUDA, torch on CPU), triton, flashinfer or torch",
    "disable_cuda_graph": "run decode steps eagerly on CUDA instead of replaying CUDA graphs",
    "cuda_graph_max_bs": "largest decode batch captured in a CUDA graph",
    "kv_cache_dtype": "auto (the model dtype) or fp8_e4m3: half the KV bytes, twice the tokens",
    "disable_shared_prefix_decode": "triton decode: read a prefix shared by running requests once "
    "per request instead of once per group",
    "disable_fused_kernels": "CUDA: torch ops instead of weft's Triton norm/rotary/SiLU kernels",
    "overlap_schedule": "auto (on with CUDA), on or off: prepare step t+1 while step t runs",
    "speculative_algorithm": "ngram (drafts from the request's own prompt and output) or draft "
    "(a small model with the same vocabulary runs ahead); greedy output is unchanged",
    "speculative_draft_model_path": "the draft model of --speculative-algorithm draft: HF folder "
    "or .gguf file",
    "speculative_num_draft_tokens": "tokens one verify step runs per request, the last accepted "
    "one included: up to this many minus one drafts",
    "speculative_ngram_min_match_window_size": "ngram: shortest suffix matched against the "
    "request's earlier tokens",
    "speculative_ngram_max_match_window_size": "ngram: longest suffix matched (the longest match "
    "wins, then the latest)",
    "lora_paths": "LoRA adapters (PEFT folders) to serve, as name=path (a bare path is its own "
    "name); requests choose one by name (lora_path)",
    "enable_lora": "serve LoRA adapters loaded while serving (/load_lora_adapter) even without "
    "--lora-paths (then --max-lora-rank sizes the pool)",
    "max_loras_per_batch": "most distinct LoRA adapters in one batch (the device pool's slots)",
    "max_lora_rank": "the LoRA pool's rank; none = the largest loaded adapter's",
    "cache_dir": "where converted models are kept; none = ~/.cache/weft",
    "log_level": "debug, info, warning or error",
    "cpu_threads": "torch threads of the scheduler on CPU; none = torch's default",
    "grammar_backend": "llguidance or outlines",
    "grammar_timeout": "seconds a grammar may compile before the request gets a 400",
    "grammar_max_repeat": "a grammar's largest counted repetition ({n,m}); more is a 400",
    "grammar_max_expanded": "a regex's items with counted repetitions multiplied out; more is a 400",
    "grammar_max_regex_chars": "characters of one regex in a grammar; more is a 400",
    "grammar_max_spec_chars": "characters of a JSON schema, EBNF grammar or structural tag; more "
    "is a 400",
    "strict_schemas": "the same as --grammar-strictness strict",
    "grammar_strictness": "JSON schemas with keywords the grammar cannot enforce exactly: lenient "
    "compiles the rest and reports each output's validity (meta_info schema_valid), strict "
    "refuses them with a 400",
    "disable_jump_forward": "sample grammar-forced tokens one by one (so with overlap anyway)",
    "reasoning_parser": "deepseek-r1 or qwen3: OpenAI chat answers carry the model's <think> "
    "text as reasoning_content, and a chat request's constraint starts after </think>",
    "gemv": "decode graphs of 1-16 rows on weft's skinny GEMV: auto (where the step replays "
    "faster), on or off",
    "graph_blas": "the cuBLAS path of the decode graphs' GEMMs: auto (measured), cublas or cublaslt",
    "disable_pdl": "launch the norm and GEMV kernels plainly, not as programmatic dependents",
    "extend_work": "the triton extend kernel's work list: auto (on over an fp8 pool), on or off",
    "grammar_mask_threads": "threads computing grammar masks ahead; none = min(3, cores - 1)",
    "spec_decode_rows": "speculative verify steps and draft catch-ups as decode rows, one per "
    "token: auto (replayed from the decode CUDA graphs where they fit), on or off (one extend)",
}


_CHOICES = {
    "quantization": ("gguf", "fp8"),
    "speculative_algorithm": ("ngram", "draft"),
    "grammar_strictness": ("lenient", "strict"),
    "reasoning_parser": ("deepseek-r1", "qwen3"),
}  # shown as {gguf,fp8} in --help


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    """One --flag per EngineConfig and TuningConfig field, with its default shown."""
    _add_fields(parser.add_argument_group("engine options"), EngineConfig)
    _add_fields(
        parser.add_argument_group("tuning (defaults measured; the others force a path)"),
        TuningConfig,
    )


def _add_fields(group: argparse._ArgumentGroup, cls: type) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name == "tuning":
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        text = f"{_HELP.get(f.name, '')} (default: {default})".strip()
        if isinstance(default, bool):
            group.add_argument(flag, action="store_true", help=text)
        elif isinstance(default, tuple):  # a list option: --lora-paths a=/x b=/y
            group.add_argument(flag, nargs="*", default=default, metavar="ENTRY", help=text)
        else:
            kind = _cli_type(hints[f.name])
            group.add_argument(flag, type=kind, default=default, help=text,
                               choices=_CHOICES.get(f.name))  # fmt: skip


def _cli_type(hint: Any) -> type:
    """The argparse type of a field annotated `hint` (int, float, else str; `X | None` as X)."""
    kinds = typing.get_args(hint) or (hint,)
    return int if int in kinds else float if float in kinds else str


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
              if f.name != "tuning"}  # fmt: skip
    kwargs["tuning"] = {f.name: getattr(args, f.name) for f in dataclasses.fields(TuningConfig)}
    return kwargs


def cmd_generate(args: argparse.Namespace) -> int:
    from weft.runtime.server.engine import Engine

    params = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
    }
    if args.skip_tokenizer_init:
        raise ValueError("weft generate takes a text prompt: drop --skip-tokenizer-init")
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


def cmd_serve(args: argparse.Namespace) -> int:
    from weft.runtime.server.http.serve import run_server
    from weft.runtime.server.http.state import ServerConfig

    config = ServerConfig(
        engine=EngineConfig.from_kwargs(**_engine_kwargs(args)),
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        chat_template=args.chat_template,
        incremental_streaming_output=args.incremental_streaming_output,
        tool_call_parser=args.tool_call_parser,
        enable_cache_report=args.enable_cache_report,
        max_top_logprobs=args.max_top_logprobs,
        max_n=args.max_n,
        max_request_bytes=args.max_request_bytes,
        shutdown_timeout=args.shutdown_timeout,
    )
    return run_server(config)


def _add_limit_options(parser: argparse.ArgumentParser) -> None:
    """The server's limits and shutdown (README "Limits"); over a limit is a 4xx, no work queued."""
    group = parser.add_argument_group("limits and shutdown")
    group.add_argument(
        "--max-top-logprobs",
        type=int,
        default=20,
        help="most top logprobs per position a request may ask for (native top_logprobs_num, "
        "OpenAI logprobs / top_logprobs); more is a 400. Each one is an entry per prompt or "
        "output token in the reply: uncapped, a 20-token prompt could ask for the whole "
        "vocabulary at every position (tens of MB). 20 is OpenAI's cap (default: 20)",
    )
    group.add_argument(
        "--max-n",
        type=int,
        default=128,
        help="most samples per prompt (n, sampling_params.n); more is a 400. Each sample is a "
        "sequence of its own in the batch, with its own KV for its output; 128 is OpenAI's cap "
        "(default: 128)",
    )
    group.add_argument(
        "--max-request-bytes",
        type=int,
        default=32 << 20,
        help="largest request body in bytes; a larger one is a 413, refused from its "
        "Content-Length or as soon as a chunked body passes the limit (default: 33554432, "
        "32 MiB: about 8M tokens of prompt text)",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds the requests in flight may finish after SIGTERM/SIGINT (new ones get "
        "503); the rest are then aborted ('server shutting down') and the server exits 0. A "
        "second signal exits at once with code 1 (default: 30)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weft", description="weft: structured-generation runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve SGLang's native API and the OpenAI API over HTTP",
        description="Serve a model over HTTP: SGLang's native /generate API and the OpenAI API "
        "(/v1/completions, /v1/chat/completions). Defaults to the packaged SmolLM2 on "
        "127.0.0.1:30000.",
    )
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=30000, help="TCP port (default: 30000)")
    serve.add_argument(
        "--api-key",
        default=os.environ.get("WEFT_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' (default: $WEFT_API_KEY if set, which keeps "
        "the key out of the process list; the key is never logged or printed)",
    )
    serve.add_argument(
        "--served-model-name", default=None, help="the model id clients use (default: from --model)"
    )
    serve.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file (default: the model's own)",
    )
    serve.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=list(TOOL_CALL_PARSERS),
        help="how the model writes tool calls: hermes / qwen25 (<tool_call> JSON blocks), "
        "qwen3_coder (<tool_call><function=...> XML), mistral ([TOOL_CALLS]), llama3 (a JSON call "
        "as the message), pythonic (a Python list of calls as the message: Llama 3.2 / 4), "
        "deepseekv3 / deepseekv31 (<｜tool▁calls▁begin｜>); the format that strict functions "
        "under tool_choice auto are constrained to, where its arguments are JSON (default auto: "
        "the chat template's)",
    )
    serve.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="native /generate streams text deltas instead of the text so far",
    )
    serve.add_argument(
        "--enable-cache-report",
        action="store_true",
        help="OpenAI usage reports prompt_tokens_details.cached_tokens (the prompt tokens "
        "served from the prefix cache), as SGLang's flag does",
    )
    _add_limit_options(serve)
    _add_engine_options(serve)
    gen = sub.add_parser("generate", help="generate text for one prompt with the offline engine")
    gen.add_argument("prompt")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="print the whole result as JSON")
    _add_engine_options(gen)
    args = parser.parse_args(argv)
    try:
        return cmd_serve(args) if args.command == "serve" else cmd_generate(args)
    except ValueError as exc:
        print(f"weft: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
