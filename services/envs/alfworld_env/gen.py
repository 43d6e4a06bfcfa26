"""ALFWorld game generator: real ALFWorld games (PDDL problem + ``traj_data.json``) built offline from
the 120 AI2-THOR room layouts and ALFRED's tables that ship inside the PyPI ``alfworld`` wheel.

The wheel has the PDDL domain, the text grammar, the goal library and, per scene, the receptacles with
their approach points (``FloorPlanN-openable.json``), the object classes present (``-objects.json``)
and the reachable grid (``-layout.npy``); it has no games (its downloader needs the internet). So:

1. A *tuple* is (task type, object, receptacle, scene), the same key ALFWorld puts in its paths
   (``pick_heat_then_place_in_recep-Egg-None-DiningTable-11``). Valid tuples follow ALFRED: the room
   types each task type allows (``GOALS_VALID``), the receptacle/object compatibility table
   (``VAL_RECEPTACLE_OBJECTS``) and the action tables (``VAL_ACTION_OBJECTS``: heatable, ...).
2. A *game* is a tuple plus a trial number: the trial seeds where every object instance lies, written
   as the PDDL problem ALFWorld's engine loads, the ``traj_data.json`` its handcoded expert reads and
   the ``game.tw-pddl`` bundle (domain + grammar with the goal text + problem).
3. The *catalogue* of a split keeps, per task type, the first N games (in a seeded order that cycles
   through the tuples), with whether ALFWorld's handcoded expert wins each within the episode's round
   limit (``expert_filter`` keeps only those it wins, as in an earlier version).

Scenes 10, 219, 308 and 424 are the test split (AgentBench holds them out); all others are train.
Everything is deterministic in the task id, so any replica rebuilds any game from its id alone.
Run ``python -m services.envs.alfworld_env.gen --train N --test M`` to build the cache up front.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import threading
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import alfworld.gen.constants as C
import numpy as np
from alfworld.agents.utils.misc import add_task_to_grammar
from alfworld.gen.goal_library import gdict
from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH

LAYOUTS = Path(C.__file__).resolve().parent / "layouts"
GEN_VERSION = "v1"  # bump when the generated games change; the cache lives under it

TASK_TYPES = ["pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
              "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_two_obj_and_place"]
TEST_SCENES = frozenset({10, 219, 308, 424})
# task type -> (difficulty level, the AgentBench prompt prefix of its paths)
DIFFICULTY = {"pick_and_place_simple": 1, "look_at_obj_in_light": 1, "pick_clean_then_place_in_recep": 2,
              "pick_heat_then_place_in_recep": 2, "pick_cool_then_place_in_recep": 2, "pick_two_obj_and_place": 3}

STATIC_RECEPTACLES = sorted(C.RECEPTACLES - C.MOVABLE_RECEPTACLES_SET)
LAMPS = ("DeskLamp", "FloorLamp")
# THOR names the sink and tub by their frame; ALFWorld's receptacle is the basin inside it.
BASINS = {"Sink": "SinkBasin", "Bathtub": "BathtubBasin"}
# Kitchens have four burners; THOR layouts list none of the non-openable fixtures, so they get one each.
FIXTURE_COUNTS = {"StoveBurner": 4}
# Where THOR rooms keep their lamps (the look-at goal wants the lamp in a receptacle the agent is at).
LAMP_HOSTS = {"DeskLamp": ("Desk", "SideTable", "Dresser"),
              "FloorLamp": ("SideTable", "Dresser", "Desk", "Sofa", "ArmChair", "CoffeeTable")}


def room_type(scene: int) -> str:
    return next(name for name, nums in C.SCENE_TYPE.items() if scene in nums)


def split_of(scene: int) -> str:
    return "test" if scene in TEST_SCENES else "train"


def pddl_name(thor_id: str) -> str:
    """THOR id -> PDDL symbol, exactly as ALFRED writes its problems (the demangler undoes it)."""
    for a, b in (("-", "_minus_"), ("|", "_bar_"), ("+", "_plus_"), (".", "_dot_"), (",", "_comma_")):
        thor_id = thor_id.replace(a, b)
    return thor_id


@dataclass(frozen=True)
class Scene:
    num: int
    receptacles: tuple[tuple[str, str, str], ...]  # (THOR id, class, location id)
    objects: tuple[str, ...]  # placeable object classes present in the room
    lamps: tuple[str, ...]
    start: str  # the agent's starting location

    @property
    def receptacle_classes(self) -> set[str]:
        return {cls for _, cls, _ in self.receptacles}


def _loc(x: float, z: float, rot: int, hor: int) -> str:
    return f"loc|{round(x / C.AGENT_STEP_SIZE)}|{round(z / C.AGENT_STEP_SIZE)}|{rot // 90}|{hor}"


@cache
def load_scene(num: int) -> Scene:
    """Receptacles with their approach points (from the layout files), the object classes in the room."""
    openable = json.loads((LAYOUTS / f"FloorPlan{num}-openable.json").read_text())
    classes = set(json.loads((LAYOUTS / f"FloorPlan{num}-objects.json").read_text()))
    grid = np.load(LAYOUTS / f"FloorPlan{num}-layout.npy")
    rng = random.Random(f"scene-{num}")
    used: set[str] = set()

    def unique(loc: str) -> str:  # each receptacle gets its own spot, so "go to" is unambiguous
        base, k = loc, 0
        while loc in used:
            k += 1
            loc = f"{base}|{k}"
        used.add(loc)
        return loc

    receptacles = []
    for thor_id, (x, z, rot, hor) in sorted(openable.items()):
        cls = thor_id.split("|")[0]
        if cls in BASINS:
            thor_id, cls = f"{thor_id}|{BASINS[cls]}", BASINS[cls]
        if cls in STATIC_RECEPTACLES:
            receptacles.append((thor_id, cls, unique(_loc(x, z, int(rot), int(hor)))))
    present = {cls for _, cls, _ in receptacles}
    for cls in sorted(BASINS.get(c, c) for c in classes):
        if cls in STATIC_RECEPTACLES and cls not in present:
            for _ in range(FIXTURE_COUNTS.get(cls, 1)):
                x, z = (float(v) for v in grid[rng.randrange(len(grid))])
                y = rng.uniform(0.3, 1.2)
                thor_id = f"{cls}|{x:+06.2f}|{y:+06.2f}|{z:+06.2f}"
                receptacles.append((thor_id, cls, unique(_loc(x, z, 90 * rng.randrange(4), 30))))
            present.add(cls)
    x, z = (float(v) for v in grid[rng.randrange(len(grid))])
    start = unique(_loc(x, z, 90 * rng.randrange(4), 30))
    placeable = set().union(*C.VAL_RECEPTACLE_OBJECTS.values())
    objects = tuple(sorted(c for c in classes if c in placeable and "Sliced" not in c and c not in present))
    lamps = tuple(sorted(c for c in classes if c in LAMPS))
    return Scene(num, tuple(receptacles), objects, lamps, start)


def all_scenes() -> list[int]:
    return sorted(int(p.name[len("FloorPlan"):-len("-layout.npy")]) for p in LAYOUTS.glob("FloorPlan*-layout.npy"))


def _hosts(scene: Scene, obj: str) -> list[str]:
    """Receptacle classes in the room that can hold ``obj`` (ALFRED's compatibility table)."""
    return sorted(c for c in scene.receptacle_classes if obj in C.VAL_RECEPTACLE_OBJECTS.get(c, ()))


def valid_tuples(scene_num: int) -> list[tuple[str, str, str, int]]:
    """Every (task type, object, receptacle or lamp, scene) ALFRED's rules allow in this room."""
    scene = load_scene(scene_num)
    out = []
    recep_classes = scene.receptacle_classes
    for task_type in TASK_TYPES:
        if room_type(scene_num) not in C.GOALS_VALID[task_type]:
            continue
        station = {"pick_clean_then_place_in_recep": "SinkBasin", "pick_heat_then_place_in_recep": "Microwave",
                   "pick_cool_then_place_in_recep": "Fridge"}.get(task_type)
        if station and station not in recep_classes:
            continue
        action = {"pick_clean_then_place_in_recep": "Cleanable", "pick_heat_then_place_in_recep": "Heatable",
                  "pick_cool_then_place_in_recep": "Coolable"}.get(task_type)
        for obj in scene.objects:
            if action and obj not in C.VAL_ACTION_OBJECTS[action]:
                continue
            hosts = _hosts(scene, obj)
            if task_type == "look_at_obj_in_light":
                out += [(task_type, obj, lamp, scene_num) for lamp in scene.lamps if hosts]
                continue
            for recep in hosts:
                # the object must start somewhere else than the goal receptacle class
                if recep != station and any(h != recep for h in hosts):
                    out.append((task_type, obj, recep, scene_num))
    return out


def tuple_name(t: tuple[str, str, str, int]) -> str:
    return f"{t[0]}-{t[1]}-None-{t[2]}-{t[3]}"


def parse_task_id(task_id: str) -> tuple[tuple[str, str, str, int], int]:
    """``pick_heat_then_place_in_recep-Egg-None-DiningTable-11/trial_3`` -> (tuple, trial)."""
    name, trial = task_id.split("/")
    task_type, obj, _mrecep, recep, scene = name.split("-")
    if task_type not in TASK_TYPES or not trial.startswith("trial_"):
        raise KeyError(task_id)
    return (task_type, obj, recep, int(scene)), int(trial[len("trial_"):])


# ------------------------------------------------------------------------------------------------ games
def build_game(task_id: str) -> dict[str, Any]:
    """The game of a task id: ``{"problem": PDDL, "traj_data": {...}, "game": tw-pddl bundle}``."""
    (task_type, obj, recep, scene_num), trial = parse_task_id(task_id)
    if (task_type, obj, recep, scene_num) not in set(valid_tuples(scene_num)):
        raise KeyError(task_id)
    scene = load_scene(scene_num)
    rng = random.Random(f"{GEN_VERSION}:{task_id}")
    by_class: dict[str, list[tuple[str, str]]] = {}
    for thor_id, cls, loc in scene.receptacles:
        by_class.setdefault(cls, []).append((thor_id, loc))

    def thor_object_id(cls: str) -> str:
        x, y, z = rng.uniform(-3, 3), rng.uniform(0, 2), rng.uniform(-3, 3)
        return f"{cls}|{x:+06.2f}|{y:+06.2f}|{z:+06.2f}"

    # Where each instance lies: a random compatible receptacle; the target never starts in the goal
    # receptacle class (the goal would hold at step 0) nor, for clean/heat/cool, in the station.
    placed: list[tuple[str, str, str]] = []  # (object id, class, receptacle id)
    station = {"pick_clean_then_place_in_recep": "SinkBasin", "pick_heat_then_place_in_recep": "Microwave",
               "pick_cool_then_place_in_recep": "Fridge"}.get(task_type)
    for cls in scene.objects:
        hosts = _hosts(scene, cls)
        if not hosts:
            continue
        if cls == obj:
            lo = 2 if task_type == "pick_two_obj_and_place" else 1
            n = rng.randint(lo, C.PICKUP_REPEAT_MAX)
            if task_type != "look_at_obj_in_light":  # (if the station is its only other host, start there)
                hosts = [h for h in hosts if h not in (recep, station)] or [h for h in hosts if h != recep]
        else:
            n = rng.randint(1, C.MAX_NUM_OF_OBJ_INSTANCES)
        for _ in range(n):
            host_cls = rng.choice(hosts)
            placed.append((thor_object_id(cls), cls, rng.choice(by_class[host_cls])[0]))
    lamps = []
    for cls in scene.lamps:
        hosts = [c for c in LAMP_HOSTS[cls] if c in by_class] or sorted(by_class)
        lamps.append((thor_object_id(cls), cls, rng.choice(by_class[rng.choice(hosts)])[0]))

    problem = _pddl_problem(scene, placed, lamps, task_type, obj, recep, task_id)
    pddl_params = {"object_target": obj, "parent_target": "" if task_type == "look_at_obj_in_light" else recep,
                   "toggle_target": recep if task_type == "look_at_obj_in_light" else "", "mrecep_target": "",
                   "object_sliced": False}
    traj_data = {"task_id": task_id, "task_type": task_type, "pddl_params": pddl_params,
                 "scene": {"scene_num": scene_num, "floor_plan": f"FloorPlan{scene_num}", "random_seed": trial},
                 "turk_annotations": {"anns": []}, "generator": f"jetrl-alfworld-{GEN_VERSION}"}
    # The goal sentence is drawn from ALFWorld's templates with the global random module: seed it.
    random.seed(f"{GEN_VERSION}:{task_id}:goal")
    grammar = add_task_to_grammar(_logic()["grammar"], traj_data)
    game = {"pddl_domain": _logic()["pddl_domain"], "grammar": grammar, "pddl_problem": problem,
            "solvable": None, "walkthrough": None}
    return {"problem": problem, "traj_data": traj_data, "game": game}


@cache
def _logic() -> dict[str, str]:
    return {"pddl_domain": Path(ALFRED_PDDL_PATH).read_text(), "grammar": Path(ALFRED_TWL2_PATH).read_text()}


def _pddl_problem(scene: Scene, placed: list[tuple[str, str, str]], lamps: list[tuple[str, str, str]],
                  task_type: str, obj: str, recep: str, task_id: str) -> str:
    """The PDDL problem in the shape ALFRED's full-knowledge game state writes it."""
    rloc = {thor_id: loc for thor_id, _, loc in scene.receptacles}
    rcls = {thor_id: cls for thor_id, cls, _ in scene.receptacles}
    otypes = sorted((set(C.OBJECTS_WSLICED) | C.MOVABLE_RECEPTACLES_SET | set(LAMPS)) - set(STATIC_RECEPTACLES))
    locations = sorted({loc for _, _, loc in scene.receptacles} | {scene.start})
    things = placed + lamps
    n = pddl_name
    objects = (["agent1 - agent"] + [f"{t}Type - otype" for t in otypes]
               + [f"{t}Type - rtype" for t in STATIC_RECEPTACLES]
               + [f"{n(o)} - object" for o, _, _ in things]
               + [f"{n(r)} - receptacle" for r, _, _ in scene.receptacles]
               + [f"{n(loc)} - location" for loc in locations])
    init = [f"(atLocation agent1 {n(scene.start)})"]
    for r, cls, loc in scene.receptacles:
        init += [f"(receptacleType {n(r)} {cls}Type)", f"(receptacleAtLocation {n(r)} {n(loc)})"]
        if cls in C.OPENABLE_CLASS_SET:
            init.append(f"(openable {n(r)})")
    for rt in STATIC_RECEPTACLES:
        init += [f"(canContain {rt}Type {ot}Type)" for ot in sorted(C.VAL_RECEPTACLE_OBJECTS.get(rt, ()))
                 if ot in otypes]
    for o, cls, r in things:
        init += [f"(objectType {n(o)} {cls}Type)", f"(inReceptacle {n(o)} {n(r)})",
                 f"(objectAtLocation {n(o)} {n(rloc[r])})"]
        if cls in LAMPS:
            init.append(f"(toggleable {n(o)})")
            continue
        init.append(f"(pickupable {n(o)})")
        if cls in C.MOVABLE_RECEPTACLES_SET:
            init.append(f"(isReceptacleObject {n(o)})")
        for action, pred in (("Cleanable", "cleanable"), ("Heatable", "heatable"), ("Coolable", "coolable"),
                             ("Sliceable", "sliceable")):
            if cls in C.VAL_ACTION_OBJECTS[action]:
                init.append(f"({pred} {n(o)})")
        if rcls[r] == "Fridge" and cls in C.VAL_ACTION_OBJECTS["Coolable"]:
            init.append(f"(isCool {n(o)})")  # ALFRED marks what starts in the fridge as already cool
    goal = gdict[task_type]["pddl"].format(obj=obj, recep=recep, toggle=recep).replace("#", "-")
    return (f"(define (problem plan_{n(task_id.replace('/', '_'))})\n(:domain alfred)\n(:objects\n    "
            + "\n    ".join(objects) + "\n)\n(:init\n    " + "\n    ".join(init) + "\n)\n" + goal.strip() + "\n")


# ------------------------------------------------------------------------------------------------ cache
def data_root(data_dir: str = "") -> Path:
    base = Path(data_dir).expanduser() if data_dir else Path("~/.cache/jetrl/data").expanduser()
    return base / "alfworld" / GEN_VERSION


def game_dir(root: Path, task_id: str) -> Path:
    return root / "games" / task_id


def write_game(root: Path, task_id: str) -> Path:
    """Write the game's files (idempotent: an existing, complete game is left alone); returns game.tw-pddl."""
    folder = game_dir(root, task_id)
    path = folder / "game.tw-pddl"
    if path.exists():
        return path
    built = build_game(task_id)
    folder.mkdir(parents=True, exist_ok=True)
    # atomic writes, game.tw-pddl last: another process may be writing or reading the same game
    for name, text in (("initial_state.pddl", built["problem"]), ("traj_data.json", json.dumps(built["traj_data"])),
                       ("game.tw-pddl", json.dumps(built["game"]))):
        tmp = folder / f"{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_text(text)
        tmp.replace(folder / name)
    return path


def candidates(split: str, task_type: str) -> list[tuple[str, str, str, int]]:
    """The split's tuples of one task type, in a seeded order (the catalogue cycles through them)."""
    tuples = [t for s in all_scenes() if split_of(s) == split for t in valid_tuples(s) if t[0] == task_type]
    random.Random(f"{GEN_VERSION}:{split}:{task_type}").shuffle(tuples)
    return tuples


def candidate_id(tuples: list[tuple[str, str, str, int]], j: int) -> str:
    return f"{tuple_name(tuples[j % len(tuples)])}/trial_{j // len(tuples)}"


def verify(args: tuple[str, str, int]) -> dict[str, Any]:
    """Write a game and play ALFWorld's handcoded expert on it (runs in a pool worker)."""
    from services.envs.alfworld_env import engine

    root, task_id, max_steps = Path(args[0]), args[1], args[2]
    engine.memoize_text_parsing()
    engine.cache_translations(str(root / "sas"))  # the env's engines reuse these translations
    t0 = time.perf_counter()
    path = write_game(root, task_id)
    gen_s = time.perf_counter() - t0
    game = json.loads(path.read_text())
    walkthrough = game.get("walkthrough")
    if game.get("solvable") is not None and walkthrough is not None and len(walkthrough) <= max_steps and \
            (game["solvable"] or len(walkthrough) == max_steps) and "planner_won" in game and \
            game.get("expert_version") == engine.EXPERT_VERSION:  # checked before, by this expert
        return {"task_id": task_id, "won": game["solvable"], "steps": len(walkthrough), "gen_s": gen_s,
                "planner_won": game["planner_won"], "total_s": time.perf_counter() - t0}
    try:
        played = engine.Game()
        played.load(str(path), task_id)
        won, actions = engine.play_expert(str(path), task_id, max_steps, game=played)
        planner_won, _ = engine.play_expert(str(path), task_id, max_steps, planner=True, game=played)
    except Exception as exc:  # a game the engine cannot load or play is simply not kept
        print(f"alfworld: {task_id} failed in the engine: {exc!r}", flush=True)
        won, actions, planner_won = False, [], False
    if game.get("solvable") is None or game.get("walkthrough") != actions or game.get("planner_won") != planner_won \
            or game.get("expert_version") != engine.EXPERT_VERSION:
        game.update(solvable=won, walkthrough=actions, planner_won=planner_won, expert_version=engine.EXPERT_VERSION)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(game))
        tmp.replace(path)
    return {"task_id": task_id, "won": won, "steps": len(actions), "gen_s": gen_s, "planner_won": planner_won,
            "total_s": time.perf_counter() - t0}


