"""EngineConfig refuses a value of the wrong type with a message naming the field (a flag given
"no" would otherwise read as true); paths may be os.PathLike through from_kwargs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from weft.runtime.config import EngineConfig


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"disable_radix_cache": "no"}, "disable_radix_cache must be true or false, got 'no'"),
        ({"enable_mixed_chunk": 1}, "enable_mixed_chunk must be true or false"),
        ({"max_running_requests": "8"}, "max_running_requests must be an integer, got '8'"),
        ({"max_running_requests": True}, "max_running_requests must be an integer"),
        ({"mem_fraction": "0.5"}, "mem_fraction must be a number"),
        ({"context_length": 2.5}, "context_length must be an integer or None"),
        ({"overlap_schedule": 1}, "overlap_schedule must be one of 'auto', 'on', 'off'"),
        ({"model": 3}, "model must be a string or None"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        EngineConfig.from_kwargs(device="cpu", **kwargs)


def test_right_types_pass_and_paths_become_strings(tmp_path: Path) -> None:
    config = EngineConfig.from_kwargs(
        model=tmp_path, cache_dir=tmp_path / "cache", device="cpu", grammar_timeout=5,
        mem_fraction=0.5, context_length=None, enable_mixed_chunk=True,
    )  # fmt: skip
    assert config.model == str(tmp_path) and config.cache_dir == str(tmp_path / "cache")
    assert config.grammar_timeout == 5  # an int where a float is expected is fine
    assert EngineConfig.from_dict(config.to_dict()) == config  # the child processes' round trip


def test_the_command_line_gives_each_field_its_type() -> None:
    """`weft serve` / `weft generate` flags parse to the annotated types, so every flag builds."""
    import argparse

    from weft import cli

    parser = argparse.ArgumentParser()
    cli._add_engine_options(parser)
    argv = ["--page-size", "16", "--mem-fraction", "0.5", "--context-length", "100"]
    argv += ["--grammar-timeout", "3", "--model", "x", "--enable-mixed-chunk", "--device", "cpu"]
    config = EngineConfig.from_kwargs(**cli._engine_kwargs(parser.parse_args(argv)))
    assert (config.page_size, config.context_length, config.model) == (16, 100, "x")
    assert config.mem_fraction == 0.5 and config.grammar_timeout == 3.0
    assert config.enable_mixed_chunk and not config.disable_radix_cache
    assert EngineConfig.from_kwargs(**cli._engine_kwargs(parser.parse_args([]))) == EngineConfig()


@pytest.mark.parametrize(
    "tuning, message",
    [
        ({"gemv": "always"}, "gemv must be 'auto', 'on' or 'off', got 'always'"),
        ({"graph_blas": "lt"}, "graph_blas must be 'auto', 'cublas' or 'cublaslt'"),
        ({"extend_work": "1"}, "extend_work must be 'auto', 'on' or 'off'"),
        ({"disable_pdl": "yes"}, "disable_pdl must be true or false"),
        ({"grammar_mask_threads": 0}, "grammar_mask_threads must be >= 1, got 0"),
        ({"fold_norms": True}, "unknown tuning option\\(s\\): fold_norms"),
    ],
)
def test_a_bad_tuning_value_is_refused_by_name(tuning: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(device="cpu", tuning=tuning)


def test_tuning_comes_from_a_dict_the_command_line_and_the_child_payload() -> None:
    import argparse

    from weft import cli
    from weft.runtime.config import TuningConfig

    config = EngineConfig.from_kwargs(device="cpu", tuning={"gemv": "off", "disable_pdl": True})
    assert config.tuning == TuningConfig(gemv="off", disable_pdl=True)
    assert EngineConfig.from_dict(config.to_dict()) == config
    parser = argparse.ArgumentParser()
    cli._add_engine_options(parser)
    argv = ["--graph-blas", "cublaslt", "--grammar-mask-threads", "2", "--disable-pdl"]
    flags = EngineConfig.from_kwargs(**cli._engine_kwargs(parser.parse_args(argv)))
    assert flags.tuning == TuningConfig(graph_blas="cublaslt", grammar_mask_threads=2,
                                        disable_pdl=True)  # fmt: skip
    with pytest.raises(ValueError, match="tuning must be TuningConfig"):
        EngineConfig(tuning={"gemv": "off"})  # type: ignore[arg-type]
