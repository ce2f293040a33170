"""Chat prompts: render OpenAI-style messages with the model's own chat template (or a given one)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant", "tool", "developer")


def load_chat_template(path: str | None) -> str | None:
    """The Jinja text of --chat-template FILE (None keeps the tokenizer's own)."""
    if path is None:
        return None
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--chat-template {path!r}: no such file")
    return file.read_text()


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the messages and flatten text-part lists; ValueError naming the bad message."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError("Messages cannot be empty.")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        content = msg.get("content")
        if isinstance(content, list):
            content = _text_parts(content, i)
        elif content is None:
            if not msg.get("tool_calls"):
                raise ValueError(f"messages[{i}].content is missing")
            content = ""
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        _check_extras(msg, i)
        item = {k: v for k, v in msg.items() if k in ("name", "tool_calls", "tool_call_id")}
        out.append({"role": "system" if role == "developer" else role, "content": content, **item})
    return out


def _text_parts(parts: list[Any], i: int) -> str:
    texts = []
    for part in parts:
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(
                f"messages[{i}].content: part type {kind!r} is not supported (only text)"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"messages[{i}].content: a text part's text must be a string")
        texts.append(text)
    return "".join(texts)


def _check_extras(msg: Mapping[str, Any], i: int) -> None:
    """name and tool_call_id are strings; tool_calls a list of objects (what templates read)."""
    for key in ("name", "tool_call_id"):
        if msg.get(key) is not None and not isinstance(msg[key], str):
            raise ValueError(f"messages[{i}].{key} must be a string")
    calls = msg.get("tool_calls")
    if calls is not None and (
        not isinstance(calls, list) or not all(isinstance(c, Mapping) for c in calls)
    ):
        raise ValueError(f"messages[{i}].tool_calls must be a list of tool-call objects")


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of the conversation as the model was trained to see it."""
    text = chat_text(
        tokenizer,
        messages,
        chat_template,
        tools,
        add_generation_prompt,
        continue_final_message,
        template_kwargs,
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The conversation rendered by the chat template (the text `render_chat` tokenizes)."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; start the server with --chat-template")
    if continue_final_message:
        if messages[-1]["role"] != "assistant":
            raise ValueError(
                "continue_final_message needs the last message to be from the assistant"
            )
        add_generation_prompt = False
    try:
        text: str = tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **dict(template_kwargs or {}),
        )
    except Exception as e:  # jinja errors (raise_exception in templates) are user errors here
        raise ValueError(f"the chat template could not render these messages: {e}") from e
    return text
