"""WebShop-like task environment: a text-mode shop over a generated 50k-product catalogue, with
BM25 search (SQLite FTS5), WebShop's page flow and buttons, WebShop's synthetic goals and reward, and
AgentBench's function-calling tools (``search_action``, ``click_action``; at most 20 rounds).

* ``catalog.py`` generates and indexes the catalogue once (cached under ``EnvConfig.data_dir``);
* ``goals.py`` samples and verbalises goals and computes WebShop's reward;
* ``shop.py`` is the per-episode page state machine and the oracle.

Splits: ``train`` has ``num_train_tasks`` goals per difficulty (easy / medium / hard), ids
``train-<difficulty>-<n>``; ``test`` is a frozen 200-goal split, ids ``test-<difficulty>-<n>``, whose
targets come from product families that no train goal touches. A task id fixes everything about an
episode (the seed is not used), so replaying its action log rebuilds the same state.
"""

from __future__ import annotations

import random
from typing import Any

import structlog

from services.envs.base import Episode, TaskEnv, TaskLevel, ToolCall, ToolError, ToolResult
from services.envs.webshop.catalog import Catalog, open_catalog
from services.envs.webshop.config import WebShopTaskConfig
from services.envs.webshop.goals import DIFFICULTIES, make_goal
from services.envs.webshop.shop import ShopEpisode, oracle_call
from shared.config import EnvConfig

log = structlog.get_logger()

NUM_TEST_GOALS = 200  # frozen, whatever the config says
# Test targets come from the first 4000 families (~18k products), which the generator makes the same
# way for any catalogue at least that big: the test goals do not move with env.webshop.num_products.
TEST_FAMILY_SPAN = 4000


class WebShopEpisode(ShopEpisode):
    def reply(self, content: str) -> ToolResult:
        raise ToolError("No executable tool calls found! You should call a tool instead. "
                        f"Available Actions: {self.available_actions()}")


class WebShopEnv(TaskEnv):
    name = "webshop"

    def __init__(self, catalog: Catalog, num_train_per_difficulty: int, levels: list[int] | None = None) -> None:
        self.catalog = catalog
        self.levels = list(levels or [])
        self.goals: dict[str, dict[str, dict[str, Any]]] = {
            "train": self._goals("train", [(d, i) for d in DIFFICULTIES for i in range(num_train_per_difficulty)]),
            "test": self._goals("test", [(DIFFICULTIES[i % 3], i // 3) for i in range(NUM_TEST_GOALS)]),
        }

    def _goals(self, split: str, wanted: list[tuple[str, int]]) -> dict[str, dict[str, Any]]:
        if split == "test":  # one distinct target per test goal
            targets = self.catalog.asins_where(split, "target", max_family=TEST_FAMILY_SPAN)
            targets = random.Random("webshop-test-targets").sample(targets, min(len(wanted), len(targets)))
        else:
            targets = self.catalog.asins_where(split, "target")
        goals = {}
        for k, (difficulty, n) in enumerate(wanted):
            rng = random.Random(f"webshop-goal-{split}-{difficulty}-{n}")
            asin = targets[k % len(targets)] if split == "test" else rng.choice(targets)
            product = self.catalog.product(asin)
            assert product is not None
            goals[f"{split}-{difficulty}-{n:05d}"] = make_goal(rng, product, difficulty)
        return goals

    def task_ids(self, split: str) -> list[str]:
        keep = {DIFFICULTIES[level - 1] for level in self.levels}
        return [i for i in self.goals.get(split, {}) if not keep or i.split("-")[1] in keep]

    def task_level(self, task_id: str, split: str) -> TaskLevel:
        self.goals[split][task_id]  # KeyError for an unknown task
        difficulty = task_id.split("-")[1]
        return TaskLevel(DIFFICULTIES.index(difficulty) + 1, difficulty)

    def goal(self, task_id: str, split: str) -> dict[str, Any]:
        return self.goals[split][task_id]  # KeyError for an unknown split or id, as open() promises

    def open(self, task_id: str, split: str, seed: int) -> Episode:
        return WebShopEpisode(self.catalog, self.goal(task_id, split), task_id)

    def oracle(self, episode: Episode) -> ToolCall:
        assert isinstance(episode, ShopEpisode)
        return oracle_call(episode)

    def close(self) -> None:
        self.catalog.close()


Config = WebShopTaskConfig
"""[env.webshop]: the settings the task registry (shared/tasks.py) reads and checks."""


def make_env(cfg: EnvConfig) -> WebShopEnv:
    # A results page (10 titles, prices and the clickables) is ~1.5k characters: the host cuts
    # observations at env.webshop.max_observation_chars, which overrides the shared default.
    catalog = open_catalog(cfg.data_dir, cfg.webshop.num_products)
    env = WebShopEnv(catalog, cfg.num_train_tasks, cfg.webshop.levels)
    log.info("webshop_ready", products=catalog.num_products, catalog=str(catalog.path),
             train=len(env.goals["train"]), test=len(env.goals["test"]))
    return env
