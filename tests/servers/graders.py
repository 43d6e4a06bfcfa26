"""A grader given to the MCP adapter by name (``tests.servers.graders:used_sql_and_right``)."""

from __future__ import annotations

from typing import Any


def used_sql_and_right(task: dict[str, Any], transcript: list[dict[str, Any]]) -> float:
    """1.0 when the agent ran SQL before answering and its answer is the task's; 0.5 for a right guess."""
    answer = transcript[-1]["arguments"]["answer"].strip()
    if answer != str(task["answer"]):
        return 0.0
    return 1.0 if any(call["tool"] == "execute_sql" for call in transcript[:-1]) else 0.5
