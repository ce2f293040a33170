"""Speculative decoding (n-gram drafts) on the packaged SmolLM2: greedy outputs equal plain
decoding token for token on prompts whose answer repeats them, with drafts accepted; meta_info
reports the verify steps and accepted length; `weft serve --speculative-algorithm ngram` answers
the native API, the openai client (streaming several tokens per chunk) and /metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from support import ServerProcess

import weft

PROMPTS = [
    "<|im_start|>user\nRepeat after me: the quick brown fox jumps over the lazy dog, the quick "
    "brown fox jumps over the lazy dog.<|im_end|>\n<|im_start|>assistant\n",
    "Count: one two three four five six seven eight nine ten, one two three four five six",
]
PARAMS = {"temperature": 0, "max_new_tokens": 40}


@pytest.fixture(scope="module")
def plain(default_model_dir: Path) -> list[dict[str, Any]]:
    with weft.Engine(str(default_model_dir)) as eng:
        out = eng.generate(PROMPTS, PARAMS)
    assert isinstance(out, list)
    return out


@pytest.fixture(scope="module")
def spec_server(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    log = tmp_path_factory.mktemp("spec-server") / "serve.log"
    args = ["--model", str(default_model_dir), "--served-model-name", "smollm2",
            "--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "6"]  # fmt: skip
    proc = ServerProcess(args, log)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def test_ngram_greedy_equals_plain_on_the_real_model(
    spec_server: Any, plain: list[dict[str, Any]]
) -> None:
    r = httpx.post(f"{spec_server.url}/generate",
                   json={"text": PROMPTS, "sampling_params": PARAMS}, timeout=300)  # fmt: skip
    assert r.status_code == 200, r.text
    spec = r.json()
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert [o["text"] for o in spec] == [o["text"] for o in plain]
    meta = spec[1]["meta_info"]  # the count goes on repeating itself: long drafts accepted
    assert meta["spec_verify_ct"] > 0
    assert meta["spec_accept_length"] > 2.5, meta
    assert meta["spec_accepted_tokens"] <= meta["spec_draft_tokens"]
    assert "spec_verify_ct" not in plain[1]["meta_info"]


def test_openai_stream_and_metrics(spec_server: Any, plain: list[dict[str, Any]]) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{spec_server.url}/v1", api_key="none")
    stream = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=40,
                                       temperature=0, stream=True)  # fmt: skip
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text == plain[0]["text"]
    metrics = httpx.get(f"{spec_server.url}/metrics").text
    rate = [ln for ln in metrics.splitlines() if ln.startswith("weft_spec_accept_rate ")]
    length = [ln for ln in metrics.splitlines() if ln.startswith("weft_spec_accept_length ")]
    assert rate and 0.0 < float(rate[0].split()[1]) <= 1.0, rate
    assert length and float(length[0].split()[1]) > 1.0, length


def test_cli_refuses_a_bad_speculative_combination(spec_server: Any) -> None:
    from weft.runtime.config import EngineConfig

    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        EngineConfig(speculative_algorithm="draft")
    with pytest.raises(ValueError, match="tp_size"):
        EngineConfig(speculative_algorithm="ngram", tp_size=2)
