"""ALFWorld as a JetRL task env: the real ALFWorld text engine (PyPI ``alfworld`` on TextWorld's PDDL
engine) on games generated offline (``gen.py``), with AgentBench's function-calling interface.

* Tool: ``take_action(action)``, as AgentBench FC. The command is lower-cased, cut to its first line
  and, when it is not admissible, mapped to the admissible command with the best BLEU score (AgentBench's
  ``process_action``; ``env.alfworld.snap_actions=false`` passes it to the engine as typed, which answers
  "Nothing happens."). Each observation ends with the admissible commands.
* Grading (AgentBench): reward 1 when the engine reports ``won``; at most 20 rounds; the same action
  three times in a row ends the episode as ``invalid_action`` with reward 0.
* Oracle: ALFWorld's handcoded expert, tracking the episode step by step (``engine.py``).
* Task ids name the game: ``pick_heat_then_place_in_recep-Egg-None-DiningTable-11/trial_0``. Each split
  has a catalogue of games (``env.alfworld.num_train_games`` / ``num_test_games`` per task type, else
  ``env.num_train_tasks`` / ``num_test_tasks``; the task types of ``env.alfworld.levels``; the expert's result
  on each recorded, not used to pick them); any other valid id of the split is generated on demand. The seed
  is unused: a game is fixed by its id. ``env.alfworld.game_files`` serves ALFWorld's own game files as
  split ``dev`` (ids ``<task folder>/<trial folder>``).
* Engines run in child processes with a pool of loaded games (``pool.py``).

This package is not called ``alfworld`` so that ``import alfworld`` always means the PyPI engine.
"""

from __future__ import annotations

import glob
import json
import warnings
from pathlib import Path
from typing import Any

import structlog

from services.envs.alfworld_env import gen
from services.envs.alfworld_env.config import AlfworldTaskConfig
from services.envs.alfworld_env.engine import Step
from services.envs.alfworld_env.pool import EngineDied, EnginePool, EngineProc
from services.envs.base import Episode, TaskEnv, TaskLevel, ToolCall, ToolError, ToolResult
from shared.config import EnvConfig
from shared.messages import EpisodeStatus

log = structlog.get_logger()

TOOLS = [{"type": "function", "function": {
    "name": "take_action",
    "description": "Take an action.",
    "parameters": {"type": "object",
                   "properties": {"action": {"type": "string", "description": "The action you would like to take"}},
                   "required": ["action"], "additionalProperties": False}}}]

INSTRUCTION = (
    "Interact with a household to solve a task. Imagine you are an intelligent agent in a household environment "
    "and your target is to perform actions to complete the task goal. At the beginning of your interactions, you "
    "will be given the detailed description of the current environment and your goal to accomplish. A tool is "
    "provided to submit the action you want to take: it is the only tool you should and must use to operate in "
    "the environment, with the chosen action in the arguments of your tool call. For each of your turn, you will "
    "be given a list of actions which you can choose one to perform in this turn. After your each turn, the "
    "environment will give you immediate feedback based on which you plan your next few steps. If the "
    "environment outputs \"Nothing happens\", that means the previous action is invalid and you should try more "
    "options.\n Reminder:\n1. the action must be chosen from the given available actions. Any actions except "
    "provided available actions will be regarded as illegal.\n2. Always call the tool to hand in your next action "
    "and think when necessary.")


def available(actions: list[str]) -> str:
    return " AVAILABLE ACTIONS: " + "\n".join(actions) + "\n"


def snap(action: str, choices: list[str], limit: float = 0.01) -> str:
    """AgentBench's ``process_action``: first line, lower case; else the admissible command closest by
    smoothed sentence BLEU if it scores above ``limit``; else the text as is."""
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

    action = action.strip().lower().split("\n")[0]
    if not choices or action in choices:
        return action
    smooth = SmoothingFunction().method4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nltk warns on zero n-gram overlaps
        scores = [sentence_bleu([c.split()], action.split(), smoothing_function=smooth) for c in choices]
    best = max(range(len(choices)), key=scores.__getitem__)
    return choices[best] if scores[best] > limit else action


