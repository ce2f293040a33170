"""run_batch: many programs at once on a thread pool, with a progress bar; results in order."""

from __future__ import annotations

import time

from example_args import setup

import weft

INSTRUCTIONS = (
    "Classify the topic of each headline as sports, politics, science or food. "
    "Then give a three-word summary.\n"
)
HEADLINES = [
    "Local team wins the championship after extra time",
    "Parliament passes the new budget by a narrow vote",
    "Astronomers find water vapour on a distant planet",
    "Chef opens a noodle bar in the old harbour",
    "Marathon record falls in windy conditions",
    "Election results delayed by a recount",
    "New battery chemistry doubles storage capacity",
    "Summer festival celebrates regional cheeses",
]


@weft.function
def classify(s: weft.ProgramState, headline: str) -> None:
    # The instructions are the same for every item: run_batch prefills them once.
    s += INSTRUCTIONS + "Headline: " + headline + "\nTopic:"
    s += weft.select("topic", choices=[" sports", " politics", " science", " food"])
    s += "\nSummary:" + weft.gen("summary", stop="\n")


def main() -> None:
    backend, max_tokens = setup(__doc__, max_tokens=8)
    start = time.perf_counter()
    states = classify.run_batch(
        [{"headline": h} for h in HEADLINES],
        temperature=0,
        max_new_tokens=max_tokens,
        progress_bar=True,
    )
    elapsed = time.perf_counter() - start
    for headline, state in zip(HEADLINES, states, strict=True):  # states come back in input order
        print(f"{state['topic']:>9} | {headline} |{state['summary']}")
    print(f"{len(states)} programs in {elapsed:.1f} s ({len(states) / elapsed:.2f} programs/s)")
    backend.shutdown()


if __name__ == "__main__":
    main()
