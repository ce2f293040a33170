"""Constrained decoding on CUDA: masks prefetched into pinned slot rows, copied per run of used slots
and applied by the Triton kernel (or torch ops, unfused); constrained requests spread among
unconstrained ones in a CUDA-graph batch with overlap scheduling. Skipped without CUDA."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

import weft

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
REGEX = r"(yes|no), [0-9]{1,3}(\.[0-9])?"


@pytest.mark.parametrize("unfused", [False, True])
def test_constrained_requests_among_unconstrained_ones_stay_valid(
    byte_llama: Path, unfused: bool
) -> None:
    """40 requests to a random model with a byte-level tokenizer; those at a few far-apart
    positions (hence request slots) are constrained, at temperature 0 and 1: every JSON output
    validates and every regex output fullmatches."""
    kinds = {0: "json", 3: "regex", 17: "json", 18: "regex", 38: "json"}
    prompts, params = [], []
    for i in range(40):
        p: dict[str, object] = {
            "max_new_tokens": 192,
            "temperature": (i % 2) * 1.0,
            "sampling_seed": i,
        }
        if kinds.get(i) == "json":
            p["json_schema"] = json.dumps(SCHEMA)
        elif kinds.get(i) == "regex":
            p["regex"] = REGEX
        else:
            p["ignore_eos"] = True
        prompts.append(f"Request {i}: answer briefly.")
        params.append(p)
    with weft.Engine(
        str(byte_llama), device="cuda", dtype="bfloat16", disable_fused_kernels=unfused
    ) as eng:
        outs = eng.generate(prompts, params)
        fills = eng.get_state()["mask_fill"]
    assert isinstance(outs, list)
    for i, kind in kinds.items():
        out = outs[i]
        assert out["meta_info"]["finish_reason"]["type"] == "stop", (i, out["text"])
        if kind == "json":
            jsonschema.validate(json.loads(out["text"]), SCHEMA)
        else:
            assert re.fullmatch(REGEX, out["text"]), (i, out["text"])
    assert fills["count"] > 0 and fills["apply_p50_us"] > 0


def test_the_fused_apply_is_warmed_up_for_every_variant_a_step_takes() -> None:
    """After GrammarMasks.warm_up, applying masks as a step does (1, 2, 3 or 32 masked rows,
    mask rows of the device copy) compiles no new variant of the Triton kernel."""
    knobs = getattr(pytest.importorskip("triton"), "knobs", None)
    if knobs is None or not hasattr(knobs.runtime, "jit_cache_hook"):
        pytest.skip("this triton has no jit_cache_hook")

    from weft.runtime.executor.grammar_masks import GrammarMasks
    from weft.runtime.executor.transfer import to_device

    misses: list[str] = []

    def on_miss(**kwargs: object) -> bool:  # a variant not in the in-memory cache: compiled next
        if str(kwargs.get("repr", "")).startswith("_bitmask_kernel"):
            misses.append(str(kwargs["repr"]))
        return False  # go on and compile it

    vocab, dev = 128_256, torch.device("cuda")
    masks = GrammarMasks(64, vocab, dev, fused=True)
    old, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, on_miss
    try:
        masks.warm_up(torch.bfloat16)  # the logits' dtype: the model's
        warmed = len(misses)
        from weft.kernels.bitmask import apply_token_bitmask

        on_device = torch.full((64, (vocab + 31) // 32), -1, dtype=torch.int32, device=dev)
        for n in (1, 2, 3, 32):
            logits = torch.zeros(n + 1, vocab, dtype=torch.bfloat16, device=dev)
            index = to_device(list(range(n)) + list(range(5, 5 + n)), torch.int64, dev)
            apply_token_bitmask(logits, on_device, rows=index[:n], mask_rows=index[n:])
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_cache_hook = old
    assert warmed >= 1 and len(misses) == warmed, misses