class AlfworldEpisode(Episode):
    calls_per_message = "first"  # AgentBench's ALFWorld task runs a message's first call

    def __init__(self, env: AlfworldEnv, task_id: str, proc: EngineProc, first: Step, max_turns: int) -> None:
        self.env, self.task_id, self.proc, self.last = env, task_id, proc, first
        self.max_turns = max_turns
        self.outputs: list[str] = []  # raw tool arguments, for AgentBench's repeat rule
        self.actions: list[str] = []  # commands sent to the engine (the replay log)
        self.nothing_happens = 0
        self.closed = False

    @property
    def tools(self) -> list[dict[str, Any]]:
        return TOOLS

    def opening(self) -> list[dict[str, Any]]:
        ob = "\n".join(self.last.observation.split("\n\n")[1:])  # drop the "-= Welcome =-" banner
        return [{"role": "system", "content": INSTRUCTION},
                {"role": "user", "content": "Here is your task. " + ob + available(self.last.admissible)}]

    def call(self, tool: ToolCall) -> ToolResult:
        if tool.name != "take_action":
            raise ToolError(f"Unknown tool {tool.name!r}. Available tools: take_action.")
        raw = tool.arguments.get("action")
        if not isinstance(raw, str) or not raw.strip():
            raise ToolError("take_action needs a non-empty string argument `action`, one of the available actions.")
        if len(raw) > 1000:
            raise ToolError(f"The action is {len(raw)} characters long; an action is one short command (<= 1000).")
        command = snap(raw, self.last.admissible) if self.env.snap_actions else raw.strip().lower().split("\n")[0]
        self.last = self.env.pool.step(self.proc, command)
        self.actions.append(command)
        self.outputs.append(raw)
        self.nothing_happens += not self.last.valid
        observation = self.last.observation
        if observation.startswith("You arrive at loc "):  # AgentBench's process_ob
            observation = observation[observation.find(". ") + 2:]
        metrics = {"won": float(self.last.won), "nothing_happens": float(self.nothing_happens)}
        content = observation + available(self.last.admissible)
        if self.last.won:
            return ToolResult(content, finish=True, reward=1.0, status=EpisodeStatus.COMPLETED, metrics=metrics)
        if len(self.outputs) > 3 and len(set(self.outputs[-3:])) == 1:  # AgentBench: 3 repeats = failure
            return ToolResult(content + "\nThe same action three times in a row: the episode ends.", finish=True,
                              reward=0.0, status=EpisodeStatus.INVALID_ACTION, metrics=metrics)
        return ToolResult(content, metrics=metrics)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.env.pool.release(self.proc)


class AlfworldEnv(TaskEnv):
    name = "alfworld"

    def __init__(self, cfg: EnvConfig) -> None:
        self.cfg = cfg
        self.root = gen.data_root(cfg.data_dir)
        self.max_turns = cfg.alfworld.max_rounds
        self.snap_actions = cfg.alfworld.snap_actions
        bad = sorted(set(cfg.alfworld.levels) - set(gen.DIFFICULTY.values()))
        if bad:
            raise ValueError(f"env.alfworld.levels: {bad} are not task-type difficulties (1, 2, 3)")
        levels = cfg.alfworld.levels
        self.task_types = [t for t in gen.TASK_TYPES if not levels or gen.DIFFICULTY[t] in levels]
        counts = (("train", cfg.alfworld.num_train_games or cfg.num_train_tasks),
                  ("test", cfg.alfworld.num_test_games or cfg.num_test_tasks))
        self.catalogue = {split: gen.build_catalogue(split, n, cfg.data_dir, self.max_turns, log=self._log_build,
                                                     filter_won=cfg.alfworld.expert_filter, task_types=self.task_types)
                          for split, n in counts}
        self.ids = {split: [t for tt in self.task_types for t in cat["tasks"][tt]]
                    for split, cat in self.catalogue.items()}
        if cfg.alfworld.oracle not in ("expert", "planner"):
            raise ValueError(f"env.alfworld.oracle must be expert or planner, got {cfg.alfworld.oracle!r}")
        self.files = game_files(cfg.alfworld.game_files)  # the user's own ALFWorld games: split "dev"
        self.ids["dev"] = list(self.files)
        self.pool = EnginePool(max_procs=cfg.max_sessions + cfg.alfworld.pool_size,
                               sas_cache=str(self.root / "sas"), recycle_after=cfg.alfworld.recycle_after,
                               prefetch=cfg.alfworld.prefetch, step_timeout_s=0.9 * cfg.action_timeout_s)

    @staticmethod
    def _log_build(**kv: Any) -> None:
        log.info("alfworld_catalogue_built", **kv)

    def task_ids(self, split: str) -> list[str]:
        return list(self.ids.get(split, []))

    def task_level(self, task_id: str, split: str) -> TaskLevel:
        if task_id in self.files:
            task_type = task_id.split("-")[0]
            return TaskLevel(gen.DIFFICULTY.get(task_type, 2), task_type)
        (task_type, _, _, _), _ = gen.parse_task_id(task_id)
        return TaskLevel(gen.DIFFICULTY[task_type], task_type)

    def task_info(self, task_id: str) -> dict[str, Any]:
        if task_id in self.files:  # ALFWorld's own name: type-object-movable receptacle-receptacle-scene
            task_type, obj, mrecep, recep, scene = task_id.split("/")[0].split("-")
            return {"task_type": task_type, "object": obj, "movable_receptacle": mrecep, "receptacle": recep,
                    "scene": int(scene), "trial": task_id.split("/")[1], "difficulty": gen.DIFFICULTY.get(task_type, 2),
                    "split": "dev", "path": self.files[task_id]}
        (task_type, obj, recep, scene), trial = gen.parse_task_id(task_id)
        return {"task_type": task_type, "object": obj, "receptacle": recep, "scene": scene, "trial": trial,
                "difficulty": gen.DIFFICULTY[task_type], "split": gen.split_of(scene)}

    def game_path(self, task_id: str, split: str) -> str:
        if split == "dev":
            return self.files[task_id]  # KeyError -> 404
        try:
            (_, _, _, scene), _ = gen.parse_task_id(task_id)
        except (ValueError, KeyError):
            raise KeyError(task_id) from None
        if gen.split_of(scene) != split:
            raise KeyError(task_id)
        return str(gen.write_game(self.root, task_id))  # KeyError for a tuple ALFRED's rules do not allow

    def open(self, task_id: str, split: str, seed: int) -> AlfworldEpisode:
        path = self.game_path(task_id, split)
        proc, first = self.pool.acquire(task_id, path)
        return AlfworldEpisode(self, task_id, proc, first, self.max_turns)

    def oracle(self, episode: Episode) -> ToolCall:
        """ALFWorld's handcoded expert (it searches the room as an agent would), or with
        ``env.alfworld.oracle = "planner"`` the full-knowledge planner (``engine.plan_next``: straight to the
        object, the station and the goal; the expert where it has no plan)."""
        assert isinstance(episode, AlfworldEpisode)
        if self.cfg.alfworld.oracle == "planner" and episode.last.plan:
            return ToolCall("take_action", {"action": episode.last.plan})
        return ToolCall("take_action", {"action": episode.last.expert})

    def replay(self, task_id: str, split: str, seed: int, actions: list[str]) -> AlfworldEpisode:
        """Rebuild a session from its action log (another replica died mid-episode)."""
        episode = self.open(task_id, split, seed)
        try:
            for command in actions:
                episode.last = self.pool.step(episode.proc, command)
                episode.actions.append(command)
                episode.outputs.append(command)
                episode.nothing_happens += not episode.last.valid
        except EngineDied:
            episode.close()
            raise
        return episode

    def close(self) -> None:
        self.pool.close()


