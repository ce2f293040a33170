"""The shared DSL programs (weft.lang.testing) on the FakeBackend: their structural checks, then the
exact text, variables and requests each one produces."""

from __future__ import annotations

import json
from typing import Any

import pytest

from weft.lang import FakeBackend
from weft.lang.backends.fake import chatml
from weft.lang.params import INT_REGEX
from weft.lang.testing import (
    BATCH_INSTRUCTION,
    CHECKS,
    FEW_SHOT,
    IP_REGEX,
    Person,
    fake_backend,
    story,
)


@pytest.fixture
def fake() -> FakeBackend:
    return fake_backend()


def test_at_least_15_programs() -> None:
    assert len(CHECKS) >= 15


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_program_checks_pass_on_the_fake(name: str, fake: FakeBackend) -> None:
    CHECKS[name](fake, True)


def test_few_shot_qa(fake: FakeBackend) -> None:
    s = CHECKS["few_shot_qa"](fake, True)
    assert s["answer"] == " Berlin"
    (req,) = fake.gen_requests
    assert req.ctx.text == FEW_SHOT + "Q: What is the capital of Germany?\nA:"
    assert req.args.stop == ("\n",) and req.args.max_new_tokens == 6 and req.args.temperature == 0


def test_multi_turn_chat_text_is_the_template_rendering(fake: FakeBackend) -> None:
    s = CHECKS["multi_turn_chat"](fake, False)
    assert (s["answer_1"], s["answer_2"]) == ("The giraffe.", "The cheetah.")
    assert s.text() == chatml(s.messages(), False)
    first, second = fake.gen_requests
    assert first.ctx.text == chatml(s.messages()[:2], True)  # what /v1/chat/completions renders
    assert first.ctx.role == "assistant" and first.ctx.turn_text == ""
    assert "<|im_end|>" in first.args.stop and "<|im_end|>" in second.args.stop


def test_select_all_methods(fake: FakeBackend) -> None:
    states = CHECKS["select"](fake, False)
    assert [s["answer"] for s in states] == [" yes"] * 3
    meta = states[0].get_meta_info("answer")
    assert meta["normalized_prompt_logprobs"] == [-0.1, -2.0]
    assert "unconditional_token_logprobs" in states[2].get_meta_info("answer")


def test_regex_gen(fake: FakeBackend) -> None:
    s = CHECKS["regex"](fake, False)
    assert s["ip"] == "127.0.0.1" and fake.gen_requests[0].args.regex == IP_REGEX


def test_json_gen_with_pydantic(fake: FakeBackend) -> None:
    s = CHECKS["json_pydantic"](fake, False)
    assert s.parsed("person") == Person(name="Alice", age=30)
    assert json.loads(s["person"]) == {"name": "Alice", "age": 30}
    expected = {**Person.model_json_schema(), "additionalProperties": False}  # closed objects
    assert json.loads(fake.gen_requests[0].args.json_schema) == expected


def test_gen_int(fake: FakeBackend) -> None:
    s = CHECKS["gen_int"](fake, False)
    assert s["legs"] == "8"
    args = fake.gen_requests[0].args
    assert args.regex == INT_REGEX and args.stop == (" ", "\n")


def test_fork_join_prefills_the_prefix_once(fake: FakeBackend) -> None:
    s = CHECKS["fork_join"](fake, False)
    assert s["tip"] == [" Start small.", " Keep notes.", " Rest well."]
    prefix = "Here are three short, practical tips about sleep, one sentence each.\n"
    assert fake.prefixes_cached == [prefix]
    assert s["summary"] == " Small steps, notes, rest."
    assert s.text().startswith(
        prefix + "Tip 1: Start small.\nTip 2: Keep notes.\nTip 3: Rest well.\n"
    )


def test_concat_join(fake: FakeBackend) -> None:
    s = CHECKS["concat_join"](fake, False)
    assert s.text() == "Two colors: red and green blue and yellow"
    assert s["more"] == [" and green", " and yellow"]


def test_tool_use_branches_on_a_read_variable(fake: FakeBackend) -> None:
    calc, search = CHECKS["tool_use"](fake, False)
    assert (calc["tool"], calc["expression"]) == (" calculator", " 12 * 7")
    assert (search["tool"], search["query"]) == (" search", " author of Hamlet")


def test_run_batch_order_and_one_warmup(fake: FakeBackend) -> None:
    states = CHECKS["run_batch"](fake, False)
    assert [s["answer"] for s in states] == [f" {2 * i}" for i in range(20)]
    assert fake.prefixes_cached == [BATCH_INSTRUCTION + "Question: "]
    assert all(r.ctx.text.startswith(BATCH_INSTRUCTION) for r in fake.gen_requests)


def test_streaming_in_pieces() -> None:
    fake = fake_backend()
    s = CHECKS["streaming"](fake, False)
    assert s["story"] == " there was a small robot who loved to"
    slow = fake_backend(delay=0.05)
    streamed = story.run(backend=slow, stream=True)
    chunks = list(streamed.text_iter("story"))
    assert "".join(chunks) == streamed["story"] and len(chunks) >= 2  # pieces, as they come


def test_var_scope(fake: FakeBackend) -> None:
    assert CHECKS["var_scope"](fake, False)["reply"] == " Hi Ada!"


def test_gen_n(fake: FakeBackend) -> None:
    s = CHECKS["gen_n"](fake, False)
    assert s["fruit"] == [" apple", " banana", " cherry"]
    assert fake.gen_requests[0].args.n == 3


def test_error_stops_the_queue(fake: FakeBackend) -> None:
    s = CHECKS["error"](fake, False)
    assert "min_new_tokens must be in [0, max_new_tokens]" in str(s.error())
    assert len(fake.gen_requests) == 1  # the gen after the failure was dropped


def test_composition_and_bind(fake: FakeBackend) -> None:
    s, s2 = CHECKS["composition"](fake, False)
    assert s["answer"] == " Madrid" and s2["rest"] == " How are you today?"


def test_meta_info(fake: FakeBackend) -> None:
    s = CHECKS["meta_info"](fake, False)
    meta = s.get_meta_info("next")
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (4, 3)
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    args = fake.gen_requests[0].args
    assert args.return_logprob and args.top_logprobs_num == 2


def test_async(fake: FakeBackend) -> None:
    s: Any = CHECKS["async"](fake, False)
    assert s["story"] == " there was a small robot who loved to"