def task_ids_for(tuples: list[tuple[str, str, str, int]], trials: int = 1) -> list[str]:
    """Task ids of games for given (task type, object, receptacle, scene) tuples (AgentBench's lists name
    tuples: ``agentbench_task_ids``), ``trials`` games each; a tuple ALFRED's rules do not allow is an error."""
    out = []
    for t in tuples:
        task_type, obj, recep, scene = t[0], t[1], t[2], int(t[3])
        if (task_type, obj, recep, scene) not in set(valid_tuples(scene)):
            raise ValueError(f"alfworld: ({task_type}, {obj}, {recep}, {scene}) is not a game ALFRED's rules allow")
        out += [f"{tuple_name((task_type, obj, recep, scene))}/trial_{k}" for k in range(trials)]
    return out


def build_catalogue(split: str, per_type: int, data_dir: str = "", max_steps: int = 20, workers: int = 0,
                    log: Any = None, filter_won: bool = False, progress: Any = None,
                    task_types: list[str] | None = None) -> dict[str, Any]:
    """The first ``per_type`` games of each task type (cached as a manifest), with the handcoded expert's
    result on each (``expert``: won within ``max_steps``, steps). ``filter_won`` keeps only games the expert
    wins (the catalogue in an earlier version, which hid the games it cannot win). ``task_types`` (default:
    all of ``TASK_TYPES``) limits the catalogue to those types; each type's games are the same as in the
    full catalogue. ``progress`` (a ``shared.progress.Progress`` over ``per_type`` games per task type) is
    told each accepted game."""
    types = [t for t in TASK_TYPES if task_types is None or t in task_types]
    unknown = set(task_types or []) - set(TASK_TYPES)
    if unknown:
        raise ValueError(f"alfworld: unknown task types {sorted(unknown)}")
    # a catalogue of some task types only is its own manifest: -t<index of each type in TASK_TYPES>
    only = "" if types == TASK_TYPES else "-t" + "".join(str(TASK_TYPES.index(t)) for t in types)
    root = data_root(data_dir)
    from services.envs.alfworld_env.engine import EXPERT_VERSION
    from services.envs.alfworld_env.pool import engine_context

    # the expert's results are part of the catalogue: a catalogue of another expert is not this one's
    kept = "" if filter_won else "-all2"
    manifest = root / f"catalogue-{split}-{per_type}-{max_steps}{kept}{only}-e{EXPERT_VERSION}.json"
    if manifest.exists():
        return json.loads(manifest.read_text())

    workers = workers or min(8, os.cpu_count() or 1)
    t0 = time.perf_counter()
    out: dict[str, Any] = {"split": split, "per_type": per_type, "max_steps": max_steps, "filter_won": filter_won,
                           "tasks": {}, "stats": {}, "expert": {}}
    with engine_context().Pool(workers, maxtasksperchild=50) as pool:
        for task_type in types:
            tuples = candidates(split, task_type)
            accepted: list[dict[str, Any]] = []
            tried, j = 0, 0
            while len(accepted) < per_type and tuples:
                batch = [(str(root), candidate_id(tuples, j + i), max_steps)
                         for i in range(max(workers, per_type - len(accepted)))]
                j += len(batch)
                for res in pool.imap(verify, batch):  # imap keeps the order, so the result is deterministic
                    tried += 1
                    if (res["won"] or not filter_won) and len(accepted) < per_type:
                        accepted.append(res)
                        out["expert"][res["task_id"]] = {"won": res["won"], "steps": res["steps"],
                                                         "planner_won": res["planner_won"]}
                        if progress is not None:
                            progress.update(note=f"{task_type} (tried {tried})")
                if j > 50 * per_type + 100:
                    raise RuntimeError(f"alfworld: the expert solves too few {task_type} games in {split}")
            out["tasks"][task_type] = [r["task_id"] for r in accepted]
            out["stats"][task_type] = {"tried": tried, "accepted": len(accepted),
                                       "expert_won": sum(r["won"] for r in accepted),
                                       "planner_won": sum(r["planner_won"] for r in accepted),
                                       "mean_expert_steps": float(np.mean([r["steps"] for r in accepted] or [0]))}
            if log:
                log(task_type=task_type, split=split, **out["stats"][task_type])
    out["stats"]["build_s"] = time.perf_counter() - t0
    root.mkdir(parents=True, exist_ok=True)  # no game was built where per_type is 0: the folder may not exist
    tmp = manifest.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(manifest)
    return out


