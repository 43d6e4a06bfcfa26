"""The OS task (AgentBench's os_interaction, function-calling version): a real Linux shell per episode.

Tools: ``bash_action(script)`` runs a script in the episode's persistent bash (output cut at
``env.max_observation_chars``, the cut stated), ``answer_action(answer)`` and ``finish_action(thought)`` end
the episode and grade it (the thought is the answer, as AgentBench's grader takes it); at most 8 rounds, a
message's first call runs. Each episode gets its own sandbox (``sandbox.py``); tasks are AgentBench's format
or generated in it (``tasks.py``). ``make setup-os`` builds the rootfs.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import structlog

from services.envs.base import Episode, TaskEnv, TaskLevel, ToolCall, ToolError, ToolResult
from services.envs.os_task.config import OSTaskConfig
from services.envs.os_task.docker_sandbox import DockerSandbox
from services.envs.os_task.rootfs import ensure_rootfs
from services.envs.os_task.sandbox import BwrapSandbox, Cgroup, Limits, Sandbox
from services.envs.os_task.tasks import (
    COMPARISONS,
    OSTask,
    Script,
    content_key,
    expand_task_files,
    generate_split,
    load_agentbench,
)
from shared.config import EnvConfig
from shared.messages import EpisodeStatus

log = structlog.get_logger()

MAX_ROUNDS = 8  # AgentBench's round_limit for the OS task
HIDDEN_SCRIPT = '__jetrl_c=$JETRL_CHECK; unset JETRL_CHECK; eval "$__jetrl_c"'
SWITCH_USER = re.compile(r"(?:^|[\s;&|(])(?:su|login|sudo\s+(?:-\w*[is]\w*|su))(?:\s|$)")
INIT_TIMEOUT_S = 120.0  # AgentBench waits for init without a limit; one training task sleeps 60 s

SYSTEM_PROMPT = (
    "You are an assistant that will act like a person, I will play the role of linux (ubuntu) operating system. "
    "Your goal is to implement the operations required by me or answer to the question proposed by me. For each "
    "of your turns, first think about what you should do, then call exactly one tool: bash_action to run a bash "
    "script, answer_action once you have the answer to the question, or finish_action once you have done the "
    "required operations. If the output is too long, I will truncate it; the truncated output is not complete, "
    "and you have to deal with the truncating problem by yourself. Your bash code should not contain any input "
    "operation."
)

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "bash_action",
        "description": "Execute a bash script in the OS and return its output (stdout and stderr). The shell "
                       "persists between calls: the working directory and variables carry over.",
        "parameters": {"type": "object", "properties": {
            "script": {"type": "string", "description": "The bash script to execute."}},
            "required": ["script"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "answer_action",
        "description": "Give the answer to the question. This ends the task.",
        "parameters": {"type": "object", "properties": {
            "answer": {"type": "string", "description": "The answer, and nothing else."}},
            "required": ["answer"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "finish_action",
        "description": "Declare that the required operations are done (for tasks that ask you to change the "
                       "system rather than to answer). This ends the task.",
        # AgentBench's: its grader takes the thought as the answer (checks get it as $1, a match compares it)
        "parameters": {"type": "object", "properties": {
            "thought": {"type": "string", "description": "The thought or reason indicating the task is finished."}},
            "required": ["thought"], "additionalProperties": False}}},
]


def script_argv(script: Script, params: list[str]) -> list[str]:
    """How AgentBench's ``execute_independent`` runs a script with the values as its arguments."""
    if script.language == "python":
        return ["python3", "-c", script.code, *params]
    return ["bash", "-c", script.code, *(["--", *params] if params else [])]


