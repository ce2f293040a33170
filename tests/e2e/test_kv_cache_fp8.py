"""kv_cache_dtype="fp8_e4m3" on the packaged model (CPU, torch backend): the same KV memory holds
4x the tokens of the float32 pool, and outputs stay close to the full-precision pool's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import weft

PROMPT = (
    "The quick brown fox jumps over the lazy dog. In the beginning of the story, the old man "
    "walked to the market to buy bread and milk for his family."
)


def run(model: Path, **kwargs: Any) -> tuple[int, list[float], list[int]]:
    """(KV pool tokens, prompt logprobs, greedy output ids)."""
    with weft.Engine(str(model), kv_cache_bytes=64 << 20, **kwargs) as eng:
        tokens = int(eng.get_state()["max_total_tokens"])
        out = eng.generate(
            PROMPT,
            {"max_new_tokens": 16, "temperature": 0},
            return_logprob=True,
            logprob_start_len=0,
        )
    assert isinstance(out, dict)
    prompt_logprobs = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]
    return tokens, prompt_logprobs, out["output_ids"]


def test_fp8_kv_cache_quadruples_the_pool_and_stays_close(default_model_dir: Path) -> None:
    full_tokens, full_lp, full_ids = run(default_model_dir)
    fp8_tokens, fp8_lp, fp8_ids = run(default_model_dir, kv_cache_dtype="fp8_e4m3")
    assert fp8_tokens == pytest.approx(4 * full_tokens, abs=4)  # 1 byte per element, not 4
    diffs = [abs(a - b) for a, b in zip(full_lp, fp8_lp, strict=True)]
    mean = sum(diffs) / len(diffs)
    assert 0 < mean < 0.3, mean  # really quantized, and close (measured: 0.13 mean, 0.57 max)
    assert max(diffs) < 1.5, max(diffs)
    assert fp8_ids[:8] == full_ids[:8]  # greedy agrees (measured: all 16 tokens)


def test_kv_cache_dtype_is_validated() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto' or 'fp8_e4m3'"):
        weft.EngineConfig(kv_cache_dtype="fp8")  # type: ignore[arg-type]
    # every backend reads an fp8 pool (flashinfer's: tests/gpu/test_fp8_cuda.py)
    config = weft.EngineConfig(kv_cache_dtype="fp8_e4m3", attention_backend="flashinfer")
    assert config.kv_cache_dtype == "fp8_e4m3"