def task_digest(task_id: str) -> str:
    return hashlib.sha256(task_id.encode()).hexdigest()[:12]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Build the ALFWorld game catalogue (cached under the data dir).")
    ap.add_argument("--train", type=int, default=256, help="train games per task type")
    ap.add_argument("--test", type=int, default=64, help="test games per task type")
    ap.add_argument("--data-dir", default="", help="cache root; empty = ~/.cache/jetrl/data")
    ap.add_argument("--max-steps", type=int, default=20, help="the expert's round limit")
    ap.add_argument("--expert-filter", action="store_true", help="keep only games the expert wins")
    ap.add_argument("--workers", type=int, default=0, help="processes; 0 = min(8, cores)")
    a = ap.parse_args()
    from shared.progress import Progress

    for split, n in (("train", a.train), ("test", a.test)):
        with Progress(f"alfworld {split} catalogue", total=n * len(TASK_TYPES), unit="games") as bar:
            cat = build_catalogue(split, n, a.data_dir, a.max_steps, a.workers, progress=bar,
                                  log=lambda **kv: print(" ".join(f"{k}={v}" for k, v in kv.items()), flush=True),
                                  filter_won=a.expert_filter)
        print(f"split={split} per_type={n} build_s={cat['stats']['build_s']:.1f}", flush=True)
