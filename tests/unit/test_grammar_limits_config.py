"""The grammar limits are options: `weft serve --grammar-max-*` and Engine(grammar_max_*=...) set
what a spec may ask, validated at construction, documented, and named in each refusal."""

from __future__ import annotations

from pathlib import Path

import pytest

import weft
from weft import cli
from weft.constrain.limits import GrammarLimits
from weft.runtime.config import EngineConfig
from weft.runtime.server.http import serve
from weft.runtime.server.http.state import ServerConfig

README = Path(__file__).resolve().parents[2] / "README.md"
OPTIONS = {
    "--grammar-max-repeat": "max_repeat",
    "--grammar-max-expanded": "max_expanded",
    "--grammar-max-regex-chars": "max_regex_chars",
    "--grammar-max-spec-chars": "max_grammar_chars",
}


def parsed(monkeypatch: pytest.MonkeyPatch, *argv: str) -> ServerConfig:
    seen: list[ServerConfig] = []
    monkeypatch.setattr(serve, "run_server", lambda config: seen.append(config) or 0)
    assert cli.main(["serve", *argv]) == 0
    return seen[0]


def test_defaults_are_the_documented_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parsed(monkeypatch).engine.grammar_limits == GrammarLimits()


def test_each_option_sets_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    for i, (option, field) in enumerate(OPTIONS.items()):
        limits = parsed(monkeypatch, option, str(7 + i)).engine.grammar_limits
        assert getattr(limits, field) == 7 + i, option
        others = {f: getattr(limits, f) for f in OPTIONS.values() if f != field}
        assert others == {f: getattr(GrammarLimits(), f) for f in others}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_a_limit_below_one_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], option: str
) -> None:
    monkeypatch.setattr(serve, "run_server", lambda config: 0)
    assert cli.main(["serve", option, "0"]) == 2
    name = option.removeprefix("--").replace("-", "_")
    assert f"{name} must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"{name} must be >= 1, got -3"):
        EngineConfig(**{name: -3})


def test_every_grammar_limit_is_documented(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    help_text = capsys.readouterr().out
    readme = README.read_text()
    for option in OPTIONS:
        assert option in help_text and f"`{option}`" in readme, option


def test_the_engine_applies_its_limits_and_names_the_option(tiny_model_dir: Path) -> None:
    params = {"max_new_tokens": 4, "temperature": 0}
    with weft.Engine(str(tiny_model_dir), grammar_max_repeat=5) as eng:
        with pytest.raises(ValueError, match="repetition count of 6; the limit is 5 .*"
                           "--grammar-max-repeat"):  # fmt: skip
            eng.generate("x", {**params, "regex": "a{6}"})
        out = eng.generate("x", {**params, "max_new_tokens": 8, "regex": "a{5}"})
        assert out["text"] == "aaaaa"  # within the limit: compiled and followed
        with pytest.raises(ValueError, match="too long .*--grammar-max-regex-chars"):
            eng.generate("x", {**params, "regex": "a" * 100_001})
