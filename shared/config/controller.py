"""[controller]: what the controller publishes and when (of the run's tasks, ``run.tasks``), and its status API."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.config.fields import opt

EvalPass = Literal["greedy", "sampled"]


@dataclass
class ControllerConfig:
    mode: Literal["train", "eval"] = opt("train", "train (publish training groups) or eval (each test task once, "
                                                  "then report)")
    train_limit: int = opt(0, "train: draw groups from only the first this many training tasks of each task type "
                              "(0 = all); a probe with eval_split=train and the same eval_limit runs those tasks", ge=0)
    eval_split: str = opt("test", "eval: the split to run")
    eval_limit: int = opt(0, "eval: at most this many tasks per task type (0 = all)", ge=0)
    eval_passes: list[EvalPass] = opt(["greedy"], "eval: greedy (one attempt per task at temperature 0) and/or "
                                                  "sampled (eval_samples attempts at eval_temperature; pass@k)")
    eval_samples: int = opt(4, "eval: attempts per task in the sampled pass (k of pass@k)", ge=1)
    eval_temperature: float = opt(1.0, "eval: sampling temperature of the sampled pass", ge=0)
    group_size: int = opt(4, "episodes per group (same task instance), for group-relative advantages", ge=1)
    max_inflight: int = opt(16, "at most this many episodes published and not yet finished", ge=1)
    task_max_inflight: dict[str, int] = opt({}, "per-task lanes: task -> most of its episodes published and not "
                                                "yet finished ('*' = every task not named); a task at its bound "
                                                "is skipped, so a saturated slow task never holds every in-flight "
                                                "slot; empty = max_inflight alone", ge=1)
    lane_lead: int = opt(0, "per-task lanes: groups a task may run ahead of its share while another task's lane is "
                            "full; then publishing waits for it (shares stay near the weights). 0 = never wait "
                            "(a stuck task's share goes to the others)", ge=0)
    sync: bool = opt(False, "synchronous, on-policy baseline: publish one training batch (trainer.min_groups "
                            "groups) played with the newest weights, wait for the trainer's step on it, then "
                            "the next (rollouts load the new weights before their first turn); staleness 0. "
                            "false = asynchronous: rollouts run ahead of the trainer, bounded by max_backlog")
    max_backlog: int = opt(256, "publishing pauses while this many finished trajectories wait for the trainer "
                                "(its consumer's pending + unacked); bounds wasted rollouts and staleness; 0 = no bound",
                                ge=0)
    temperature: float = opt(1.0, "sampling temperature for training episodes", ge=0)
    task_sampler: Literal["mix", "learnability"] = opt("mix", "how training groups are drawn: mix (tasks in the exact "
                                                              "shares of tasks, task ids uniformly) or learnability "
                                                              "(tasks and levels weighted by p(1-p) of their recent "
                                                              "success, mixed with the shares: "
                                                              "services/controller/sampler.py)")
    sampler_window: int = opt(64, "learnability sampler: recent training episodes per task and per level it counts",
                                  ge=1)
    sampler_floor: float = opt(0.02, "learnability sampler: least weight p(1-p) counts as (0.25 at p = 1/2), so an "
                                     "always-solved or never-solved task or level is still drawn now and then",
                                     ge=0, le=0.25)
    sampler_mix: float = opt(0.2, "learnability sampler: share of draws that follow the configured mix (tasks) and "
                                  "uniform task ids (levels) whatever the success; 1 = the mix alone", ge=0, le=1)
    http_host: str = opt("127.0.0.1", "status API bind address")
    http_port: int = opt(0, "status API port; 0 = pick a free one (written to the run dir)")
    episode_timeout_s: float = opt(3600.0, "an episode unfinished this long after publishing is written off as lost",
                                     gt=0)
    http_token: str = opt("", "bearer token the status API requires (Authorization: Bearer ...); empty = none")
    http_token_file: str = opt("", "file holding http_token (a Docker secret), instead of http_token")
    env_wait_s: float = opt(120.0, "wait this long for each task's env service to list its tasks before failing; "
                                   "a replica whose heartbeat says it is building its task data (a generated knowledge "
                                   "graph: ~2-4 min on 2 busy cores) is waited for as long as it builds")
