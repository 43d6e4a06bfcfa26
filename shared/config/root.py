"""``JetRLConfig``: every section of the one config each role loads, and the checks across sections."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from shared.config.controller import ControllerConfig
from shared.config.env import EnvConfig
from shared.config.fields import ConfigError, check_section, keys
from shared.config.nats import NatsConfig
from shared.config.rollout import RolloutConfig, ServeConfig
from shared.config.run import ModelConfig, RunConfig, SupervisorConfig, WarmStartConfig
from shared.config.trainer import TrainerConfig


@dataclass
class JetRLConfig:
    nats: NatsConfig = field(default_factory=NatsConfig)
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def validate(cfg: JetRLConfig) -> None:
    """Every key against its declaration (type, choices, bounds: ``check_section``), then what no one key can
    say alone: the checks across keys, in one place."""
    for name in keys(cfg):
        check_section(getattr(cfg, name), name)
    if cfg.trainer.max_groups < cfg.trainer.min_groups:
        raise ConfigError(f"trainer: need min_groups <= max_groups, got {cfg.trainer.min_groups} > "
                          f"{cfg.trainer.max_groups}")
    if cfg.trainer.dual_clip and cfg.trainer.dual_clip <= 1.0:
        raise ConfigError(f"trainer.dual_clip must be 0 (off) or > 1, got {cfg.trainer.dual_clip}")
    if cfg.rollout.engine == "openai" and not (cfg.rollout.openai.base_url and cfg.rollout.openai.model):
        raise ConfigError("rollout.engine=openai needs rollout.openai.base_url and rollout.openai.model "
                          "(jetrl eval --engine openai --base-url URL --model NAME)")
    if not cfg.controller.eval_passes:
        raise ConfigError("controller.eval_passes must list greedy and/or sampled, got none")
    if cfg.rollout.adapter_versions > 0 and (cfg.trainer.lora_rank == 0 or cfg.rollout.engine not in ("continuous", "hf")):
        raise ConfigError("rollout.adapter_versions > 0 needs LoRA broadcasts (trainer.lora_rank > 0) and "
                          f"rollout.engine = continuous | hf (got lora_rank {cfg.trainer.lora_rank}, engine "
                          f"{cfg.rollout.engine!r})")
    if cfg.controller.sync and cfg.rollout.cross_policy_prob > 0:
        raise ConfigError("controller.sync needs rollout.cross_policy_prob = 0: turns from the pool's stale "
                          "engines are off-policy by design")
    for key, lanes in (("rollout.task_concurrency", cfg.rollout.task_concurrency),
                       ("controller.task_max_inflight", cfg.controller.task_max_inflight),
                       ("trainer.max_tokens", cfg.trainer.max_tokens)):
        unknown = set(lanes) - set(cfg.run.tasks) - {"*"} if cfg.run.tasks else set()
        if unknown:
            raise ConfigError(f"{key} maps the run's tasks (run.tasks: {', '.join(cfg.run.tasks)}; "
                              f"or '*'), got {', '.join(sorted(unknown))}")
