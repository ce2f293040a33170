"""LoRA adapters in the DSL: `gen(..., lora=name)`, `select(..., lora=name)` and the program's
default `run(lora=name)` / `run_batch(lora=name)`. On a tiny random Llama with two PEFT adapters
(lora_helpers) and a word tokenizer ("w5 w17 ..." is token ids [5, 17, ...]): each gen gives its
adapter's greedy tokens (those of HF's merged model, and of Engine.generate(lora_path=...)), a
per-gen adapter overrides the default, fork branches keep the default (their shared prefix is
warmed under it), select scores under the adapter; the request bodies carry `lora_path` only when
an adapter is asked for; an unknown adapter fails the program as any failed request does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from lora_helpers import ADAPTERS, NEW_TOKENS, PROMPTS, build_lora_setup

import weft
from weft.lang import FakeBackend

pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[test]')")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

NAMES = ("all", "rs")  # the adapters served
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


def words(ids: list[int]) -> str:
    """The text of token ids under the word tokenizer, as a continuation (" w5 w17 ...")."""
    return "".join(f" w{i}" for i in ids)


PROMPT_TEXT = [words(p).lstrip() for p in PROMPTS]


@weft.function
def two_gens(s: Any, prompt: str) -> None:
    s += prompt + weft.gen("a")  # the program's default adapter
    s += weft.gen("b", lora="rs")  # this one's own


@weft.function
def forked(s: Any, prompt: str) -> None:
    s += prompt
    forks = s.fork(2)
    forks[0] += weft.gen("x")  # inherits the run's adapter
    forks[1] += weft.gen("x", lora="all")
    forks.join()


@weft.function
def pick(s: Any, prompt: str, choices: list[str], adapter: str | None = None) -> None:
    s += prompt + weft.select("c", choices=choices, lora=adapter)


##### A real in-process Engine #####


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path], dict]:
    from support import save_word_tokenizer

    root = tmp_path_factory.mktemp("lang-lora")
    base, folders, expected = build_lora_setup(root, {n: ADAPTERS[n] for n in NAMES})
    save_word_tokenizer(base, 128)
    assert all(expected[n, 0] != expected[None, 0] for n in NAMES)
    return base, folders, expected


@pytest.fixture(scope="module")
def engine(setup: tuple) -> Iterator[weft.Engine]:
    base, folders, _ = setup
    loras = {n: str(folders[n]) for n in NAMES}
    with weft.Engine(str(base), cpu_threads=1, lora_paths=loras) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(setup: tuple, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from support import ServerProcess

    base, folders, _ = setup
    loras = [f"{n}={folders[n]}" for n in NAMES]
    args = ["--model", str(base), "--cpu-threads", "1", "--lora-paths", *loras]
    proc = ServerProcess(args, tmp_path_factory.mktemp("lang-lora-serve") / "serve.log")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def direct(engine: weft.Engine, text: str, lora: str | None) -> str:
    out = engine.generate(text, dict(GREEDY), lora_path=lora)
    assert isinstance(out, dict)
    return str(out["text"])


def test_gen_gives_each_adapters_tokens_and_overrides_the_default(
    engine: weft.Engine, setup: tuple
) -> None:
    expected = setup[2]
    for name in (*NAMES, None):
        states = two_gens.run_batch(
            [{"prompt": p} for p in PROMPT_TEXT], backend=engine, lora=name, **GREEDY
        )
        for i, s in enumerate(states):
            assert s.error() is None
            assert s["a"] == words(expected[name, i]) == direct(engine, PROMPT_TEXT[i], name)
            assert s["b"] == direct(engine, PROMPT_TEXT[i] + s["a"], "rs"), (name, i)
    s = two_gens.run(PROMPT_TEXT[0], backend=engine, **GREEDY)  # no default: the base model
    assert s["a"] == words(expected[None, 0])


def test_fork_branches_keep_the_adapter(engine: weft.Engine, setup: tuple) -> None:
    expected = setup[2]
    assert engine.flush_cache()
    s = forked.run(PROMPT_TEXT[1], backend=engine, lora="rs", **GREEDY)
    assert s["x"] == [words(expected["rs", 1]), words(expected["all", 1])]
    # the shared prefix was warmed under the default adapter: only its branch finds it
    cached = [m["cached_tokens"] for m in s.get_meta_info("x")]
    assert cached[0] >= len(PROMPTS[1]) - 1 and cached[1] == 0, cached


def test_select_scores_under_the_adapter(engine: weft.Engine, setup: tuple) -> None:
    expected = setup[2]
    choices = [words(expected[n, 0][:2]) for n in (*NAMES, None)]  # each adapter's greedy pair
    for name, choice in zip((*NAMES, None), choices, strict=True):
        assert pick.run(PROMPT_TEXT[0], choices, backend=engine, lora=name)["c"] == choice
        if name is not None:  # select's own adapter overrides the run's (None inherits it)
            s = pick.run(PROMPT_TEXT[0], choices, name, backend=engine, lora="nope")
            assert s["c"] == choice


def test_an_unknown_adapter_fails_the_program(engine: weft.Engine) -> None:
    s = two_gens.run(PROMPT_TEXT[0], backend=engine, lora="nope", **GREEDY)
    assert isinstance(s.error(), ValueError)
    assert "unknown LoRA adapter 'nope' (loaded: all, rs)" in str(s.error())
    with pytest.raises(weft.ProgramError):
        s["a"]


def test_runtime_endpoint_sends_the_adapter(server: Any, engine: weft.Engine, setup: tuple) -> None:
    expected = setup[2]
    ep = weft.RuntimeEndpoint(server.url)
    try:
        s = two_gens.run(PROMPT_TEXT[2], backend=ep, lora="all", **GREEDY)
        assert s["a"] == words(expected["all", 2])
        assert s["b"] == direct(engine, PROMPT_TEXT[2] + s["a"], "rs")
        streamed = two_gens.run(PROMPT_TEXT[2], backend=ep, lora="all", stream=True, **GREEDY)
        assert streamed["a"] == s["a"] and streamed["b"] == s["b"]
        s = forked.run(PROMPT_TEXT[0], backend=ep, lora="rs", **GREEDY)
        assert s["x"] == [words(expected["rs", 0]), words(expected["all", 0])]
        choices = [words(expected[n, 0][:2]) for n in (*NAMES, None)]
        assert pick.run(PROMPT_TEXT[0], choices, backend=ep, lora="rs")["c"] == choices[1]
        err = two_gens.run(PROMPT_TEXT[0], backend=ep, lora="nope", **GREEDY).error()
        assert isinstance(err, weft.BackendError)
        assert "HTTP 400: unknown LoRA adapter 'nope' (loaded: all, rs)" in str(err)
    finally:
        ep.shutdown()


##### Request shapes and argument checks (no model) #####


class Recorder:
    """A native server that answers every /generate with one token and records the bodies."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        path = request.url.path
        if path == "/get_model_info":
            return httpx.Response(200, json={"model_path": "mock"})
        if path == "/tokenize":
            return httpx.Response(
                200, json={"tokens": [[ord(c) for c in p] for p in body["prompt"]]}
            )
        self.bodies.append(body)
        rows = body.get("input_ids")
        n = len(rows) if rows and isinstance(rows[0], list) else 1
        lps = [[-1.0, 7, "x"]]
        meta = {"prompt_tokens": 1, "cached_tokens": 0, "input_token_logprobs": lps}
        outs = [{"text": " y", "output_ids": [7], "meta_info": meta}] * n
        return httpx.Response(200, json=outs if n > 1 else outs[0])