def game_files(entries: list[str]) -> dict[str, str]:
    """``env.alfworld.game_files`` (paths or globs of ALFWorld's ``game.tw-pddl`` files) as {task id: path};
    the id is ALFWorld's own ``<task folder>/<trial folder>``, as AgentBench's lists name games."""
    out: dict[str, str] = {}
    for entry in entries:
        pattern = str(Path(entry).expanduser())
        paths = sorted(glob.glob(pattern, recursive=True)) if any(c in pattern for c in "*?[") else [pattern]
        if not paths:
            raise FileNotFoundError(f"env.alfworld.game_files: no file matches {pattern!r}")
        for p in map(Path, paths):
            if not p.is_file():
                raise FileNotFoundError(f"env.alfworld.game_files: {p} is not a file")
            if not (p.parent / "traj_data.json").is_file():
                raise FileNotFoundError(f"env.alfworld.game_files: {p} has no traj_data.json beside it (the "
                                        "expert and the goal need it, as in ALFWorld's data)")
            task_id = f"{p.parent.parent.name}/{p.parent.name}"
            if out.get(task_id, str(p)) != str(p):
                raise ValueError(f"env.alfworld.game_files: {p} and {out[task_id]} are both game {task_id}")
            out[task_id] = str(p)
    return out


def agentbench_task_ids(train_valid: Path) -> dict[str, list[str]]:
    """AgentBench's ALFWorld list (``train_valid.json``: task type -> game paths) as our task ids: the same
    (task type, object, receptacle, scene), trial k for the k-th ALFRED trial of that tuple."""
    out: dict[str, list[str]] = {}
    for key, paths in json.loads(Path(train_valid).read_text()).items():
        seen: dict[str, int] = {}
        for p in paths:
            name = p.split("/")[2]
            k = seen.get(name, 0)
            seen[name] = k + 1
            out.setdefault(key, []).append(f"{name}/trial_{k}")
    return out


Config = AlfworldTaskConfig
"""[env.alfworld]: the settings the task registry (shared/tasks.py) reads and checks."""


def make_env(cfg: EnvConfig) -> AlfworldEnv:
    return AlfworldEnv(cfg)
