"""Engine on the packaged SmolLM2 (fp32, CPU): token-for-token equality with HF, batching, prefix reuse,
memory pressure, chunked prefill, logprobs and bad input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import weft

GREEDY = {"temperature": 0, "max_new_tokens": 32}

PLAIN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 5, 8, 13,",
    "Translate to French: 'Good morning, my friend.' ->",
    "Les fleurs du jardin sont",
    "Q: What is the boiling point of water in Celsius?\nA:",
]
CHAT = [{"role": "user", "content": "Write a haiku about the moon. Use emoji 🌙."}]


def chat_prompt(tokenizer: Any) -> str:
    return tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module")
def hf_model(default_model_dir: Path) -> Any:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        default_model_dir, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def engine(default_model_dir: Path, weft_cache: Path) -> Any:
    with weft.Engine(seed=0, cache_dir=str(weft_cache)) as eng:
        yield eng


@pytest.fixture(scope="module")
def prompts(engine: Any) -> list[str]:
    return [*PLAIN_PROMPTS, chat_prompt(engine.tokenizer)]


@pytest.fixture(scope="module")
def reference(engine: Any, prompts: list[str]) -> list[list[int]]:
    """Greedy outputs of the default engine, one request at a time."""
    outs = []
    for p in prompts:
        out = engine.generate(p, GREEDY)
        outs.append(out["output_ids"])
    return outs


def hf_greedy(hf_model: Any, tokenizer: Any, prompt: str, n: int) -> list[int]:
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=2,
        )
    return out[0, ids.shape[1] :].tolist()


def test_greedy_equals_hf_token_for_token(
    engine: Any, hf_model: Any, prompts: list[str], reference: list[list[int]]
) -> None:
    batched = engine.generate(prompts, GREEDY)
    assert len(prompts) >= 8
    for prompt, out, single in zip(prompts, batched, reference, strict=True):
        expected = hf_greedy(hf_model, engine.tokenizer, prompt, 32)
        assert out["output_ids"] == expected, prompt
        assert single == expected, prompt
        assert out["text"] == engine.tokenizer.decode(expected, skip_special_tokens=True)


def test_batch_of_16_equals_one_at_a_time(engine: Any) -> None:
    prompts = [
        f"Item {i}: the {w} is" for i, w in enumerate("sky sea tree cat dog sun moon car".split())
    ]
    prompts += [f"Fact {i}: water" for i in range(8)]
    alone = [engine.generate(p, GREEDY)["output_ids"] for p in prompts]
    together = [o["output_ids"] for o in engine.generate(prompts, GREEDY)]
    assert together == alone


def test_prefix_reuse_counts_and_skips_cached_tokens(engine: Any) -> None:
    assert engine.flush_cache()
    shared = "You are a careful assistant. " * 20
    first = engine.generate(
        shared + "Tell me about Paris.", {"temperature": 0, "max_new_tokens": 4}
    )
    assert first["meta_info"]["cached_tokens"] == 0
    shared_len = len(engine.tokenizer.encode(shared))
    second_prompt = shared + "Now describe Rome briefly."
    before = engine.get_state()["num_forward_tokens"]
    second = engine.generate(second_prompt, {"temperature": 0, "max_new_tokens": 4})
    ran = engine.get_state()["num_forward_tokens"] - before
    meta = second["meta_info"]
    common = _common_prefix(
        engine.tokenizer.encode(shared + "Tell me about Paris."),
        engine.tokenizer.encode(second_prompt),
    )
    assert common >= shared_len - 1
    assert meta["cached_tokens"] == common
    assert meta["cached_tokens"] <= meta["prompt_tokens"] - 1
    # only the uncached prompt tokens are prefilled, then one token per further decode step
    assert ran == meta["prompt_tokens"] - meta["cached_tokens"] + (meta["completion_tokens"] - 1)
    # the same prompt again: everything but the last token is cached
    again = engine.generate(second_prompt, {"temperature": 0, "max_new_tokens": 4})
    assert again["meta_info"]["cached_tokens"] == meta["prompt_tokens"] - 1
    assert again["output_ids"] == second["output_ids"]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_memory_pressure_retracts_and_matches(
    engine: Any, prompts: list[str], default_model_dir: Path
) -> None:
    many = [prompts[i % len(prompts)] + f" ({i})" for i in range(20)]
    expected = [o["output_ids"] for o in engine.generate(many, GREEDY)]
    longest = max(len(engine.tokenizer.encode(p)) for p in many) + 32
    with weft.Engine(
        str(default_model_dir), max_total_tokens=2 * longest + 8, page_size=4
    ) as small:
        got = [o["output_ids"] for o in small.generate(many, GREEDY)]
        state = small.get_state()
    assert got == expected
    assert state["retractions"] > 0, "the pool was meant to be too small for 20 requests"
    assert state["num_running"] == 0 and state["num_waiting"] == 0
    assert state["protected_tokens"] == 0
    assert state["free_tokens"] + state["evictable_tokens"] == state["max_total_tokens"]


def test_chunked_prefill_matches_unchunked(
    engine: Any, prompts: list[str], default_model_dir: Path
) -> None:
    long_prompts = [p * 4 for p in prompts[:4]]
    expected = [o["output_ids"] for o in engine.generate(long_prompts, GREEDY)]
    with weft.Engine(
        chunked_prefill_size=16, max_prefill_tokens=24, schedule_policy="lpm"
    ) as chunky:
        got = [o["output_ids"] for o in chunky.generate(long_prompts, GREEDY)]
        assert chunky.get_state()["num_forward_tokens"] > 0
    assert got == expected


def test_logprobs_match_hf(engine: Any, hf_model: Any) -> None:
    prompt = "The quick brown fox jumps over the lazy"
    ids = engine.tokenizer.encode(prompt)
    out = engine.generate(
        prompt,
        {"temperature": 0, "max_new_tokens": 3},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
        token_ids_logprob=[ids[1]],
    )
    meta = out["meta_info"]
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids + out["output_ids"]])).logits[0]
    lp = torch.log_softmax(logits.float(), -1)
    inp = meta["input_token_logprobs"]
    assert inp[0][0] is None and inp[0][1] == ids[0]
    assert len(inp) == len(ids)
    for i in range(1, len(ids)):
        assert inp[i][1] == ids[i]
        assert inp[i][0] == pytest.approx(lp[i - 1, ids[i]].item(), abs=1e-4)
    outs = meta["output_token_logprobs"]
    assert [t for _, t, _ in outs] == out["output_ids"]
    for k, (val, tok, _) in enumerate(outs):
        assert val == pytest.approx(lp[len(ids) - 1 + k, tok].item(), abs=1e-4)
        top = meta["output_top_logprobs"][k]
        assert top[0][1] == tok  # greedy picks the top token
        assert len(top) == 2
    assert len(meta["input_top_logprobs"]) == len(ids)
    assert meta["input_token_ids_logprobs"][1][0][1] == ids[1]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"prompt": ""}, "empty"),
        ({"prompt": "hi " * 9000}, "context length"),
        ({"prompt": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
        ({"prompt": "hi", "sampling_params": {"top_p": 0}}, "top_p"),
        ({"prompt": "hi", "sampling_params": {"top_k": 0}}, "top_k"),
        ({"prompt": "hi", "sampling_params": {"min_p": 2}}, "min_p"),
        ({"prompt": "hi", "sampling_params": {"frequency_penalty": 3}}, "frequency_penalty"),
        ({"prompt": "hi", "sampling_params": {"presence_penalty": -3}}, "presence_penalty"),
        ({"prompt": "hi", "sampling_params": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"prompt": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        (
            {"prompt": "hi", "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 5}},
            "min_new_tokens",
        ),
        ({"prompt": "hi", "sampling_params": {"n": 0}}, "n"),
        ({"prompt": "hi", "sampling_params": {"bogus": 1}}, "bogus"),
        ({"prompt": "hi", "sampling_params": {"logit_bias": {"99999999": 1.0}}}, "vocabulary"),
        ({"prompt": ["a", "b"], "sampling_params": [{}, {}, {}]}, "batch"),
        ({"prompt": ["a", "b"], "rid": ["x"]}, "rid"),
        ({"input_ids": [1, 2, 10**9]}, "vocab"),
        ({}, "text or input_ids"),
        ({"prompt": "hi", "sampling_params": {"max_new_tokens": 9000}}, "context length"),
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(
    engine: Any, kwargs: dict[str, Any], needle: str
) -> None:
    with pytest.raises(ValueError) as err:
        engine.generate(**kwargs)
    assert needle in str(err.value)
    ok = engine.generate("Hello", {"temperature": 0, "max_new_tokens": 2})
    assert ok["meta_info"]["completion_tokens"] == 2
