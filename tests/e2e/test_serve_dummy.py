"""`weft serve --load-format dummy` on a config.json-only folder (as benchmarks/configs has): with the
synthetic tokenizer every process shares, and with --skip-tokenizer-init (token ids in and out,
what needs text refused with a 400 naming the option) through the real HTTP server."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import ServerProcess

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 600,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}  # fmt: skip
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def config_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("config-only")
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return folder


def serve(folder: Path, tmp: Path, *args: str) -> Iterator[ServerProcess]:
    cache = str(tmp / "cache")
    proc = ServerProcess(
        ["--model", str(folder), "--load-format", "dummy", "--cache-dir", cache, *args],
        tmp / "serve.log",
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()
    assert os.listdir(folder) == ["config.json"]  # nothing written into the model folder


@pytest.fixture(scope="module")
def synthetic(config_only: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("synthetic")
    for proc in serve(config_only, tmp):
        yield proc.url
    assert (
        "tokenizer: a synthetic byte-level tokenizer of 600 ids" in (tmp / "serve.log").read_text()
    )


@pytest.fixture(scope="module")
def ids_only(config_only: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    for proc in serve(config_only, tmp_path_factory.mktemp("ids-only"), "--skip-tokenizer-init"):
        yield proc.url


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def generate(url: str, **body: Any) -> Any:
    r = post(url, "/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def completion(prompt: Any, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True, **extra}


def sse(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    return events


##### The synthetic tokenizer #####


def test_the_server_reports_the_synthetic_tokenizer(synthetic: str, config_only: Path) -> None:
    info = httpx.get(f"{synthetic}/server_info").json()
    source = info["tokenizer_source"]
    assert source["kind"] == "synthetic" and "600 ids" in source["description"]
    assert "/synthetic-tokenizers/" in source["path"] and str(config_only) not in source["path"]
    assert httpx.get(f"{synthetic}/model_info").json()["tokenizer_path"] == source["path"]
    tokens = post(synthetic, "/tokenize", {"prompt": "Grüße, {1}"}).json()["tokens"]
    assert len(tokens) == len("Grüße, {1}".encode())  # bytes, no merges
    assert post(synthetic, "/detokenize", {"tokens": tokens}).json()["text"] == "Grüße, {1}"


def test_text_stop_strings_and_grammars_run_on_it(synthetic: str) -> None:
    """The scheduler (stop check, grammar) and the detokenizer decode with the same tokenizer:
    a stop string cut from a greedy output stops the same output there."""
    params = {**GREEDY, "max_new_tokens": 48, "skip_special_tokens": False}
    full = generate(synthetic, text="The sea is", sampling_params=params)
    assert full["meta_info"]["prompt_tokens"] == len(b"The sea is")
    word = re.search(r"[a-z]{3,}", full["text"])
    assert word is not None, full["text"]
    cut = generate(synthetic, text="The sea is", sampling_params={**params, "stop": word[0]})
    assert cut["text"] == full["text"][: full["text"].index(word[0])]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": word[0]}
    pick = generate(synthetic, text="Yes or no?", sampling_params={"regex": "(yes|no)"})
    assert pick["text"] in ("yes", "no") and pick["meta_info"]["finish_reason"]["type"] == "stop"


##### skip_tokenizer_init #####


def test_token_ids_in_token_ids_out(ids_only: str) -> None:
    info = httpx.get(f"{ids_only}/server_info").json()
    assert info["skip_tokenizer_init"] is True and info["tokenizer_source"]["kind"] == "none"
    assert httpx.get(f"{ids_only}/model_info").json()["tokenizer_path"] is None
    out = generate(ids_only, input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 6})
    assert set(out) == {"output_ids", "meta_info"} and len(out["output_ids"]) == 6
    assert out["meta_info"]["prompt_tokens"] == 3 and out["meta_info"]["completion_tokens"] == 6
    ids = out["output_ids"]
    stop_at = ids.index(ids[3])  # the first place that id appears
    early = generate(
        ids_only,
        input_ids=[5, 6, 7],
        sampling_params={
            **GREEDY,
            "ignore_eos": False,
            "max_new_tokens": 6,
            "stop_token_ids": [ids[3]],
        },
    )
    assert early["output_ids"] == ids[: stop_at + 1]  # the stop id is kept, as SGLang keeps it
    assert early["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[3]}


def test_logprobs_batches_and_n_come_as_ids(ids_only: str) -> None:
    out = generate(
        ids_only,
        input_ids=[[5, 6, 7], [8, 9]],
        sampling_params={"max_new_tokens": 3, "n": 2, "min_new_tokens": 2},
        return_logprob=True,
        top_logprobs_num=2,
        token_ids_logprob=[4],
    )
    assert len(out) == 4 and all("text" not in o for o in out)
    for o in out:
        rows = o["meta_info"]["output_token_logprobs"]
        assert [r[1] for r in rows] == o["output_ids"] and all(r[2] is None for r in rows)
        assert all(len(top) == 2 for top in o["meta_info"]["output_top_logprobs"])
        assert all(row[0][1] == 4 for row in o["meta_info"]["output_token_ids_logprobs"])


def test_streams_carry_ids(ids_only: str) -> None:
    body = {"input_ids": [5, 6, 7], "sampling_params": {**GREEDY, "max_new_tokens": 5}}
    whole = generate(ids_only, **body)["output_ids"]
    events = sse(ids_only, "/generate", {**body, "stream": True})
    assert events and all("text" not in e for e in events)
    assert events[-1]["output_ids"] == whole  # cumulative, as SGLang streams
    chunks = sse(ids_only, "/v1/completions", completion([5, 6, 7], stream=True))
    assert [t for c in chunks for t in c["choices"][0].get("output_ids", [])] == whole
    assert all(c["choices"][0]["text"] == "" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_completions_take_token_id_prompts(ids_only: str) -> None:
    r = post(ids_only, "/v1/completions", completion([[5, 6, 7], [8]]))
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["text"] for c in choices] == ["", ""]
    assert [len(c["output_ids"]) for c in choices] == [5, 5]
    assert r.json()["usage"]["prompt_tokens"] == 4


REFUSALS = [
    ("/generate", {"text": "Hi"}, "a text prompt"),
    ("/generate", {"input_ids": [5], "sampling_params": {"stop": "x"}}, "stop strings"),
    ("/generate", {"input_ids": [5], "sampling_params": {"json_schema": "{}"}}, "json_schema"),
    ("/generate", {"input_ids": [5], "sampling_params": {"ebnf": 'root ::= "a"'}}, "ebnf"),
    ("/generate", {"input_ids": [5], "return_logprob": True, "return_text_in_logprobs": True},
     "return_text_in_logprobs"),
    ("/v1/completions", {"prompt": "Hi"}, "a text prompt"),
    ("/v1/completions", completion([5], echo=True), "echo"),
    ("/v1/completions", completion([5], logprobs=1), "logprobs"),
    ("/v1/completions", completion([5], regex="a+"), "regex"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]},
     "/v1/chat/completions"),
    ("/tokenize", {"prompt": "Hi"}, "/tokenize"),
    ("/detokenize", {"tokens": [5]}, "/detokenize"),
    ("/apply_chat_template", {"messages": [{"role": "user", "content": "Hi"}]},
     "/apply_chat_template"),
]  # fmt: skip


@pytest.mark.parametrize("path, body, what", REFUSALS, ids=[f"{p} {w}" for p, _, w in REFUSALS])
def test_what_needs_text_is_a_400_naming_skip_tokenizer_init(
    ids_only: str, path: str, body: dict[str, Any], what: str
) -> None:
    r = post(ids_only, path, body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert what in message and "skip_tokenizer_init" in message, message
    stream = post(ids_only, path, {**body, "stream": True}) if "/generate" in path else None
    assert stream is None or stream.status_code == 400
    assert httpx.get(f"{ids_only}/health").status_code == 200  # nothing took a process down


def test_the_engine_serves_ids_offline_too(config_only: Path, tmp_path: Path) -> None:
    import weft

    with weft.Engine(
        str(config_only), load_format="dummy", skip_tokenizer_init=True, cache_dir=str(tmp_path)
    ) as engine:
        assert engine.tokenizer is None
        assert engine.server_info["tokenizer_source"]["kind"] == "none"
        out = engine.generate(input_ids=[5, 6], sampling_params={**GREEDY, "max_new_tokens": 3})
        assert isinstance(out, dict) and set(out) == {"output_ids", "meta_info"}
        with pytest.raises(ValueError, match="a text prompt needs a tokenizer"):
            engine.generate("Hi")
        again = engine.generate(input_ids=[5], sampling_params={"max_new_tokens": 2})
        assert isinstance(again, dict) and len(again["output_ids"]) == 2  # still serving
