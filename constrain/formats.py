"""JSON-schema `format`s as regexes: the grammar enforces them as string patterns, and the output
validation (validation.py) checks them with the same regexes, so both agree.

Each regex is written in the subset that Python's `re` and Rust's regex-syntax (llguidance) read
alike (no lookarounds, no backreferences, ASCII classes spelled out) and matches the whole string.
They follow the RFCs as the JSON-Schema-Test-Suite's optional/format files read them:

- `date`, `date-time`, `time`: RFC 3339 (`T`/`Z` in either case; days of each month, 29 February
  only in leap years; a leap second `:60` only where the time, less its offset, is 23:59 UTC; year
  0000 refused, as Python's `date` does).
- `duration`: RFC 3339 appendix A (`P`, `T` and the unit letters in upper case; no fractions).
- `email`: RFC 5321 `Mailbox`: a dot-atom or a quoted local part, at a hostname or an address
  literal (`[IPv4]`, `[IPv6:...]`; no general address literals, no length limits).
- `hostname`: RFC 1123 labels (letters, digits, inner hyphens; 63 characters each), 253 in all.
  Labels with `--` in the 3rd and 4th place are A-labels (`xn--`) or reserved: whether one is
  valid Punycode under IDNA's rules is no grammar's business, so `hostname_checks` decodes them.
- `ipv4`: dotted quad without leading zeros (Python's `ipaddress`); `ipv6`: RFC 4291 text forms,
  an IPv4 tail included (no zone id).
- `uri`, `uri-reference`: RFC 3986 exactly; `uuid`: 8-4-4-4-12 hex digits, either case.
- `json-pointer`: RFC 6901 (`/` segments, `~` only as `~0` / `~1`); `relative-json-pointer`: a
  non-negative integer without leading zeros, then `#` or a JSON pointer.

- `regex`: ECMA-262 pattern syntax with the `u` flag, groups nested up to REGEX_MAX_DEPTH (balanced
  groups are not regular: the bound makes them so); back-references, range order and quantified
  assertions are left to the validation (format_checks.py), so it is inexact (refused if strict).
"""

from __future__ import annotations

import copy
import functools
import re
from typing import Any

import idna

from weft.constrain.format_checks import ecma262_error
from weft.constrain.schema import walk

_D = "[0-9]"
_HEX = "[0-9A-Fa-f]"

##### Dates and times (RFC 3339) #####

_YEAR = f"(?:{_D}{{3}}[1-9]|{_D}{{2}}[1-9]0|{_D}[1-9]00|[1-9]000)"  # not 0000
_LEAP_YEAR = f"(?:{_D}{{2}}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (
    f"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]{_D}|3[01])"
    f"|(?:0[469]|11)-(?:0[1-9]|[12]{_D}|30)|02-(?:0[1-9]|1{_D}|2[0-8]))|{_LEAP_YEAR}-02-29)"
)
_FRAC = f"(?:\\.{_D}+)?"
_HOUR = f"(?:[01]{_D}|2[0-3])"
_MINUTE = f"[0-5]{_D}"
_OFFSET = f"(?:[Zz]|[+-]{_HOUR}:{_MINUTE})"