def test_native_requests_carry_lora_path_only_when_asked() -> None:
    server = Recorder()
    ep = weft.RuntimeEndpoint("http://mock", transport=httpx.MockTransport(server))

    @weft.function
    def prog(s: Any) -> None:
        s += "q" + weft.gen("a", max_tokens=1) + weft.gen("b", max_tokens=1, lora="rs")
        s += weft.select("c", choices=["1", "2"])
        forks = s.fork(2)
        forks += weft.gen("d", max_tokens=1)
        forks.join()

    prog.run(backend=ep, lora="all")
    loras = [b.get("lora_path") for b in server.bodies]
    # gen a, gen b, select's prompt prefill and its scoring batch, the fork's warm, 2 branches
    assert loras == ["all", "rs", "all", "all", "all", "all", "all"]
    server.bodies.clear()
    prog.run(backend=ep)
    assert ["lora_path" in b for b in server.bodies] == [False, True] + [False] * 5


def test_openai_backend_names_the_adapter_in_model() -> None:
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        choice = {"index": 0, "text": " y", "finish_reason": "length"}
        return httpx.Response(200, json={"id": "c", "choices": [choice], "usage": {}})

    backend = weft.OpenAI(
        "base",
        base_url="http://mock/v1",
        is_chat_model=False,
        transport=httpx.MockTransport(handler),
    )
    two_gens.run("q", backend=backend)
    two_gens.run("q", backend=backend, lora="all")
    assert [b["model"] for b in bodies] == ["base", "base:rs", "base:all", "base:rs"]


@pytest.mark.parametrize("bad", [3, "", ["all"], b"all"])
def test_lora_must_be_a_name(bad: Any) -> None:
    with pytest.raises(ValueError, match="lora must be an adapter's name"):
        weft.gen("a", lora=bad)
    with pytest.raises(ValueError, match="lora must be an adapter's name"):
        weft.select("a", choices=["x", "y"], lora=bad)
    with pytest.raises(ValueError, match="lora must be an adapter's name"):
        weft.gen("a", choices=["x", "y"], lora=bad)
    fake = FakeBackend()
    with pytest.raises(ValueError, match="run: lora must be an adapter's name"):
        two_gens.run("q", backend=fake, lora=bad)
    with pytest.raises(ValueError, match="run_batch: lora must be an adapter's name"):
        two_gens.run_batch([{"prompt": "q"}], backend=fake, lora=bad)
