"""BFCL: the Berkeley Function Calling Leaderboard's offline categories, as an env, for evaluation only.

Agent RL should not cost general function calling (AgentRL checks this on BFCL). The data, the
function docs and the graders are PyPI ``bfcl-eval``'s own, used the way its function-calling (FC)
model handlers use them, so a score here follows BFCL's published rules:

* **tools**: each entry's function docs through ``convert_to_tool`` (BFCL's types mapped to JSON
  schema; a ``.`` in a name becomes ``_``, as for every OpenAI-style FC model), with BFCL's
  "Python 3 syntax" hint in each description (``load_dataset_entry``);
* **single-turn** (``simple_python``, ``multiple``, ``parallel``, ``parallel_multiple``): one assistant
  message; every one of its tool calls is the answer (``{name: arguments}``, as ``decode_ast`` reads an
  FC reply), graded by ``ast_checker`` against the possible answers; no tool call = wrong;
* **irrelevance**: one assistant message; right when it makes no tool call;
* **multi_turn_base**: the user turns of the entry one after the other; within a turn every call is run
  on the entry's own instances of BFCL's simulated APIs (file system, trading bot, ...) and its result
  comes back; a message with no call (or calls that do not decode) ends the turn and the next user turn
  comes as the observation; more than BFCL's 20 steps in a turn fails the entry (``force_terminated``).
  After the last turn ``multi_turn_checker`` compares states and results with the ground truth's.

The env has no training split: ``task_ids("train")`` is empty. Each category is a task *kind*, so the
eval report's ``by_kind`` is BFCL's per-category accuracy, with its bootstrap interval. The test split
interleaves the categories, so ``controller.eval_limit`` takes an even slice of each.

Two things differ from running ``bfcl`` itself, both for a long-lived server: each episode's simulated
API instances live under a name of its own (BFCL keys them by model and entry only, so two samples of
one entry would share them) and are dropped when it ends; and a call whose name is not one of the
entry's functions, or whose argument names are not identifiers, is not run (BFCL would ``eval`` it and
report the error; it could not have matched the ground truth either). ``bfcl-eval`` is installed
without its dependencies (they would replace numpy and pull in every vendor's SDK); its model registry,
which the AST checker reads only to learn that FC models' names have ``_`` for ``.``, is then replaced
by exactly that rule.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import types
import uuid
from pathlib import Path
from typing import Any

import structlog

from services.envs.base import Episode, TaskEnv, TaskLevel, ToolCall, ToolResult
from services.envs.bfcl.config import BFCLTaskConfig
from shared.config import EnvConfig
from shared.messages import EpisodeStatus

log = structlog.get_logger()

SINGLE_TURN = ("simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance")
MULTI_TURN = ("multi_turn_base",)
CATEGORIES = SINGLE_TURN + MULTI_TURN
MODEL_NAME = "jetrl-FC"
"""The model name handed to BFCL's checkers: an FC model whose tool names have ``_`` for ``.``."""


class _FCModelConfig:
    underscore_to_dot = True  # BFCL's rule for every OpenAI-style FC model


class _FCModels(dict):  # type: ignore[type-arg]
    def __missing__(self, key: str) -> _FCModelConfig:
        return _FCModelConfig()


def _bfcl(data_dir: str) -> types.SimpleNamespace:
    """The parts of bfcl-eval we use, imported once; BFCL writes its lock files under BFCL_PROJECT_ROOT."""
    root = Path(data_dir or Path.home() / ".cache" / "jetrl" / "data") / "bfcl"
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("BFCL_PROJECT_ROOT", str(root))
    try:
        import bfcl_eval.constants.model_config  # noqa: F401  (needs every vendor's SDK)
    except ImportError:
        registry = types.ModuleType("bfcl_eval.constants.model_config")
        registry.MODEL_CONFIG_MAPPING = _FCModels()  # type: ignore[attr-defined]
        sys.modules["bfcl_eval.constants.model_config"] = registry
    from bfcl_eval.constants.default_prompts import MAXIMUM_STEP_LIMIT
    from bfcl_eval.constants.enums import Language, ModelStyle
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
    from bfcl_eval.eval_checker.ast_eval import ast_checker as ast_module
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker
    from bfcl_eval.model_handler.utils import convert_to_function_call, convert_to_tool
    from bfcl_eval.utils import (
        is_empty_output,
        is_function_calling_format_output,
        load_dataset_entry,
        load_ground_truth_entry,
    )

    ast_module.MODEL_CONFIG_MAPPING = _FCModels()  # the rule above, whichever registry was imported
    return types.SimpleNamespace(
        MAXIMUM_STEP_LIMIT=MAXIMUM_STEP_LIMIT, Language=Language, ModelStyle=ModelStyle,
        GORILLA_TO_OPENAPI=GORILLA_TO_OPENAPI, ast_checker=ast_module.ast_checker, multi_turn_utils=multi_turn_utils,
        multi_turn_checker=multi_turn_checker, convert_to_function_call=convert_to_function_call,
        convert_to_tool=convert_to_tool, is_empty_output=is_empty_output,
        is_function_calling_format_output=is_function_calling_format_output, load_dataset_entry=load_dataset_entry,
        load_ground_truth_entry=load_ground_truth_entry)


