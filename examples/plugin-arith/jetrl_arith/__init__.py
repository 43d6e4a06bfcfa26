"""``arith``: work out an expression with a calculator tool, then answer. A JetRL task plugin, whole.

Task set: seeded expressions of 2 to 4 operands (the level is the number of operators), train and test
split by id. Tools: ``calculate(expression)`` and ``answer(value)``. Grader: reward 1 for the exact value.
Oracle: calculate the question's expression, then answer what the calculator said.
"""

import ast
import operator
import random
from dataclasses import dataclass

from services.envs.base import Episode, TaskEnv, TaskLevel, ToolCall, ToolError, ToolResult
from shared.config import EnvConfig, opt

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
TOOLS = [
    {"type": "function", "function": {"name": "calculate", "description": "Evaluate + - * over integers.",
     "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}},
    {"type": "function", "function": {"name": "answer", "description": "Give the final value; ends the episode.",
     "parameters": {"type": "object", "properties": {"value": {"type": "integer"}}, "required": ["value"]}}},
]


@dataclass
class Config:
    """[env.arith]: read and checked by JetRL's task registry, then handed over as ``env.section("arith")``."""

    max_operand: int = opt(20, "largest number in a question")
    max_turns: int = opt(4, "tool calls per episode")


def evaluate(text: str) -> int:
    """The calculator: integers, + - * and parentheses, nothing else (no eval)."""
    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) < 10**6:
            return node.value
        raise ToolError(f"calculate: only integers, + - * and parentheses, got {ast.unparse(node)!r}")
    try:
        return walk(ast.parse(text, mode="eval").body)
    except SyntaxError:
        raise ToolError(f"calculate: cannot read {text!r}") from None


class ArithEpisode(Episode):
    def __init__(self, question: str, max_turns: int) -> None:
        self.question, self.max_turns, self.last = question, max_turns, None

    @property
    def tools(self) -> list[dict]:
        return TOOLS

    def opening(self) -> list[dict]:
        return [{"role": "system", "content": "Use calculate, then answer with the exact integer."},
                {"role": "user", "content": f"What is {self.question}?"}]

    def call(self, tool: ToolCall) -> ToolResult:
        if tool.name == "calculate":
            self.last = evaluate(str(tool.arguments["expression"]))
            return ToolResult(content=str(self.last))
        right = tool.arguments["value"] == evaluate(self.question)
        return ToolResult(content="Correct." if right else "Wrong.", finish=True, reward=float(right),
                          status="completed", metrics={"correct": float(right)})


class ArithEnv(TaskEnv):
    name = "arith"

    def __init__(self, env: EnvConfig, settings: Config) -> None:
        self.settings = settings
        self.ids = {"train": [f"train-{i}" for i in range(env.num_train_tasks)],
                    "test": [f"test-{i}" for i in range(env.num_test_tasks)]}

    def question(self, task_id: str) -> str:
        rng = random.Random(task_id)  # the id alone fixes the question: every replica agrees
        terms = [str(rng.randint(1, self.settings.max_operand)) for _ in range(2 + rng.randrange(3))]
        return "".join(t + (f" {rng.choice('+-*')} " if i < len(terms) - 1 else "") for i, t in enumerate(terms))

    def task_ids(self, split: str) -> list[str]:
        return self.ids[split]  # KeyError for an unknown split: the host answers 404

    def task_level(self, task_id: str, split: str) -> TaskLevel:
        return TaskLevel(level=self.question(task_id).count(" ") // 2, kind="arith")

    def open(self, task_id: str, split: str, seed: int) -> Episode:
        if task_id not in self.ids[split]:
            raise KeyError(task_id)
        return ArithEpisode(self.question(task_id), self.settings.max_turns)

    def oracle(self, episode: Episode) -> ToolCall:
        if episode.last is None:
            return ToolCall("calculate", {"expression": episode.question})
        return ToolCall("answer", {"value": episode.last})


def make_env(env: EnvConfig) -> ArithEnv:
    return ArithEnv(env, env.section(env.task or "arith"))
