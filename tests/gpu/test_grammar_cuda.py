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