def _leap_seconds() -> str:
    """`HH:MM:60[.frac]offset` where HH:MM less the offset is 23:59 UTC (every offset)."""
    alts = [f"23:59:60{_FRAC}(?:[Zz]|[+-]00:00)"]
    for sign, s in (("+", 1), ("-", -1)):
        for off_hour in range(24):
            by_hour: dict[int, list[str]] = {}
            for off_minute in range(60):
                if off_hour == off_minute == 0:
                    continue
                local = (23 * 60 + 59 + s * (off_hour * 60 + off_minute)) % (24 * 60)
                tail = f"{local % 60:02d}:60{_FRAC}\\{sign}{off_hour:02d}:{off_minute:02d}"
                by_hour.setdefault(local // 60, []).append(tail)
            alts += [f"{h:02d}:(?:{'|'.join(tails)})" for h, tails in sorted(by_hour.items())]
    return "(?:" + "|".join(alts) + ")"


_TIME = f"(?:{_HOUR}:{_MINUTE}:[0-5]{_D}{_FRAC}{_OFFSET}|{_leap_seconds()})"
_DATE_TIME = f"{_DATE}[Tt]{_TIME}"
# time and date-time with a leap second allowed at any time of day: looser than the formats, for
# a backend that cannot index the exact leap-second rule in time (outlines; reported unenforced)
_TIME_ANY_LEAP = f"{_HOUR}:{_MINUTE}:(?:[0-5]{_D}|60){_FRAC}{_OFFSET}"
LOOSE_TIME_FORMATS = {"time": _TIME_ANY_LEAP, "date-time": f"{_DATE}[Tt]{_TIME_ANY_LEAP}"}

_N = f"{_D}+"
_DUR_TIME = f"T(?:{_N}H(?:{_N}M(?:{_N}S)?)?|{_N}M(?:{_N}S)?|{_N}S)"
_DUR_DATE = f"(?:{_N}D|{_N}M(?:{_N}D)?|{_N}Y(?:{_N}M(?:{_N}D)?)?)"
_DURATION = f"P(?:{_DUR_DATE}(?:{_DUR_TIME})?|{_DUR_TIME}|{_N}W)"

##### Internet addresses #####

_OCTET = f"(?:25[0-5]|2[0-4]{_D}|1{_D}{{2}}|[1-9]{_D}|{_D})"
_IPV4 = f"{_OCTET}(?:\\.{_OCTET}){{3}}"
_H16 = f"{_HEX}{{1,4}}"
_LS32 = f"(?:{_H16}:{_H16}|{_IPV4})"
_IPV6 = (
    "(?:"
    + "|".join(  # RFC 3986 section 3.2.2, its nine forms
        [
            f"(?:{_H16}:){{6}}{_LS32}",
            f"::(?:{_H16}:){{5}}{_LS32}",
            f"(?:{_H16})?::(?:{_H16}:){{4}}{_LS32}",
            f"(?:(?:{_H16}:){{0,1}}{_H16})?::(?:{_H16}:){{3}}{_LS32}",
            f"(?:(?:{_H16}:){{0,2}}{_H16})?::(?:{_H16}:){{2}}{_LS32}",
            f"(?:(?:{_H16}:){{0,3}}{_H16})?::{_H16}:{_LS32}",
            f"(?:(?:{_H16}:){{0,4}}{_H16})?::{_LS32}",
            f"(?:(?:{_H16}:){{0,5}}{_H16})?::{_H16}",
            f"(?:(?:{_H16}:){{0,6}}{_H16})?::",
        ]
    )
    + ")"
)
_LABEL = "[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = f"{_LABEL}(?:\\.{_LABEL})*"
HOSTNAME_MAX_LENGTH = 253  # enforced as maxLength next to the pattern (a regex cannot count)

_ATEXT = "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]"
_QUOTED = '"(?:[ !#-\\[\\]-~]|\\\\[ -~])*"'  # RFC 5321 qtextSMTP / quoted-pairSMTP
_EMAIL = (
    f"(?:{_ATEXT}+(?:\\.{_ATEXT}+)*|{_QUOTED})@(?:{_HOSTNAME}|\\[{_IPV4}\\]|\\[IPv6:{_IPV6}\\])"
)

##### URIs (RFC 3986) #####

_UNRESERVED = "A-Za-z0-9._~\\-"
_SUB_DELIMS = "!$&'()*+,;="
_PCT = f"%{_HEX}{_HEX}"
_PCHAR = f"(?:[{_UNRESERVED}{_SUB_DELIMS}:@]|{_PCT})"
_SEGMENT = f"{_PCHAR}*"
_SEGMENT_NZ = f"{_PCHAR}+"
_SEGMENT_NZ_NC = f"(?:[{_UNRESERVED}{_SUB_DELIMS}@]|{_PCT})+"
_IP_LITERAL = f"\\[(?:{_IPV6}|[vV]{_HEX}+\\.[{_UNRESERVED}{_SUB_DELIMS}:]+)\\]"
_REG_NAME = f"(?:[{_UNRESERVED}{_SUB_DELIMS}]|{_PCT})*"  # IPv4 addresses included
_USERINFO = f"(?:[{_UNRESERVED}{_SUB_DELIMS}:]|{_PCT})*"
_AUTHORITY = f"(?:{_USERINFO}@)?(?:{_IP_LITERAL}|{_REG_NAME})(?::{_D}*)?"
_PATH_ABEMPTY = f"(?:/{_SEGMENT})*"
_PATH_ABSOLUTE = f"/(?:{_SEGMENT_NZ}(?:/{_SEGMENT})*)?"
_QUERY = f"(?:[?]{_PCHAR.replace(':@]', ':@/?]')}*)?"
_FRAGMENT = f"(?:#{_PCHAR.replace(':@]', ':@/?]')}*)?"
_SCHEME = "[A-Za-z][A-Za-z0-9+.-]*"
_HIER = f"(?://{_AUTHORITY}{_PATH_ABEMPTY}|{_PATH_ABSOLUTE}|{_SEGMENT_NZ}(?:/{_SEGMENT})*)?"
_URI = f"{_SCHEME}:{_HIER}{_QUERY}{_FRAGMENT}"
_RELATIVE = f"(?://{_AUTHORITY}{_PATH_ABEMPTY}|{_PATH_ABSOLUTE}|{_SEGMENT_NZ_NC}(?:/{_SEGMENT})*)?"
_URI_REFERENCE = f"(?:{_URI}|{_RELATIVE}{_QUERY}{_FRAGMENT})"

_UUID = f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}"

