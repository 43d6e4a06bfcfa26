"""[env.kg]: this task's own settings, read by the task registry (shared/tasks.py) from the
package's ``Config`` and checked key by key; the task's code reads them as ``cfg.kg``."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import opt


@dataclass
class KGTaskConfig:
    """[env.kg]: SPARQL tools over a generated knowledge graph."""

    result_cap: int = opt(1000, "most entities one tool call may produce; a bigger step is refused")
    query_timeout_s: float = opt(3.0, "time limit of one SPARQL query (keep below env.action_timeout_s)")
    seed: int = opt(0, "seed of the question generator (task ids and splits follow from it)")
    levels: list[int] = opt([], "levels the splits keep (1-3: two to four joins); empty = all")
    strict_prerequisites: bool = opt(False, "refuse get_neighbors / argmax / argmin before get_relations / "
                                            "get_attributes on that variable; false = list them implicitly, as "
                                            "AgentBench does")
    one_shot: bool = opt(False, "open each episode with an example conversation, as AgentBench's std split does: "
                                "a solved question of the project's own graph for generated questions, "
                                "AgentBench's published example for its own (split dev)")
    ntriples: str = opt("", "serve questions on this Freebase-namespace N-Triples graph (loaded once into a "
                            "pyoxigraph store under data_dir) instead of the generated graph; no generated splits", path=True)
    agentbench_file: str = opt("", "AgentBench-format questions (JSON list: question, entities, answer, actions) "
                                   "served as split 'dev'", path=True)
