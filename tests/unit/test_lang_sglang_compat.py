"""Where the DSL behaves as SGLang's frontend does, on the FakeBackend: fork items assigned back,
per-chunk stream meta data, messages() (stripped content, the template's default system prompt),
unnamed gens under None, and the default system prompt found in a template."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

import weft
from weft.lang import ChatTemplate, FakeBackend
from weft.lang.backends.base import GenRequest, StreamDelta
from weft.lang.backends.fake import DEFAULT_SYSTEM, chatml
from weft.lang.chat_template import plain_template


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend({"Tip 1:": " one", "Tip 2:": " two", "Story:": " a b c d"}, default=" ok")


##### fork items #####


def test_fork_items_take_augmented_assignment(fake: FakeBackend) -> None:
    @weft.function
    def prog(s: Any) -> None:
        s += "Tips."
        forks = s.fork(2)
        for i in range(2):
            forks[i] += f" Tip {i + 1}:"
            forks[i] += weft.gen("tip", max_tokens=4)  # Python stores forks[i] back
        forks.join()
        s += "|".join(s["tip"])

    s = prog.run(backend=fake)
    assert s["tip"] == [" one", " two"] and s.text() == "Tips. one| two"


def test_fork_item_cannot_be_replaced(fake: FakeBackend) -> None:
    @weft.function
    def prog(s: Any) -> None:
        forks = s.fork(2)
        forks[0] = forks[1]

    with pytest.raises(ValueError, match=r"forks\[0\] = \.\.\.: a branch cannot be replaced"):
        prog.run(backend=fake)


##### stream meta data #####


@weft.function
def story(s: Any) -> None:
    s += "Story:" + weft.gen("story", max_tokens=8, return_logprob=True)


def _check_sglang_chunks(chunks: list[tuple[str, Any]]) -> None:
    """SGLang's test_stream_logprobs assertions, verbatim in meaning."""
    assert chunks
    prev = 0
    for text, meta in chunks:
        assert text
        done = meta["completion_tokens"]
        assert meta["output_token_logprobs_length"] == done
        assert len(meta["output_token_logprobs"]) == done - prev
        prev = done


def test_text_async_iter_yields_each_chunks_meta(fake: FakeBackend) -> None:
    async def collect() -> list[tuple[str, Any]]:
        s = story.run(backend=fake, stream=True)
        return [c async for c in s.text_async_iter("story", return_meta_data=True)]

    chunks = asyncio.run(collect())
    _check_sglang_chunks(chunks)
    assert "".join(c for c, _ in chunks) == " a b c d"
    assert chunks[-1][1]["completion_tokens"] == 4


def test_text_iter_meta_and_plain_forms(fake: FakeBackend) -> None:
    s = story.run(backend=fake, stream=True)
    chunks = list(s.text_iter("story", return_meta_data=True))
    _check_sglang_chunks(chunks)
    assert s.get_meta_info("story")["output_token_logprobs_length"] == 4
    assert len(s.get_meta_info("story")["output_token_logprobs"]) == 4  # whole once finished
    whole = list(story.run(backend=fake, stream=True).text_iter(return_meta_data=True))
    assert all(isinstance(c, str) for c in whole)  # the program text: plain chunks, as SGLang
    assert "".join(whole) == "Story: a b c d"
    not_streamed = story.run(backend=fake)
    ((text, meta),) = list(not_streamed.text_iter("story", return_meta_data=True))
    assert text == " a b c d" and meta["output_token_logprobs_length"] == 4


class SilentTokens(FakeBackend):
    """Streams 'x' then a token without text, then 'y': that token's logprob rides with 'y'."""

    def generate_stream(self, req: GenRequest) -> Iterator[StreamDelta]:
        entries = [(-1.0, 5, None), (-2.0, 6, None), (-3.0, 7, None)]
        for k, text in enumerate(["x", "", "y"]):
            meta = {
                "completion_tokens": k + 1,
                "output_token_logprobs": entries[: k + 1],
                "output_token_logprobs_length": k + 1,
            }
            yield StreamDelta(text, meta)


def test_tokens_without_text_are_merged_into_the_next_chunk() -> None:
    s = story.run(backend=SilentTokens(), stream=True)
    chunks = list(s.text_iter("story", return_meta_data=True))
    assert "".join(c for c, _ in chunks) == "xy"
    assert [e[1] for _, m in chunks for e in m["output_token_logprobs"]] == [5, 6, 7]
    _check_sglang_chunks(chunks)


##### messages() #####


def test_messages_strip_content_and_show_the_templates_system_prompt(fake: FakeBackend) -> None:
    @weft.function
    def chat(s: Any) -> None:
        s += weft.user("  Hi")
        s += weft.assistant(weft.gen("reply", max_tokens=4))

    s = chat.run(backend=fake)
    assert s["reply"] == " ok"
    assert s.messages() == [
        {"role": "system", "content": DEFAULT_SYSTEM},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "ok"},
    ]
    assert s.text() == chatml([{"role": "user", "content": "  Hi"}], True) + " ok<|im_end|>\n"


def test_a_programs_own_system_message_is_the_only_one(fake: FakeBackend) -> None:
    @weft.function
    def chat(s: Any) -> None:
        s += weft.system("Be brief.")
        s += weft.user("Hi")

    assert [m["role"] for m in chat.run(backend=fake).messages()] == ["system", "user"]


def test_default_system_prompt_is_found_only_where_the_template_writes_one() -> None:
    assert ChatTemplate(chatml).default_system("user") == DEFAULT_SYSTEM
    assert ChatTemplate(chatml).default_system("system") is None
    assert plain_template().default_system("user") is None

    def no_system_role(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        if any(m["role"] == "system" for m in messages):
            raise ValueError("System role not supported")
        return "".join(f"[{m['role']}] {m['content']}\n" for m in messages)

    assert ChatTemplate(no_system_role).default_system("user") is None


##### unnamed gens #####


def test_unnamed_gens_and_selects_are_stored_under_none(fake: FakeBackend) -> None:
    @weft.function
    def prog(s: Any) -> None:
        s += "Tip 1:" + weft.gen(max_tokens=4)
        s["first"] = s[None]
        s += " Tip 2:" + weft.gen(max_tokens=4, return_logprob=True)

    s = prog.run(backend=fake)
    assert s["first"] == " one" and s[None] == " two"
    assert len(s.get_meta_info(None)["output_token_logprobs"]) == 1

    @weft.function
    def pick(s: Any) -> None:
        s += "Tip 1:" + weft.select(choices=["one", "two"])

    assert pick.run(backend=fake)[None] in ("one", "two")
