"""The shared DSL programs on a real `weft serve` (packaged SmolLM2) through RuntimeEndpoint, and
the OpenAI backend on its /v1 routes: same conversation, same prompt tokens and greedy text."""

from __future__ import annotations

from typing import Any

import pytest

import weft
from weft.lang.testing import CHECKS, GRAMMAR_MISSING, multi_turn_chat, yes_no


@pytest.fixture(scope="module")
def endpoint(server: Any) -> Any:
    b = weft.RuntimeEndpoint(server.url)
    yield b
    b.shutdown()


@pytest.fixture(scope="module")
def openai_chat(server: Any) -> Any:
    b = weft.OpenAI("smollm2", base_url=f"{server.url}/v1")
    yield b
    b.shutdown()


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_program_on_the_server(endpoint: Any, name: str) -> None:
    CHECKS[name](endpoint, True)


def test_dsl_chat_equals_chat_completions(endpoint: Any, openai_chat: Any) -> None:
    questions = ("What is the tallest animal?", "And the fastest?")
    native = multi_turn_chat.run(*questions, backend=endpoint, temperature=0)
    chat = multi_turn_chat.run(*questions, backend=openai_chat, temperature=0)
    assert chat.error() is None and native.error() is None
    for name in ("answer_1", "answer_2"):
        assert native[name] == chat[name]
        n_meta, c_meta = native.get_meta_info(name), chat.get_meta_info(name)
        assert n_meta["prompt_tokens"] == c_meta["prompt_tokens"]
    assert native.messages() == chat.messages()


def test_openai_backend_n_stream_and_select(server: Any, openai_chat: Any) -> None:
    @weft.function
    def fruit(s: Any) -> None:
        s += weft.user("Name a fruit.")
        s += weft.assistant(weft.gen("fruit", n=2, max_tokens=3))

    s = fruit.run(backend=openai_chat, temperature=0.7)
    assert isinstance(s["fruit"], list) and len(s["fruit"]) == 2 and s.error() is None

    streamed = multi_turn_chat.run("Hi!", "Bye!", backend=openai_chat, temperature=0, stream=True)
    assert "".join(streamed.text_iter("answer_1")) == streamed["answer_1"]

    completion = weft.OpenAI("smollm2", base_url=f"{server.url}/v1", is_chat_model=False)
    assert yes_no.run("Is the sky blue?", backend=completion)["answer"] in (" yes", " no")

    @weft.function
    def chat_select(s: Any) -> None:
        s += weft.user("Is the sky blue? Answer yes or no.")
        s += weft.assistant(weft.select("answer", choices=["yes", "no"]))

    picked = chat_select.run(backend=openai_chat)
    if picked.error() is not None:  # a chat model's select needs a json_schema constraint
        assert GRAMMAR_MISSING in str(picked.error())
    else:
        assert picked["answer"] in ("yes", "no")


def test_openai_chat_needs_gen_at_the_start_of_an_assistant_turn(openai_chat: Any) -> None:
    @weft.function
    def misplaced(s: Any) -> None:
        s += weft.user("Hi") + weft.gen("x", max_tokens=2)

    err = misplaced.run(backend=openai_chat).error()
    assert isinstance(err, ValueError) and "start of an assistant turn" in str(err)


def test_endpoint_errors(server: Any) -> None:
    with pytest.raises(weft.BackendError, match="failed"):
        weft.RuntimeEndpoint("http://127.0.0.1:9")  # nothing listens there
    info = weft.get_server_info(weft.RuntimeEndpoint(server.url))
    assert "max_total_num_tokens" in info
