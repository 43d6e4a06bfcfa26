"""[env.bfcl]: this task's own settings, read by the task registry (shared/tasks.py) from the
package's ``Config`` and checked key by key; the task's code reads them as ``cfg.bfcl``."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import opt


@dataclass
class BFCLTaskConfig:
    """[env.bfcl]: the Berkeley Function Calling Leaderboard's offline categories (PyPI bfcl-eval), eval only."""

    categories: list[str] = opt(["simple_python", "multiple", "parallel", "irrelevance", "multi_turn_base"],
                                "BFCL categories to run: simple_python, multiple, parallel, parallel_multiple, "
                                "irrelevance, multi_turn_base")
    per_category: int = opt(0, "first entries of each category to keep (0 = all)")
    max_observation_chars: int = opt(4000, "overrides env.max_observation_chars: a multi-turn tool result "
                                           "(a file listing, a ticket) is kept whole")
