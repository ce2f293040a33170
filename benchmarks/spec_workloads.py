"""The workloads of benchmarks/spec.py: code-edit prompts built from templates, ShareGPT first turns,
JSON-schema records; real text through the model's chat template."""

from __future__ import annotations

import json
import keyword
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORKLOADS = ("code-edit", "sharegpt", "json")
SHAREGPT_CHARS = (16, 2000)  # first human turns of this many characters (shorter/longer skipped)

##### Workloads #####


@dataclass(frozen=True)
class Workload:
    """Prompts (chat-templated text) and the sampling parameters they all run with."""

    name: str
    prompts: list[str]
    params: dict[str, Any]
    note: str = ""

    def take(self, n: int) -> list[str]:
        """The first n prompts; ValueError when there are fewer."""
        if n > len(self.prompts):
            raise ValueError(f"{self.name}: {n} prompts wanted, {len(self.prompts)} available")
        return self.prompts[:n]


@dataclass(frozen=True)
class WorkloadSpec:
    """What build_workload needs besides the tokenizer."""

    num_prompts: int
    max_new_tokens: int
    ignore_eos: bool = False
    snippet_lines: tuple[int, int] = (20, 60)
    sharegpt: Path | None = None
    seed: int = 0
    extra_params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        lo, hi = self.snippet_lines
        if not 4 <= lo <= hi:
            raise ValueError(f"snippet_lines must be 4 <= LO <= HI, got {lo} {hi}")
        if self.num_prompts < 1 or self.max_new_tokens < 1:
            raise ValueError("num_prompts and max_new_tokens must be >= 1")


def chat(tokenizer: Any, user: str) -> str:
    """`user` as one user turn with the generation prompt: the tokenizer's chat template, or a
    plain 'User:/Assistant:' frame for a tokenizer without one (a synthetic one)."""
    if getattr(tokenizer, "chat_template", None):
        msgs = [{"role": "user", "content": user}]
        return str(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    return f"User: {user}\nAssistant:"


def build_workload(name: str, tokenizer: Any, spec: WorkloadSpec) -> Workload:
    """The named workload's prompts (spec.num_prompts of them); greedy, spec.max_new_tokens.
    FileNotFoundError for sharegpt without its file."""
    params: dict[str, Any] = {"temperature": 0, "max_new_tokens": spec.max_new_tokens,
                              "ignore_eos": spec.ignore_eos, **spec.extra_params}  # fmt: skip
    if name == "code-edit":
        users = code_edit_prompts(spec.num_prompts, spec.snippet_lines, spec.seed)
        note = f"Python snippets of {spec.snippet_lines[0]}-{spec.snippet_lines[1]} lines to edit"
    elif name == "sharegpt":
        if spec.sharegpt is None or not spec.sharegpt.is_file():
            raise FileNotFoundError(f"sharegpt: no file at {spec.sharegpt} (fetch it with "
                                    "shared/tools/fetch-models.sh sharegpt, or pass --sharegpt PATH)")  # fmt: skip
        users = sharegpt_prompts(spec.sharegpt, spec.num_prompts)
        note = f"first human turns of {spec.sharegpt.name}, {SHAREGPT_CHARS[0]}-" \
               f"{SHAREGPT_CHARS[1]} characters, in file order"  # fmt: skip
    elif name == "json":
        users = json_prompts(spec.num_prompts, spec.seed)
        params["json_schema"] = json.dumps(PERSON_SCHEMA)
        note = "JSON-schema constrained records (json_schema of 5 fields)"
    else:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if len(users) < spec.num_prompts:
        raise ValueError(f"{name}: only {len(users)} prompts, {spec.num_prompts} wanted")
    return Workload(name, [chat(tokenizer, u) for u in users], params, note)


##### ShareGPT #####


def sharegpt_prompts(path: Path, n: int) -> list[str]:
    """The first n first-human turns of SHAREGPT_CHARS characters, in file order."""
    lo, hi = SHAREGPT_CHARS
    out: list[str] = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            turns = json.loads(line).get("conversations") or []
            first = next((t.get("value", "") for t in turns if t.get("from") == "human"), "")
            if lo <= len(first.strip()) <= hi:
                out.append(first.strip())
                if len(out) == n:
                    break
    return out


##### JSON #####

PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "skills": {"type": "array", "items": {"type": "string"}},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "skills", "employed"],
    "additionalProperties": False,
}
JOBS = ["carpenter", "nurse", "pilot", "chemist", "baker", "librarian", "welder", "architect",
        "teacher", "farmer", "programmer", "journalist", "sailor", "dentist", "painter", "judge"]  # fmt: skip
CITIES = ["Lisbon", "Osaka", "Lagos", "Lima", "Oslo", "Hanoi", "Quebec", "Perth", "Cairo",
          "Tbilisi", "Denver", "Porto", "Seoul", "Nairobi", "Krakow", "Bogota"]  # fmt: skip


