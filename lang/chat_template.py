"""Role prefixes and suffixes cut from the model's own chat template by rendering sentinel texts.

For the conversation so far (its roles `history`) and a new message of `role`, the template is
rendered with a sentinel as each message's content:

    render([h0: S0, ..., hk: Sk, role: S])
        = ... S_k | suffix(h_k) + prefix(role) | S | suffix(role)

`prefix` is what comes before S once the previous message's suffix (already in the program text)
is removed; `suffix` is everything after S. An assistant message's prefix is the template's
generation prompt, so the text a gen sees is exactly what /v1/chat/completions renders. A text
that the tokenizer adds itself when encoding (a BOS token) is removed from the first prefix, so
encoding the program text gives the template's tokens once, not twice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

# (messages, add_generation_prompt) -> the rendered text
RenderFn = Callable[[list[dict[str, Any]], bool], str]


class ChatTemplateError(ValueError):
    """The template cannot be split into per-role prefixes and suffixes."""


class ChatTemplate:
    def __init__(self, render: RenderFn, auto_prefix: str = "") -> None:
        self._render = render
        self._auto_prefix = auto_prefix
        self._cache: dict[tuple[tuple[str, ...], str], tuple[str, str]] = {}
        self._default_system: dict[str, str | None] = {}
        self._lock = threading.RLock()

    def prefix(self, history: tuple[str, ...], role: str) -> str:
        """Text that opens a `role` message after messages of roles `history`."""
        return self._split(history, role)[0]

    def suffix(self, history: tuple[str, ...], role: str) -> str:
        """Text that closes a `role` message after messages of roles `history`."""
        return self._split(history, role)[1]

    @property
    def end_of_turn(self) -> str | None:
        """The stop string that ends an assistant turn (e.g. `<|im_end|>`), if the template
        has one: the assistant suffix without its whitespace."""
        return self.suffix(("user",), "assistant").strip() or None

    def default_system(self, role: str) -> str | None:
        """The system message the template writes by itself when a conversation starts with a
        `role` message (SmolLM2's "You are a helpful AI assistant named SmolLM, ..."), or None:
        the content c for which [system: c, role: S] renders exactly as [role: S] does."""
        with self._lock:
            if role not in self._default_system:
                self._default_system[role] = None if role == "system" else self._find_default(role)
            return self._default_system[role]

    def _find_default(self, role: str) -> str | None:
        sentinel, content = _sentinel(0), _sentinel(1)
        alone = self._render([{"role": role, "content": content}], False)
        try:
            with_system = self._render(
                [{"role": "system", "content": sentinel}, {"role": role, "content": content}], False
            )
        except Exception:  # noqa: BLE001 - a template that refuses system messages adds none
            return None
        head, _, tail = with_system.partition(sentinel)
        fits = len(head) + len(tail) < len(alone)
        if not (fits and alone.startswith(head) and alone.endswith(tail)):
            return None
        found = alone[len(head) : len(alone) - len(tail)]
        explicit = [{"role": "system", "content": found}, {"role": role, "content": content}]
        return found if self._render(explicit, False) == alone else None

    def _split(self, history: tuple[str, ...], role: str) -> tuple[str, str]:
        key = (history, role)
        with self._lock:
            if key not in self._cache:
                self._cache[key] = self._compute(history, role)
            return self._cache[key]

    def _compute(self, history: tuple[str, ...], role: str) -> tuple[str, str]:
        roles = (*history, role)
        sentinels = [_sentinel(i) for i in range(len(roles))]
        msgs = [{"role": r, "content": s} for r, s in zip(roles, sentinels, strict=True)]
        text = self._render(msgs, False)
        start = _find(text, sentinels[-1], role)
        suffix = text[start + len(sentinels[-1]) :]
        if not history:
            prefix = text[:start]
            if self._auto_prefix and prefix.startswith(self._auto_prefix):
                prefix = prefix[len(self._auto_prefix) :]
        else:
            prev_end = _find(text, sentinels[-2], history[-1]) + len(sentinels[-2])
            between = text[prev_end:start]
            prev_suffix = self._split(history[:-1], history[-1])[1]
            if not between.startswith(prev_suffix):
                raise ChatTemplateError(
                    f"the chat template renders a {history[-1]} message differently once a "
                    f"{role} message follows it ({prev_suffix!r} then {between!r}); "
                    "the DSL cannot build this conversation message by message"
                )
            prefix = between[len(prev_suffix) :]
        if role == "assistant" and history:
            prefix = self._generation_prompt(msgs[:-1]) or prefix
        return prefix, suffix

    def _generation_prompt(self, msgs: list[dict[str, Any]]) -> str | None:
        plain = self._render(msgs, False)
        with_prompt = self._render(msgs, True)
        if with_prompt.startswith(plain) and len(with_prompt) > len(plain):
            return with_prompt[len(plain) :]
        return None


def plain_template() -> ChatTemplate:
    """`role: content` lines: the display text of backends that send messages, not text."""

    def render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")

    return ChatTemplate(render)


def _sentinel(i: int) -> str:
    return f"@@Weft{i}@@"  # mixed case: a template that changes case is caught


def _find(text: str, sentinel: str, role: str) -> int:
    pos = text.find(sentinel)
    if pos < 0:
        raise ChatTemplateError(
            f"the chat template changed the content of a {role} message while rendering it; "
            "the DSL cannot cut it into role prefixes and suffixes"
        )
    return pos
