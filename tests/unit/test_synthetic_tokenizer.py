"""Which tokenizer a runtime uses (runtime/loader/tokenizer_source.py): the model's, a given one, a
synthetic byte-level one for dummy weights (built once into the cache dir, never into the model
folder), none with skip_tokenizer_init; the 8B benchmark config up to weight loading."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support import save_word_tokenizer

from weft.runtime.config import EngineConfig
from weft.runtime.loader import synthetic_tokenizer as synth
from weft.runtime.loader.synthetic_tokenizer import (
    byte_alphabet,
    cached_synthetic_tokenizer,
    synthetic_tokenizer,
)
from weft.runtime.loader.tokenizer_source import resolve_tokenizer
from weft.runtime.server.launch import prepare

ROOT = Path(__file__).resolve().parents[2]
LLAMA_8B = ROOT / "benchmarks" / "configs" / "llama-3.1-8b"


def config_folder(tmp_path: Path, vocab_size: int = 600, **extra: object) -> Path:
    """A config.json-only folder (as benchmarks/configs has)."""
    folder = tmp_path / "model"
    folder.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
        "bos_token_id": 1, "eos_token_id": [2, 599], **extra,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_the_tokenizer_has_every_id_the_specials_and_every_byte() -> None:
    tok = synthetic_tokenizer(600, bos_id=1, eos_ids=[2, 599])
    assert len(tok) == 600 and sorted(tok.get_vocab().values()) == list(range(600))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.convert_ids_to_tokens([1, 2, 599]) == [
        "<|begin_of_text|>", "<|end_of_text|>", "<|special_599|>",
    ]  # fmt: skip
    assert set(byte_alphabet().values()) <= set(tok.get_vocab())
    text = 'héllo {"a": 1} 世界\n'
    ids = tok.encode(text)
    assert len(ids) == len(text.encode()) and tok.decode(ids) == text
    again = synthetic_tokenizer(600, bos_id=1, eos_ids=[2, 599])
    assert again.get_vocab() == tok.get_vocab()  # seeded: the same arguments, the same vocabulary
    with pytest.raises(ValueError, match="vocab_size 200 is too small"):
        synthetic_tokenizer(200, None, [2])


def test_the_byte_alphabet_is_gpt2s() -> None:
    table = byte_alphabet()
    assert table[ord("A")] == "A" and table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ"
    assert len(set(table.values())) == 256


def test_it_is_built_once_into_the_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = cached_synthetic_tokenizer(tmp_path, 600, 1, [2])
    assert first.parent == tmp_path.resolve() / "synthetic-tokenizers"
    assert (first / "tokenizer.json").is_file()
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no staging folder left

    def refuse(*args: object) -> None:
        raise AssertionError("rebuilt a cached tokenizer")

    monkeypatch.setattr(synth, "synthetic_tokenizer", refuse)
    assert cached_synthetic_tokenizer(tmp_path, 600, 1, [2]) == first
    with pytest.raises(AssertionError, match="rebuilt"):  # another key is another tokenizer
        cached_synthetic_tokenizer(tmp_path, 601, 1, [2])


def test_a_process_that_loses_the_race_uses_the_winners_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_replace = os.replace

    def replace_after_a_rival(src: str, dst: str) -> None:
        monkeypatch.setattr(os, "replace", real_replace)
        rival = cached_synthetic_tokenizer(tmp_path, 600, 1, [2])  # publishes first
        assert str(rival) == str(dst)
        real_replace(src, dst)  # (a non-empty target: fails as on a real race)

    monkeypatch.setattr(os, "replace", replace_after_a_rival)
    folder = cached_synthetic_tokenizer(tmp_path, 600, 1, [2])
    assert (folder / "tokenizer.json").is_file()
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]


def test_dummy_weights_without_a_tokenizer_get_the_synthetic_one(tmp_path: Path) -> None:
    folder = config_folder(tmp_path)
    config = EngineConfig(model=str(folder), load_format="dummy", cache_dir=str(tmp_path / "c"))
    source = resolve_tokenizer(config, folder)
    assert source.kind == "synthetic" and source.path is not None
    assert source.path.is_relative_to((tmp_path / "c").resolve())
    assert "synthetic byte-level tokenizer of 600 ids (BOS 1, EOS 2, 599)" in source.description
    tok = source.load()
    assert tok is not None and len(tok) == 600 and tok.eos_token_id == 2
    assert os.listdir(folder) == ["config.json"]  # nothing written into the model folder
    assert source.to_dict() == {
        "kind": "synthetic", "path": str(source.path), "description": source.description,
    }  # fmt: skip


def test_a_tokenizer_in_the_folder_or_given_wins(tmp_path: Path) -> None:
    folder = config_folder(tmp_path)
    given = tmp_path / "tok"
    save_word_tokenizer(given, 600)
    config = EngineConfig(model=str(folder), load_format="dummy", tokenizer=str(given))
    assert resolve_tokenizer(config, folder).kind == "given"
    save_word_tokenizer(folder, 600)
    source = resolve_tokenizer(EngineConfig(model=str(folder), load_format="dummy"), folder)
    assert (source.kind, source.path) == ("model", folder)


def test_real_weights_without_a_tokenizer_are_refused_naming_what_to_pass(tmp_path: Path) -> None:
    folder = config_folder(tmp_path)
    with pytest.raises(ValueError) as err:
        resolve_tokenizer(EngineConfig(model=str(folder)), folder)
    assert "has no tokenizer" in str(err.value)
    assert "--tokenizer" in str(err.value) and "--skip-tokenizer-init" in str(err.value)


def test_skip_tokenizer_init_loads_none_and_excludes_a_tokenizer(tmp_path: Path) -> None:
    folder = config_folder(tmp_path)
    config = EngineConfig(model=str(folder), skip_tokenizer_init=True)
    source = resolve_tokenizer(config, folder)
    assert (source.kind, source.path, source.load()) == ("none", None, None)
    with pytest.raises(ValueError, match="do not pass tokenizer= too"):
        EngineConfig(model=str(folder), skip_tokenizer_init=True, tokenizer=str(folder))


def test_a_config_without_a_vocab_size_is_refused(tmp_path: Path) -> None:
    folder = config_folder(tmp_path, vocab_size="big", eos_token_id=2)  # type: ignore[arg-type]
    config = EngineConfig(model=str(folder), load_format="dummy", cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="has no integer vocab_size"):
        resolve_tokenizer(config, folder)


def test_the_8b_config_prepares_up_to_the_weights(tmp_path: Path) -> None:
    """`weft serve --model benchmarks/configs/llama-3.1-8b --load-format dummy` up to loading the
    weights (32 GB in fp32: more than this machine holds): the synthetic tokenizer of 128,256
    ids with Llama 3.1's BOS and three EOS ids, the model's facts."""
    before = sorted(os.listdir(LLAMA_8B))
    config = EngineConfig(model=str(LLAMA_8B), load_format="dummy", cache_dir=str(tmp_path))
    prep = prepare(config)
    tok = prep.tokenizer
    assert prep.tokenizer_source.kind == "synthetic"
    assert len(tok) == 128_256 and tok.bos_token_id == 128_000 and tok.eos_token_id == 128_001
    assert tok.convert_ids_to_tokens([128_008, 128_009]) == ["<|special_128008|>",
                                                             "<|special_128009|>"]  # fmt: skip
    assert tok.decode([128_000, 128_008, 128_009], skip_special_tokens=True) == ""  # special
    assert prep.info.vocab_size == 128_256 and prep.info.eos_ids == {128_001, 128_008, 128_009}
    assert prep.info.context_len == 131_072 and prep.model_path == LLAMA_8B.resolve()
    assert sorted(os.listdir(LLAMA_8B)) == before == ["config.json"]
