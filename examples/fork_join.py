"""fork/join: branches share the prompt (prefilled once, then found in the prefix cache)."""

from __future__ import annotations

from example_args import setup

import weft


@weft.function
def tips(s: weft.ProgramState, topic: str) -> None:
    s += "Here are three short tips about " + topic + ", one sentence each.\n"
    # fork(3): three copies of the state; the shared text is prefilled once first.
    forks = s.fork(3)
    forks += lambda i: f"Tip {i + 1}:"  # a callable gets the branch index
    forks += weft.gen("tip", stop="\n")  # the same expression goes to every branch
    # join(): wait for the branches; their variables come back as lists, in branch order.
    forks.join()
    for i, tip in enumerate(s["tip"]):
        s += f"Tip {i + 1}:{tip}\n"
    s += "In short:" + weft.gen("summary", stop="\n")


def main() -> None:
    backend, max_tokens = setup(__doc__, max_tokens=16)
    state = tips.run("sleeping well", temperature=0, max_new_tokens=max_tokens)
    print(state.text())
    for meta in state.get_meta_info("tip"):
        print(
            f"branch prompt: {meta['prompt_tokens']} tokens, {meta['cached_tokens']} from the cache"
        )
    backend.shutdown()


if __name__ == "__main__":
    main()
