"""Typed IPC messages between the engine, the scheduler and the detokenizer, and their one codec.

Directions:
    engine -> scheduler:       BatchGenerateReq, AbortReq, FlushCacheReq, GetStateReq,
                               LoadLoraReq, UnloadLoraReq
    scheduler -> detokenizer:  BatchTokenOut
    detokenizer -> engine:     BatchStrOut
    scheduler -> engine:       ReadyOut, FlushCacheOut, StateOut, LoraOut (control replies go
                               straight back)
    any child -> engine:       ReadyOut on start-up
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

from weft.runtime.sampling_params import SamplingParams

LogprobEntry = tuple[float, int]  # (logprob, token id)


class FinishReason(msgspec.Struct, frozen=True):
    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None  # stop: the stop string, the regex match, or the stop token id
    length: int | None = None  # length: max_new_tokens that was reached
    message: str | None = None  # abort: why
    status: int | None = None  # abort caused by the request itself (e.g. 400: bad grammar)
    trim_offset: int | None = None  # stop string/regex: char offset of the match in the output text

    def to_dict(self) -> dict[str, Any]:
        if self.type == "length":
            return {"type": "length", "length": self.length}
        if self.type == "abort":
            out: dict[str, Any] = {"type": "abort", "message": self.message}
            if self.status is not None:
                out["status_code"] = self.status
            return out
        return {"type": "stop", "matched": self.matched}


class TokenizedGenerateReq(msgspec.Struct, tag=True):
    rid: str
    input_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # resolved by the engine: fits the context length and the KV pool
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] = msgspec.field(default_factory=list)
    stream: bool = False
    lora_path: str | None = None  # the LoRA adapter's name (EngineConfig.lora_paths); None: base


class BatchGenerateReq(msgspec.Struct, tag=True):
    """The requests of one generate call, sent together: the scheduler admits them in one step
    (sent one by one, the first arrivals started a prefill of their own)."""

    reqs: list[TokenizedGenerateReq]


class AbortReq(msgspec.Struct, tag=True):
    rid: str = ""
    abort_all: bool = False
    message: str = ""  # the finish reason's message; empty: "aborted by request"


class FlushCacheReq(msgspec.Struct, tag=True):
    pass


class GetStateReq(msgspec.Struct, tag=True):
    pass


class LoadLoraReq(msgspec.Struct, tag=True):
    """Load the PEFT adapter folder `path` as `name` while serving."""

    name: str
    path: str


class UnloadLoraReq(msgspec.Struct, tag=True):
    """Stop serving adapter `name`: new requests for it are refused at once; those already
    sent keep it until they finish."""

    name: str


class TokenOut(msgspec.Struct):
    """Progress of one request in one step (deltas since the last TokenOut of that request)."""

    rid: str
    new_ids: list[int]
    finish: FinishReason | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stop: list[str] = msgspec.field(default_factory=list)  # for streaming hold-back
    decode_prefix: list[int] = msgspec.field(default_factory=list)  # prompt tail: decode context
    # the scheduler decodes this request (stop strings or regex) one token at a time, and its
    # trim_offset indexes that text: the detokenizer must push the ids the same way
    token_by_token: bool = False
    output_logprobs: list[LogprobEntry] = msgspec.field(default_factory=list)
    output_top_logprobs: list[list[LogprobEntry]] = msgspec.field(default_factory=list)
    output_ids_logprobs: list[list[LogprobEntry]] = msgspec.field(default_factory=list)
    input_logprobs: list[tuple[float | None, int]] = msgspec.field(default_factory=list)
    input_top_logprobs: list[list[LogprobEntry]] = msgspec.field(default_factory=list)
    input_ids_logprobs: list[list[LogprobEntry]] = msgspec.field(default_factory=list)
    retractions: int = 0
    # speculative decoding: the request's verify steps, its drafts and those accepted
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    unenforced: list[str] = msgspec.field(default_factory=list)  # schema keywords not enforced


class BatchTokenOut(msgspec.Struct, tag=True):
    outs: list[TokenOut]


class StrOut(msgspec.Struct):
    """TokenOut plus the new text (already trimmed at a stop string, hold-back applied)."""

    text: str  # new text since the last StrOut of this request
    token: TokenOut
    full_text: str | None = None  # on finish: the whole output text


class BatchStrOut(msgspec.Struct, tag=True):
    outs: list[StrOut]


class ReadyOut(msgspec.Struct, tag=True):
    who: Literal["scheduler", "detokenizer"]
    info: dict[str, Any] = msgspec.field(default_factory=dict)
    error: str | None = None  # start-up failed: why


class FlushCacheOut(msgspec.Struct, tag=True):
    success: bool
    message: str


class StateOut(msgspec.Struct, tag=True):
    state: dict[str, Any]


class LoraOut(msgspec.Struct, tag=True):
    """The reply to LoadLoraReq / UnloadLoraReq: `status` 400 (a bad adapter) or 404 (an unknown
    name) when it failed; `adapters` (name -> path) are those served after it."""

    success: bool
    message: str
    adapters: dict[str, str]
    status: int = 200


Message = Union[  # noqa: UP007 (msgspec needs a typing.Union here)
    TokenizedGenerateReq,
    BatchGenerateReq,
    AbortReq,
    FlushCacheReq,
    GetStateReq,
    LoadLoraReq,
    UnloadLoraReq,
    BatchTokenOut,
    BatchStrOut,
    ReadyOut,
    FlushCacheOut,
    StateOut,
    LoraOut,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Decode a message; anything not one of ours raises msgspec.ValidationError/DecodeError."""
    return _decoder.decode(data)
