"""Validating a finished output against its full JSON schema (the `jsonschema` package): what the
server reports as `schema_valid` / `schema_error`, whatever the grammar left unenforced."""

from __future__ import annotations

import functools
import json
import warnings
from dataclasses import dataclass
from typing import Any

import jsonschema
import jsonschema.exceptions

from weft.constrain.format_checks import idn_hostname_ok
from weft.constrain.formats import FORMAT_REGEXES, conforms
from weft.constrain.schema import walk

VALIDATOR_CACHE = 256  # compiled validators kept, by schema text
# draft 2020-12's format-assertion vocabulary: a schema using one the validator has no checker for
# (e.g. `iri`, `uri-template` without their optional packages) cannot be called valid, only unchecked
STANDARD_FORMATS = frozenset(
    "date-time date time duration email idn-email hostname idn-hostname ipv4 ipv6 uri "
    "uri-reference iri iri-reference uuid uri-template json-pointer relative-json-pointer "
    "regex".split()
)


@dataclass(frozen=True)
class SchemaCheck:
    """The verdict on one output: `valid` None when the schema itself could not be checked (e.g. a
    remote $ref, which is never fetched). `path`: the JSON pointer of the first failing instance
    location ("" is the whole document); `keyword_path`: the pointer of the failing keyword in the
    schema."""

    valid: bool | None
    path: str = ""
    keyword_path: str = ""
    message: str = ""

    def meta(self) -> dict[str, Any]:
        """The meta_info keys: `schema_valid`, and `schema_error` unless valid."""
        out: dict[str, Any] = {"schema_valid": self.valid}
        if self.valid is not True:
            out["schema_error"] = {
                "path": self.path,
                "keyword_path": self.keyword_path,
                "message": self.message,
            }
        return out


def check_output(schema_text: str, text: str) -> SchemaCheck:
    """Whether `text` is one JSON document valid under `schema_text` (JSON text of a schema).
    Formats are asserted where jsonschema can check them, and those of formats.py as the grammar
    enforces them."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except (json.JSONDecodeError, ValueError, RecursionError) as e:
        return SchemaCheck(False, message=f"the output is not one JSON document: {e}")
    try:
        validator = schema_validator(schema_text)
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    except RecursionError:
        return SchemaCheck(None, message="the schema could not be checked: it recurses too deeply")
    except Exception as e:  # NOTE: an unresolvable $ref, a regex Python cannot read: reported
        return SchemaCheck(None, message=f"the schema could not be checked: {_short(e)}")
    if error is None:
        unchecked = _unchecked_formats(schema_text)
        if unchecked:
            names = ", ".join(unchecked)
            return SchemaCheck(None, message=f"every keyword holds but format {names}, which "
                               "this server cannot check (no checker installed)")  # fmt: skip
        return SchemaCheck(True)
    return SchemaCheck(
        False,
        path=_pointer(error.absolute_path),
        keyword_path=_pointer(error.absolute_schema_path),
        message=_short(error.message),
    )


##### Internal Helper Functions #####


@functools.lru_cache(maxsize=VALIDATOR_CACHE)
def schema_validator(schema_text: str) -> Any:
    """A jsonschema validator of the schema text, its draft's format checker on."""
    schema = json.loads(schema_text)
    with warnings.catch_warnings():  # an unknown $schema: read as 2020-12 (as the grammar does)
        warnings.simplefilter("ignore", DeprecationWarning)
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=_format_checker(cls))


@functools.lru_cache(maxsize=VALIDATOR_CACHE)
def _unchecked_formats(schema_text: str) -> tuple[str, ...]:
    """The standard formats the schema uses that its validator has no checker for."""
    known = schema_validator(schema_text).format_checker.checkers
    found = {node.get("format") for node in walk(json.loads(schema_text))}
    return tuple(sorted(f for f in found if f in STANDARD_FORMATS and f not in known))


@functools.cache
def _format_checker(cls: Any) -> jsonschema.FormatChecker:
    """`cls`'s format checker, with the formats the grammar enforces checked as it enforces them
    (formats.py: jsonschema's own checkers differ, e.g. `email` is any text with an `@`)."""
    checker = jsonschema.FormatChecker(formats=())
    checker.checkers = dict(cls.FORMAT_CHECKER.checkers)
    for name in FORMAT_REGEXES:
        checker.checkers[name] = (functools.partial(_conforms, name), ())
    # (`regex` is one of them: ECMA-262, not jsonschema's Python `re`); jsonschema checks
    # idn-hostname with a bare idna.encode (format_checks.py says what that lets through)
    checker.checkers["idn-hostname"] = (_idn_hostname, ())
    return checker


def _conforms(name: str, instance: object) -> bool:
    return not isinstance(instance, str) or conforms(name, instance)


def _idn_hostname(instance: object) -> bool:
    return not isinstance(instance, str) or idn_hostname_ok(instance)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _pointer(parts: Any) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def _short(e: BaseException | str) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 300 else text[:297] + "..."
