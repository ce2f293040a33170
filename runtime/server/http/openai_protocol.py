"""OpenAI API requests: the /v1 request models (with SGLang's extensions), checked into a clear 400."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from weft.constrain import GrammarError, GrammarSpec
from weft.runtime.server.http.errors import BadRequest
from weft.runtime.server.http.tool_calls import ToolPlan, plan_tools
from weft.runtime.server.http.tool_parser import ToolFormat

# Known fields weft cannot honour: a 400 naming the field when one is set (not null).
UNSUPPORTED_FIELDS = {
    "suffix": "suffix (insertion) is not supported by this server",
    "functions": "functions is deprecated and not supported: use tools",
    "function_call": "function_call is deprecated and not supported: use tool_choice",
    "audio": "audio output is not supported by this server",
    "prediction": "predicted outputs (prediction) are not supported by this server",
    "return_hidden_states": "return_hidden_states is not supported by this server",
    "session_params": "session_params is not supported by this server",
}
# How a field with a union type is described when none of its forms matches.
_EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "stop_regex": "a string or a list of strings",
    "rid": "a string or a list of strings",
    "tool_choice": '"none", "auto", "required" or {"type": "function", "function": {"name"}}',
}


_SEED_MOD = 2**64  # OpenAI seeds are int64, sampling_seed is uint64
# request fields passed to SamplingParams under the same name
_SAME_NAME = (
    "stop stop_token_ids stop_regex temperature top_p top_k min_p frequency_penalty presence_penalty"
    " repetition_penalty n ignore_eos skip_special_tokens spaces_between_special_tokens no_stop_trim"
    " logit_bias thinking_budget"
).split()


class _Strict(BaseModel):
    # strict: JSON types are not coerced ("16" is not an int, true is not a number)
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaSpec(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    # extra allowed: structural_tag carries its own fields (structures and triggers, or format)
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaSpec | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # bare schema, SGLang accepts it


class FunctionDef(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class _Common(_Strict):
    """Fields shared by both endpoints: OpenAI's, then SGLang's extensions (sent at top level)."""

    model: str = "default"
    n: int = Field(1, ge=1)  # capped by weft serve --max-n
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    response_format: ResponseFormat | None = None
    # SGLang extensions
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = Field(None, ge=0)
    repetition_penalty: float | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    no_stop_trim: bool | None = None
    ignore_eos: bool | None = None
    thinking_budget: int | None = Field(None, ge=0)  # reasoning tokens before </think> is forced
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    rid: str | list[str] | None = None
    # accepted and ignored: user, store, metadata, service_tier, prompt_cache_key,
    # safety_identifier, cache_salt, priority (and on chat separate_reasoning,
    # reasoning_effort); refused when set: UNSUPPORTED_FIELDS
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_salt: str | None = None
    priority: int | None = None
    lora_path: str | None = None  # SGLang's: the adapter's name (model="base:name" does the same)
    return_hidden_states: Any = None
    session_params: Any = None

    def sampling_params(
        self, max_new_tokens: int | None, defaults: Mapping[str, Any]
    ) -> dict[str, Any]:
        """SGLang sampling_params; a None field keeps its default (`defaults`, then weft's), except
        max_new_tokens, where None means up to the context length."""
        params: dict[str, Any] = {
            "min_new_tokens": self.min_tokens,
            "sampling_seed": None if self.seed is None else self.seed % _SEED_MOD,
            **{k: getattr(self, k) for k in _SAME_NAME},
            **self.constraint(),
        }
        for key, value in defaults.items():
            if params.get(key) is None:
                params[key] = value
        return {
            "max_new_tokens": max_new_tokens,
            **{k: v for k, v in params.items() if v is not None},
        }

    def constraint(self) -> dict[str, Any]:
        """json_schema / regex / ebnf / structural_tag, from the extension fields or from
        response_format (whose `strict: true` refuses schema keywords the grammar cannot enforce:
        strict_json_schema)."""
        out = {k: getattr(self, k) for k in ("json_schema", "regex", "ebnf")}
        out = {k: v for k, v in out.items() if v is not None}
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return out
        if out:
            raise BadRequest(
                "response_format cannot be combined with json_schema, regex or ebnf",
                400,
                "response_format",
            )
        if fmt.type == "structural_tag":
            return {"structural_tag": _structural_tag(fmt)}
        schema = _format_schema(fmt)
        spec = fmt.json_schema
        if spec is not None and spec.strict:
            return {"json_schema": schema, "strict_json_schema": True}
        return {"json_schema": schema}


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, gt=0)  # null: up to the context length
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)  # capped by weft serve --max-top-logprobs
    best_of: int | None = Field(None, ge=1)
    suffix: Any = None


class ChatCompletionRequest(_Common):
    messages: Any  # checked by weft.runtime.server.chat.normalize_messages
    max_tokens: int | None = Field(None, gt=0)  # deprecated by OpenAI for max_completion_tokens
    max_completion_tokens: int | None = Field(None, gt=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)  # capped by --max-top-logprobs
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool | None = None
    return_cached_tokens_details: bool = False
    reasoning_effort: str | None = None
    modalities: list[Literal["text"]] | None = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None

    def tool_plan(self, tool_format: ToolFormat = "hermes") -> ToolPlan:
        """What tools / tool_choice / parallel_tool_calls ask (weft.runtime.server.http.tool_calls), for
        a model whose chat template asks for `tool_format` calls."""
        tools = [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None
        asked = self.tool_choice
        choice = asked.model_dump() if isinstance(asked, NamedToolChoice) else asked
        return plan_tools(tools, choice, self.parallel_tool_calls, tool_format)


def _format_schema(fmt: ResponseFormat) -> str:
    if fmt.type == "json_object":
        return '{"type": "object"}'
    schema = fmt.json_schema.schema_ if fmt.json_schema is not None else fmt.schema_
    if schema is None:
        raise BadRequest(
            "response_format json_schema needs a schema (response_format.json_schema.schema)",
            400,
            "response_format",
        )
    return json.dumps(schema)


def _structural_tag(fmt: ResponseFormat) -> str:
    """The structural_tag sampling parameter (canonical JSON), checked here for a clear 400."""
    if fmt.json_schema is not None or fmt.schema_ is not None:
        raise BadRequest(
            "response_format structural_tag takes structures and triggers, or a format; not a schema",
            400,
            "response_format",
        )
    try:
        return GrammarSpec.structural_tag(dict(fmt.model_extra or {})).spec
    except GrammarError as e:
        raise BadRequest(f"response_format: {e}", 400, "response_format") from None


M = TypeVar("M", bound=BaseModel)


def parse_request(cls: type[M], body: Any) -> M:
    """Validate a /v1 body; a BadRequest (400) naming the first bad field, never pydantic's dump."""
    if not isinstance(body, Mapping):
        raise ValueError("the request body must be a JSON object")
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        raise _bad_request(e) from None
    for name, why in UNSUPPORTED_FIELDS.items():
        if name in cls.model_fields and getattr(req, name) is not None:
            raise BadRequest(why, 400, name)
    return req


def _bad_request(e: ValidationError) -> BadRequest:
    errors = e.errors()
    first = errors[0]
    loc = [str(x) for x in first["loc"]]
    field = loc[0] if loc else "body"
    path = ".".join(loc) or "body"
    if field in _EXPECTED and sum(1 for err in errors if err["loc"][:1] == (field,)) > 1:
        return BadRequest(f"{field} must be {_EXPECTED[field]}, got {_shown(first)}", 400, field)
    if first["type"] == "missing":
        return BadRequest(f"{path} is required", 400, field)
    if first["type"] == "extra_forbidden":
        return BadRequest(f"unknown field {path!r}: not an OpenAI or weft field", 400, field)
    return BadRequest(f"{path}: {first['msg']}, got {_shown(first)}", 400, field)


def _shown(err: Any) -> str:
    text = repr(err.get("input"))
    return text if len(text) <= 80 else text[:77] + "..."
