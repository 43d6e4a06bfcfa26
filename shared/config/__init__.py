"""One typed config for every role: a TOML file, then ``JETRL__SECTION__KEY`` env vars, then
``--section.key=value`` command-line overrides, each layer over the last (``loader``).

Every key is declared once, beside its field, with ``opt(default, help, ge=..., le=...)`` and a type
(a ``Literal`` of its choices where it has a few): the checks, ``jetrl config`` and the reference page
are made from those declarations (``fields``). Unknown keys and values of the wrong type or out of
range are refused with a message naming the key.

The sections, by the role that reads them: [nats] and [run], [model] (every role); [env] and
[env.<task>] (env services: ``env``); [rollout] with each engine's own [rollout.continuous],
[rollout.vllm], [rollout.openai], and [serve] (rollout replicas: ``rollout``); [trainer] with
[trainer.deepspeed] (``trainer``); [controller] (``controller``); [warmstart], [supervisor] (the
``jetrl`` command: ``run``). ``root`` puts them together and checks what spans sections.

A task's own keys are in ``[env.<task>]`` (``[env.<task>] levels``, ``JETRL__ENV__<TASK>__LEVELS``,
``--env.<task>.levels``), kept as given and read by the task's settings class, which only its plugin
knows (shared/tasks.py), where the task is served.
"""

from shared.config.controller import ControllerConfig
from shared.config.describe import describe
from shared.config.env import EnvConfig
from shared.config.fields import ConfigError, opt
from shared.config.loader import from_argv, load_config, save_config
from shared.config.nats import NatsConfig
from shared.config.rollout import (
                                   ContinuousEngineConfig,
                                   OpenAIEngineConfig,
                                   RolloutConfig,
                                   ServeConfig,
                                   VllmEngineConfig,
)
from shared.config.root import JetRLConfig, validate
from shared.config.run import ModelConfig, RunConfig, SupervisorConfig, WarmStartConfig
from shared.config.trainer import DeepSpeedConfig, TrainerConfig

__all__ = ["ConfigError", "ContinuousEngineConfig", "ControllerConfig", "DeepSpeedConfig", "EnvConfig",
           "JetRLConfig", "ModelConfig", "NatsConfig", "OpenAIEngineConfig", "RolloutConfig", "RunConfig",
           "ServeConfig", "SupervisorConfig", "TrainerConfig", "VllmEngineConfig", "WarmStartConfig", "describe",
           "from_argv", "load_config", "opt", "save_config", "validate"]