##### ECMA-262 regular expressions (u-mode syntax; format_checks.py parses them exactly) #####

REGEX_MAX_DEPTH = 6  # groups nested deeper than this: a valid regex the grammar cannot write
_RE_SYNTAX = "\\^$\\\\.*+?()\\[\\]{}|"  # ^ $ \ . * + ? ( ) [ ] { } |, escaped for a class
_RE_NAME = "[A-Za-z_$][A-Za-z0-9_$]*"
_RE_CHAR_ESCAPE = (  # after the backslash: CharacterEscape
    f"(?:[fnrtv0]|c[A-Za-z]|x{_HEX}{{2}}|u{_HEX}{{4}}|u\\{{{_HEX}+\\}}|[{_RE_SYNTAX}/])"
)
_RE_CLASS_ESCAPE = "(?:[dDsSwW]|[pP]\\{[A-Za-z0-9_]+(?:=[A-Za-z0-9_]+)?\\})"
_RE_CLASS = f"\\[\\^?(?:[^\\\\\\]]|\\\\(?:[b\\-]|{_RE_CHAR_ESCAPE}|{_RE_CLASS_ESCAPE}))*\\]"
_RE_ATOM = (
    f"(?:[^{_RE_SYNTAX}]|\\.|{_RE_CLASS}|\\\\(?:{_RE_CHAR_ESCAPE}|{_RE_CLASS_ESCAPE}"
    f"|[bB]|[1-9]{_D}*|k<{_RE_NAME}>))"
)
_RE_QUANTIFIER = f"(?:[*+?]|\\{{{_D}+(?:,{_D}*)?\\}})\\??"
_RE_GROUP_OPEN = f"\\((?:\\?(?::|<{_RE_NAME}>|<?[=!]|[ims]+(?:-[ims]*)?:|-[ims]+:))?"


def _regex_syntax(depth: int) -> str:
    """ECMA-262 pattern syntax with groups nested up to `depth` (a Disjunction: terms and `|`
    in any order, empty alternatives being valid). What no regex can say (a back-reference to
    a group that exists, ranges in order, quantified assertions) the output validation checks
    (format_checks.ecma262_error)."""
    inner = "" if depth == 0 else f"|{_RE_GROUP_OPEN}{_regex_syntax(depth - 1)}\\)"
    return f"(?:(?:{_RE_ATOM}{inner})(?:{_RE_QUANTIFIER})?|[$^|])*"


_REGEX = _regex_syntax(REGEX_MAX_DEPTH)

