"""xgrammar's newer structural tag, `{"type": "structural_tag", "format": {...}}`: a tree of formats
(const_string, json_schema, regex, grammar, any_text, sequence, or, tag, triggered_tags,
tags_with_separator, optional, plus, star, repeat) written as an llguidance grammar.

Token-level formats (token, exclude_token, any_tokens, token_triggered_tags, dispatch) and
options beyond plain JSON (`style`, `any_order`, ...) are refused by name, never approximated.
`any_text` runs to the end of the text, or (inside a tag or a sequence) up to the first
occurrence of the string that follows it.

Structure tokens: where a literal (a begin, an end, a trigger, a separator, a const_string) holds
the text of one of the model's special or added tokens (Qwen's `<tool_call>`, Llama's
`<|python_tag|>`), that part is the token itself, as the model writes it, not its text spelled in
ordinary tokens. A trigger may hold such a token only at its start.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from weft.constrain.errors import GrammarError
from weft.constrain.regex_text import ascii_classes, lark_ascii_classes
from weft.constrain.schema import string_patterns
from weft.constrain.structural_check import children, tag_ends

ANY = r"(.|\n)*"


def format_texts(node: Mapping[str, Any]) -> list[str]:
    """Every literal the grammar of a (checked) format writes."""
    kind, out = node["type"], []
    if kind == "const_string":
        out.append(node["value"])
    elif kind == "tag":
        out += [node["begin"], *tag_ends(node)]
    elif kind in ("triggered_tags", "tags_with_separator"):
        out += node.get("triggers", []) + [node.get("separator", "")]
    for child in children(node):
        out += format_texts(child)
    return [t for t in out if t]


def format_grammar(
    node: Mapping[str, Any],
    json_options: Mapping[str, Any],
    tokens: Mapping[str, int] | None = None,
) -> tuple[str, frozenset[int]]:
    """The llguidance grammar of a checked format tree (Lark text, or JSON with side grammars),
    and the structure tokens it holds: the ids of `tokens` (text -> id of the model's special
    and added tokens) whose text appears in its literals."""
    builder = _Builder(dict(json_options), dict(tokens or {}))
    top = builder.expr(node, follow=None)
    main = "%llguidance {}\nstart: " + top + "\n" + "\n".join(builder.rules) + "\n"
    if not builder.side:
        return main, frozenset(builder.used)
    grammars = [{"name": "structural_tag", "lark_grammar": main}, *builder.side]
    return json.dumps({"grammars": grammars}), frozenset(builder.used)


##### Internal Helper Functions #####


def _lit(text: str) -> str:
    return json.dumps(text)


def _regex_literal(text: str) -> str:
    out = []
    for ch in text:
        if ch in "\\.+*?()|[]{}^$#&-~/":
            out.append("\\" + ch)
        elif ch.isprintable() and ch != "\n":
            out.append(ch)
        else:
            out.append(f"\\x{{{ord(ch):x}}}")
    return "".join(out)


def _slashes_escaped(pattern: str) -> str:
    """`pattern` with its unescaped `/` escaped (Lark's regex delimiter)."""
    out, escaped = [], False
    for ch in pattern:
        out.append("\\/" if ch == "/" and not escaped else ch)
        escaped = ch == "\\" and not escaped
    return "".join(out)


def _free_text(excluded: list[str]) -> str:
    """A regex of any text that contains none of `excluded`."""
    if not excluded:
        return f"/{ANY}/"
    either = "|".join(_regex_literal(t) for t in excluded)
    return f"/{ANY}/ & ~/{ANY}({either}){ANY}/"


class _Builder:
    """Lark rules for a format tree; `expr` returns what to write where the format stands."""

    def __init__(self, json_options: dict[str, Any], tokens: dict[str, int]) -> None:
        self.json_options = json_options
        self.rules: list[str] = []
        self.side: list[dict[str, str]] = []
        self.tokens = tokens
        self.used: set[int] = set()  # structure tokens written
        # longest first: at each position the longest token text wins
        ordered = sorted(tokens, key=len, reverse=True)
        self._token_re = re.compile("|".join(map(re.escape, ordered))) if ordered else None

    def pieces(self, text: str) -> list[str | int]:
        """`text` cut into plain text and structure tokens (ids), in order."""
        if self._token_re is None:
            return [text] if text else []
        out: list[str | int] = []
        at = 0
        for m in self._token_re.finditer(text):
            if m.start() > at:
                out.append(text[at : m.start()])
            out.append(self.tokens[m.group()])
            at = m.end()
        if at < len(text):
            out.append(text[at:])
        return out

    def lit(self, text: str) -> str:
        """A literal as a Lark sequence: quoted text, and `<[id]>` for each structure token."""
        parts = []
        for piece in self.pieces(text) or [""]:
            if isinstance(piece, int):
                self.used.add(piece)
                parts.append(f"<[{piece}]>")
            else:
                parts.append(_lit(piece))
        return " ".join(parts)

    def has_token(self, texts: list[str]) -> bool:
        return any(isinstance(p, int) for t in texts for p in self.pieces(t))

    def rule(self, body: str, attrs: str = "") -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}{attrs}: {body}")
        return name

    def free(self, excluded: list[str]) -> str:
        """A terminal: any text containing none of `excluded` (lazy rules need terminals)."""
        name = f"T{len(self.rules)}"
        self.rules.append(f"{name}: {_free_text(excluded)}")
        return name

    def expr(self, node: Mapping[str, Any], follow: list[str] | None) -> str:
        """`follow`: the strings one of which comes right after this format; None: the end of
        the text; []: something that is not a string (any_text there is refused)."""
        kind = node["type"]
        if kind == "const_string":
            return self.lit(node["value"])
        if kind == "json_schema":
            schema = node["json_schema"]
            schema = {} if schema is True else schema
            if schema is False:
                raise GrammarError("structural_tag json_schema false allows no value")
            schema = string_patterns(schema)  # patterns read as at the top level
            return self.rule("%json " + json.dumps({**schema, "x-guidance": self.json_options}))
        if kind == "regex":
            return self.rule("/" + _slashes_escaped(ascii_classes(node["pattern"])) + "/")
        if kind == "grammar":
            import llguidance

            name = f"g{len(self.side)}"
            try:
                text = llguidance.grammar_from(node.get("syntax", "ebnf"), node["grammar"])
            except ValueError as e:
                raise GrammarError(f"structural_tag grammar format: {e}") from None
            text = lark_ascii_classes(text)
            self.side.append({"name": name, "lark_grammar": text})
            return f"@{name}"
        if kind == "any_text":
            return self.any_text(node.get("excludes", []), follow)
        if kind == "sequence":
            return self.sequence(node["elements"], follow)
        if kind == "or":
            return self.rule(" | ".join(self.expr(e, follow) for e in node["elements"]))
        if kind == "tag":
            return self.tag(node)
        if kind == "triggered_tags":
            return self.triggered(node)
        if kind == "tags_with_separator":
            return self.separated(node)
        inner = self.expr(node["content"], follow if kind == "optional" else [])
        suffix = {"optional": "?", "plus": "+", "star": "*"}.get(kind)
        if suffix is None:  # repeat
            suffix = f"{{{node['min']},{node['max']}}}"
        return self.rule(f"({inner}){suffix}")

    def any_text(self, excludes: list[str], follow: list[str] | None) -> str:
        if follow is None:
            return self.rule(self.free(excludes))
        if not follow or any(not f for f in follow):
            raise GrammarError(
                "structural_tag any_text must end the text or be followed by a non-empty string"
            )
        ends = " | ".join(self.lit(f) for f in follow)
        if self.has_token(follow):
            # NOTE: a lazy rule is one lexeme, which a token cannot be part of: the text instead
            # excludes what follows (spelled out), so it ends where the token comes
            return self.rule(f"{self.free(excludes + list(follow))} ({ends})")
        # lazy: the text ends at the first occurrence of what follows (which it then includes)
        return self.rule(f"{self.free(excludes)} ({ends})", "[lazy]")

    def sequence(self, elements: list[Mapping[str, Any]], follow: list[str] | None) -> str:
        parts = []
        i = 0
        while i < len(elements):
            node = elements[i]
            nxt = elements[i + 1] if i + 1 < len(elements) else None
            if nxt is None:
                parts.append(self.expr(node, follow))
                break
            after = [nxt["value"]] if nxt["type"] == "const_string" and nxt["value"] else []
            if node["type"] == "any_text" and after:
                parts.append(self.any_text(node.get("excludes", []), after))
                i += 2  # the lazy rule wrote the string too
                continue
            parts.append(self.expr(node, after))
            i += 1
        return self.rule(" ".join(parts))

    def tag(self, node: Mapping[str, Any]) -> str:
        content, ends = node["content"], tag_ends(node)
        begin = self.lit(node["begin"])
        if content["type"] == "any_text":  # up to (and with) the first end
            return self.rule(f"{begin} {self.any_text(content.get('excludes', []), ends)}")
        end = " | ".join(self.lit(e) for e in ends)
        return self.rule(f"{begin} {self.expr(content, ends)} ({end})")

    def triggered(self, node: Mapping[str, Any]) -> str:
        triggers = list(dict.fromkeys(node["triggers"]))
        free = self.free(triggers + list(node.get("excludes", [])))
        alternatives = []
        # a trigger that starts with a shorter one is reached through it (free text ends at the
        # shorter): the shorter one leads to the tags of both
        leads = [t for t in triggers if not any(o != t and t.startswith(o) for o in triggers)]
        for trigger in leads:
            pieces = self.pieces(trigger)
            if any(isinstance(p, int) for p in pieces[1:]):
                raise GrammarError(
                    f"structural_tag trigger {trigger!r}: a special token may only start a trigger"
                )
            if isinstance(pieces[0], int):  # the token ends the free text (no lazy lexeme)
                lead = self.rule(f"{free} {self.lit(trigger)}")
            else:
                lead = self.rule(f"{free} {_lit(trigger)}", "[lazy]")
            rests = []
            for tag in node["tags"]:
                if tag["begin"].startswith(trigger):
                    rest = {**tag, "type": "tag", "begin": tag["begin"][len(trigger) :]}
                    rests.append(self.tag(rest))
            if rests:
                alternatives.append(f"{lead} ({' | '.join(rests)})")
        one = self.rule(" | ".join(alternatives))
        first, more = node.get("stop_after_first", False), node.get("at_least_one", False)
        if first:
            return self.rule(one if more else f"{one} | {free}")
        return self.rule(f"{one}{'+' if more else '*'} {free}")

    def separated(self, node: Mapping[str, Any]) -> str:
        one = self.rule(" | ".join(self.tag({**t, "type": "tag"}) for t in node["tags"]))
        more, first = node.get("at_least_one", False), node.get("stop_after_first", False)
        if first:
            return self.rule(one if more else f"({one})?")
        many = f"{one} ({self.lit(node['separator'])} {one})*"
        return self.rule(many if more else f"({many})?")
