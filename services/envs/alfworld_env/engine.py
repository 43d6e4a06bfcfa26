"""ALFWorld's engine and expert for one game at a time: TextWorld's ``PddlEnv`` (Fast Downward under
the hood) wrapped exactly as ALFWorld wraps it (``AlfredDemangler``, ``AlfredInfos``), with ALFWorld's
``HandCodedTWAgent`` following along so the oracle knows its next command after any history.

Not thread-safe: ``pddl2sas`` rewrites ``sys.argv``, swaps ``sys.stdout`` and keeps module globals.
One ``Game`` is used by one thread; replicas run games in worker processes (``pool.py``).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import os
import pickle
import random
import sys
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fast_downward
import textworld
from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
from alfworld.agents.expert import HandCodedTWAgent
from textworld.envs import PddlEnv
from textworld.envs.pddl import textgen

from services.envs.alfworld_env.gen import LAMP_HOSTS


def memoize_text_parsing() -> None:
    """Make TextWorld's text generation cheaper; it is most of a step's time.

    Each step re-derives the text of every admissible command: each derivation parses its template
    and the grammar rules' conditions with tatsu from scratch, and deep-copies the whole game state
    for every symbol it expands. The parsers are pure functions of their text, so their results are
    cached (derivations get a deep copy, since the grammar writes contexts into the symbols), and the
    state is shared instead of copied. The text produced is unchanged: the tests play the same games
    with and without this and compare every observation and command list.
    """
    if getattr(textgen, "_jetrl_memoized", False):
        return
    parse = textgen._parse_and_convert
    parsed: dict[tuple[Any, ...], Any] = {}

    def parse_cached(text: str, rule_name: str, **kwargs: Any) -> Any:
        key = (text, rule_name)
        if key not in parsed:
            parsed[key] = parse(text, rule_name=rule_name, **kwargs)
        return copy.deepcopy(parsed[key])

    def symbol_copy(self: textgen.Symbol, context: dict[str, Any]) -> textgen.Symbol:
        # Symbol.copy deep-copies the symbol *with its old context*, i.e. the whole game state and fact
        # list, then throws that context away. Share those (read-only during a derivation) instead.
        shared = {id(v): v for ctx in (self.context, context) for k, v in ctx.items()
                  if k in ("state", "facts", "entity_infos")}
        out = copy.deepcopy(self, shared)
        out.context = textgen.copy_context(context)
        return out

    def copy_context(context: dict[str, Any]) -> dict[str, Any]:
        # The stock version deep-copies the entity infos and logic variables of every context it
        # copies (thousands per step); derivations only add keys to these dicts and never change
        # the objects in them, so copying the dicts is enough.
        return {"state": context["state"], "facts": context["facts"], "variables": dict(context["variables"]),
                "mapping": dict(context["mapping"]), "entity_infos": context["entity_infos"]}

    query = textworld.logic.Rule.parse_conjunctive_query.__func__
    textgen._parse_and_convert = parse_cached
    textgen.Symbol.copy = symbol_copy
    textgen.copy_context = copy_context
    textworld.logic.Rule.parse_conjunctive_query = classmethod(functools.lru_cache(maxsize=8192)(query))
    textgen._jetrl_memoized = True


def cache_translations(cache_dir: str = "") -> None:
    """Memoize Fast Downward's PDDL -> SAS translation (deterministic in its input): in memory, so a
    game reset in the same process skips it, and on disk (zlib'd pickles, ~120 kB a game) when a
    directory is given, so a game translated once (e.g. by the catalogue's expert check) loads fast
    in every later process. This is where most of a reset's seconds go."""
    if getattr(fast_downward.pddl2sas, "_jetrl_cache_dir", None) == cache_dir:
        return
    orig = getattr(fast_downward.pddl2sas, "_jetrl_orig", fast_downward.pddl2sas)
    memory: OrderedDict[str, bytes] = OrderedDict()

    def pddl2sas(domain: str, problem: str, verbose: bool = False, optimize: bool = False) -> Any:
        # TextWorld also translates an optimised copy, used only to re-plan (the PDDL planner expert,
        # ALFWorld's "walkthrough"/"policy_commands" infos); we play the handcoded expert and request
        # neither, so that copy is the plain translation and a load translates once instead of twice.
        optimize = False
        key = hashlib.sha256(f"{optimize}\0{domain}\0{problem}".encode()).hexdigest()
        blob = memory.get(key)
        path = Path(cache_dir) / key[:2] / f"{key}.pkl.z" if cache_dir else None
        if blob is None and path is not None and path.exists():
            blob = path.read_bytes()
        if blob is None:
            argv = sys.argv  # the translator overwrites sys.argv
            try:
                result = orig(domain, problem, verbose=verbose, optimize=optimize)
            finally:
                sys.argv = argv
            blob = zlib.compress(pickle.dumps(result), 6)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_bytes(blob)
                tmp.replace(path)
        memory[key] = blob
        memory.move_to_end(key)
        while len(memory) > 8:
            memory.popitem(last=False)
        return pickle.loads(zlib.decompress(blob))  # a fresh copy: states never share a task object

    pddl2sas._jetrl_orig = orig  # type: ignore[attr-defined]
    pddl2sas._jetrl_cache_dir = cache_dir  # type: ignore[attr-defined]
    fast_downward.pddl2sas = pddl2sas


# ALFWorld's expert looks for an object where ALFRED may put its class (VAL_RECEPTACLE_OBJECTS). Nothing puts a
# lamp anywhere, so on its own it has no prior for one and searches every receptacle from the end of the room's
# list (shelves, a safe, drawers before the desks): past 20 rounds in the look_at games of AgentBench's test
# tuples. Lamps stand where THOR rooms keep them (gen.LAMP_HOSTS), searched first (see also Game.reset). The
# version marks the games whose expert results this expert recorded.
LAMP_PRIORS = {lamp.lower(): [host.lower() for host in hosts] for lamp, hosts in LAMP_HOSTS.items()}
EXPERT_VERSION = 2


@dataclass
class Step:
    observation: str
    won: bool
    admissible: list[str]
    valid: bool = True  # False: the engine answered "Nothing happens."
    expert: str = "look"  # the expert's next command from here
    plan: str = ""  # the full-knowledge planner's next command ("" = it has none; see ``plan_next``)


@dataclass
class Game:
    """A reusable engine slot. Each ``PddlEnv`` loads its own copy of libdownward.so (33 MB, never
    unloaded), so a worker keeps a few slots and loads game after game into them."""

    env: textworld.core.Wrapper = field(init=False)
    task_id: str = ""
    path: str = ""
    steps: int = 0
    expert: HandCodedTWAgent | None = None
    expert_next: str = "look"
    last: Step | None = None

    def __post_init__(self) -> None:
        infos = textworld.EnvInfos(won=True, admissible_commands=True, facts=True, feedback=True,
                                   extras=["gamefile"])
        self.env = AlfredInfos(AlfredDemangler(PddlEnv(infos), shuffle=False))

    def load(self, path: str, task_id: str) -> Step:
        """Load and reset a game (the slow part: PDDL -> SAS translation, grammar parsing)."""
        self.path, self.task_id = path, task_id
        self.env.load(path)
        return self.reset()

    def reset(self) -> Step:
        state = self.env.reset()
        self.steps = 0
        self.expert = HandCodedTWAgent(max_steps=200)
        self.expert.reset(self.path)
        policy = self.expert.policy
        policy.OBJECT_TO_VAL_RECEPTACLE = {**policy.OBJECT_TO_VAL_RECEPTACLE, **LAMP_PRIORS}
        self.expert.observe(state["feedback"])
        # a mug or a bowl is a receptacle class too: the expert would look for one among the room's receptacles
        # of that class (none: they are objects here), then everywhere in list order; its priors lead it instead
        policy.RECEPTACLES = sorted(set(policy.receptacles.values()))
        self.expert_next = "look"  # what ALFWorld's AlfredExpert wrapper plans first
        self.params = _goal_params(self.path)
        self.last = Step(state["feedback"], bool(state["won"]), list(state["admissible_commands"]),
                         expert=self.expert_next, plan=self._plan(state))
        return self.last

    def _plan(self, state: textworld.GameState) -> str:
        try:
            return plan_next([str(f) for f in state["facts"] or []], self.params, list(state["admissible_commands"]))
        except Exception:  # a state the planner does not model: no plan (the oracle falls back to the expert)
            return ""

    def step(self, command: str) -> Step:
        state, _, _ = self.env.step(command)
        self.steps += 1
        self.expert_next = self._expert_act(state, command)
        self.last = Step(state["feedback"], bool(state["won"]), list(state["admissible_commands"]),
                         valid=state["feedback"] != "Nothing happens.", expert=self.expert_next,
                         plan=self._plan(state))
        return self.last

    def _expert_act(self, state: textworld.GameState, command: str) -> str:
        """As ALFWorld's AlfredExpert wrapper, but an expert that gives up (it raises) plans "look"
        instead of breaking the engine step. Its random tie-breaks are seeded by (task, step)."""
        random.seed(f"{self.task_id}:{self.steps}")
        # ALFWorld 0.4.2's grammar names the put command "move X to Y", but its expert still tracks
        # "put" (inventory, blacklist); without this it re-fetches the object it just placed, forever.
        seen = "put " + command[len("move "):] if command.startswith("move ") else command
        try:
            action = self.expert.act(state, 0, state["won"], seen)
        except Exception:  # HandCodedAgentFailed / Timeout after an agent wandered off its plan
            return "look"
        return action if action in state["admissible_commands"] else "look"


def play_expert(path: str, task_id: str, max_steps: int, planner: bool = False,
                game: Game | None = None) -> tuple[bool, list[str]]:
    """Play the handcoded expert (or the full-knowledge planner, the expert where it has no plan) on a
    game; (won within max_steps, commands). ``game``: one already loaded with this game (it is reset)."""
    if game is None:
        game = Game()
        step = game.load(path, task_id)
    else:
        step = game.reset()
    actions: list[str] = []
    while not step.won and len(actions) < max_steps:
        command = (step.plan or step.expert) if planner else step.expert
        actions.append(command)
        step = game.step(command)
    return step.won, actions


# ------------------------------------------------------------------------------------------------ planner
# ALFWorld's handcoded expert searches the room for the object like an agent would, and often runs past
# AgentBench's 20 rounds. The planner reads the game's true state (TextWorld's facts, with the names the
# agent sees) and walks straight to the object, the station and the goal receptacle.
STATIONS = {"pick_clean_then_place_in_recep": ("clean", "sinkbasin", "isclean"),
            "pick_heat_then_place_in_recep": ("heat", "microwave", "ishot"),
            "pick_cool_then_place_in_recep": ("cool", "fridge", "iscool")}


@functools.lru_cache(maxsize=256)
def _goal_params(path: str) -> dict[str, str]:
    import json

    traj = json.loads((Path(path).parent / "traj_data.json").read_text())
    return {"task_type": traj["task_type"], **traj["pddl_params"]}


def _facts(facts: list[str]) -> list[tuple[str, list[str]]]:
    """``inreceptacle(mug 1: object, shelf 2: receptacle)`` -> ("inreceptacle", ["mug 1", "shelf 2"])."""
    out = []
    for f in facts:
        name, _, rest = f.partition("(")
        out.append((name, [a.split(":")[0].strip() for a in rest.rstrip(")").split(",") if a.strip()]))
    return out


def plan_next(facts: list[str], params: dict[str, str], admissible: list[str]) -> str:
    """The next command of a shortest-minded plan for the goal, or "" when none applies."""
    fs = _facts(facts)
    kind = lambda x: x.rsplit(" ", 1)[0].replace(" ", "")  # noqa: E731 - "desk lamp 1" -> "desklamp"
    one = {p: {a[0] for q, a in fs if q == p and a} for p in ("opened", "openable", "isclean", "ishot", "iscool")}
    inrec = {a[0]: a[1] for q, a in fs if q == "inreceptacle" and len(a) == 2}
    holds = [a[-1] for q, a in fs if q == "holds"]
    recloc = {a[0]: a[1] for q, a in fs if q == "receptacleatlocation" and len(a) == 2}
    here = next((a[1] for q, a in fs if q == "atlocation" and a and a[0].startswith("agent")), None)
    at = {r for r, loc in recloc.items() if loc == here}
    task_type = params["task_type"]
    target, goal, lamp = (params["object_target"].lower(), params["parent_target"].lower(),
                          params["toggle_target"].lower())
    station = STATIONS.get(task_type)

    def go_open(recep: str) -> str | None:
        if recep not in at:
            return f"go to {recep}"
        if recep in one["openable"] and recep not in one["opened"]:
            return f"open {recep}"
        return None

    def pick(prefix: str) -> str:
        return next((c for c in admissible if c.startswith(prefix)), "")

    def treated(o: str) -> bool:
        return station is None or o in one[station[2]]

    receptacles = sorted(recloc)
    goals = [r for r in receptacles if kind(r) == goal]
    done = [o for o, r in inrec.items() if kind(o) == target and r in goals and treated(o)]
    if holds:
        obj = holds[0]
        if kind(obj) != target:
            return ""
        if task_type == "look_at_obj_in_light":
            lamps = [o for o in inrec if kind(o) == lamp]
            if not lamps:
                return ""
            return go_open(inrec[lamps[0]]) or pick(f"use {lamps[0]}")
        if not treated(obj):
            assert station is not None
            where = next(r for r in receptacles if kind(r) == station[1])
            return go_open(where) if where not in at else pick(f"{station[0]} {obj} with {where}")
        if not goals:
            return ""
        target_recep = next((inrec[o] for o in done), goals[0])  # pick-two: the same receptacle twice
        return go_open(target_recep) or pick(f"move {obj} to {target_recep}") or pick(f"put {obj} ")
    todo = sorted((o for o in inrec if kind(o) == target and o not in done),
                  key=lambda o: (inrec[o] in goals, inrec[o] not in at, o))
    if not todo:
        return ""
    obj = todo[0]
    return go_open(inrec[obj]) or pick(f"take {obj} from {inrec[obj]}")
