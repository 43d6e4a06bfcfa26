"""What a task environment implements. The host (``host.py``) turns any of these into a NATS micro
service speaking the unified function-call API; a task module only knows its own world.

A task module (a package under ``services/envs/`` or a plugin's) exposes ``make_env(cfg: EnvConfig) -> TaskEnv``,
found by the task registry (shared/tasks.py: a ``jetrl.envs`` entry point or ``[env.<task>] factory``), and
may declare its ``[env.<task>]`` settings as a dataclass ``Config`` beside it (read as ``cfg.section(task)``).

* ``TaskEnv`` owns the task set (train/test splits, deterministic by seed) and opens episodes.
* ``Episode`` is one session: its opening messages, its tools (OpenAI function schemas), and
  ``call(name, arguments)`` for one tool call. Calls run in a worker thread, one at a time per
  episode; an exception from ``call`` becomes an ``env_error`` ending, never a dead replica.
* ``oracle(episode)`` returns the scripted expert's next tool call, for demonstrations and tests.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

CallsPerMessage = Literal["one", "first", "all"]


@dataclass
class ToolResult:
    """The outcome of one tool call. ``finish`` ends the episode with ``reward`` and ``status``."""

    content: str
    finish: bool = False
    reward: float = 0.0
    status: str = "running"
    metrics: dict[str, float] = field(default_factory=dict)
    role: str = "tool"
    """``user`` for what is not a tool's answer: the next user turn of a multi-turn conversation."""


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    content: str = ""
    """Assistant text sent with the call; with an empty ``name`` the turn is text only."""


class ToolError(Exception):
    """A bad tool call (unknown tool, wrong arguments): shown to the agent, the episode goes on."""


class Episode(ABC):
    max_turns: int = 15
    calls_per_message: CallsPerMessage = "one"
    """What the host runs of an assistant message with several tool calls, AgentBench's rule for the task:
    ``all`` of them in order, until one ends the episode, each call's result returned (its SQL and knowledge-graph
    tasks); the ``first`` only, the others dropped unanswered (its shell, household and shopping tasks); or (``one``, for
    tasks AgentBench has no rule for) none, with an error saying so. A message is one turn whatever the rule."""
    takes_whole_message: bool = False
    """True: the host hands each assistant message as it is to ``respond`` (every tool call of it: a task that grades
    parallel calls) instead of checking and running its first call with ``call`` / ``reply``."""

    @property
    @abstractmethod
    def tools(self) -> list[dict[str, Any]]:
        """OpenAI function-calling schemas, with AgentBench's names and arguments."""

    @abstractmethod
    def opening(self) -> list[dict[str, Any]]:
        """The first messages (system and user), OpenAI format."""

    @abstractmethod
    def call(self, tool: ToolCall) -> ToolResult:
        """Run one tool call. Raise ToolError for a bad call; the host turns it into an observation."""

    def call_timeout_s(self, tool: ToolCall) -> float | None:
        """How long the host waits for this call, where the episode bounds it itself and needs longer than
        ``env.action_timeout_s`` (OS grading: check scripts run without the agent's time limit); None: that."""
        return None

    def reply(self, content: str) -> ToolResult:
        """An assistant turn with no tool call. Most tasks refuse it; AgentBench's knowledge-graph task takes its
        final answer this way ("Final Answer: #3"). Raise ToolError for a bad turn, as ``call`` does."""
        raise ToolError("No tool call found. Reply with exactly one tool call, using one of the listed tools.")

    def respond(self, message: dict[str, Any]) -> ToolResult:
        """The whole assistant message, for episodes with ``takes_whole_message``."""
        raise NotImplementedError

    def close(self) -> None:
        """Free what the episode holds (databases, sandboxes). Called exactly once."""

    def limit_reached(self) -> ToolResult:
        """What happens when the turn limit is hit without an answer (AgentBench: reward 0)."""
        return ToolResult(content="Turn limit reached.", finish=True, reward=0.0, status="task_limit_reached")


@dataclass(frozen=True)
class TaskLevel:
    """How hard a task is (1 easy .. 3 hard, 0 = not graded by level) and what kind it is (a task type,
    a question shape, a command family): the breakdowns of the eval report."""

    level: int = 0
    kind: str = ""


class TaskEnv(ABC):
    name: str = ""

    def task_level(self, task_id: str, split: str) -> TaskLevel:
        """Level and kind of one task (for reports). Raise KeyError for an unknown task."""
        return TaskLevel()

    @abstractmethod
    def task_ids(self, split: str) -> list[str]:
        """Ids of the tasks in a split ("train" or "test"); ids are stable across replicas."""

    @abstractmethod
    def open(self, task_id: str, split: str, seed: int) -> Episode:
        """Start an episode of one task. Raise KeyError for an unknown task id."""

    def oracle(self, episode: Episode) -> ToolCall:
        """The scripted expert's next call for this episode."""
        raise NotImplementedError(f"{self.name} has no oracle yet")

    def close(self) -> None:
        """Free replica-wide resources (called on shutdown)."""
