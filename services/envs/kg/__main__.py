"""Build the KG graph and the default task sets ahead of time: ``python -m services.envs.kg [--env.key=value ...]``.

Replicas build them on first start too; this is the one-off ``make setup-kg`` step so they need not.
"""

from __future__ import annotations

import json
import sys

from services.envs.kg import make_env
from shared.config import from_argv
from shared.progress import ticking

if __name__ == "__main__":
    cfg, _ = from_argv(sys.argv[1:])
    with ticking("kg graph and task sets"):
        env = make_env(cfg.env)
    print(json.dumps({"graph": str(env.graph.path), **env.graph.meta, "train": len(env.task_ids("train")),
                      "test": len(env.task_ids("test"))}))
