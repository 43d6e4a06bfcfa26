"""[env.webshop]: this task's own settings, read by the task registry (shared/tasks.py) from the
package's ``Config`` and checked key by key; the task's code reads them as ``cfg.webshop``."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import opt


@dataclass
class WebShopTaskConfig:
    """[env.webshop]: a generated shop, search and click."""

    num_products: int = opt(52000, "products in the generated catalogue (built once, cached)")
    max_observation_chars: int = opt(2400, "overrides env.max_observation_chars: a results page is ~1.5k "
                                           "characters")
    levels: list[int] = opt([], "goal difficulties the splits keep (1 easy, 2 medium, 3 hard); empty = all")
