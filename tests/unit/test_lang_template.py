"""Role prefixes/suffixes cut from real Jinja chat templates (SmolLM2's, a Llama-3-like one with a
BOS, one with a thinking generation prompt), and the templates the DSL cannot split."""

from __future__ import annotations

from typing import Any

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

import weft
from weft.lang import ChatTemplate, ChatTemplateError, FakeBackend
from weft.lang.chat_template import RenderFn, plain_template

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ '<|begin_of_text|>' }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
    "'<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
THINKING = (
    "{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] + '</' + m['role'] + '>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<assistant><think></think>' }}{% endif %}"
)


def jinja(template: str) -> RenderFn:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    compiled = env.from_string(template)

    def render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt)

    return render


def build(template: ChatTemplate, messages: list[dict[str, str]]) -> str:
    """The text the interpreter appends for these messages."""
    text = ""
    hist: tuple[str, ...] = ()
    for m in messages:
        text += template.prefix(hist, m["role"]) + m["content"] + template.suffix(hist, m["role"])
        hist += (m["role"],)
    return text


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]


def test_smollm2_prefixes_suffixes_and_end_of_turn() -> None:
    render = jinja(SMOLLM2)
    t = ChatTemplate(render)
    assert t.prefix((), "system") == "<|im_start|>system\n"
    assert t.prefix((), "user").startswith("<|im_start|>system\nYou are a helpful AI assistant")
    assert t.prefix(("user",), "assistant") == "<|im_start|>assistant\n"
    assert t.suffix(("user",), "assistant") == "<|im_end|>\n"
    assert t.end_of_turn == "<|im_end|>"
    for msgs in (CONVERSATION, CONVERSATION[1:]):
        assert build(t, msgs) == render(msgs, False)
        # a gen in the next assistant turn sees exactly the generation prompt rendering
        before = build(t, msgs) + t.prefix(tuple(m["role"] for m in msgs), "assistant")
        assert before == render(msgs, True)


def test_a_bos_the_tokenizer_adds_itself_is_cut_from_the_first_prefix() -> None:
    render = jinja(LLAMA3)
    t = ChatTemplate(render, auto_prefix="<|begin_of_text|>")
    assert t.prefix((), "system") == "<|start_header_id|>system<|end_header_id|>\n\n"
    assert "<|begin_of_text|>" + build(t, CONVERSATION) == render(CONVERSATION, False)
    assert t.end_of_turn == "<|eot_id|>"


def test_assistant_prefix_is_the_generation_prompt() -> None:
    t = ChatTemplate(jinja(THINKING))
    assert t.prefix(("user",), "assistant") == "<assistant><think></think>"
    assert t.prefix((), "assistant") == "<assistant>"  # no generation prompt to compare with


def test_templates_that_cannot_be_cut() -> None:
    upper = ChatTemplate(jinja("{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"))
    with pytest.raises(ChatTemplateError, match="changed the content"):
        upper.prefix((), "user")
    unstable = (
        "{% for m in messages %}{{ m['role'] + ':' + m['content'] }}"
        "{% if loop.last %}{{ '.' }}{% else %}{{ ';' }}{% endif %}{% endfor %}"
    )
    with pytest.raises(ChatTemplateError, match="renders a user message differently"):
        ChatTemplate(jinja(unstable)).prefix(("user",), "assistant")


def test_template_errors_surface_in_the_program() -> None:
    def no_system(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        if messages[0]["role"] == "system":
            raise jinja2.TemplateError("System role not supported")
        return "".join(m["content"] for m in messages)

    fake = FakeBackend()
    fake._template = ChatTemplate(no_system)

    @weft.function
    def prog(s: Any) -> None:
        s += weft.system("x")

    assert "System role not supported" in str(prog.run(backend=fake).error())


def test_plain_template() -> None:
    t = plain_template()
    assert build(t, CONVERSATION[:2]) == "system: Be brief.\nuser: Hi\n"
    assert t.prefix(("user",), "assistant") == "assistant: " and t.end_of_turn is None
