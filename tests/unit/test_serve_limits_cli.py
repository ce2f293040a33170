"""`weft serve`'s limit and shutdown options: parsed into ServerConfig, validated with a clear
error, documented in --help and in the README's Limits table; the API key from $WEFT_API_KEY."""

from __future__ import annotations

from pathlib import Path

import pytest

from weft import cli
from weft.runtime.server.http import serve
from weft.runtime.server.http.state import ServerConfig
from weft.runtime.server.limits import RequestLimits

OPTIONS = ("--max-top-logprobs", "--max-n", "--max-request-bytes", "--shutdown-timeout")
README = Path(__file__).resolve().parents[2] / "README.md"


def parsed(monkeypatch: pytest.MonkeyPatch, *argv: str) -> ServerConfig:
    seen: list[ServerConfig] = []
    monkeypatch.setattr(serve, "run_server", lambda config: seen.append(config) or 0)
    assert cli.main(["serve", *argv]) == 0
    return seen[0]


def test_defaults_and_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WEFT_API_KEY", raising=False)
    config = parsed(monkeypatch)
    assert (config.max_top_logprobs, config.max_n) == (20, 128)
    assert config.max_request_bytes == 32 << 20 and config.shutdown_timeout == 30.0
    assert config.enable_cache_report is False and config.api_key is None
    config = parsed(monkeypatch, "--max-top-logprobs", "3", "--max-n", "2",
                    "--max-request-bytes", "1000", "--shutdown-timeout", "1.5",
                    "--enable-cache-report")  # fmt: skip
    assert config.limits == RequestLimits(max_top_logprobs=3, max_n=2)
    assert config.max_request_bytes == 1000 and config.shutdown_timeout == 1.5
    assert config.enable_cache_report


def test_api_key_from_the_environment_is_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEFT_API_KEY", "from-env")
    config = parsed(monkeypatch)
    assert config.api_key == "from-env" and "from-env" not in repr(config)
    assert parsed(monkeypatch, "--api-key", "flag").api_key == "flag"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-n", "0"], "max_n must be >= 1, got 0"),
        (["--max-top-logprobs", "-1"], "max_top_logprobs must be >= 0, got -1"),
        (["--max-request-bytes", "0"], "max_request_bytes must be >= 1, got 0"),
        (["--shutdown-timeout", "-2"], "shutdown_timeout must be >= 0, got -2"),
    ],
)
def test_bad_values_are_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str],
    message: str,
) -> None:  # fmt: skip
    monkeypatch.setattr(serve, "run_server", lambda config: 0)
    assert cli.main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_every_limit_is_documented(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    help_text = capsys.readouterr().out
    readme = README.read_text()
    for option in (*OPTIONS, "--enable-cache-report"):
        assert option in help_text, option
        assert f"`{option}`" in readme, option


def test_limits_name_the_number_and_the_cap() -> None:
    limits = RequestLimits(max_top_logprobs=5, max_n=4)
    with pytest.raises(ValueError, match=r"top_logprobs_num is 6, more than .* limit of 5"):
        limits.check_top_logprobs(6, "top_logprobs_num")
    with pytest.raises(ValueError, match=r"n is 5, more than .* limit of 4 .*--max-n"):
        limits.check_n(5)
    limits.check_n(4)
    RequestLimits().check_n(10**6)  # no cap: the offline Engine
