"""Few-shot question answering: a shared prefix of examples, then one gen per question."""

from __future__ import annotations

from example_args import setup

import weft

EXAMPLES = (
    "Q: What is the capital of France?\nA: Paris\n"
    "Q: What is the capital of Japan?\nA: Tokyo\n"
    "Q: What is the capital of Italy?\nA: Rome\n"
)


@weft.function
def few_shot_qa(s: weft.ProgramState, question: str) -> None:
    s += EXAMPLES
    s += "Q: " + question + "\nA:"
    s += weft.gen("answer", stop="\n")  # one line: the model would go on with "Q: ..."


def main() -> None:
    backend, max_tokens = setup(__doc__, max_tokens=8)
    for country in ("Germany", "Spain", "Egypt"):
        state = few_shot_qa.run(
            f"What is the capital of {country}?", temperature=0, max_new_tokens=max_tokens
        )
        meta = state.get_meta_info("answer")
        # The examples are the same for every question, so later runs find them in the
        # prefix cache: cached_tokens counts the prompt tokens that were not recomputed.
        print(
            f"{country}:{state['answer']}  (cached {meta['cached_tokens']}/{meta['prompt_tokens']})"
        )
    backend.shutdown()


if __name__ == "__main__":
    main()
