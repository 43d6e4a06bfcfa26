"""Build the KG graph and the default task sets ahead of time: ``python -m services.envs.kg [--env.key=value ...]``
(``python -m services.envs.kg one-shot --env.num_train_tasks=12 --env.num_test_tasks=6`` writes the example
conversation of ``env.kg.one_shot``: a question of the split the tests build).

Replicas build them on first start too; this is the one-off ``make setup-kg`` step so they need not.
"""

from __future__ import annotations

import json
import sys

from services.envs.kg import make_env
from shared.config import from_argv
from shared.progress import ticking

if __name__ == "__main__":
    if sys.argv[1:2] == ["one-shot"]:  # write one_shot.json: a level-2 intersection question of the train split
        from services.envs.kg import ONE_SHOT_PATH, record_example

        cfg, _ = from_argv(sys.argv[2:])
        env = make_env(cfg.env)
        task = next(t for t in env.tasks["train"] if t["program"][0] == "and")
        messages = record_example(env, task["qid"])
        ONE_SHOT_PATH.write_text(json.dumps(messages, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(json.dumps({"qid": task["qid"], "messages": len(messages), "path": str(ONE_SHOT_PATH)}))
        sys.exit(0)
    cfg, _ = from_argv(sys.argv[1:])
    with ticking("kg graph and task sets"):
        env = make_env(cfg.env)
    print(json.dumps({"graph": str(env.graph.path), **env.graph.meta, "train": len(env.task_ids("train")),
                      "test": len(env.task_ids("test"))}))
