"""outlines-core compile worker: run as a script (imports no weft code) so a timed-out compile is killed.

Protocol on stdin/stdout: length-prefixed pickles. First frame: the outlines `Vocabulary`. Then one
job frame `(kind, text, whitespace)` -> one reply frame `("ok", pickled Index)` or `("error", msg)`.
"""

from __future__ import annotations

import pickle
import struct
import sys
from typing import IO, Any

_HEADER = struct.Struct("<Q")
# NOTE: every regex is compiled as `(?:R)SENTINEL`, the sentinel being a fake token that only
# the end of a match can be followed by. outlines-core 0.2.14 loses transitions out of states
# that are already a match (`ab?-?b` refuses "ab-b"); with the sentinel no such state exists.
SENTINEL = "\U0010ffff"


def build_index(kind: str, text: str, whitespace: str, vocabulary: Any) -> Any:
    """The Index of a regex (or of a JSON schema: kind 'schema'), followed by the sentinel."""
    import outlines_core

    if kind == "schema":
        text = outlines_core.json_schema.build_regex_from_schema(text, whitespace)
    return outlines_core.Index(f"(?:{text}){SENTINEL}", vocabulary)


def write_frame(stream: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def read_frame(stream: IO[bytes]) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    return pickle.loads(stream.read(_HEADER.unpack(header)[0]))


def main() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    vocabulary = read_frame(stdin)
    while (job := read_frame(stdin)) is not None:
        kind, text, whitespace = job
        try:
            write_frame(
                stdout, ("ok", pickle.dumps(build_index(kind, text, whitespace, vocabulary)))
            )
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # a Rust panic too: every failure goes back as a refusal
            write_frame(stdout, ("error", f"{type(e).__name__}: {e}"))


if __name__ == "__main__":
    main()
