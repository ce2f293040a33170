"""The DSL interpreter on the FakeBackend: asynchrony, bad programs and their errors, run_batch,
tracing and prefix warming, forks, streaming, and the default backend."""

from __future__ import annotations

import inspect
import re
import threading
from typing import Any

import pytest

import weft
from weft.lang import FakeBackend, ProgramError
from weft.lang.backends.fake import DEFAULT_SYSTEM
from weft.lang.ir import Argument, Constant, Gen, Select
from weft.lang.program import RUN_DEFAULTS, Program
from weft.lang.testing import batch_item, fake_backend, few_shot_qa


@pytest.fixture
def fake() -> FakeBackend:
    return fake_backend()


##### Execution model #####


class GatedFake(FakeBackend):
    """Generation waits for `gate` (at most `timeout` seconds) before it starts."""

    def __init__(self, timeout: float = 5.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gate = threading.Event()
        self.timeout = timeout

    def generate(self, req: Any) -> Any:
        self.gate.wait(self.timeout)
        return super().generate(req)


def test_appending_returns_at_once_and_reads_block() -> None:
    fake = GatedFake(replies={"A:": " a", "B:": " b"})
    seen: dict[str, Any] = {}

    @weft.function
    def prog(s: Any) -> None:
        s += "A:" + weft.gen("a", max_tokens=2)
        s += " B:" + weft.gen("b", max_tokens=2)
        seen["generated_before_reading"] = len(fake.requests)  # nothing ran yet: s += returned
        fake.gate.set()
        seen["a"] = s["a"]  # blocks until generated

    s = prog.run(backend=fake)
    assert seen == {"generated_before_reading": 0, "a": " a"} and s.text() == "A: a B: b"


def test_worker_error_releases_readers_and_drops_the_rest() -> None:
    fake = FakeBackend({"boom": RuntimeError("server exploded")})

    @weft.function
    def prog(s: Any) -> None:
        s += "boom" + weft.gen("x") + weft.gen("y")

    s = prog.run(backend=fake)
    assert isinstance(s.error(), RuntimeError) and "exploded" in str(s.error())
    with pytest.raises(ProgramError, match="'y' was never set") as info:
        s["y"]
    assert info.value.__cause__ is s.error()
    assert len(fake.requests) == 1


def test_reading_a_failed_variable_inside_the_body_raises_from_run() -> None:
    fake = FakeBackend({"boom": ValueError("bad request")})

    @weft.function
    def prog(s: Any) -> None:
        s += "boom" + weft.gen("x")
        s += s["x"]

    with pytest.raises(ProgramError, match="'x' was never set"):
        prog.run(backend=fake)


def test_streamed_program_failure_ends_text_iter() -> None:
    fake = FakeBackend({"boom": ValueError("bad request")})

    @weft.function
    def prog(s: Any) -> None:
        s += "boom"
        s += weft.gen("x")

    s = prog.run(backend=fake, stream=True)
    assert "".join(s.text_iter()) == "boom"
    assert isinstance(s.error(), ValueError)


def test_body_exception_propagates_and_drops_queued_gens() -> None:
    fake = GatedFake(timeout=0.5)  # a gen that starts waits until the body has raised

    @weft.function
    def prog(s: Any) -> None:
        for _ in range(5):
            s += weft.gen(max_tokens=1)
        raise KeyError("mine")

    with pytest.raises(KeyError, match="mine"):
        prog.run(backend=fake)
    assert len(fake.requests) <= 1  # the one gen already started, if any; the rest dropped


def test_variables_set_contains_and_unknown(fake: FakeBackend) -> None:
    @weft.function
    def prog(s: Any) -> None:
        s["given"] = 3
        s += "x" + weft.gen("g", max_tokens=1)

    s = prog.run(backend=fake)
    assert s["given"] == 3 and "g" in s and "nope" not in s
    with pytest.raises(KeyError, match="nope"):
        s["nope"]


def test_unnamed_gen_and_regenerating_a_name(fake: FakeBackend) -> None:
    fake.replies.update({"1:": " one", "2:": " two"})

    @weft.function
    def prog(s: Any) -> None:
        s += "1:" + weft.gen("x") + " 2:" + weft.gen("x") + weft.gen()

    s = prog.run(backend=fake)
    assert s["x"] == " two" and s.text() == "1: one 2: two two"


def test_with_role_blocks_and_messages(fake: FakeBackend) -> None:
    @weft.function
    def prog(s: Any) -> None:
        with s.user():
            s += "Hi "
            s += "there"
        s.assistant("Hello.")

    s = prog.run(backend=fake)
    assert s.messages() == [  # the template's own system prompt comes first (as in SGLang)
        {"role": "system", "content": DEFAULT_SYSTEM},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
    ]


def test_copy_keeps_variables_not_text(fake: FakeBackend) -> None:
    @weft.function
    def prog(s: Any) -> None:
        s += "Base."
        with s.copy() as c:
            c += " side" + weft.gen("side", max_tokens=1)

    s = prog.run(backend=fake)
    assert s.text() == "Base." and s["side"] == " ok"


def test_fork_of_one_does_not_prefill(fake: FakeBackend) -> None:
    @weft.function
    def prog(s: Any) -> None:
        s += "text"
        forks = s.fork(1)
        forks += weft.gen("x", max_tokens=1)
        forks.join()

    assert prog.run(backend=fake)["x"] == [" ok"] and fake.prefixes_cached == []


##### Bad programs: clear errors #####


def test_first_parameter_must_be_s() -> None:
    with pytest.raises(TypeError, match="first parameter must be the program state, named 's'"):

        @weft.function
        def prog(state: Any, q: str) -> None:
            pass


def test_unknown_bound_and_missing_arguments(fake: FakeBackend) -> None:
    with pytest.raises(TypeError, match=r"bind\(\): unknown argument\(s\) answer"):
        few_shot_qa.bind(answer="x")
    with pytest.raises(TypeError, match=r"few_shot_qa\(question\).*missing a required argument"):
        few_shot_qa.run(backend=fake)
    with pytest.raises(TypeError, match="unexpected keyword argument 'nope'"):
        few_shot_qa.run(question="q", nope=1, backend=fake)


def test_run_batch_argument_mismatch(fake: FakeBackend) -> None:
    with pytest.raises(
        ValueError, match="run_batch item 1: given 2 arguments, but .* takes 1 to 1"
    ):
        batch_item.run_batch([("a",), ("b", "c")], backend=fake)
    with pytest.raises(TypeError, match="run_batch item 0"):
        batch_item.run_batch([{"q": "a"}], backend=fake)
    with pytest.raises(TypeError, match="unknown keyword argument"):
        batch_item.run_batch([("a",)], backend=fake, temprature=0)
    assert batch_item.run_batch([], backend=fake) == []


@pytest.mark.parametrize(
    "body",
    [
        lambda s: s.__iadd__(weft.user(weft.assistant("x"))),
        lambda s: [s.__iadd__(weft.user_begin()), s.__iadd__(weft.system("x"))],
        lambda s: s.__iadd__(weft.user_end()),
    ],
)
def test_role_nesting_fails_at_the_call(body: Any, fake: FakeBackend) -> None:
    prog = Program(lambda s: body(s))
    with pytest.raises(ValueError, match="Nested roles are not allowed|without a matching"):
        prog.run(backend=fake)


def test_appending_none_or_a_number(fake: FakeBackend) -> None:
    with pytest.raises(ValueError, match="None"):
        Program(lambda s: s.__iadd__(None)).run(backend=fake)
    with pytest.raises(TypeError, match="int"):
        Program(lambda s: s.__iadd__(5)).run(backend=fake)


def test_no_backend_is_a_clear_error() -> None:
    weft.set_default_backend(None)
    with pytest.raises(RuntimeError, match="no backend to run this program on"):
        few_shot_qa.run(question="q")


def test_default_backend(fake: FakeBackend) -> None:
    weft.set_default_backend(fake)
    try:
        assert few_shot_qa("What is the capital of Germany?")["answer"] == " Berlin"
    finally:
        weft.set_default_backend(None)
    with pytest.raises(TypeError, match="expected a backend"):
        weft.set_default_backend("http://localhost")


def test_gen_argument_errors() -> None:
    with pytest.raises(re.error):
        weft.gen(regex="([a-z")
    with pytest.raises(ValueError, match="not valid JSON"):
        weft.gen(json_schema="{nope")
    with pytest.raises(TypeError, match="pydantic model class"):
        weft.gen(json_schema=3)
    with pytest.raises(ValueError, match="at most one of regex and json_schema"):
        weft.gen(regex="a", json_schema={"type": "string"})
    with pytest.raises(ValueError, match="dtype must be"):
        weft.gen(dtype=list)
    with pytest.raises(ValueError, match="non-empty list"):
        weft.select(choices=[])
    with pytest.raises(ValueError, match="non-empty list"):
        weft.select(choices="yes")


def test_fork_errors(fake: FakeBackend) -> None:
    def wrong_list(s: Any) -> None:
        s += "x"
        forks = s.fork(2)
        forks += ["only one"]

    with pytest.raises(ValueError, match="one item per branch"):
        Program(wrong_list).run(backend=fake)
    with pytest.raises(ValueError, match="n must be at least 1"):
        Program(lambda s: s.fork(0)).run(backend=fake)

    def bad_join(s: Any) -> None:
        s += "x"
        forks = s.fork(2)
        forks += weft.user_begin()
        forks.join("concate_and_append")

    with pytest.raises(ValueError, match="opened or closed a role"):
        Program(bad_join).run(backend=fake)


##### gen / select IR and parameter resolution #####


def test_gen_with_choices_is_a_select_and_none_inherits(fake: FakeBackend) -> None:
    node = weft.gen("x", choices=["a", "b"])
    assert isinstance(node, Select) and node.temperature == 0.0
    gen = weft.gen("y", max_tokens=3, stop="!")
    assert isinstance(gen, Gen) and gen.params.temperature is None

    @weft.function
    def prog(s: Any) -> None:
        s += "go" + weft.gen("y", max_tokens=3, stop="!")
        s += weft.assistant(weft.gen("z"))

    prog.run(backend=fake, temperature=0.3, stop=["?"], max_new_tokens=9)
    outside, inside = fake.gen_requests
    assert (outside.args.temperature, outside.args.max_new_tokens, outside.args.stop) == (
        0.3,
        3,
        ("!",),
    )
    assert (inside.args.max_new_tokens, inside.args.stop) == (9, ("?", "<|im_end|>"))


def test_dtype_overrides_regex_with_a_warning() -> None:
    from weft.lang.params import BOOL_REGEX, SamplingArgs, resolve

    node = weft.gen("b", dtype="bool", regex="x+")
    assert isinstance(node, Gen)
    with pytest.warns(UserWarning, match="overrides regex"):
        args = resolve(SamplingArgs(), node.params, None)
    assert args.regex == BOOL_REGEX


def test_run_defaults_match_run_signature() -> None:
    params = inspect.signature(Program.run).parameters
    assert {k: params[k].default for k in RUN_DEFAULTS} == RUN_DEFAULTS


##### run_batch #####


def test_run_batch_keeps_input_order_with_tuples_and_progress(capsys: Any) -> None:
    delays = {f"what is {i} plus {i}?": f" {i}" for i in range(12)}
    fake = FakeBackend(delays, delay=0.01)
    items = [(f"what is {i} plus {i}?",) for i in range(12)]
    states = batch_item.run_batch(items, backend=fake, num_threads=4, progress_bar=True)
    assert [s["answer"] for s in states] == [f" {i}" for i in range(12)]
    assert "batch_item" in capsys.readouterr().err
    lazy = batch_item.run_batch(items, backend=fake, generator_style=True)
    assert [s["answer"] for s in lazy] == [f" {i}" for i in range(12)]


def test_short_constant_prefix_is_not_warmed(fake: FakeBackend) -> None:
    few_shot = few_shot_qa.run_batch([("a",), ("b",)], backend=fake)
    assert len(few_shot) == 2 and len(fake.prefixes_cached) == 1  # FEW_SHOT is long

    @weft.function
    def short(s: Any, q: str) -> None:
        s += "Q: " + q + weft.gen("a", max_tokens=1)

    short.run_batch([("a",), ("b",)], backend=fake)
    assert len(fake.prefixes_cached) == 1
    assert short.cache(backend=fake) == "Q: " and fake.prefixes_cached[-1] == "Q: "


def test_chat_program_prefix_includes_the_rendered_roles(fake: FakeBackend) -> None:
    @weft.function
    def chat(s: Any, q: str) -> None:
        s += weft.system("You are a meticulous assistant who answers in exactly one short word.")
        s += weft.user(q)
        s += weft.assistant(weft.gen("a", max_tokens=1))

    chat.run_batch([("a",), ("b",)], backend=fake)
    expected = (
        "<|im_start|>system\nYou are a meticulous assistant who answers in exactly one short "
        "word.<|im_end|>\n<|im_start|>user\n"
    )
    assert fake.prefixes_cached == [expected]


##### Tracing #####


def test_trace_builds_the_ir_without_a_model(capsys: Any) -> None:
    traced = few_shot_qa.trace()
    leaves = traced.flatten_nodes()
    assert isinstance(leaves[0], Constant) and leaves[2] == Argument("question")
    assert isinstance(traced.last_node, Gen) and traced.last_node.name == "answer"
    assert traced.text().endswith("Q: {question}\nA:{answer}")
    traced.print_graph_dfs()
    assert "Gen(name='answer'" in capsys.readouterr().out


def test_trace_forks_and_fstring_arguments(capsys: Any) -> None:
    from weft.lang.testing import two_colors

    traced = two_colors.trace()
    assert len(traced.branches) == 1 and len(traced.branches[0]) == 2
    assert traced.branches[0][1].nodes[0] == Constant(" blue")
    traced.print_graph_dfs()
    assert "branch 1:" in capsys.readouterr().out

    @weft.function
    def fstring(s: Any, q: str) -> None:
        s += f"Q: {q}"

    with pytest.raises(TypeError, match="Cannot put argument 'q' inside a f-string"):
        fstring.trace()


##### Streaming and async #####


def test_text_async_iter_with_meta(fake: FakeBackend) -> None:
    import asyncio

    from weft.lang.testing import story

    async def main() -> list[Any]:
        s = story.run(backend=fake, stream=True)
        return [item async for item in s.text_async_iter("story", return_meta_data=True)]

    items = asyncio.run(main())
    assert "".join(c for c, _ in items) == " there was a small robot who loved to"
    assert items[-1][1]["completion_tokens"] == 8


def test_text_iter_without_stream_yields_the_final_text_once(fake: FakeBackend) -> None:
    s = few_shot_qa.run("What is the capital of Germany?", backend=fake)
    assert list(s.text_iter()) == [s.text()] and list(s.text_iter("answer")) == [" Berlin"]