##### JSON pointers (RFC 6901; relative: draft-handrews-relative-json-pointer-01) #####

_JSON_POINTER = "(?:/(?:[^~/]|~[01])*)*"
_RELATIVE_JSON_POINTER = f"(?:0|[1-9]{_D}*)(?:#|{_JSON_POINTER})"

# format name -> a regex of the whole string
FORMAT_REGEXES: dict[str, str] = {
    "date": _DATE,
    "date-time": _DATE_TIME,
    "time": _TIME,
    "duration": _DURATION,
    "email": _EMAIL,
    "hostname": _HOSTNAME,
    "ipv4": _IPV4,
    "ipv6": _IPV6,
    "uri": _URI,
    "uri-reference": _URI_REFERENCE,
    "uuid": _UUID,
    "json-pointer": _JSON_POINTER,
    "relative-json-pointer": _RELATIVE_JSON_POINTER,
    "regex": _REGEX,
}
# formats whose regex admits strings the format rejects: only the output validation decides
# (refused in strict mode)
INEXACT_FORMATS = {
    "hostname": "A-labels (xn--) must be valid Punycode under IDNA's rules",
    "regex": "back-references must name groups that exist, ranges must be in order, and groups "
    f"may nest only {REGEX_MAX_DEPTH} deep",
}


##### Public API #####


def format_pattern(name: str) -> str | None:
    """The anchored regex (`^...$`) a string of format `name` matches; None for formats weft
    does not enforce."""
    regex = FORMAT_REGEXES.get(name)
    return None if regex is None else f"^{regex}$"


def conforms(name: str, text: str) -> bool:
    """Whether `text` is a valid `name` (one of FORMAT_REGEXES): the regex, and for hostnames,
    IDNA's checks of every A-label; a `regex` by parsing it (format_checks.ecma262_error: the
    format's regex bounds the nesting of groups)."""
    if name == "regex":
        return ecma262_error(text) is None
    if _compiled(name).fullmatch(text) is None:
        return False
    if name == "hostname" and len(text) > HOSTNAME_MAX_LENGTH:
        return False
    return name != "hostname" or all(_label_ok(label) for label in text.split("."))


def format_patterns(schema: Any) -> tuple[Any, list[str]]:
    """(a copy of `schema` where each `format` of FORMAT_REGEXES is a `pattern` instead, the
    INEXACT_FORMATS so rewritten); `schema` itself if it has none. A subschema with its own
    `pattern` gets the format's as an `allOf` entry (both must match); a hostname also gets
    `maxLength` 253. `format` is string-only, as `pattern` and `maxLength` are."""
    if not any(_enforced(node) for node in walk(schema)):
        return schema, []
    schema = copy.deepcopy(schema)
    inexact: list[str] = []
    for node in list(walk(schema)):
        if not _enforced(node):
            continue
        name = node.pop("format")
        pattern = format_pattern(name)
        if "pattern" in node:
            node["allOf"] = [*node.get("allOf", []), {"pattern": pattern}]
        else:
            node["pattern"] = pattern
        if name == "hostname":
            limit = node.get("maxLength")
            fits = isinstance(limit, int) and limit <= HOSTNAME_MAX_LENGTH
            node["maxLength"] = limit if fits else HOSTNAME_MAX_LENGTH
        if name in INEXACT_FORMATS:
            inexact.append(f"format:{name}")
    return schema, list(dict.fromkeys(inexact))


##### Internal Helper Functions #####


def _enforced(node: dict[str, Any]) -> bool:
    return node.get("format") in FORMAT_REGEXES and isinstance(node.get("allOf", []), list)


@functools.cache
def _compiled(name: str) -> re.Pattern[str]:
    return re.compile(FORMAT_REGEXES[name])


def _label_ok(label: str) -> bool:
    """An ASCII label; one with `--` in the 3rd and 4th place must be a valid A-label."""
    if label[2:4] != "--":
        return True
    if label[:4].lower() != "xn--":
        return False
    try:
        idna.decode(label)
    except (idna.IDNAError, UnicodeError):
        return False
    return True
