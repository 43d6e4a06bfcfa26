"""A small env for tests whose grader is a setting: sums, a calculator tool, and an answer that a lenient
grader reads as a number ("12.0" is 12) and a strict one as text (``[env.sums] numeric = false``). Its
oracle writes the odd tasks' answers as decimals, so a change of grader changes exactly their reward.
Served as a task with ``[env.sums] factory = "tests.sums_env:make_env"``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.envs.base import Episode, TaskEnv, ToolCall, ToolError, ToolResult
from shared.config import EnvConfig, opt

TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "The sum of two integers.",
                                      "parameters": {"type": "object", "properties": {
                                          "a": {"type": "integer"}, "b": {"type": "integer"}},
                                          "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "answer", "description": "Give the final answer.",
                                      "parameters": {"type": "object", "properties": {"value": {"type": "string"}},
                                                     "required": ["value"]}}},
]


class SumEpisode(Episode):
    max_turns = 4

    def __init__(self, a: int, b: int, numeric: bool) -> None:
        self.a, self.b, self.numeric = a, b, numeric
        self.total: int | None = None

    @property
    def tools(self) -> list[dict[str, Any]]:
        return TOOLS

    def opening(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": f"{self.a} + {self.b}?"}]

    def call(self, tool: ToolCall) -> ToolResult:
        if tool.name == "add":
            self.total = int(tool.arguments["a"]) + int(tool.arguments["b"])
            return ToolResult(content=str(self.total))
        if tool.name == "answer":
            right = self.grade(str(tool.arguments["value"]))
            return ToolResult(content="correct" if right else "wrong", finish=True, reward=float(right),
                              status="completed")
        raise ToolError(f"unknown tool {tool.name}")

    def grade(self, value: str) -> bool:
        if self.numeric:
            try:
                return float(value) == self.a + self.b
            except ValueError:
                return False
        return value.strip() == str(self.a + self.b)


class SumEnv(TaskEnv):
    name = "sums"

    def __init__(self, numeric: bool = True, tasks: int = 8) -> None:
        self.numeric, self.tasks = numeric, tasks

    def task_ids(self, split: str) -> list[str]:
        return [f"{split}-{i}" for i in range(self.tasks)]

    def open(self, task_id: str, split: str, seed: int) -> Episode:
        if task_id not in self.task_ids(split):
            raise KeyError(task_id)
        i = int(task_id.rsplit("-", 1)[1])
        return SumEpisode(3 * i + 1, 5 + i, self.numeric)

    def oracle(self, episode: Episode) -> ToolCall:
        assert isinstance(episode, SumEpisode)
        if episode.total is None:
            return ToolCall("add", {"a": episode.a, "b": episode.b})
        odd = (episode.a - 1) // 3 % 2 == 1
        return ToolCall("answer", {"value": f"{episode.total}.0" if odd else str(episode.total)})


@dataclass
class Config:
    numeric: bool = opt(True, "grade the answer as a number (12.0 is 12); false: as text")


def make_env(env: EnvConfig) -> SumEnv:
    return SumEnv(numeric=env.section(env.task).numeric, tasks=env.num_train_tasks)
