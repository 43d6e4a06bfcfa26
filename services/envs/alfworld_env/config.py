"""[env.alfworld]: this task's own settings, read by the task registry (shared/tasks.py) from the
package's ``Config`` and checked key by key; the task's code reads them as ``cfg.alfworld``."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import opt


@dataclass
class AlfworldTaskConfig:
    """[env.alfworld]: generated ALFWorld games in a pool of engine processes."""

    max_rounds: int = opt(20, "rounds per episode (AgentBench FC: 20); the catalogue records whether the expert "
                              "wins within it")
    snap_actions: bool = opt(True, "map a non-admissible command to the closest admissible one by BLEU, as "
                                   "AgentBench does; false = the engine says Nothing happens.")
    pool_size: int = opt(4, "engine processes kept beyond env.max_sessions for loaded, ready games")
    prefetch: int = opt(1, "a cold start also loads its game in this many idle processes (GRPO plays a task "
                           "group_size times)")
    recycle_after: int = opt(50, "episodes an engine process plays before it is replaced (the engine leaks memory)")
    game_files: list[str] = opt([], "real ALFWorld game files (.../<task>/trial_*/game.tw-pddl, traj_data.json "
                                    "beside it): paths or globs, served as split 'dev'", path=True)
    expert_filter: bool = opt(False, "keep in the catalogue only games the expert wins within max_rounds (the "
                                     "old behaviour); false = the first games of each type, the expert's result "
                                     "recorded beside them")
    oracle: str = opt("expert", "expert (ALFWorld's handcoded expert: searches the room) | planner (reads the "
                                "game's true state: straight to the object, station and goal)")
    levels: list[int] = opt([], "task-type difficulties the catalogue holds and the splits serve (1 pick and place, "
                                "look at in light; 2 clean, heat, cool then place; 3 pick two); empty = all")
    num_train_games: int = opt(0, "games per task type in the train catalogue; 0 = env.num_train_tasks", ge=0)
    num_test_games: int = opt(0, "games per task type in the test catalogue; 0 = env.num_test_tasks", ge=0)
    max_observation_chars: int = opt(4000, "overrides env.max_observation_chars: an observation lists every "
                                           "admissible command")
