"""check_finish when the request's grammar refuses the sampled token: the request alone ends with
a 400 that says why (a grammar no ordinary token can continue), not an internal error."""

from __future__ import annotations

from kv_helpers import make_req

from weft.runtime.scheduler.finish import check_finish


class _NoTokenGrammar:
    """A grammar whose mask allowed nothing: every sampled token is refused, and no error is
    recorded (as llguidance reports a grammar whose text needs a special token's spelling)."""

    def accept_token(self, token: int) -> bool:
        return False

    def error(self) -> str | None:
        return None


def test_a_refused_token_ends_the_request_with_a_400() -> None:
    req = make_req("r", [5, 6, 7])
    req.grammar = _NoTokenGrammar()  # type: ignore[assignment]
    req.output_ids.append(0)
    reason = check_finish(req, 0, frozenset())
    assert reason is not None and reason.type == "abort" and reason.status == 400
    assert reason.message is not None and "empty mask" in reason.message
    assert "internal error" not in reason.message
