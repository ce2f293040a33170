"""Quickstart: programs with gen, roles and streaming (python examples/quickstart.py)."""

from __future__ import annotations

from example_args import setup

import weft


@weft.function
def describe(s: weft.ProgramState, thing: str) -> None:
    # `s += ...` queues text and generations and returns at once; the model runs behind.
    s += "Here is a one-sentence description of " + thing + ".\n" + thing + " is"
    # gen() generates text into s["description"]; it stops at the end of the sentence.
    s += weft.gen("description", stop=[".", "\n"])


@weft.function
def chat(s: weft.ProgramState, question: str) -> None:
    # Roles use the model's own chat template, exactly as /v1/chat/completions renders them.
    s += weft.system("You are a helpful assistant. Answer in one sentence.")
    s += weft.user(question)
    s += weft.assistant(weft.gen("answer"))


def main() -> None:
    backend, max_tokens = setup(__doc__, max_tokens=24)
    # run()'s sampling arguments are the defaults of every gen that does not set its own.
    state = describe.run(thing="The Moon", temperature=0, max_new_tokens=max_tokens)
    print("description:", state["description"])  # reading a variable waits for it
    print("meta info:", state.get_meta_info("description"))

    state = chat.run("What is the capital of France?", temperature=0, max_new_tokens=max_tokens)
    print("answer:", state["answer"])
    print("messages:", state.messages())

    # Streaming: run() returns at once and text_iter() yields the text as it is generated.
    state = chat.run("Name a color.", temperature=0, max_new_tokens=max_tokens, stream=True)
    for chunk in state.text_iter("answer"):
        print(chunk, end="", flush=True)
    print()
    backend.shutdown()


if __name__ == "__main__":
    main()
