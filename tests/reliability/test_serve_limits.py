"""`weft serve`'s limits on a tiny model: top logprobs and n capped (400 naming the number and the
cap), the body size (413, by Content-Length and chunked), prompts over the context (400 with both
numbers before any work is queued, on every path), and /health answering while a multi-MB
prompt is tokenized."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from serve_support import start_tiny
from support import ServerProcess

MAX_BYTES = 16_000_000


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("limits") / "serve.log"
    args = ("--max-top-logprobs", "5", "--max-n", "4", "--max-request-bytes", str(MAX_BYTES))
    proc = start_tiny(tiny_model_dir, log, *args, "--enable-cache-report")
    try:
        yield proc
    finally:
        proc.stop()


def post(srv: ServerProcess, path: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=60, **kw)


def error_of(resp: httpx.Response) -> str:
    return str(resp.json()["error"]["message"])


def test_top_logprobs_capped_on_every_api(srv: ServerProcess) -> None:
    native = {"text": "Hi", "return_logprob": True, "logprob_start_len": 0,
              "top_logprobs_num": 49152, "sampling_params": {"max_new_tokens": 1}}  # fmt: skip
    r = post(srv, "/generate", native)
    assert r.status_code == 400, r.text
    assert "top_logprobs_num is 49152" in error_of(r) and "limit of 5" in error_of(r)
    batch = {**native, "text": ["a", "b"], "top_logprobs_num": [1, 6]}
    assert post(srv, "/generate", batch).status_code == 400
    ok = post(srv, "/generate", {**native, "top_logprobs_num": 5}).json()
    assert all(len(row) == 5 for row in ok["meta_info"]["input_top_logprobs"][1:])
    r = post(srv, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "logprobs": 6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
    assert "logprobs is 6" in error_of(r) and "limit of 5" in error_of(r)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "logprobs": True}
    r = post(srv, "/v1/chat/completions", {**chat, "top_logprobs": 6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text
    assert post(srv, "/v1/chat/completions", {**chat, "top_logprobs": 5}).status_code == 200


def test_n_capped_on_every_api(srv: ServerProcess) -> None:
    r = post(srv, "/generate", {"text": "Hi", "sampling_params": {"n": 5, "max_new_tokens": 1}})
    assert r.status_code == 400 and "sampling_params.n is 5" in error_of(r), r.text
    assert "limit of 4" in error_of(r)
    r = post(srv, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "n": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "n": 5}
    assert post(srv, "/v1/chat/completions", chat).status_code == 400
    ok = post(srv, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "n": 4})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


def test_body_over_the_cap_is_413(srv: ServerProcess) -> None:
    big = b'{"text": "' + b"a" * MAX_BYTES + b'"}'
    r = httpx.post(srv.url + "/generate", content=big, timeout=60)
    assert r.status_code == 413 and f"limit of {MAX_BYTES} bytes" in error_of(r), r.text
    assert f"{len(big)} bytes" in error_of(r)

    def chunks() -> Iterator[bytes]:  # no Content-Length: Transfer-Encoding chunked
        yield b'{"prompt": "'
        for _ in range(MAX_BYTES // (1 << 20) + 1):
            yield b"a" * (1 << 20)
        yield b'", "max_tokens": 1}'

    headers = {"Content-Type": "application/json"}
    r = httpx.post(srv.url + "/v1/completions", content=chunks(), headers=headers, timeout=60)
    assert r.status_code == 413, r.text
    err = r.json()["error"]  # OpenAI's shape on /v1
    assert err["code"] == 413 and f"limit of {MAX_BYTES} bytes" in err["message"]
    assert httpx.get(srv.url + "/health").status_code == 200


def test_prompt_over_the_context_is_400_with_both_numbers(srv: ServerProcess) -> None:
    long_ids = list(range(10, 610))  # 600 tokens; the tiny model's context is 512
    cases: list[tuple[str, dict[str, Any]]] = [
        ("/generate", {"input_ids": long_ids}),
        ("/generate", {"text": " hello" * 600}),
        ("/generate", {"input_ids": [[5, 6], long_ids]}),
        ("/generate", {"input_ids": long_ids, "sampling_params": {"n": 2}}),
        ("/v1/completions", {"prompt": long_ids, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": " hi" * 600}]}),
    ]
    for path, body in cases:
        r = post(srv, path, body)
        assert r.status_code == 400, (path, r.text)
        message = error_of(r)
        assert "(512 tokens)" in message and "tokens) is longer" in message, message
    r = post(
        srv, "/generate", {"input_ids": long_ids[:500], "sampling_params": {"max_new_tokens": 20}}
    )
    assert r.status_code == 400 and "500 tokens from the input" in error_of(r), r.text
    assert "20 tokens for the completion" in error_of(r) and "512 tokens" in error_of(r)
    state = httpx.get(srv.url + "/server_info", timeout=10).json()["internal_states"][0]
    assert state["num_running"] == 0 and state["num_waiting"] == 0


def test_health_answers_while_a_huge_batch_is_tokenized(srv: ServerProcess) -> None:
    # 300 prompts of 40,000 characters: each could fit the context from its length (at most 81
    # characters a token), so each is tokenized, for seconds in all, before the first is refused
    text = ("hello world, this is a test of tokenization. " * 900)[:40_000]
    body = {"text": [text] * 300, "sampling_params": {"max_new_tokens": 1}}
    result: dict[str, Any] = {}

    def send() -> None:
        started = time.monotonic()
        result["resp"] = post(srv, "/generate", body)
        result["seconds"] = time.monotonic() - started

    def probe() -> float:
        t = time.monotonic()
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
        return time.monotonic() - t

    idle = sorted(probe() * 1000 for _ in range(20))  # for the report: this machine's baseline
    worker = threading.Thread(target=send)
    worker.start()
    time.sleep(0.5)  # the body is in, tokenization under way
    latencies = []
    while worker.is_alive():
        latencies.append(probe())
        time.sleep(0.05)
    worker.join()
    resp = result["resp"]
    assert resp.status_code == 400 and "longer than the model's context length" in error_of(resp)
    ms = sorted(x * 1000 for x in latencies)
    print(f"idle /health: median {idle[10]:.0f} ms, max {idle[-1]:.0f} ms")
    print(f"tokenize+reject {result['seconds']:.2f} s; /health over {len(ms)} probes: median "
          f"{ms[len(ms) // 2]:.0f} ms, p95 {ms[int(len(ms) * 0.95)]:.0f} ms, max {ms[-1]:.0f} ms")  # fmt: skip
    assert result["seconds"] > 1.0 and len(latencies) >= 3
    assert max(latencies) < 1.0, latencies


def test_a_prompt_too_long_by_its_length_alone_is_refused_untokenized(srv: ServerProcess) -> None:
    text = "hello world, this is a test of tokenization. " * 220_000  # 9.9M characters
    started = time.monotonic()
    resp = post(srv, "/generate", {"text": text})
    took = time.monotonic() - started
    assert resp.status_code == 400, resp.text
    message = error_of(resp)
    assert "(at least 122223 tokens: 9900000 characters, at most 81 per token)" in message
    assert "context length (512 tokens)" in message
    assert took < 5.0  # tokenizing it takes 6-12 s here


def test_models_retrieve_with_the_openai_client(srv: ServerProcess) -> None:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
    name = client.models.list().data[0].id
    model = client.models.retrieve(name)
    assert model.id == name and model.object == "model"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    body = err.value.body
    assert isinstance(body, dict) and body.get("code") == "model_not_found"
    assert "no-such-model" in str(body.get("message"))


def test_cache_report_with_the_openai_client(srv: ServerProcess) -> None:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
    prompt = "The cache report counts the prompt tokens served from the prefix cache. " * 3
    first = client.completions.create(model="default", prompt=prompt, max_tokens=2)
    again = client.completions.create(model="default", prompt=prompt, max_tokens=2)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert first.usage is not None
    messages: Any = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model="default", messages=messages, max_tokens=2)
    chunks = list(
        client.chat.completions.create(
            model="default", messages=messages, max_tokens=2, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens > 0
