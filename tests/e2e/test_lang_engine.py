"""The shared DSL programs on a real in-process Engine (a tiny random Llama with SmolLM2's
tokenizer): structural expectations, and chat text that tokenizes like the chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import weft
from weft.lang.testing import CHECKS, multi_turn_chat
from weft.runtime.server.chat import render_chat


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path) -> Any:
    b = weft.EngineBackend(model=str(tiny_model_dir), seed=0)
    yield b
    b.shutdown()


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_program_on_the_engine(backend: Any, name: str) -> None:
    CHECKS[name](backend, False)


def test_chat_tokens_are_the_chat_template_tokens(backend: Any) -> None:
    s = multi_turn_chat.run(
        "What is the tallest animal?", "And the fastest?", backend=backend, temperature=0
    )
    tok = backend.tokenizer
    # messages() left-strips each content, as SGLang does: the conversation as generated has the
    # answers as the gens wrote them
    messages = [dict(m) for m in s.messages()]
    messages[2]["content"], messages[4]["content"] = s["answer_1"], s["answer_2"]
    # the whole conversation, as the engine tokenizes the program text
    assert tok.encode(s.text()) == render_chat(tok, messages, add_generation_prompt=False)
    # each gen's prompt is what /v1/chat/completions renders for the messages before it
    for name, before in (("answer_1", messages[:2]), ("answer_2", messages[:4])):
        expected = render_chat(tok, before, add_generation_prompt=True)
        assert s.get_meta_info(name)["prompt_tokens"] == len(expected)


def test_engine_object_as_the_default_backend(backend: Any) -> None:
    from weft.lang.testing import few_shot_qa

    weft.set_default_backend(backend.engine)  # a bare weft.Engine is wrapped
    try:
        assert isinstance(
            few_shot_qa("What is the capital of Germany?", temperature=0)["answer"], str
        )
    finally:
        weft.set_default_backend(None)
