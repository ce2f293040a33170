"""skip_tokenizer_init without processes: what needs a tokenizer is refused naming the option, the
results carry output_ids and no text, and the detokenizer passes ids through."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

from weft import cli
from weft.runtime.ipc.messages import BatchTokenOut, FinishReason, StrOut, TokenOut
from weft.runtime.loader.model_info import ModelInfo
from weft.runtime.server.detokenizer import Detokenizer
from weft.runtime.server.generate_input import GenerateInput
from weft.runtime.server.http.native import _accumulate
from weft.runtime.server.output import ReqState, build_output
from weft.runtime.server.tokenizer_manager import TokenizerManager

REFUSED = [
    ({"text": "Hello"}, "a text prompt"),
    ({"input_ids": [5], "sampling_params": {"stop": ["x"]}}, "stop strings (stop)"),
    ({"input_ids": [5], "sampling_params": {"stop_regex": "x+"}}, "stop_regex"),
    (
        {"input_ids": [5], "sampling_params": {"json_schema": '{"type": "object"}'}},
        "constrained decoding (json_schema)",
    ),
    ({"input_ids": [5], "sampling_params": {"regex": "a+"}}, "constrained decoding (regex)"),
    (
        {"input_ids": [5], "sampling_params": {"ebnf": 'root ::= "a"'}},
        "constrained decoding (ebnf)",
    ),
    (
        {"input_ids": [5], "return_logprob": True, "return_text_in_logprobs": True},
        "return_text_in_logprobs",
    ),
    ({"input_ids": [[5], [6]], "sampling_params": [{}, {"stop": "y"}]}, "stop strings (stop)"),
]


@pytest.mark.parametrize("fields, what", REFUSED, ids=[w for _, w in REFUSED])
def test_what_needs_a_tokenizer_is_refused_naming_the_option(
    tmp_path: Path, fields: dict[str, Any], what: str
) -> None:
    async def submit() -> None:
        tm = manager(tmp_path)
        try:
            await tm.submit(GenerateInput(**fields))
        finally:
            await tm.close()

    with pytest.raises(
        ValueError, match=f"^{re.escape(what)} needs a tokenizer.*skip_tokenizer_init"
    ) as err:
        asyncio.run(submit())
    assert "send input_ids" in str(err.value)


def test_ids_and_everything_that_reads_ids_are_accepted() -> None:
    ok = GenerateInput(
        input_ids=[[5, 6], [7]],
        sampling_params={"stop_token_ids": [9], "min_new_tokens": 2, "logit_bias": {"3": 1.0}},
        return_logprob=True,
        top_logprobs_num=2,
        token_ids_logprob=[4],
    )
    assert [spec.needs_tokenizer() for spec in ok.specs()] == [None, None]


def test_a_result_has_output_ids_and_no_text() -> None:
    spec = GenerateInput(input_ids=[5, 6], return_logprob=True).specs()[0]
    state = ReqState(spec, [5, 6], "r", 0)
    token = TokenOut("r", [7, 8], None, 2, 0, 2, output_logprobs=[(-0.5, 7), (-0.25, 8)])
    state.add(StrOut("", token), now=1.0)
    delta = build_output(None, state, final=False)
    assert delta["output_ids"] == [7, 8] and "text" not in delta
    assert delta["meta_info"]["output_token_logprobs"] == [(-0.5, 7, None), (-0.25, 8, None)]
    done = TokenOut("r", [2], FinishReason("stop", matched=2), 2, 0, 3)
    state.add(StrOut("", done), now=2.0)
    final = build_output(None, state, final=True)
    assert final["output_ids"] == [7, 8, 2] and "text" not in final
    assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    totals: dict[str, Any] = {}
    _accumulate(totals, {"output_ids": [7, 8], "meta_info": {}})  # the native SSE, cumulative
    event = _accumulate(totals, {"output_ids": [2], "meta_info": {}})
    assert event == {"output_ids": [7, 8, 2], "meta_info": {}}


def test_the_detokenizer_passes_ids_on_without_text() -> None:
    outs = [
        TokenOut("a", [7], None, 2, 0, 1, stop=["x"]),
        TokenOut("b", [9, 2], FinishReason("stop", matched=2), 1, 0, 2),
    ]
    strs = Detokenizer(None).process(BatchTokenOut(outs)).outs
    assert [(s.text, s.token.new_ids, s.full_text) for s in strs] == [
        ("", [7], None), ("", [9, 2], None),
    ]  # fmt: skip


def test_weft_generate_refuses_the_option_before_starting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["generate", "Hi", "--skip-tokenizer-init", "--device", "cpu"]) == 2
    assert "takes a text prompt: drop --skip-tokenizer-init" in capsys.readouterr().err


def manager(tmp_path: Path) -> TokenizerManager:
    info = ModelInfo(str(tmp_path), "llama", ("LlamaForCausalLM",), 4096, 1000, frozenset([2]))
    return TokenizerManager(
        None, info, 100_000, f"ipc://{tmp_path}/scheduler", f"ipc://{tmp_path}/inbox", lambda: None
    )
