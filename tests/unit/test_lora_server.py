"""LoRA adapters through a real `weft serve` (tiny random Llama, --skip-tokenizer-init, CPU) and
the offline Engine: /generate's lora_path (one or one per prompt) and the openai client's
model="base:name" give peft's merged-model tokens; /v1/models lists the adapters; adapters are
loaded and unloaded while serving (a running request keeps its adapter; a reloaded name never
hits its old KV); bad adapters and unknown names are 400/404 with a message, and serving goes on."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from lora_helpers import NEW_TOKENS, PROMPTS, build_lora_setup, save_adapter

import weft

pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[test]')")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

BASE = "tiny"
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
SERVED = ("all", "rs")  # --lora-paths; "attn" is loaded while serving


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path], dict]:
    root = tmp_path_factory.mktemp("lora-server")
    base, folders, expected = build_lora_setup(root)
    # r=16 is above the pool's rank (8, the largest adapter at start)
    save_adapter(root / "rank16", {"r": 16, "lora_alpha": 16, "target_modules": ["q_proj"]}, 9)
    folders["rank16"] = root / "rank16"
    weights = (folders["attn"] / "adapter_model.safetensors").read_bytes()
    (root / "truncated").mkdir()  # a broken weights file
    (root / "truncated" / "adapter_model.safetensors").write_bytes(weights[: len(weights) // 2])
    (root / "truncated" / "adapter_config.json").write_bytes(
        (folders["attn"] / "adapter_config.json").read_bytes()
    )
    folders["truncated"] = root / "truncated"
    return base, folders, expected


@pytest.fixture(scope="module")
def server(setup: tuple, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from support import ServerProcess

    base, folders, _ = setup
    loras = [f"{n}={folders[n]}" for n in SERVED]
    args = ["--model", str(base), "--served-model-name", BASE, "--skip-tokenizer-init",
            "--cpu-threads", "1", "--lora-paths", *loras]  # fmt: skip
    proc = ServerProcess(args, tmp_path_factory.mktemp("lora-serve") / "serve.log")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def post(server: Any, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def generate(server: Any, prompt: int, lora: str | None, **params: Any) -> dict[str, Any]:
    body = {"input_ids": PROMPTS[prompt], "sampling_params": {**GREEDY, **params}}
    resp = post(server, "/generate", {**body, "lora_path": lora})
    assert resp.status_code == 200, resp.text
    return resp.json()


def error_of(resp: httpx.Response, status: int) -> str:
    assert resp.status_code == status, resp.text
    return str(resp.json()["error"]["message"])


def test_generate_lora_path_equals_the_merged_model(server: Any, setup: tuple) -> None:
    expected = setup[2]
    for name in (*SERVED, None):
        assert generate(server, 0, name)["output_ids"] == expected[name, 0], name
    names = ["all", None, "rs"]  # one adapter per prompt of a batch
    body = {"input_ids": PROMPTS, "sampling_params": GREEDY, "lora_path": names}
    outs = post(server, "/generate", body).json()
    assert [o["output_ids"] for o in outs] == [expected[n, i] for i, n in enumerate(names)]
    message = error_of(post(server, "/generate", {**body, "lora_path": ["all"]}), 400)
    assert "lora_path has 1 entries but the batch has 3 prompts" in message
    unknown = {"input_ids": PROMPTS[0], "lora_path": "nope"}
    message = error_of(post(server, "/generate", unknown), 400)
    assert message == "unknown LoRA adapter 'nope' (loaded: all, rs)"


def test_openai_model_names_the_adapter(server: Any, setup: tuple) -> None:
    expected = setup[2]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
    models = {m.id: m for m in client.models.list().data}
    assert list(models)[:3] == [BASE, *SERVED]
    assert models["rs"].model_extra["parent"] == BASE and models[BASE].model_extra["parent"] is None
    assert httpx.get(f"{server.url}/v1/models/rs").json()["root"] == str(setup[1]["rs"])
    for model, name in ((f"{BASE}:rs", "rs"), ("all", "all"), (BASE, None)):
        out = client.completions.create(
            model=model, prompt=PROMPTS[1], max_tokens=NEW_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert out.model == model
        assert out.choices[0].model_extra["output_ids"] == expected[name, 1], model
    with pytest.raises(openai.NotFoundError, match="no LoRA adapter 'nope' is loaded"):
        client.completions.create(model=f"{BASE}:nope", prompt=PROMPTS[1], max_tokens=1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt=PROMPTS[1], max_tokens=1)


def test_bad_adapters_are_refused_and_serving_goes_on(server: Any, setup: tuple) -> None:
    folders, expected = setup[1], setup[2]
    cases = [
        ({"lora_name": "x", "lora_path": "/no/such/folder"}, "is not a folder"),
        ({"lora_name": "x", "lora_path": str(folders["rank16"])}, "max_lora_rank=8"),
        ({"lora_name": "x", "lora_path": str(folders["truncated"])}, "adapter_model.safetensors"),
        ({"lora_name": "rs", "lora_path": str(folders["attn"])}, "already loaded"),
        ({"lora_name": BASE, "lora_path": str(folders["attn"])}, "the base model's name"),
        ({"lora_name": "x"}, "lora_path must be a non-empty string"),
    ]
    for body, match in cases:
        assert match in error_of(post(server, "/load_lora_adapter", body), 400), body
    message = error_of(post(server, "/unload_lora_adapter", {"lora_name": "nope"}), 404)
    assert message == "unknown LoRA adapter 'nope' (loaded: all, rs)"
    assert generate(server, 2, "rs")["output_ids"] == expected["rs", 2]


def test_load_and_unload_while_serving(server: Any, setup: tuple) -> None:
    folders, expected = setup[1], setup[2]
    load = {"lora_name": "attn", "lora_path": str(folders["attn"])}
    reply = post(server, "/load_lora_adapter", load).json()
    assert reply["success"] and list(reply["loaded_adapters"]) == ["all", "rs", "attn"]
    assert generate(server, 1, "attn")["output_ids"] == expected["attn", 1]
    assert "attn" in [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]
    assert post(server, "/unload_lora_adapter", {"lora_name": "attn"}).json()["success"]
    message = error_of(post(server, "/generate", {"input_ids": [5], "lora_path": "attn"}), 400)
    assert "unknown LoRA adapter 'attn'" in message
    # the name again, another adapter: its KV is its own (no prefix of the old one is hit)
    post(server, "/load_lora_adapter", {"lora_name": "attn", "lora_path": str(folders["rs"])})
    again = generate(server, 1, "attn")
    assert again["output_ids"] == expected["rs", 1] and again["meta_info"]["cached_tokens"] == 0
    assert post(server, "/unload_lora_adapter", {"lora_name": "attn"}).json()["success"]


def test_unload_while_a_request_runs(server: Any, setup: tuple) -> None:
    folders, expected = setup[1], setup[2]
    body = {"input_ids": PROMPTS[0], "lora_path": "all", "stream": True,
            "sampling_params": {**GREEDY, "max_new_tokens": 200}}  # fmt: skip
    started, events = threading.Event(), []

    def run() -> None:
        with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    started.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(30)
    assert post(server, "/unload_lora_adapter", {"lora_name": "all"}).json()["success"]
    assert "unknown LoRA adapter 'all'" in error_of(
        post(server, "/generate", {"input_ids": [5], "lora_path": "all"}), 400
    )
    thread.join(60)
    last = events[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 200}, last
    assert last["output_ids"][:NEW_TOKENS] == expected["all", 0]
    load = {"lora_name": "all", "lora_path": str(folders["all"])}  # retired: loads again
    assert post(server, "/load_lora_adapter", load).json()["success"]
    assert generate(server, 0, "all")["output_ids"] == expected["all", 0]


def test_engine_lora_api(setup: tuple) -> None:
    base, folders, expected = setup
    loras = {n: folders[n] for n in SERVED}
    with weft.Engine(str(base), skip_tokenizer_init=True, cpu_threads=1, lora_paths=loras) as eng:
        outs = eng.generate(
            input_ids=PROMPTS, sampling_params=GREEDY, lora_path=["rs", None, "all"]
        )
        assert isinstance(outs, list)
        assert [o["output_ids"] for o in outs] == [
            expected["rs", 0],
            expected[None, 1],
            expected["all", 2],
        ]
        assert list(eng.load_lora_adapter("attn", str(folders["attn"]))) == [*SERVED, "attn"]
        out = eng.generate(input_ids=PROMPTS[2], sampling_params=GREEDY, lora_path="attn")
        assert isinstance(out, dict) and out["output_ids"] == expected["attn", 2]
        assert list(eng.unload_lora_adapter("attn")) == list(SERVED)
        with pytest.raises(ValueError, match="unknown LoRA adapter 'attn'"):
            eng.generate(input_ids=PROMPTS[2], sampling_params=GREEDY, lora_path="attn")
        with pytest.raises(ValueError, match="max_lora_rank"):
            eng.load_lora_adapter("big", str(folders["rank16"]))