def category_of(entry_id: str) -> str:
    return entry_id.rsplit("_", 1)[0]  # BFCL's own rule: "multi_turn_base_12" -> "multi_turn_base"


def fc_output(message: dict[str, Any]) -> list[dict[str, Any]] | str:
    """An assistant message as BFCL's OpenAI FC handler records it: ``[{name: arguments}, ...]`` for its tool
    calls, its text when it made none."""
    calls = message.get("tool_calls") or []
    if not calls:
        return str(message.get("content") or "")
    return [{c["function"]["name"]: c["function"].get("arguments", "{}")} for c in calls]


def decode_ast(output: list[dict[str, Any]] | str) -> list[dict[str, Any]]:
    """``decode_ast`` of BFCL's OpenAI FC handler: arguments parsed from JSON; raises on anything else."""
    if isinstance(output, str):
        raise ValueError("no tool call")
    return [{name: json.loads(args) if isinstance(args, str) else args for name, args in call.items()}
            for call in output]


class BFCLEpisode(Episode):
    """Both kinds read the whole assistant message (``respond``); ``call`` is never used."""

    takes_whole_message = True

    def call(self, tool: ToolCall) -> ToolResult:
        raise NotImplementedError("BFCL episodes take the whole message (respond)")


class SingleTurnEpisode(BFCLEpisode):
    max_turns = 1

    def __init__(self, env: BFCLEnv, entry: dict[str, Any]) -> None:
        self.env, self.entry, self.category = env, entry, category_of(entry["id"])
        self._tools = env.tools_of(entry)

    @property
    def tools(self) -> list[dict[str, Any]]:
        return self._tools

    def opening(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self.entry["question"][0])

    def respond(self, message: dict[str, Any]) -> ToolResult:
        b = self.env.bfcl
        try:
            decoded = decode_ast(fc_output(message))
            error = "" if b.is_function_calling_format_output(decoded) else "ast_decoder:decoder_wrong_output_format"
        except Exception as exc:
            decoded, error = None, f"ast_decoder:decoder_failed ({exc})"
        if self.category == "irrelevance":  # right when nothing decodes to a call
            valid = decoded is None or b.is_empty_output(decoded)
            error = "" if valid else "irrelevance_error:decoder_success"
        elif not error:
            result = b.ast_checker(self.entry["function"], decoded, self.env.answers[self.entry["id"]],
                                   b.Language.PYTHON, self.category, MODEL_NAME)
            valid = bool(result["valid"])
            error = "" if valid else f"{result.get('error_type')}: {'; '.join(map(str, result.get('error', [])))}"
        else:
            valid = False
        return ToolResult(content="BFCL: correct" if valid else f"BFCL: wrong ({error})", finish=True,
                          reward=float(valid), status=EpisodeStatus.COMPLETED, metrics={"bfcl_valid": float(valid)})


