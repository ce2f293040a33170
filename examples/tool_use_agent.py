"""A tool-using agent: the program reads the model's choice of tool and branches on it."""

from __future__ import annotations

import ast
import operator

from example_args import setup

import weft

TOOLS = [" calculator", " lookup", " answer"]
FACTS = {
    "everest": "Mount Everest is 8849 metres high.",
    "eiffel": "The Eiffel Tower is 330 metres high.",
    "nile": "The Nile is about 6650 kilometres long.",
}
INSTRUCTIONS = (
    "Answer the question. Use the calculator for arithmetic, lookup for facts, "
    "and answer once you know the result.\n"
    "Question: What is 6 times 7?\nTool: calculator\nInput: 6 * 7\nResult: 42\n"
    "Tool: answer\nFinal answer: 42\n"
    "Question: How long is the Nile?\nTool: lookup\nInput: nile\n"
    "Result: The Nile is about 6650 kilometres long.\nTool: answer\nFinal answer: 6650 km\n"
)


@weft.function
def agent(s: weft.ProgramState, question: str, max_steps: int) -> None:
    s += INSTRUCTIONS + "Question: " + question + "\n"
    for _ in range(max_steps):
        s += "Tool:" + weft.select("tool", choices=TOOLS)
        tool = s["tool"].strip()  # reading a variable waits for it: the program can branch
        if tool == "answer":
            break
        s += "\nInput:" + weft.gen("input", stop="\n")
        s += "\nResult: " + run_tool(tool, s["input"]) + "\n"
    s += "\nFinal answer:" + weft.gen("answer", stop="\n")


def run_tool(tool: str, arg: str) -> str:
    if tool == "calculator":
        try:
            return str(calculate(ast.parse(arg.strip(), mode="eval").body))
        except (SyntaxError, ValueError, ZeroDivisionError):
            return "not an arithmetic expression"
    words = arg.lower().split()
    return next((fact for key, fact in FACTS.items() if key in words), "nothing found")


_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def calculate(node: ast.expr) -> float:
    """Numbers and + - * / only (never eval() model output)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](calculate(node.left), calculate(node.right))
    raise ValueError("unsupported expression")


def main() -> None:
    backend, max_tokens = setup(__doc__, max_tokens=16)
    for question in ("What is 17 times 23?", "How high is Mount Everest?"):
        state = agent.run(question, 3, temperature=0, max_new_tokens=max_tokens)
        print(state.text())
        print("-" * 40)
    backend.shutdown()


if __name__ == "__main__":
    main()