class OSEpisode(Episode):
    max_turns = MAX_ROUNDS
    calls_per_message = "first"  # AgentBench's os_interaction runs a message's first call

    def __init__(self, task: OSTask, sandbox: Sandbox, cfg: EnvConfig) -> None:
        self.task, self.sandbox, self.cfg = task, sandbox, cfg
        # One command at a time even if the host gave up waiting on the last one (its thread runs on).
        self._lock = threading.Lock()
        self.command_timeout = max(1.0, min(cfg.os.command_timeout_s, cfg.action_timeout_s - 2.0))
        self.gold: str | None = None
        self.last_output: str | None = None
        self.example_output: str | None = None
        self.metrics: dict[str, float] = {"bash_calls": 0.0, "timeouts": 0.0, "shell_restarts": 0.0}
        self.closed = False
        self.shell_stopped = False  # grading stops the agent's shell (see judge)

    # ------------------------------------------------------------------ setup (called by OSEnv.open)
    def prepare(self) -> None:
        """AgentBench's order: init scripts as fresh processes, then ``start`` in the agent's shell."""
        for script in self.task.init:
            res = self.sandbox.exec(script_argv(script, []), timeout=INIT_TIMEOUT_S)
            if res["code"] != 0:
                raise RuntimeError(f"init script of {self.task.task_id} failed ({res['code']}): "
                                   f"{(res['stderr'] or res['stdout'])[-500:]}")
        if self.task.start is not None:
            code = (self.task.start.code if self.task.start.language == "bash"
                    else shlex.join(script_argv(self.task.start, [])))
            # AgentBench types `start` into the agent's shell: a `su - user` there switches it for the episode
            self.sandbox.shell(code, timeout=30.0, stdin_pipe=SWITCH_USER.search(code) is not None)
        if self.task.fresh_gold and self.task.wants_answer and self.task.example is not None:
            res = self.sandbox.exec(script_argv(self.task.example, []), timeout=30.0)
            if res["code"] != 0:
                raise RuntimeError(f"reference script of {self.task.task_id} failed ({res['code']}): {res['stderr']}")
            self.gold = res["stdout"]

    def oracle_script(self) -> str:
        example = self.task.example
        assert example is not None
        return example.code if example.language == "bash" else shlex.join(script_argv(example, []))

    # ------------------------------------------------------------------ the Episode API
    @property
    def tools(self) -> list[dict[str, Any]]:
        return TOOLS

    def opening(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": "Now, I will start a new problem in a new OS. My problem is:\n\n"
                                            + self.task.description}]

    def call(self, tool: ToolCall) -> ToolResult:
        with self._lock:
            if self.closed:
                raise ToolError("This episode is closed.")
            if tool.name == "bash_action":
                return self._bash(str(tool.arguments["script"]))
            if tool.name == "answer_action":
                return self._grade(str(tool.arguments["answer"]))
            if tool.name == "finish_action":
                thought = tool.arguments.get("thought")  # AgentBench: the first argument, or None without one
                return self._grade(None if thought is None else str(thought))
            raise ToolError(f"Unknown tool {tool.name!r}. Available tools: bash_action, answer_action, finish_action.")

    def call_timeout_s(self, tool: ToolCall) -> float | None:
        """Grading runs the task's check scripts one after another, each within ``env.os.check_timeout_s``."""
        if tool.name in ("answer_action", "finish_action"):
            return self.cfg.os.check_timeout_s * max(1, len(self.task.check or [])) + 30.0
        return None

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self.sandbox.close()

    # ------------------------------------------------------------------ actions
    def _bash(self, script: str) -> ToolResult:
        res = self.sandbox.shell(script, self.command_timeout)
        self.metrics["bash_calls"] += 1
        self.last_output = res["output"]
        if self.task.example is not None and script == self.oracle_script():
            self.example_output = res["output"]  # what the oracle answers, whatever else was run
        notes = []
        if res.get("background_bytes"):
            notes.append(f"[{res['background_bytes']} bytes that background processes wrote since the last command "
                         "were discarded.]")
        if res.get("timed_out"):
            self.metrics["timeouts"] += 1
            notes.append(f"[The command ran longer than the {self.command_timeout:g}s limit and was stopped.]")
        if res.get("crowded"):
            notes.append(f"[Too many processes (limit {self.cfg.os.pids}): the processes this command started "
                         "were ended.]")
        if res.get("restarted"):
            self.metrics["shell_restarts"] += 1
            status = res.get("exited")
            notes.append("[The shell " + (f"exited with status {status}" if status is not None else "stopped responding")
                         + "; a new shell was started in /root. Variables and the working directory were reset.]")
        return ToolResult(content=self.observation(res["output"], res["bytes"], notes), metrics=dict(self.metrics))

    def observation(self, output: str, total_bytes: int, notes: list[str]) -> str:
        """AgentBench's wording; the output is cut so that the whole message fits the host's limit."""
        tail = "".join("\n" + n for n in notes)
        if not output and not notes:
            return "The output of the OS is empty."
        head = "The output of the OS:\n\n"
        budget = self.cfg.task_value("os", "max_observation_chars") - len(head) - len(tail)
        if len(output) > budget or total_bytes > len(output.encode()):
            shown_note = "\n[truncated because the output is too long: the first {} of {} characters are shown]"
            total = max(total_bytes, len(output))
            keep = max(0, budget - len(shown_note.format(budget, total)))
            output = output[:keep] + shown_note.format(keep, total)
        return head + output + tail

    def _grade(self, answer: str | None) -> ToolResult:
        t0 = time.monotonic()
        ok, detail = self.judge(answer)
        metrics = dict(self.metrics, grade_s=time.monotonic() - t0, success=float(ok))
        log.info("os_graded", task_id=self.task.task_id, ok=ok, detail=detail)
        return ToolResult(content="Your answer is correct." if ok else "Your answer is wrong.", finish=True,
                          reward=1.0 if ok else 0.0, status=EpisodeStatus.COMPLETED, metrics=metrics)

    def judge(self, answer: str | None) -> tuple[bool, str]:
        """AgentBench's rule (``_evaluate_answer``): ``finish_action``'s thought is the answer, as there."""
        task = self.task
        if task.match is not None:
            if answer is None:
                return False, "no answer"
            if task.match.get("strip", True):
                answer = answer.strip()
            if "answer" in task.match:
                return answer == task.match["answer"], "match"
            return re.search(task.match["regex"], answer) is not None, "regex"
        params = [str(answer)]
        # checks are ours, not the agent's: AgentBench runs them without a limit, here each gets its own bound
        timeout = self.cfg.os.check_timeout_s
        for entry in task.check or []:
            if entry is None and self.gold is not None:
                params.append(self.gold)
                continue
            script = entry or task.example
            assert script is not None  # the loader refuses a chain with None and no example
            if script.language == "builtin":
                if len(params) < 2 or not COMPARISONS[script.code](params[0], params[1]):
                    return False, script.code
                continue  # AgentBench's comparison scripts print nothing
            argv = script_argv(script, params)
            if entry is None:
                # The gold is the example run again now. The agent counted processes from its own shell; here
                # that shell is stopped and the example's shell stands in its place, with the script out of its
                # command line, as the agent's `bash --login` had none (`ps -A | wc -l` then counts what it saw)
                if not self.shell_stopped:
                    self.sandbox.stop_shell()
                    self.shell_stopped = True
                if script.language == "bash":
                    argv = ["bash", "-c", HIDDEN_SCRIPT, "bash", *params]
                    env = {"JETRL_CHECK": script.code}
                else:
                    env = {}
                res = self.sandbox.exec(argv, timeout=timeout, env=env)
            else:
                res = self.sandbox.exec(argv, timeout=timeout)
            if res["code"] != 0:
                return False, f"check exit {res['code']}"
            params.append(res["stdout"])
        return True, "check"


