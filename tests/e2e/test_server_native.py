"""SGLang's native HTTP API on a real `weft serve` (packaged SmolLM2): /generate single, batch, n,
streams, logprob invariants, cache reuse, concurrency, disconnects, bad input, info routes, metrics."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import httpx
import pytest

GREEDY = {"temperature": 0, "max_new_tokens": 8}


def post(server: Any, path: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120, **kw)


def events(resp: httpx.Response) -> list[Any]:
    """The JSON payloads of an SSE body, and the literal [DONE] at the end."""
    out: list[Any] = []
    for line in resp.text.split("\n\n"):
        if not line.strip():
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_generate_single_batch_and_n(server: Any) -> None:
    one = post(server, "/generate", {"text": "The capital of France is", "sampling_params": GREEDY})
    assert one.status_code == 200
    body = one.json()
    assert set(body) == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    assert meta["completion_tokens"] == len(body["output_ids"]) == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    batch = post(
        server,
        "/generate",
        {"text": ["a b c", "The capital of France is"], "sampling_params": GREEDY},
    ).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[1]["output_ids"] == body["output_ids"]  # batching does not change greedy output
    ids = post(server, "/tokenize", {"prompt": "The capital of France is"}).json()["tokens"]
    by_ids = post(server, "/generate", {"input_ids": ids, "sampling_params": GREEDY}).json()
    assert by_ids["output_ids"] == body["output_ids"]
    n = post(
        server, "/generate", {"text": ["x", "y"], "sampling_params": {"n": 2, "max_new_tokens": 3}}
    ).json()
    assert len(n) == 4 and all(o["meta_info"]["completion_tokens"] == 3 for o in n)


def test_stream_is_cumulative_and_ends_with_done(server: Any) -> None:
    full = post(server, "/generate", {"text": "Once upon a time", "sampling_params": GREEDY}).json()
    resp = post(
        server, "/generate", {"text": "Once upon a time", "sampling_params": GREEDY, "stream": True}
    )
    assert resp.headers["content-type"].startswith("text/event-stream")
    evs = events(resp)
    assert evs[-1] == "[DONE]" and len(evs) > 2
    texts = [e["text"] for e in evs[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))  # cumulative
    assert evs[-2]["text"] == full["text"] and evs[-2]["output_ids"] == full["output_ids"]
    assert evs[-2]["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    multi = events(
        post(server, "/generate", {"text": ["a", "b"], "sampling_params": GREEDY, "stream": True})
    )
    assert {e["index"] for e in multi[:-1]} == {0, 1}


def test_logprob_invariants_and_cached_tokens(server: Any) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    body = {
        "text": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": 4},
        "return_logprob": True,
        "logprob_start_len": 2,
        "top_logprobs_num": 3,
        "return_text_in_logprobs": True,
    }
    first = post(server, "/generate", body).json()
    meta = first["meta_info"]
    assert meta["prompt_tokens"] == 2 + len(meta["input_token_logprobs"])
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == 4
    for (lp, tok, text), top in zip(
        meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True
    ):
        assert top[0][1] == tok and lp == pytest.approx(top[0][0])
        assert isinstance(text, str)
    again = post(server, "/generate", {**body, "return_logprob": False}).json()
    assert again["meta_info"]["cached_tokens"] == again["meta_info"]["prompt_tokens"] - 1
    assert again["output_ids"] == first["output_ids"]


def test_32_concurrent_streams_complete(server: Any) -> None:
    prompts = [f"Story {i}: In a land far away" for i in range(32)]
    params = {"temperature": 0, "max_new_tokens": 6}
    expected = post(server, "/generate", {"text": prompts, "sampling_params": params}).json()

    async def one(client: httpx.AsyncClient, prompt: str) -> dict[str, Any]:
        last: dict[str, Any] = {}
        async with client.stream(
            "POST", "/generate", json={"text": prompt, "sampling_params": params, "stream": True}
        ) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    last = json.loads(line[6:])
        return last

    async def main() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    got = asyncio.run(main())
    for g, e in zip(got, expected, strict=True):
        assert g["output_ids"] == e["output_ids"] and g["text"] == e["text"]
        assert g["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


def scheduler_state(server: Any) -> dict[str, Any]:
    return httpx.get(f"{server.url}/server_info", timeout=30).json()["internal_states"][0]


def wait_idle(server: Any, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        state = scheduler_state(server)
        if state["num_running"] == 0 and state["num_waiting"] == 0:
            return state
        assert time.monotonic() < deadline, state
        time.sleep(0.2)


def test_disconnect_mid_stream_frees_the_request(server: Any) -> None:
    body = {
        "text": "Count forever:",
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
        "stream": True,
    }
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/generate", json=body) as resp:
            lines = resp.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got += 1
                if got == 2:
                    break
            assert scheduler_state(server)["num_running"] == 1
    state = wait_idle(server)
    assert state["protected_tokens"] == 0
    assert state["free_tokens"] + state["evictable_tokens"] == state["max_total_tokens"]
    ok = post(server, "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200


def test_abort_request_route(server: Any) -> None:
    async def main() -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            req = asyncio.ensure_future(
                client.post(
                    "/generate",
                    json={
                        "text": "Go",
                        "rid": "kill-me",
                        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
                    },
                )
            )
            await asyncio.sleep(1.5)
            assert (await client.post("/abort_request", json={"rid": "kill-me"})).status_code == 200
            return (await req).json()

    out = asyncio.run(main())
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    wait_idle(server)


BAD_NATIVE = [
    ("/generate", b"{not json", 400, "malformed JSON"),
    ("/generate", [], 400, "JSON object"),
    ("/generate", {}, 400, "text, input_ids"),
    ("/generate", {"text": ""}, 400, "empty"),
    ("/generate", {"text": 5}, 400, "text must be a string"),
    ("/generate", {"input_ids": []}, 400, "input_ids"),
    ("/generate", {"input_ids": [1, "a"]}, 400, "input_ids"),
    ("/generate", {"input_ids": [1, 10**9]}, 400, "vocab"),
    ("/generate", {"input_ids": [1, -3]}, 400, "negative"),
    ("/generate", {"text": "hi", "input_ids": [1]}, 400, "exactly one"),
    ("/generate", {"text": "hi", "bogus": 1}, 400, "bogus"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -0.5}}, 400, "temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": "hot"}}, 400, "temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"top_p": 1.5}}, 400, "top_p"),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": 0}}, 400, "top_k"),
    ("/generate", {"text": "hi", "sampling_params": {"min_p": -1}}, 400, "min_p"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -2}}, 400, "max_new_tokens"),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 2}},
        400,
        "min_new_tokens",
    ),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"repetition_penalty": 3}},
        400,
        "repetition_penalty",
    ),
    ("/generate", {"text": "hi", "sampling_params": {"stop_regex": "("}}, 400, "stop_regex"),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"logit_bias": {"99999999": 1}}},
        400,
        "vocabulary",
    ),
    ("/generate", {"text": "hi", "sampling_params": {"n": 0}}, 400, "n must"),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"regex": "a", "json_schema": "{}"}},
        400,
        "Only one of",
    ),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}]}, 400, "entries"),
    ("/generate", {"text": ["a", "b"], "rid": ["r", "r"]}, 400, "unique"),
    ("/generate", {"text": "hi " * 9000}, 400, "context length"),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 9000}},
        400,
        "context length",
    ),
    ("/generate", {"text": "hi", "return_logprob": "yes"}, 400, "return_logprob"),
    (
        "/generate",
        {"text": "hi", "token_ids_logprob": [10**9], "return_logprob": True},
        400,
        "vocabulary",
    ),
    ("/generate", {"text": "hi", "image_data": "abc"}, 400, "image_data"),
    ("/detokenize", {"tokens": [1, "x"]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, 400, "vocabulary"),
    ("/tokenize", {"prompt": 3}, 400, "prompt"),
    ("/abort_request", {"rid": 3}, 400, "rid"),
]


@pytest.mark.parametrize(("path", "body", "status", "needle"), BAD_NATIVE)
def test_bad_native_input(server: Any, path: str, body: Any, status: int, needle: str) -> None:
    if isinstance(body, bytes):
        resp = httpx.post(f"{server.url}{path}", content=body, timeout=60)
    else:
        resp = post(server, path, body)
    assert resp.status_code == status, resp.text
    message = resp.json()["error"]["message"]
    assert needle.lower() in message.lower(), message
    ok = post(server, "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 1}})
    assert ok.status_code == 200


def test_info_routes(server: Any) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/health_generate", timeout=60).status_code == 200
    info = httpx.get(f"{server.url}/model_info").json()
    assert info == httpx.get(f"{server.url}/get_model_info").json()
    assert info["is_generation"] is True and info["model_type"] == "llama"
    assert set(info) == {
        "model_path",
        "tokenizer_path",
        "is_generation",
        "preferred_sampling_params",
        "weight_version",
        "has_image_understanding",
        "has_audio_understanding",
        "model_type",
        "architectures",
    }
    sinfo = httpx.get(f"{server.url}/server_info").json()
    assert sinfo["max_total_num_tokens"] > 0 and isinstance(sinfo["version"], str)
    assert sinfo["internal_states"][0]["max_total_tokens"] == sinfo["max_total_num_tokens"]
    assert httpx.get(f"{server.url}/get_server_info").status_code == 200
    wait_idle(server)
    flushed = httpx.post(f"{server.url}/flush_cache", timeout=30)
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed")
    toks = post(server, "/tokenize", {"prompt": "Hello world"}).json()
    assert toks["count"] == len(toks["tokens"]) == 2
    assert post(server, "/detokenize", {"tokens": toks["tokens"]}).json()["text"] == "Hello world"


def test_metrics(server: Any) -> None:
    post(server, "/generate", {"text": "metrics", "sampling_params": {"max_new_tokens": 3}})
    params = {"max_new_tokens": 4, "regex": "[a-z]{3}[0-9]"}
    post(server, "/generate", {"text": "a code:", "sampling_params": params})
    text = httpx.get(f"{server.url}/metrics").text
    p99 = re.search(r'weft_grammar_mask_fill_microseconds\{quantile="0.99"\} (\S+)', text)
    assert p99 is not None and float(p99.group(1)) > 0, "a constrained request's fills are timed"
    for name in (
        'weft_requests_total{finish_reason="length"}',
        "weft_time_to_first_token_seconds_bucket",
        "weft_time_per_output_token_seconds_count",
        "weft_inter_token_latency_seconds_count",
        "weft_e2e_request_latency_seconds_sum",
        "weft_num_running_reqs",
        "weft_num_waiting_reqs",
        "weft_kv_pool_usage",
        "weft_retracted_requests_total",
        "weft_new_token_ratio",
        "weft_prefix_cache_hit_rate",
        'weft_grammar_mask_fill_microseconds{quantile="0.99"}',
        "weft_prompt_tokens_total",
        "weft_generation_tokens_total",
    ):
        assert name in text, name


def test_apply_chat_template_matches_the_tokenizer(server: Any, default_model_dir: Any) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    messages = [{"role": "user", "content": "Hi there 🙂"}]
    got = post(server, "/apply_chat_template", {"messages": messages}).json()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert got["text"] == text
    assert got["input_ids"] == tok.encode(text, add_special_tokens=False)
    bad = post(server, "/apply_chat_template", {"messages": []})
    assert bad.status_code == 400 and "empty" in bad.json()["error"]["message"]


def test_disconnect_while_waiting_for_a_non_stream_reply_aborts(server: Any) -> None:
    body = {
        "text": "Count forever:",
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
    }
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/generate", json=body, timeout=3)
    state = wait_idle(server, timeout=30)
    assert state["protected_tokens"] == 0
