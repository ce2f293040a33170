"""Multi-turn chat: each turn sees the whole conversation, rendered with the chat template."""

from __future__ import annotations

from example_args import setup

import weft


@weft.function
def conversation(s: weft.ProgramState, questions: list[str]) -> None:
    s += weft.system("You are a helpful assistant. Keep answers short.")
    for i, question in enumerate(questions):
        s += weft.user(question)
        # Inside an assistant turn, gen also stops at the template's end-of-turn token.
        s += weft.assistant(weft.gen(f"answer_{i}"))


def main() -> None:
    backend, max_tokens = setup(__doc__, max_tokens=32)
    questions = ["What is the tallest animal?", "How tall does it grow?"]
    state = conversation.run(questions, temperature=0, max_new_tokens=max_tokens)
    for message in state.messages():  # OpenAI-style messages
        print(f"{message['role']:>9}: {message['content']}")
    # The second answer's prompt reused the first turn from the prefix cache.
    print("cached tokens of turn 2:", state.get_meta_info("answer_1")["cached_tokens"])
    backend.shutdown()


if __name__ == "__main__":
    main()