class OSEnv(TaskEnv):
    name = "os"

    def __init__(self, cfg: EnvConfig) -> None:
        self.cfg = cfg
        self.cache_dir = Path(cfg.data_dir or Path.home() / ".cache" / "jetrl" / "data").expanduser() / "os"
        self.limits = Limits(memory_mb=cfg.os.memory_mb, pids=cfg.os.pids, disk_mb=cfg.os.disk_mb, cpus=cfg.os.cpus)
        self.tasks: dict[str, dict[str, OSTask]] = {"train": {}, "test": {}}
        self.skipped: dict[str, str] = {}
        train = generate_split("train", cfg.num_train_tasks)
        test = generate_split("test", cfg.num_test_tasks, exclude={content_key(t) for t in train})
        origin: dict[str, str] = {}  # task id -> the file it came from: two files must never share an id
        for split, generated, entries in (("train", train, cfg.os.agentbench_train),
                                          ("test", test, cfg.os.agentbench_test)):
            self.tasks[split].update((t.task_id, t) for t in generated)
            for entry in entries:
                for task_file in expand_task_files(entry):
                    loaded, skipped = load_agentbench(task_file.path, script_dir=task_file.script_dir)
                    for task_id in [t.task_id for t in loaded] + list(skipped):
                        if task_id in origin:
                            raise ValueError(
                                f"AgentBench task id {task_id} of {task_file.path} is also the id of a task of "
                                f"{origin[task_id]}: list each file once, and give files with the same name "
                                "AgentBench's layout (data/<N>/<name>.json), whose ids carry the folder")
                        origin[task_id] = str(task_file.path)
                    self.tasks[split].update((t.task_id, t) for t in loaded)
                    self.skipped.update(skipped)
        if self.skipped:
            log.info("os_tasks_skipped", count=len(self.skipped), first=next(iter(self.skipped.items())))
        self._rootfs: dict[str, Path] = {}
        self._rootfs_lock = threading.Lock()
        self._open: weakref.WeakSet[Sandbox] = weakref.WeakSet()
        self.run_dir = self.cache_dir / "run" / str(os.getpid())
        if cfg.os.backend == "bwrap":
            sweep_stale(self.run_dir.parent)

    def task_ids(self, split: str) -> list[str]:
        keep = set(self.cfg.os.levels)
        return [i for i, t in self.tasks.get(split, {}).items() if not keep or t.level in keep]

    def task_level(self, task_id: str, split: str) -> TaskLevel:
        task = self.tasks[split][task_id]
        return TaskLevel(task.level, task.family)

    def rootfs(self, variant: str) -> Path:
        with self._rootfs_lock:
            if variant not in self._rootfs:
                self._rootfs[variant] = ensure_rootfs(self.cache_dir, variant, self.cfg.os.suite, self.cfg.os.mirror)
            return self._rootfs[variant]

    def sandbox(self, variant: str = "default") -> Sandbox:
        if self.cfg.os.backend == "docker":
            box: Sandbox = DockerSandbox(f"{self.cfg.os.docker_prefix}/{variant}", self.limits)
        elif self.cfg.os.backend == "bwrap":
            box = BwrapSandbox(self.rootfs(variant), self.limits, self.run_dir)
        else:
            raise ValueError(f"unknown env.os.backend {self.cfg.os.backend!r}: bwrap | docker")
        self._open.add(box)
        return box

    def open(self, task_id: str, split: str, seed: int) -> OSEpisode:
        task = self.tasks[split][task_id]  # KeyError -> 404 from the host
        t0 = time.monotonic()
        episode = OSEpisode(task, self.sandbox(task.image), self.cfg)
        try:
            episode.prepare()
        except BaseException:
            episode.close()
            raise
        episode.metrics["open_s"] = time.monotonic() - t0
        return episode

    def oracle(self, episode: Episode) -> ToolCall:
        """Run the gold (AgentBench ``example``) or reference script, then answer its output or finish."""
        assert isinstance(episode, OSEpisode)
        task = episode.task
        if task.example is not None and episode.example_output is None:
            return ToolCall("bash_action", {"script": episode.oracle_script()})
        if not task.wants_answer and not task.reads_answer:
            return ToolCall("finish_action", {"thought": "The required operations are done."})
        if task.example is None:  # match-only task: the oracle knows the answer
            return ToolCall("answer_action", {"answer": str((task.match or {}).get("answer", ""))})
        return ToolCall("answer_action", {"answer": (episode.example_output or "").strip()})

    def close(self) -> None:
        for box in list(self._open):
            box.close()


def sweep_stale(runs: Path) -> None:
    """Remove what a killed replica left: its run dir (named by its pid) and empty episode cgroups a
    minute old. No mount can leak: each lived in its episode's own mount namespace."""
    for controller in ("", "memory", "pids", "cpu"):
        parent = Cgroup.ROOT / controller / "jetrl-os"
        for d in parent.glob("ep-*") if parent.is_dir() else []:
            try:
                if time.time() - d.stat().st_mtime > 60 and not (d / "cgroup.procs").read_text().strip():
                    d.rmdir()
            except OSError:
                pass
    for d in runs.iterdir() if runs.is_dir() else []:
        if d.name.isdigit() and not Path(f"/proc/{d.name}").exists():
            shutil.rmtree(d, ignore_errors=True)


Config = OSTaskConfig
"""[env.os]: the settings the task registry (shared/tasks.py) reads and checks."""


def make_env(cfg: EnvConfig) -> TaskEnv:
    return OSEnv(cfg)