class MultiTurnEpisode(BFCLEpisode):

    def __init__(self, env: BFCLEnv, entry: dict[str, Any]) -> None:
        self.env, self.entry, self.category = env, entry, category_of(entry["id"])
        self._tools = env.tools_of(entry)
        self.names = {t["function"]["name"] for t in self._tools}
        self.turns: list[list[str]] = [[m["content"] for m in turn] for turn in entry["question"]]
        # BFCL's limits: at most MAXIMUM_STEP_LIMIT + 1 steps per user turn, and one closing message each
        self.max_turns = len(self.turns) * (env.bfcl.MAXIMUM_STEP_LIMIT + 2)
        self.turn, self.steps = 0, 0
        self.responses: list[list[list[str]]] = [[]]  # per user turn, per step: the decoded calls
        self.instance_name = f"jetrl_{uuid.uuid4().hex[:12]}"  # this episode's simulated APIs (see above)

    @property
    def tools(self) -> list[dict[str, Any]]:
        return self._tools

    def opening(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self.entry["question"][0])

    def _calls(self, message: dict[str, Any]) -> list[str]:
        """BFCL's ``decode_execute`` for FC output: ``name(arg=repr(value), ...)`` strings; raises when the
        message has no call or a call does not decode; leaves out calls that are not the entry's functions."""
        output = fc_output(message)
        if isinstance(output, str):
            raise ValueError("no tool call")
        calls = self.env.bfcl.convert_to_function_call(output)
        kept = []
        for call, parsed in zip(calls, decode_ast(output), strict=True):
            ((name, args),) = parsed.items()
            if name in self.names and all(isinstance(k, str) and k.isidentifier() for k in args):
                kept.append(call)
        return kept

    def respond(self, message: dict[str, Any]) -> ToolResult:
        b = self.env.bfcl
        try:
            calls = self._calls(message)
        except Exception:
            calls = None
        if calls is None:  # no call, or none that decodes: the user turn is over (BFCL moves on)
            self.turn += 1
            self.steps = 0
            if self.turn < len(self.turns):
                self.responses.append([])
                return ToolResult(content="\n".join(self.turns[self.turn]), role="user")
            return self._grade()
        results, _ = b.multi_turn_utils.execute_multi_turn_func_call(
            calls, self.entry.get("initial_config", {}), self.entry["involved_classes"], self.instance_name,
            self.entry["id"], long_context=False, is_evaL_run=False)
        if calls:
            self.responses[self.turn].append(calls)
        self.steps += 1
        if self.steps > b.MAXIMUM_STEP_LIMIT:  # BFCL force-quits the entry: it fails
            return ToolResult(content=f"BFCL: wrong (multi_turn:force_terminated after {self.steps} steps)",
                              finish=True, reward=0.0, status=EpisodeStatus.TASK_LIMIT_REACHED,
                              metrics={"bfcl_valid": 0.0})
        dropped = len(fc_output(message)) - len(calls)
        if dropped:
            results = [*results, f"Error: {dropped} call(s) to functions that do not exist were not run."]
        return ToolResult(content=results[0] if len(results) == 1 else json.dumps(results))

    def _grade(self) -> ToolResult:
        b = self.env.bfcl
        try:
            result = b.multi_turn_checker(self.responses, self.env.answers[self.entry["id"]], self.entry,
                                          self.category, self.instance_name)
        finally:
            self._drop_instances()
        valid = bool(result["valid"])
        note = "correct" if valid else f"wrong ({result.get('error_type')}: {result.get('error_message', '')})"
        return ToolResult(content=f"BFCL: {note}", finish=True, reward=float(valid), status=EpisodeStatus.COMPLETED,
                          metrics={"bfcl_valid": float(valid), "bfcl_user_turns": float(len(self.turns))})

    def _drop_instances(self) -> None:
        space = vars(self.env.bfcl.multi_turn_utils)
        for name in [n for n in list(space) if n.startswith(self.instance_name)]:
            space.pop(name, None)

    def limit_reached(self) -> ToolResult:
        self._drop_instances()
        return super().limit_reached()

    def close(self) -> None:
        self._drop_instances()


class BFCLEnv(TaskEnv):
    name = "bfcl"

    def __init__(self, cfg: EnvConfig) -> None:
        c = cfg.bfcl
        unknown = set(c.categories) - set(CATEGORIES)
        if unknown or not c.categories:
            raise ValueError(f"env.bfcl.categories: unknown {sorted(unknown)} (known: {', '.join(CATEGORIES)})")
        self.bfcl = _bfcl(cfg.data_dir)
        self.entries: dict[str, dict[str, Any]] = {}
        self.answers: dict[str, Any] = {}
        per_category: list[list[str]] = []
        for category in c.categories:
            entries = self.bfcl.load_dataset_entry(category)[: c.per_category or None]
            if category != "irrelevance":  # irrelevance has no possible answers: no call is the answer
                answers = {a["id"]: a["ground_truth"] for a in self.bfcl.load_ground_truth_entry(category)}
                self.answers.update({e["id"]: answers[e["id"]] for e in entries})
            self.entries.update({e["id"]: e for e in entries})
            per_category.append([e["id"] for e in entries])
        # interleaved: the first n ids hold about n / categories of each
        self.test_ids = [ids[i] for i in range(max(map(len, per_category))) for ids in per_category if i < len(ids)]
        log.info("bfcl_loaded", categories=c.categories, entries=len(self.entries))

    def tools_of(self, entry: dict[str, Any]) -> list[dict[str, Any]]:
        """OpenAI tool schemas (``{"type": "function", "function": ...}``), as BFCL's OpenAI FC handler sends them."""
        return self.bfcl.convert_to_tool(copy.deepcopy(entry["function"]), self.bfcl.GORILLA_TO_OPENAPI,
                                         self.bfcl.ModelStyle.OPENAI_COMPLETIONS)

    def task_ids(self, split: str) -> list[str]:
        return list(self.test_ids) if split == "test" else []

    def task_level(self, task_id: str, split: str) -> TaskLevel:
        if task_id not in self.entries:
            raise KeyError(task_id)
        return TaskLevel(level=0, kind=category_of(task_id))

    def open(self, task_id: str, split: str, seed: int) -> Episode:
        entry = self.entries[task_id] if split == "test" else None
        if entry is None:
            raise KeyError(task_id)
        if category_of(task_id) in MULTI_TURN:
            return MultiTurnEpisode(self, entry)
        return SingleTurnEpisode(self, entry)


Config = BFCLTaskConfig
"""[env.bfcl]: the settings the task registry (shared/tasks.py) reads and checks."""


def make_env(cfg: EnvConfig) -> BFCLEnv:
    return BFCLEnv(cfg)


__all__ = ["Config", "BFCLEnv", "CATEGORIES", "MultiTurnEpisode", "SingleTurnEpisode", "make_env"]
