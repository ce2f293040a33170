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
    assert EngineConfig(**config.to_dict()) == config  # the child processes' round trip


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
