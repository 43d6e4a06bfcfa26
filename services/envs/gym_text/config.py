"""[env.<task>] of a Gymnasium-style text env: which env, its constructor's arguments, the episode's limits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.config import opt


@dataclass
class GymTextConfig:
    """[env.gym] (or any task whose factory is ``services.envs.gym_text:make_env``): a text env, unchanged."""

    source: str = opt("gymnasium", "gymnasium (a gymnasium.Env, by id or entry_point) | textarena (a TextArena "
                                   "game id, single-player) | reasoning_gym (a reasoning-gym dataset name)")
    id: str = opt("", "the env: a registered gymnasium id (gymnasium.make; 'pkg.mod:Name-v0' imports pkg.mod "
                      "first), a TextArena id (GuessTheNumber-v0) or a reasoning-gym dataset (basic_arithmetic)")
    entry_point: str = opt("", "pkg.mod:Class of a gymnasium.Env no registry knows (source gymnasium)")
    kwargs: dict[str, Any] = opt({}, "keyword arguments of the env (gymnasium.make, textarena.make or "
                                     "reasoning_gym.create_dataset)")
    max_episode_steps: int = opt(0, "gymnasium's TimeLimit for the env (0 = its registered limit): past it "
                                    "the env truncates the episode")
    max_turns: int = opt(30, "tool calls per episode (the host's turn limit; reward = the return so far)")
    instructions: str = opt("", "the system message; empty = one that names the act tool and the action "
                                "space")
    action_help: str = opt("", "what the act tool says an action is; empty = from the action space")
    test_seed_offset: int = opt(1_000_000, "test task i resets with seed offset + i, train task i with seed i: "
                                           "the splits never share a seed")
