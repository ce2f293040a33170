"""EngineBackend: programs on an in-process `weft.Engine` (requests go over ZMQ, no HTTP)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from weft.lang.backends.native import NativeBackend, accumulate_meta
from weft.runtime.server.engine import Engine

_ENGINE_ARGS = (
    "sampling_params",
    "input_ids",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "token_ids_logprob",
    "return_text_in_logprobs",
    "lora_path",
)


class EngineBackend(NativeBackend):
    """Wrap an Engine, or start one from `weft.Engine` keyword arguments (then owned: shut down
    by `shutdown()`)."""

    def __init__(self, engine: Engine | None = None, **engine_kwargs: Any) -> None:
        super().__init__()
        if engine is not None and engine_kwargs:
            raise ValueError("EngineBackend: give an engine or engine options, not both")
        self._owned = engine is None
        self.engine = engine if engine is not None else Engine(**engine_kwargs)
        self.tokenizer = self.engine.tokenizer

    def _kwargs(self, payload: dict[str, Any]) -> dict[str, Any]:
        kwargs = {k: payload[k] for k in _ENGINE_ARGS if k in payload}
        kwargs["prompt"] = payload.get("text")
        return kwargs

    def _generate(self, payload: dict[str, Any]) -> Any:
        return self.engine.generate(**self._kwargs(payload))

    def _generate_stream(self, payload: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
        meta: dict[str, Any] = {}
        deltas = self.engine.generate(**self._kwargs(payload), stream=True)
        assert not isinstance(deltas, (dict, list))
        for delta in deltas:
            meta = accumulate_meta(meta, delta["meta_info"])
            yield delta["text"], meta

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        return [list(self.tokenizer.encode(t)) for t in texts]

    def _render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return str(text)

    def _auto_prefix(self) -> str:
        tok = self.tokenizer
        bos = tok.bos_token_id
        if bos is None or not tok.bos_token:
            return ""
        with_special = tok.encode("a")
        without = tok.encode("a", add_special_tokens=False)
        return str(tok.bos_token) if with_special[:1] == [bos] and without[:1] != [bos] else ""

    def flush_cache(self) -> bool:
        return self.engine.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return {**self.engine.server_info, "model_path": str(self.engine.model_path)}

    def shutdown(self) -> None:
        if self._owned:
            self.engine.shutdown()
