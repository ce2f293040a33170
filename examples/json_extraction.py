"""JSON extraction with a pydantic model: the output is constrained to the model's schema."""

from __future__ import annotations

from example_args import setup
from pydantic import BaseModel

import weft


class Person(BaseModel):
    name: str
    age: int
    city: str


@weft.function
def extract(s: weft.ProgramState, text: str) -> None:
    s += "Extract the person described below as JSON.\n"
    s += "Text: " + text + "\nJSON: "
    # json_schema takes a pydantic class (or a dict / JSON string); s.parsed() validates.
    s += weft.gen("person", json_schema=Person)


def main() -> None:
    backend, max_tokens = setup(__doc__, max_tokens=64)
    state = extract.run(
        "Maria is 34 and lives in Lisbon.", temperature=0, max_new_tokens=max_tokens
    )
    if state.error() is not None:  # e.g. a runtime built without constrained decoding
        print("the backend could not run this program:", state.error())
    elif state.get_meta_info("person")["finish_reason"]["type"] == "length":
        print("cut by --max-tokens:", state["person"])
    else:
        person = state.parsed("person")
        print(repr(person))
    backend.shutdown()


if __name__ == "__main__":
    main()
