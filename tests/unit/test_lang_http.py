"""The HTTP backends against mock servers (httpx.MockTransport): SGLang's cumulative SSE, error
messages, the BOS check, and the OpenAI chat/completion shapes."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

import weft
from weft.lang.backends.fake import chatml
from weft.lang.testing import multi_turn_chat, story, yes_no


def sse(events: list[Any]) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


class NativeServer:
    """A /generate server whose tokenizer adds a BOS (id 1, text '<s>') to every prompt."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else {}
        self.bodies.append({"path": path, **body})
        if path == "/get_model_info":
            return httpx.Response(200, json={"model_path": "mock"})
        if path == "/tokenize":
            prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
            bos = [1] if body.get("add_special_tokens", True) else []
            tokens = [bos + [ord(c) for c in p] for p in prompts]
            return httpx.Response(
                200, json={"tokens": tokens if isinstance(body["prompt"], list) else tokens[0]}
            )
        if path == "/detokenize":
            return httpx.Response(200, json={"text": "<s>" if body["tokens"] == [1] else "?"})
        if path == "/apply_chat_template":
            return httpx.Response(
                200, json={"text": "<s>" + chatml(body["messages"], body["add_generation_prompt"])}
            )
        if path == "/flush_cache":
            return httpx.Response(400, json={"error": {"message": "requests are running"}})
        if path == "/generate" and body["sampling_params"].get("min_new_tokens", 0) > 2:
            return httpx.Response(400, json={"error": {"message": "min_new_tokens is too large"}})
        if path == "/generate" and body.get("stream"):
            if "fail" in body["text"]:
                return httpx.Response(
                    200, content=sse([{"error": {"message": "grammar exploded"}}])
                )
            meta = {
                "prompt_tokens": 3,
                "completion_tokens": 2,
                "cached_tokens": 0,
                "finish_reason": None,
            }
            events = [
                {"text": " once", "meta_info": meta},
                {"text": " once upon", "meta_info": meta},
            ]
            return httpx.Response(
                200, content=sse(events), headers={"content-type": "text/event-stream"}
            )
        final: dict[str, Any] = {
            "prompt_tokens": 3,
            "completion_tokens": 1,
            "cached_tokens": 1,
            "finish_reason": {"type": "length"},
        }
        return httpx.Response(200, json={"text": " reply", "output_ids": [7], "meta_info": final})


@pytest.fixture
def native() -> tuple[NativeServer, Any]:
    server = NativeServer()
    return server, weft.RuntimeEndpoint("http://mock", transport=httpx.MockTransport(server))


def test_runtime_endpoint_streams_cumulative_text_as_deltas(native: Any) -> None:
    server, ep = native
    s = story.run(backend=ep, stream=True)
    assert list(s.text_iter("story")) in ([" once", " upon"], [" once upon"])
    assert s["story"] == " once upon"
    gen = [b for b in server.bodies if b["path"] == "/generate"][0]
    assert gen["text"] == "Once upon a time" and gen["stream"] is True
    assert gen["sampling_params"]["max_new_tokens"] == 8


def test_runtime_endpoint_errors_carry_the_server_message(native: Any) -> None:
    _, ep = native

    @weft.function
    def prog(s: Any) -> None:
        s += "x" + weft.gen("a", min_tokens=3, max_tokens=4)

    err = prog.run(backend=ep).error()
    assert isinstance(err, weft.BackendError) and "HTTP 400: min_new_tokens is too large" in str(
        err
    )

    @weft.function
    def failing_stream(s: Any) -> None:
        s += "fail" + weft.gen("a")

    err = failing_stream.run(backend=ep, stream=True).error()
    assert isinstance(err, weft.BackendError) and "grammar exploded" in str(err)
    assert ep.flush_cache() is False


def test_runtime_endpoint_cuts_the_bos_its_tokenizer_adds(native: Any) -> None:
    _, ep = native
    s = multi_turn_chat.run("Q1", "Q2", backend=ep)
    assert s.text().startswith(
        "<|im_start|>system\nYou are a helpful"
    )  # no "<s>": the server adds it
    replies = [m["content"] for m in s.messages() if m["role"] == "assistant"]
    assert replies == ["reply", "reply"]  # the gen's " reply", left-stripped as SGLang records it
    generated = [
        {**m, "content": " reply"} if m["role"] == "assistant" else m for m in s.messages()
    ]
    assert s.text() == chatml(generated, False)


class OpenAIServer:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append({"path": request.url.path, **body})
        usage = {
            "prompt_tokens": 5,
            "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": 4},
        }
        if request.url.path == "/v1/completions":
            choices = []
            for i, prompt in enumerate(body["prompt"]):
                pieces = prompt.split(" ")
                tokens = [pieces[0]] + [" " + p for p in pieces[1:]] + ["!"]
                offsets = [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
                lps = (
                    [None]
                    + [-1.0] * (len(tokens) - 3)
                    + [-0.5 if tokens[-2] == " yes" else -3.0, -9.0]
                )
                logprobs = {"tokens": tokens, "token_logprobs": lps, "text_offset": offsets}
                choices.append(
                    {
                        "index": i,
                        "text": prompt + "!",
                        "logprobs": logprobs,
                        "finish_reason": "length",
                    }
                )
            return httpx.Response(200, json={"id": "c", "choices": choices, "usage": usage})
        if body.get("stream"):
            chunks = [
                {
                    "id": "s",
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
                },
                {"id": "s", "choices": [{"index": 0, "delta": {"content": "Hel"}}]},
                {"id": "s", "choices": [{"index": 0, "delta": {"content": "lo"}}]},
                {"id": "s", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                {"id": "s", "choices": [], "usage": usage},
            ]
            return httpx.Response(200, content=sse(chunks))
        n = body.get("n", 1)
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": f"answer {i}"},
                "finish_reason": "stop",
            }
            for i in range(n)
        ]
        return httpx.Response(200, json={"id": "x", "choices": choices, "usage": usage})


def test_openai_chat_sends_messages_and_gets_n() -> None:
    server = OpenAIServer()
    b = weft.OpenAI("m", base_url="http://mock/v1", transport=httpx.MockTransport(server))
    s = multi_turn_chat.run("Q1", "Q2", backend=b, temperature=0)
    assert s["answer_1"] == "answer 0" and s.get_meta_info("answer_1")["cached_tokens"] == 4
    second = server.bodies[1]
    assert second["messages"][-1] == {"role": "user", "content": "Q2"}
    assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant", "user"]
    assert second["max_tokens"] == 6 and second["temperature"] == 0 and "top_k" not in second

    streamed = multi_turn_chat.run("Q1", "Q2", backend=b, stream=True)
    assert list(streamed.text_iter("answer_1")) in (["Hel", "lo"], ["Hello"])
    assert streamed.get_meta_info("answer_1")["finish_reason"]["type"] == "stop"


def test_openai_completion_select_uses_echoed_logprobs() -> None:
    server = OpenAIServer()
    b = weft.OpenAI(
        "m", base_url="http://mock/v1", is_chat_model=False, transport=httpx.MockTransport(server)
    )
    s = yes_no.run("Is the sky blue?", backend=b)
    assert s["answer"] == " yes"
    assert s.get_meta_info("answer")["input_token_logprobs"] == [
        [(-0.5, -1, " yes")],
        [(-3.0, -1, " no")],
    ]
    body = server.bodies[0]
    assert body["echo"] is True and body["max_tokens"] == 1


def test_openai_model_first_then_url() -> None:
    with pytest.raises(ValueError, match="the first argument is the model name"):
        weft.OpenAI("http://localhost:30000/v1", "m")
