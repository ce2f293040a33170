"""LoRA adapters with tensor parallelism on CPU (gloo, one scheduler process per rank), on a tiny
random Llama with more and with fewer kv heads than ranks: a batch mixing two adapters and the
base model gives the same greedy tokens at TP=2 as at TP=1, and HF's with each adapter merged;
adapters load and unload through the Engine while serving, a refused load changes nothing."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

import weft

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from lora_helpers import ADAPTERS, NEW_TOKENS, PROMPTS, build_lora_setup, save_adapter  # noqa: E402

pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[test]')")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
SERVED = ("all", "rs")  # lora_paths; "attn" (o_proj too) is loaded while serving
MIX = [(name, i) for i in range(len(PROMPTS)) for name in (*SERVED, None)]  # interleaved


@pytest.fixture(scope="module", params=[2, 1], ids=["kv2", "kv1"])
def setup(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, Path, dict[str, Path], dict]:
    """(kv heads, the model, its adapters, HF's tokens) with 2 kv heads or 1 (each rank then
    holds a replica of it); "rank16" is above the pool's rank (8, the largest at start)."""
    kv_heads = request.param
    root = tmp_path_factory.mktemp(f"lora-tp-kv{kv_heads}")
    base, folders, expected = build_lora_setup(root, ADAPTERS, kv_heads=kv_heads)
    spec = {"r": 16, "lora_alpha": 16, "target_modules": ["q_proj"]}
    save_adapter(root / "rank16", spec, 9, kv_heads=kv_heads)
    folders["rank16"] = root / "rank16"
    return kv_heads, base, folders, expected


def run_workload(eng: Any, folders: dict[str, Path]) -> list[Any]:
    """The mixed batch; then "attn" loaded, run, unloaded; refused loads; the batch again."""
    ids = [PROMPTS[i] for _, i in MIX]
    first = eng.generate(input_ids=ids, sampling_params=GREEDY, lora_path=[n for n, _ in MIX])
    assert list(eng.load_lora_adapter("attn", str(folders["attn"]))) == [*SERVED, "attn"]
    attn = [eng.generate(input_ids=p, sampling_params=GREEDY, lora_path="attn") for p in PROMPTS]
    assert list(eng.unload_lora_adapter("attn")) == list(SERVED)
    with pytest.raises(ValueError, match="unknown LoRA adapter 'attn'"):
        eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="attn")
    with pytest.raises(ValueError, match="max_lora_rank"):
        eng.load_lora_adapter("big", str(folders["rank16"]))
    with pytest.raises(ValueError, match="is not a folder"):
        eng.load_lora_adapter("gone", str(folders["attn"].parent / "missing"))
    assert list(eng.lora_adapters) == list(SERVED)
    again = eng.generate(input_ids=ids, sampling_params=GREEDY, lora_path=[n for n, _ in MIX])
    eng.flush_cache()
    state = eng.get_state()
    assert state["free_tokens"] == state["max_total_tokens"]  # nothing leaked on any rank
    return [[o["output_ids"] for o in outs] for outs in (first, attn, again)]


def test_tp2_equals_tp1_and_the_merged_models(setup: tuple) -> None:
    kv_heads, base, folders, expected = setup
    loras = {n: folders[n] for n in SERVED}
    results = {}
    # NOTE: TP=1 gives HF's tokens on the 2-kv-head model in test_lora_engine / test_lora_server
    for tp in (2,) if kv_heads == 2 else (1, 2):
        with weft.Engine(
            str(base), tp_size=tp, skip_tokenizer_init=True, cpu_threads=1, lora_paths=loras
        ) as eng:
            assert eng.server_info["tp_size"] == tp
            results[tp] = run_workload(eng, folders)
    mixed = [expected[n, i] for n, i in MIX]
    assert results[2] == [mixed, [expected["attn", i] for i in range(len(PROMPTS))], mixed]
    assert results.get(1, results[2]) == results[2]
