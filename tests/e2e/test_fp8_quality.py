"""FP8 on the packaged SmolLM2 (CPU): the engine with quantization='fp8' (weights quantized per
channel at load, activations per token) stays close to full precision, and the quality bound of
the README holds on a CPU-sized slice: mean next-token KL from bf16 under 0.08 nats."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import weft
from weft.runtime.loader import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import quality  # noqa: E402

TEXTS = [
    "The quick brown fox jumps over the lazy dog. In the beginning of the story, the old man "
    "walked to the market to buy bread and milk for his family, and on the way home he met a "
    "friend who told him about the storm that was coming from the sea.",
    "Write a Python function that reads a CSV file, groups the rows by the value of the first "
    "column and returns a dictionary that maps each key to the sum of the second column. Explain "
    "how you would test it.",
]


def run(model: Path, **kwargs: Any) -> tuple[list[float], list[int]]:
    with weft.Engine(str(model), kv_cache_bytes=64 << 20, **kwargs) as eng:
        out = eng.generate(TEXTS[0], {"max_new_tokens": 12, "temperature": 0},
                           return_logprob=True, logprob_start_len=0)  # fmt: skip
    assert isinstance(out, dict)
    return [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]], out["output_ids"]


def test_fp8_engine_stays_close_to_full_precision(default_model_dir: Path) -> None:
    full_lp, full_ids = run(default_model_dir)
    fp8_lp, fp8_ids = run(default_model_dir, quantization="fp8")
    diffs = [abs(a - b) for a, b in zip(full_lp, fp8_lp, strict=True)]
    mean = sum(diffs) / len(diffs)
    assert 0 < mean < 0.3, mean  # really quantized, and close (measured: 0.10)
    assert fp8_ids[:4] == full_ids[:4]


def test_fp8_kl_bound_on_smollm2(default_model_dir: Path) -> None:
    """The README's bound on a CPU slice: two texts read by bf16 and by FP8 W8A8 (the quality
    benchmark's fast dequantized path, first checked against the quant method's own)."""
    tok = load_tokenizer(default_model_dir)
    seqs = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    max_len = max(map(len, seqs)) + 1
    ref = quality.load_model(default_model_dir, torch.bfloat16, False, max_len)
    fp8 = quality.load_model(default_model_dir, torch.bfloat16, True, max_len)
    ref_lp = quality.Runner(ref, 2, max_len, torch.bfloat16).step(seqs, [0, 0])
    fp8_lp = quality.Runner(fp8, 2, max_len, torch.bfloat16).step(seqs, [0, 0])
    score = quality.Score()
    for r, f in zip(ref_lp, fp8_lp, strict=True):
        score.add_kl(r, f)
    mean = score.summary()["mean_kl"]
    print(f"SmolLM2 FP8 vs bf16: mean KL {mean:.4f} over {score.positions} positions")
    assert 0 < mean < 0.08, mean  # measured 0.043 (README: FP8 quality)


def test_dequantized_fast_path_equals_the_quant_method(default_model_dir: Path) -> None:
    """benchmarks/quality.py's DequantizedFp8 gives the product Fp8Method's torch-path logits."""
    from weft.runtime.models.quant import quantized_layers

    slow = quality.load_model(default_model_dir, torch.bfloat16, True, 64)
    fast = quality.load_model(default_model_dir, torch.bfloat16, True, 64)
    # load_model swaps in the fast path: give `slow` the product method (and its weights) back
    for (_, layer, method), (_, fast_layer, _) in zip(
        quantized_layers(slow), quantized_layers(fast), strict=True
    ):
        assert isinstance(method, quality.DequantizedFp8)
        layer.weight = torch.nn.Parameter(method.weight.to(torch.float8_e4m3fn),
                                          requires_grad=False)  # fmt: skip
        layer.quant = quality.Fp8Method(method.scheme)
        assert fast_layer.quant is not layer.quant
    ids = [load_tokenizer(default_model_dir)(TEXTS[1])["input_ids"][:40]]
    a = quality.Runner(slow, 1, 64, torch.bfloat16).step(ids, [0])[0]
    b = quality.Runner(fast, 1, 64, torch.bfloat16).step(ids, [0])[0]
    kl = (a.exp() * (a - b)).sum(-1)
    assert kl.abs().max().item() < 1e-4, kl.abs().max().item()
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.skipif(not quality.SHAREGPT.is_file(), reason="no sharegpt.jsonl fetched")
def test_sharegpt_prompts_are_read_in_order(default_model_dir: Path) -> None:
    tok = load_tokenizer(default_model_dir)
    prompts = quality.sharegpt_prompts(quality.SHAREGPT, tok, 3, 64)
    assert len(prompts) == 3 and all(32 <= len(p) <= 64 for p in prompts)