def json_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    pairs = [(j, c) for j in JOBS for c in CITIES]
    rng.shuffle(pairs)
    return [f"Describe a fictional {job} who lives in {city} as a JSON object with the fields "
            "name, age, city, skills (a list of strings) and employed (true or false)."
            for job, city in (pairs * (n // len(pairs) + 1))[:n]]  # fmt: skip


##### Code edits #####

EDITS = [
    "Rename the variable `{old}` to `{new}` everywhere. Reply with the whole modified code.",
    "Add type hints to every function signature. Reply with the whole modified code.",
    "Add a one-line docstring to every function. Reply with the whole modified code.",
    "Replace every `print(...)` call with `logger.info(...)` and define `logger` at the top. "
    "Reply with the whole modified code.",
]
NOUNS = ["order", "packet", "sample", "record", "ticket", "sensor", "invoice", "frame", "user",
         "task", "event", "block", "entry", "reading", "message", "asset"]  # fmt: skip


def _fields(rng: random.Random, k: int) -> list[str]:
    pool = ["size", "weight", "price", "count", "limit", "offset", "score", "level", "rate",
            "depth", "width", "height", "delay", "budget", "quota", "margin", "retries", "port",
            "timeout", "version", "priority", "ttl", "buffer", "threshold"]  # fmt: skip
    return rng.sample(pool, min(k, len(pool)))


def _validator(noun: str, fields: list[str], rng: random.Random) -> list[str]:
    lines = [f"def parse_{noun}(raw):", "    result = {}", "    errors = []"]
    for f in fields:
        lo, hi = rng.randrange(0, 10), rng.randrange(100, 1000)
        lines += [f"    {f} = raw.get('{f}', {lo})",
                  f"    if not {lo} <= {f} <= {hi}:",
                  f"        errors.append('{f} out of range: ' + str({f}))",
                  f"    result['{f}'] = {f}"]  # fmt: skip
    lines += ["    if errors:", "        print('invalid', errors)", "        return None",
              "    return result"]  # fmt: skip
    return lines


def _stats(noun: str, fields: list[str], rng: random.Random) -> list[str]:
    lines = [f"def summarize_{noun}s(items):", "    totals = {}", "    count = 0",
             "    for item in items:", "        count += 1"]  # fmt: skip
    for f in fields:
        lines += [f"        totals['{f}'] = totals.get('{f}', 0) + item.{f}"]
    lines += ["    if count == 0:", "        print('no items')", "        return {}",
              "    means = {}", "    for key, total in totals.items():",
              "        means[key] = total / count", "    return means"]  # fmt: skip
    return lines


def _state_machine(noun: str, fields: list[str], rng: random.Random) -> list[str]:
    lines = [f"def next_{noun}_state(state, signal):"]
    for i, f in enumerate(fields):
        kw = "if" if i == 0 else "elif"
        nxt = fields[(i + 1) % len(fields)]
        lines += [f"    {kw} state == '{f}':",
                  f"        if signal > {rng.randrange(1, 50)}:",
                  f"            print('{noun}: {f} -> {nxt}')",
                  f"            return '{nxt}'",
                  f"        return '{f}'"]  # fmt: skip
    lines += ["    print('unknown state', state)", "    return state"]
    return lines


def _class(noun: str, fields: list[str], rng: random.Random) -> list[str]:
    cls = noun.capitalize()
    lines = [f"class {cls}:", "    def __init__(self, " + ", ".join(fields) + "):"]
    lines += [f"        self.{f} = {f}" for f in fields]
    for f in fields[: max(2, len(fields) // 2)]:
        lines += ["", f"    def scaled_{f}(self, factor):",
                  f"        value = self.{f} * factor",
                  f"        if value > {rng.randrange(10, 500)}:",
                  f"            print('{cls}.{f} large', value)",
                  "        return value"]  # fmt: skip
    return lines


def _retry(noun: str, fields: list[str], rng: random.Random) -> list[str]:
    lines = [f"def fetch_{noun}(client, key, attempts={rng.randrange(2, 6)}):",
             "    last_error = None", "    for attempt in range(attempts):",
             "        try:", f"            response = client.get('/{noun}s/' + key)",
             "            if response.status == 200:", "                data = response.json()",
             "                return {"]  # fmt: skip
    lines += [f"                    '{f}': data.get('{f}')," for f in fields]
    lines += ["                }", "            print('status', response.status)",
              "        except OSError as error:", "            last_error = error",
              "            print('attempt', attempt, 'failed:', error)",
              "    raise RuntimeError('giving up: ' + str(last_error))"]  # fmt: skip
    return lines


TEMPLATES: list[Callable[[str, list[str], random.Random], list[str]]] = [
    _validator,
    _stats,
    _state_machine,
    _class,
    _retry,
]


def _snippets(lines: tuple[int, int], rng: random.Random) -> Iterator[list[str]]:
    """Endless snippets: template after template, each with fields added until it reaches a
    length drawn from [lines[0], lines[1]], cut at lines[1]."""
    lo, hi = lines
    i = 0
    while True:
        make, noun = TEMPLATES[i % len(TEMPLATES)], rng.choice(NOUNS)
        i += 1
        seed, k, want = rng.random(), 1, rng.randint(lo, hi)
        body = make(noun, _fields(random.Random(seed), k), random.Random(seed))
        while len(body) < want and k < 24:
            k += 1
            body = make(noun, _fields(random.Random(seed), k), random.Random(seed))
        yield body[:hi]


def code_edit_prompts(n: int, lines: tuple[int, int], seed: int) -> list[str]:
    """n prompts asking to modify a generated Python snippet (the answer repeats most of it)."""
    rng = random.Random(seed)
    out = []
    for i, body in zip(range(n), _snippets(lines, rng), strict=False):
        code = "\n".join(body)
        names = sorted({w for w in code.replace("(", " ").replace(")", " ").split()
                        if w.isidentifier() and len(w) > 3 and not keyword.iskeyword(w)
                        and w != "print"})  # fmt: skip
        old = rng.choice(names)
        edit = EDITS[i % len(EDITS)].format(old=old, new=old + "_value")
        out.append(f"{edit}\n\n```python\n{code}\n```")
    return out
