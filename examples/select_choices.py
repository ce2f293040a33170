"""select: pick one of a few choices by the model's likelihood of each (no sampling)."""

# (Not named select.py: a script of that name would shadow the standard `select` module.)

from __future__ import annotations

from example_args import setup

import weft


@weft.function
def capital(s: weft.ProgramState, country: str, method: weft.ChoicesMethod) -> None:
    s += "Q: What is the capital of " + country + "?\nA:"
    # select appends exactly one of the choices and stores it in s["city"].
    s += weft.select("city", choices=[" Paris", " Berlin", " Madrid"], choices_method=method)


@weft.function
def sentiment(s: weft.ProgramState, review: str) -> None:
    s += "Review: " + review + "\nSentiment (positive or negative):"
    s += weft.select("label", choices=[" positive", " negative"])


def main() -> None:
    backend, _ = setup(__doc__, max_tokens=0)
    methods = {
        "token_length_normalized": weft.token_length_normalized,  # the default
        "greedy_token_selection": weft.greedy_token_selection,
        "unconditional_likelihood_normalized": weft.unconditional_likelihood_normalized,
    }
    for name, method in methods.items():
        state = capital.run("Germany", method)
        scores = state.get_meta_info("city")["normalized_prompt_logprobs"]
        print(f"{name}:{state['city']}  (mean token logprobs {[round(x, 2) for x in scores]})")
    for review in ("I loved every minute of it.", "Terrible food and rude staff."):
        print(review, "->", sentiment.run(review)["label"])
    backend.shutdown()


if __name__ == "__main__":
    main()
