"""RuntimeEndpoint: programs on a `weft serve` (or SGLang) server through its native HTTP API."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

from weft.lang.backends.base import BackendError
from weft.lang.backends.native import NativeBackend, merge_stream_meta


class RuntimeEndpoint(NativeBackend):
    """`RuntimeEndpoint("http://127.0.0.1:30000", api_key=None)`.

    Calls /get_model_info once (so a wrong URL fails here), then /generate (text, streaming with
    cumulative SSE text, prompt logprobs for select, prefill-only warming), /tokenize, and
    /apply_chat_template for the model's own chat template. A server without that route (an
    SGLang server) is served by the tokenizer named in its model info, loaded locally.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        verify: Any = True,
        timeout: float = 600.0,
        transport: Any = None,  # an httpx transport (tests use httpx.MockTransport)
    ) -> None:
        super().__init__()
        try:
            import httpx
        except ImportError:  # pragma: no cover - httpx comes with the test extra
            raise ImportError("RuntimeEndpoint needs httpx: pip install httpx") from None
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            verify=verify,
            timeout=httpx.Timeout(timeout, connect=10.0, pool=None),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
            transport=transport,
        )
        self.model_info: dict[str, Any] = self._request("GET", "/get_model_info")
        self._local_tokenizer: Any = None
        self._tok_lock = threading.Lock()

    ##### HTTP #####

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        import httpx

        try:
            resp = self._client.request(method, path, json=body)
        except httpx.HTTPError as e:
            raise BackendError(f"{method} {self.base_url}{path} failed: {e}") from e
        if resp.status_code != 200:
            raise BackendError(f"{method} {path}: HTTP {resp.status_code}: {_message(resp.text)}")
        ctype = resp.headers.get("content-type", "")
        return resp.json() if "json" in ctype else resp.text

    def _generate(self, payload: dict[str, Any]) -> Any:
        return self._request("POST", "/generate", payload)

    def _generate_stream(self, payload: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
        import httpx

        seen = 0
        meta: dict[str, Any] = {}
        try:
            with self._client.stream("POST", "/generate", json=payload) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise BackendError(
                        f"POST /generate: HTTP {resp.status_code}: {_message(resp.text)}"
                    )
                for line in resp.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise BackendError(
                            f"POST /generate (stream): {_message(json.dumps(event))}"
                        )
                    text = event["text"]  # cumulative
                    meta = merge_stream_meta(meta, event["meta_info"])
                    yield text[seen:], meta
                    seen = len(text)
        except httpx.HTTPError as e:
            raise BackendError(f"POST {self.base_url}/generate failed: {e}") from e

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        out = self._request("POST", "/tokenize", {"prompt": texts})
        return [list(t) for t in out["tokens"]]

    def _render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        body = {"messages": messages, "add_generation_prompt": add_generation_prompt}
        if self._local_tokenizer is None:
            try:
                return str(self._request("POST", "/apply_chat_template", body)["text"])
            except BackendError as e:
                if "HTTP 404" not in str(e):
                    raise
        tok = self._tokenizer_for_template()
        return str(
            tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        )

    def _tokenizer_for_template(self) -> Any:
        with self._tok_lock:
            if self._local_tokenizer is None:
                from transformers import AutoTokenizer

                path = self.model_info.get("tokenizer_path") or self.model_info.get("model_path")
                try:
                    self._local_tokenizer = AutoTokenizer.from_pretrained(path)
                except Exception as e:  # any loader failure: say what to do instead
                    raise BackendError(
                        f"the server has no /apply_chat_template route and its tokenizer "
                        f"{path!r} cannot be loaded here ({e}); roles need the chat template"
                    ) from e
            return self._local_tokenizer

    def _auto_prefix(self) -> str:
        with_special = self._request("POST", "/tokenize", {"prompt": "a"})["tokens"]
        without = self._request("POST", "/tokenize", {"prompt": "a", "add_special_tokens": False})[
            "tokens"
        ]
        if len(with_special) == len(without) + 1 and with_special[1:] == without:
            return str(self._request("POST", "/detokenize", {"tokens": with_special[:1]})["text"])
        return ""

    def flush_cache(self) -> bool:
        try:
            self._request("POST", "/flush_cache")
        except BackendError as e:
            if "HTTP 400" in str(e):  # requests in flight: nothing was flushed
                return False
            raise
        return True

    def get_server_info(self) -> dict[str, Any]:
        info: dict[str, Any] = self._request("GET", "/server_info")
        return info

    def shutdown(self) -> None:
        self._client.close()


def _message(body: str) -> str:
    """The error message of a JSON error body ({"error": {"message"}} or {"error": str})."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.strip()
    err = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(err, dict):
        return str(err.get("message", err))
    return str(err)
