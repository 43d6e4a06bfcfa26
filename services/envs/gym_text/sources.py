"""Where a text env comes from: Gymnasium itself, or a TextArena game or reasoning-gym dataset seen through
Gymnasium's interface (``reset(seed) -> (observation, info)``, ``step(action) -> (observation, reward,
terminated, truncated, info)``). The two views below only translate calls; the game or dataset is used as
its package ships it."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from services.envs.gym_text.config import GymTextConfig
from services.envs.gym_text.env import FreeText


def gymnasium_builder(settings: GymTextConfig, task: str) -> Callable[[], Any]:
    """``gymnasium.make`` of the id, or of an EnvSpec over the entry point, with the config's kwargs."""
    import gymnasium

    if bool(settings.id) == bool(settings.entry_point):
        raise ValueError(f"env.{task}: name the gymnasium env by exactly one of id or entry_point")
    steps = settings.max_episode_steps or None
    if settings.entry_point:
        module, _, attr = settings.entry_point.partition(":")
        if not attr or not callable(getattr(importlib.import_module(module), attr, None)):
            raise ValueError(f"env.{task}.entry_point {settings.entry_point!r}: expected pkg.mod:Class of a gymnasium.Env")
        spec = gymnasium.envs.registration.EnvSpec(id=f"jetrl-{task}-v0", entry_point=settings.entry_point,
                                                   max_episode_steps=steps)
        return lambda: gymnasium.make(spec, **settings.kwargs)
    return lambda: gymnasium.make(settings.id, max_episode_steps=steps, **settings.kwargs)


class TextArenaView:
    """A single-player TextArena game as a Gymnasium env. TextArena hands a player the whole game so far at
    every turn (its agents keep no history); the conversation here already holds it, so each step shows
    only what the game added. The game's reward comes from ``close()``, when ``step`` says it is done."""

    def __init__(self, game_id: str, kwargs: dict[str, Any]) -> None:
        import textarena

        self.game = textarena.make(game_id, **kwargs)
        self.action_space = FreeText()
        self.render_mode = None
        self.shown = ""

    def _observe(self) -> str:
        _, observation = self.game.get_observation()
        text = observation if isinstance(observation, str) else str(observation)
        new = text[len(self.shown):] if text.startswith(self.shown) else text
        self.shown = text
        return new.strip()

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.game.reset(num_players=1, seed=seed)
        self.shown = ""
        return self._observe(), {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        done, info = self.game.step(action)
        if not done:
            return self._observe(), 0.0, False, False, dict(info or {})
        ended = self.game.close()
        rewards, game_info = ended if isinstance(ended, tuple) else (ended, {})
        reward = float((rewards or {}).get(0, 0.0))
        reason = str((game_info or {}).get(0, {}).get("reason", "")) or "The game is over."
        return reason, reward, True, False, dict(game_info or {})

    def close(self) -> None:
        """TextArena's ``close`` ends a game and scores it; an unfinished one holds nothing to free."""


class ReasoningGymView:
    """One reasoning-gym question as a one-step env: the seed picks the question, the answer is scored by
    the dataset's own ``score_answer`` (1.0 right, partial credit where the dataset gives it). The answer is
    scored without the whitespace around it: a tool call's argument often starts with a space, and
    ``score_answer`` would pay ``" 3"`` half of ``"3"``."""

    def __init__(self, dataset: str, kwargs: dict[str, Any]) -> None:
        import reasoning_gym

        self.create = lambda seed: reasoning_gym.create_dataset(dataset, seed=seed, size=1, **kwargs)
        self.create(0)  # an unknown dataset or argument fails here
        self.action_space = FreeText()
        self.render_mode = None
        self.dataset: Any = None
        self.entry: dict[str, Any] = {}

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.dataset = self.create(seed or 0)
        self.entry = self.dataset[0]
        return str(self.entry["question"]), {}

    instructions = ("Answer the question: call the tool act once, with your final answer only (no working); "
                    "that ends the task.")

    def oracle_action(self) -> str:
        """The dataset's own answer: what a scripted expert submits (demonstrations for ``jetrl sft``)."""
        return str(self.entry["answer"])

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        score = float(self.dataset.score_answer(action.strip(), self.entry))
        verdict = "Correct." if score >= 1.0 else f"Scored {score:g}."
        return verdict, score, True, False, {}

    def close(self) -> None:
        self.dataset = None


def builder(settings: GymTextConfig, task: str) -> Callable[[], Any]:
    """A function that makes one fresh env of the configured source."""
    if settings.source == "gymnasium":
        return gymnasium_builder(settings, task)
    if not settings.id:
        raise ValueError(f"env.{task}.id: name the {settings.source} env")
    if settings.source == "textarena":
        return lambda: TextArenaView(settings.id, settings.kwargs)
    if settings.source == "reasoning_gym":
        return lambda: ReasoningGymView(settings.id, settings.kwargs)
    raise ValueError(f"env.{task}.source {settings.source!r}: expected gymnasium, textarena or reasoning_gym")
