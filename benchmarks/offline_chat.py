"""The chat mode of benchmarks/offline.py: the packaged model on CPU against HF, concurrency 1 and N."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
import transformers

import weft

TOPICS = [
    "the history of the printing press",
    "how bees communicate",
    "why the sky is blue",
    "the rules of chess",
    "a recipe for bread",
    "the water cycle",
    "how a compiler works",
    "the life of a star",
]


def make_prompts(tokenizer: Any, n: int) -> list[str]:
    prompts = []
    for i in range(n):
        msg = [{"role": "user", "content": f"Explain {TOPICS[i % len(TOPICS)]} (part {i})."}]
        prompts.append(
            tokenizer.apply_chat_template(msg, tokenize=False, add_generation_prompt=True)
        )
    return prompts


def bench_weft(engine: Any, prompts: list[str], new_tokens: int, concurrency: int) -> float:
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    engine.generate(prompts[0], {**params, "max_new_tokens": 4})  # warm-up
    engine.flush_cache()
    start = time.perf_counter()
    done = 0
    for i in range(0, len(prompts), concurrency):
        outs = engine.generate(prompts[i : i + concurrency], params)
        done += sum(o["meta_info"]["completion_tokens"] for o in outs)
    elapsed = time.perf_counter() - start
    assert done == len(prompts) * new_tokens
    return done / elapsed


def bench_hf(
    model: Any, tokenizer: Any, prompts: list[str], new_tokens: int, concurrency: int
) -> float:
    tokenizer.padding_side = "left"
    device = next(model.parameters()).device
    done = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        batch = tokenizer(prompts[i : i + concurrency], return_tensors="pt", padding=True).to(
            device
        )
        with torch.no_grad():
            out = model.generate(
                **batch,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id or 0,
            )
        done += (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    return done / (time.perf_counter() - start)


def run_chat(args: argparse.Namespace) -> None:
    """weft.Engine, then HF on the model it loaded, at each concurrency; prints JSON."""
    engine = weft.Engine(args.model)
    try:
        tokenizer = engine.tokenizer
        prompts = make_prompts(tokenizer, args.num_prompts)
        results: dict[str, Any] = {"torch_threads": torch.get_num_threads()}
        for c in args.concurrency:
            results[f"weft_c{c}"] = bench_weft(engine, prompts, args.new_tokens, c)
        model_path = engine.model_path
    finally:
        engine.shutdown()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hf: Any = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    hf = hf.to(device).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(model_path)
    for c in args.concurrency:
        bench_hf(hf, hf_tok, prompts[:c], 4, c)  # warm-up
        results[f"hf_c{c}"] = bench_hf(hf, hf_tok, prompts, args.new_tokens, c)
        results[f"ratio_c{c}"] = results[f"weft_c{c}"] / results[f"hf_c{c}"]
    print(
        json.dumps(
            {k: round(v, 2) if isinstance(v, float) else v for k, v in results.items()}, indent=2
        )
    )
