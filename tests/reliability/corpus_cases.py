"""The bad-input corpus: malformed requests to both HTTP APIs, each with the status it must get.

Every case is a request a client could send by mistake or on purpose; none depends on a size cap.
`body` is sent as Python's json.dumps writes it (NaN and Infinity included, lone surrogates as
"\\ud800" escapes); `raw` bytes go out as they are. `says` is a piece of the error message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

D = "\ud800"  # a lone high surrogate (json.dumps escapes it: "\\ud800")
L = "\udc00"  # a lone low surrogate
DEEP = b"[" * 100_000 + b"]" * 100_000  # RecursionError in a recursive parser
NAN = float("nan")
INF = float("inf")
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
USER = [{"role": "user", "content": "hi"}]


@dataclass(frozen=True)
class Case:
    id: str
    path: str
    body: Any = None
    raw: bytes | None = None
    status: int = 400
    method: str = "POST"
    content_type: str | None = "application/json"
    says: str = ""

    @property
    def openai(self) -> bool:
        return self.path.startswith("/v1/")


def nested(prefix: str, depth: int, suffix: str) -> bytes:
    """A JSON body with `depth` nested arrays between prefix and suffix (parses, too deep)."""
    return (prefix + "[" * depth + "]" * depth + suffix).encode()


def gen(id: str, body: Any, says: str = "", stream: bool = False) -> Case:
    body = {**body, "stream": True} if stream else body
    return Case(f"generate-{id}", "/generate", body, says=says)


def sp(id: str, says: str = "", stream: bool = False, **params: Any) -> Case:
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2, **params}}
    return gen(f"sp-{id}", body, says, stream)


def cmpl(id: str, says: str = "", status: int = 400, **fields: Any) -> Case:
    body = {"prompt": "hi", "max_tokens": 2, **fields}
    body = {k: v for k, v in body.items() if v is not ...}
    return Case(f"completions-{id}", "/v1/completions", body, status=status, says=says)


def chat(id: str, says: str = "", status: int = 400, **fields: Any) -> Case:
    body = {"messages": USER, "max_tokens": 2, **fields}
    body = {k: v for k, v in body.items() if v is not ...}
    return Case(f"chat-{id}", "/v1/chat/completions", body, status=status, says=says)


def msg(id: str, messages: Any, says: str = "", stream: bool = False) -> Case:
    return chat(f"messages-{id}", says, messages=messages, stream=stream)


def body_cases(path: str, name: str) -> list[Case]:
    """What any JSON route must refuse: no body, not JSON, not an object, not text, too deep."""
    return [
        Case(f"{name}-empty-body", path, raw=b"", says="empty"),
        Case(f"{name}-truncated-json", path, raw=b'{"text": "hi", ', says="malformed JSON"),
        Case(f"{name}-single-quotes", path, raw=b"{'text': 'hi'}", says="malformed JSON"),
        Case(f"{name}-trailing-garbage", path, raw=b'{"a": 1} x', says="malformed JSON"),
        Case(f"{name}-null", path, raw=b"null"),
        Case(f"{name}-list", path, raw=b"[]"),
        Case(f"{name}-string", path, raw=b'"hi"'),
        Case(f"{name}-number", path, raw=b"42"),
        Case(f"{name}-invalid-utf8", path, raw=b'{"text": "\xff\xfe hi"}', says="UTF-8"),
        Case(f"{name}-utf8-encoded-surrogate", path, raw=b'{"text": "\xed\xa0\x80"}', says="UTF-8"),
        Case(f"{name}-deep-100k", path, raw=DEEP, says="deeper than"),
        Case(f"{name}-deep-200-inside", path, raw=nested('{"x": ', 200, "}"), says="deeper than"),
        Case(f"{name}-surrogate-key", path, body={D: 1}, says="surrogate"),
        Case(f"{name}-5000-digit-int", path, raw=b'{"x": 1' + b"0" * 5000 + b"}", says="number"),
    ]


NATIVE_BODY = [
    *body_cases("/generate", "generate"),
    *body_cases("/tokenize", "tokenize"),
    *body_cases("/detokenize", "detokenize"),
    *body_cases("/apply_chat_template", "chat-template"),
    *body_cases("/abort_request", "abort"),
]

GENERATE = [
    gen("no-prompt", {"sampling_params": {"max_new_tokens": 2}}, "either text"),
    gen("text-and-ids", {"text": "hi", "input_ids": [1, 2]}, "exactly one"),
    gen("text-int", {"text": 5}, "text must be"),
    gen("text-bool", {"text": True}),
    gen("text-object", {"text": {"a": "b"}}),
    gen("text-empty", {"text": ""}, "empty"),
    gen("text-empty-batch", {"text": []}, "empty"),
    gen("text-nested-list", {"text": [["a"]]}),
    gen("text-list-with-int", {"text": ["a", 1]}),
    gen("ids-string", {"input_ids": "abc"}),
    gen("ids-empty", {"input_ids": []}),
    gen("ids-empty-row", {"input_ids": [[1], []]}),
    gen("ids-negative", {"input_ids": [-1]}, "negative"),
    gen("ids-float", {"input_ids": [1.5]}),
    gen("ids-bool", {"input_ids": [True]}),
    gen("ids-out-of-vocab", {"input_ids": [49152]}, "vocab"),
    gen("ids-huge", {"input_ids": [10**30]}, "vocab"),
    gen("ids-mixed-rows", {"input_ids": [[1], 2]}),
    gen("ids-object", {"input_ids": {"a": 1}}),
    gen("params-string", {"text": "hi", "sampling_params": "greedy"}),
    gen("params-number", {"text": "hi", "sampling_params": 5}),
    gen("params-list-single", {"text": "hi", "sampling_params": [{}]}, "not a batch"),
    gen("params-list-short", {"text": ["a", "b"], "sampling_params": [{}]}, "entries"),
    gen("params-mixed-n", {"text": ["a", "b"], "sampling_params": [{"n": 2}, {}]}, "same"),
    gen("unknown-field", {"text": "hi", "prompt": "hi"}, "unknown"),
    gen("unsupported-image", {"text": "hi", "image_data": "x.png"}, "not supported"),
    gen("unsupported-embeds", {"input_embeds": [[0.1]]}, "not supported"),
    gen("rid-int", {"text": "hi", "rid": 5}),
    gen("rid-empty", {"text": "hi", "rid": ""}),
    gen("rid-list-single", {"text": "hi", "rid": ["a"]}),
    gen("rid-duplicates", {"text": ["a", "b"], "rid": ["r", "r"]}, "unique"),
    gen("rid-surrogate", {"text": "hi", "rid": D}, "surrogate"),
    gen("return-logprob-string", {"text": "hi", "return_logprob": "yes"}),
    gen("logprob-start-below", {"text": "hi", "return_logprob": True, "logprob_start_len": -2}),
    gen(
        "logprob-start-past-prompt", {"text": "hi", "return_logprob": True, "logprob_start_len": 99}
    ),
    gen("top-logprobs-negative", {"text": "hi", "return_logprob": True, "top_logprobs_num": -1}),
    gen(
        "token-ids-logprob-oov",
        {"text": "hi", "return_logprob": True, "token_ids_logprob": [10**9]},
    ),
    gen("token-ids-logprob-string", {"text": "hi", "token_ids_logprob": "1"}),
    gen("stream-string", {"text": "hi", "stream": "yes"}),
    gen("text-surrogate", {"text": f"a{D}b"}, "surrogate"),
    gen("text-reversed-pair", {"text": L + D}, "surrogate"),
    gen("text-batch-surrogate", {"text": ["ok", D]}, "surrogate"),
    gen("stream-text-surrogate", {"text": D}, "surrogate", stream=True),
    gen("stream-no-prompt", {"sampling_params": {}}, stream=True),
    sp("unknown-param", says="unknown sampling parameter", max_tokens=2),
    sp("max-new-string", max_new_tokens="5"),
    sp("max-new-float", max_new_tokens=1.5),
    sp("max-new-negative", max_new_tokens=-1),
    sp("max-new-nan", max_new_tokens=NAN),
    sp("max-new-over-context", max_new_tokens=10**6, says="context length"),
    sp("max-new-over-int64", max_new_tokens=10**30),
    sp("min-new-over-max", min_new_tokens=5),
    sp("min-new-huge", min_new_tokens=10**30, max_new_tokens=None),
    sp("temperature-string", temperature="hot"),
    sp("temperature-negative", temperature=-1),
    sp("temperature-nan", temperature=NAN),
    sp("temperature-inf", temperature=INF),
    sp("temperature-bool", temperature=True),
    sp("top-p-zero", top_p=0),
    sp("top-p-over-one", top_p=1.5),
    sp("top-k-zero", top_k=0),
    sp("top-k-float", top_k=1.5),
    sp("top-k-huge", top_k=10**30),
    sp("min-p-over-one", min_p=2),
    sp("frequency-penalty-high", frequency_penalty=3),
    sp("presence-penalty-nan", presence_penalty=NAN),
    sp("repetition-penalty-zero", repetition_penalty=0),
    sp("n-zero", n=0),
    sp("n-string", n="2"),
    sp("stop-int", stop=5),
    sp("stop-list-int", stop=[1]),
    sp("stop-empty-string", stop=""),
    sp("stop-list-empty-string", stop=["ok", ""]),
    sp("stop-object", stop={"a": 1}),
    sp("stop-surrogate", stop=[D], says="surrogate"),
    sp("stop-token-ids-string", stop_token_ids="2"),
    sp("stop-token-ids-negative", stop_token_ids=[-1]),
    sp("stop-token-ids-oov", stop_token_ids=[49152]),
    sp("stop-regex-invalid", stop_regex="("),
    sp("stop-regex-empty", stop_regex=[""]),
    sp("stop-regex-surrogate", stop_regex=L, says="surrogate"),
    sp("json-schema-int", json_schema=5),
    sp("json-schema-not-json", json_schema="{"),
    sp("json-schema-list", json_schema="[]"),
    sp("json-schema-bad-type", json_schema={"type": 5}),
    sp("json-schema-bad-ref", json_schema={"$ref": "#/nowhere"}),
    sp("regex-invalid", regex="("),
    sp("regex-int", regex=5),
    sp("regex-and-schema", regex="a", json_schema="{}", says="only one"),
    sp("ebnf-int", ebnf=5),
    sp("structural-tag-not-json", structural_tag="x"),
    sp("structural-tag-no-triggers", structural_tag={"structures": []}),
    sp("strict-without-schema", strict_json_schema=True),
    sp("ignore-eos-string", ignore_eos="yes"),
    sp("skip-special-int", skip_special_tokens=1),
    sp("logit-bias-list", logit_bias=[1]),
    sp("logit-bias-bad-key", logit_bias={"abc": 1}),
    sp("logit-bias-negative-key", logit_bias={"-1": 1}),
    sp("logit-bias-oov-key", logit_bias={"49152": 1}),
    sp("logit-bias-string-value", logit_bias={"1": "x"}),
    sp("logit-bias-nan", logit_bias={"1": NAN}),
    sp("seed-negative", sampling_seed=-1),
    sp("seed-too-big", sampling_seed=2**64),
    sp("stream-regex-invalid", stream=True, regex="("),
    sp("stream-temperature-nan", stream=True, temperature=NAN),
    sp("stream-json-schema-bad-type", stream=True, json_schema={"type": "nope"}),
]

NATIVE_OTHER = [
    Case("tokenize-no-prompt", "/tokenize", {}),
    Case("tokenize-prompt-int", "/tokenize", {"prompt": 5}),
    Case("tokenize-prompt-empty-list", "/tokenize", {"prompt": []}),
    Case("tokenize-prompt-ids", "/tokenize", {"prompt": [1, 2]}),
    Case("tokenize-add-special-string", "/tokenize", {"prompt": "hi", "add_special_tokens": "y"}),
    Case("tokenize-surrogate", "/tokenize", {"prompt": ["ok", D]}, says="surrogate"),
    Case("detokenize-no-tokens", "/detokenize", {}),
    Case("detokenize-tokens-string", "/detokenize", {"tokens": "abc"}),
    Case("detokenize-floats", "/detokenize", {"tokens": [1.5]}),
    Case("detokenize-negative", "/detokenize", {"tokens": [-1]}),
    Case("detokenize-oov", "/detokenize", {"tokens": [49152]}, says="vocabulary"),
    Case("detokenize-bools", "/detokenize", {"tokens": [True]}),
    Case("chat-template-no-messages", "/apply_chat_template", {}),
    Case("chat-template-messages-string", "/apply_chat_template", {"messages": "hi"}),
    Case("chat-template-bad-role", "/apply_chat_template", {"messages": [{"role": "robot"}]}),
    Case(
        "chat-template-gen-prompt-string",
        "/apply_chat_template",
        {"messages": USER, "add_generation_prompt": "yes"},
    ),
    Case("chat-template-tools-string", "/apply_chat_template", {"messages": USER, "tools": "x"}),
    Case(
        "chat-template-continue-user",
        "/apply_chat_template",
        {"messages": USER, "continue_final_message": True},
        says="assistant",
    ),
    Case(
        "chat-template-surrogate",
        "/apply_chat_template",
        {"messages": [{"role": "user", "content": D}]},
        says="surrogate",
    ),
    Case("abort-rid-int", "/abort_request", {"rid": 5}),
    Case("abort-all-string", "/abort_request", {"abort_all": "yes"}),
    Case("abort-rid-surrogate", "/abort_request", {"rid": D}, says="surrogate"),
    Case("flush-timeout-string", "/flush_cache?timeout=abc", method="POST", content_type=None),
    Case("flush-timeout-nan", "/flush_cache?timeout=nan", method="POST", content_type=None),
    Case("flush-timeout-inf", "/flush_cache?timeout=inf", method="GET", content_type=None),
]
