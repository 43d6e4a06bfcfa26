"""The task file of an MCP task (JSONL, one task per line) and its graders.

A task is ``{"prompt": ...}`` and optionally ``id``, ``answer``, ``split`` (train | test; default train),
``setup`` (``[{"tool": NAME, "arguments": {...}}]``, run on the episode's session before its first turn),
``grader`` (overrides the config's), ``verifier_arguments`` (added to a verifier tool's arguments),
``level`` and ``kind`` (the eval report's breakdowns). A grader turns the final answer into a reward:

* ``exact``: the answer equals the task's ``answer`` (surrounding space and case aside);
* ``regex``: the task's ``answer`` is a pattern the whole answer matches;
* ``numeric``: both are numbers and agree within the relative tolerance;
* ``tool:NAME``: the server's tool NAME, called on the episode's session with ``{"answer": ...}`` and the
  task's ``verifier_arguments``, returns the reward (a number, as text or structured content);
* ``pkg.mod:function``: ``function(task, transcript) -> float`` in the env's process, with the task's
  record and every call of the episode (``{"tool", "arguments", "result", "is_error"}``, the answer last).
"""

from __future__ import annotations

import importlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUILT_IN = ("exact", "regex", "numeric")
VERIFIER = "tool:"


@dataclass(frozen=True)
class McpTask:
    id: str
    prompt: str
    split: str
    grader: str
    answer: Any = None
    setup: tuple[dict[str, Any], ...] = ()
    verifier_arguments: dict[str, Any] = field(default_factory=dict)
    level: int = 0
    kind: str = ""
    record: dict[str, Any] = field(default_factory=dict)


def load_tasks(path: str, default_grader: str) -> list[McpTask]:
    """Every task of the file; a line that is not a task is refused with its number and why."""
    if not path:
        raise ValueError("tasks_file: name the JSONL file of tasks")
    tasks: list[McpTask] = []
    seen: set[str] = set()
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
            raise ValueError(f"{where}: a task is a JSON object with a non-empty string 'prompt'")
        task_id = str(record.get("id", f"task-{number}"))
        if task_id in seen:
            raise ValueError(f"{where}: task id {task_id!r} appears twice")
        seen.add(task_id)
        split = record.get("split", "train")
        if split not in ("train", "test"):
            raise ValueError(f"{where}: split must be train or test, got {split!r}")
        setup = record.get("setup", [])
        if not isinstance(setup, list) or not all(isinstance(s, dict) and isinstance(s.get("tool"), str)
                                                  and isinstance(s.get("arguments", {}), dict) for s in setup):
            raise ValueError(f"{where}: setup must be a list of {{\"tool\": NAME, \"arguments\": {{...}}}}")
        grader = str(record.get("grader", default_grader))
        check_grader(grader, where)
        if grader in BUILT_IN and "answer" not in record:
            raise ValueError(f"{where}: the {grader} grader needs the task's answer")
        tasks.append(McpTask(id=task_id, prompt=record["prompt"], split=split, grader=grader,
                             answer=record.get("answer"), setup=tuple(setup),
                             verifier_arguments=dict(record.get("verifier_arguments", {})),
                             level=int(record.get("level", 0)), kind=str(record.get("kind", "")), record=record))
    if not tasks:
        raise ValueError(f"{path}: no tasks")
    return tasks


def check_grader(grader: str, where: str) -> None:
    if grader in BUILT_IN or (grader.startswith(VERIFIER) and grader[len(VERIFIER):]):
        return
    module, sep, attr = grader.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{where}: grader {grader!r}: expected exact, regex, numeric, tool:NAME or pkg.mod:function")


def load_callable(grader: str) -> Callable[[dict[str, Any], list[dict[str, Any]]], float]:
    module, _, attr = grader.partition(":")
    fn = getattr(importlib.import_module(module), attr, None)
    if not callable(fn):
        raise ValueError(f"grader {grader!r} is not a function")
    return fn


def grade_answer(grader: str, answer: str, expected: Any, tolerance: float) -> float:
    """The built-in graders."""
    if grader == "exact":
        return float(answer.strip().casefold() == str(expected).strip().casefold())
    if grader == "regex":
        return float(re.fullmatch(str(expected), answer.strip()) is not None)
    given, wanted = as_number(answer), as_number(expected)
    if given is None or wanted is None:
        return 0.0
    return float(math.isclose(given, wanted, rel_tol=tolerance, abs_tol=tolerance))


def as_number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(str(value).strip().replace(",", ""))
    except ValueError:
        return None


def verifier_reward(result: Any) -> float:
    """A verifier tool's reward: its structured result (a number, or one under result / reward / score) or
    its text, read as a number. A verifier that answers anything else is broken: ValueError."""
    if result.is_error:
        raise ValueError(f"the verifier tool failed: {result_text(result)}")
    structured = result.structured_content
    if isinstance(structured, dict):
        for key in ("reward", "score", "result"):
            number = as_number(structured.get(key)) if key in structured else None
            if number is not None:
                return number
    number = as_number(result_text(result))
    if number is None:
        raise ValueError(f"the verifier tool answered {result_text(result)[:200]!r}, not a number")
    return number


def result_text(result: Any) -> str:
    """A CallToolResult as text: its text blocks; other blocks named; structured content as JSON when that
    is all there is."""
    parts: list[str] = []
    for block in result.content:
        text = getattr(block, "text", None)
        if isinstance(text, str):
            parts.append(text)
        else:
            kind = getattr(block, "type", type(block).__name__)
            parts.append(f"[{kind} {getattr(block, 'mime_type', '') or ''}]".replace(" ]", "]"))
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content)
    return "\n".join(parts)
