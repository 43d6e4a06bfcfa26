"""KG task: multi-hop question answering over a real SPARQL store with AgentBench's seven tools.

AgentBench's function-calling KG task, on a graph we can build offline (see ``graph.py``): the agent
gets a question and its topic entities by name, explores with ``get_relations``, ``get_neighbors``,
``intersection``, ``get_attributes``, ``argmax``, ``argmin`` and ``count`` (variables ``#0``, ``#1``…
hold the sets they build), and answers in text with ``Final Answer: #k`` within 15 rounds.
Reward 1 for an exact set match with the gold answer (AgentBench's EM), F1 as a metric.

Options as AgentBench: ``env.kg.one_shot`` (an example conversation before the question, as its std split:
on our graph for generated questions, AgentBench's published one for its own questions, split ``dev``), implicit prerequisites (``get_neighbors``/``argmax``/``argmin`` list relations/attributes
themselves; ``env.kg.strict_prerequisites`` refuses instead), and the user's own Freebase graph as
N-Triples with AgentBench-format questions (``env.kg.ntriples``, ``env.kg.agentbench_file``: ``ntriples.py``).
Left out: its union tool (not among the seven). Observations say, as AgentBench's do, only a variable's type, never
its members: the agent has to reason with the schema, not read answers off the screen.
"""

from __future__ import annotations

import json
import os
import random
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog

from services.envs.base import Episode, TaskEnv, TaskLevel, ToolCall, ToolError, ToolResult
from services.envs.kg.config import KGTaskConfig
from services.envs.kg.engine import KB, Variable
from services.envs.kg.graph import Graph, open_graph
from services.envs.kg.questions import GENERATOR_VERSION, generate, gold, load_agentbench, s_expression
from shared.config import EnvConfig
from shared.messages import EpisodeStatus

log = structlog.get_logger()

MAX_ROUNDS = 15
INSTRUCTIONS = """You answer questions using a knowledge base (KB) that you explore with tools.
- A variable is an entity or a set of entities produced by an earlier tool call. Variables are
numbered from 0 in the order they are made: #0 is the first, #1 the second, and so on. Entities are
referred to by the names given with the question.
- Call get_relations on an entity or variable before get_neighbors on it, and get_attributes before
argmax or argmin; a relation or attribute must come from those lists. intersection needs two
variables of the same type.
- Make one tool call at a time, and use at most {max_round} rounds in all, the answer included.
- When a variable holds the answer, reply without a tool call, in the form 'Final Answer: #id'
(for example 'Final Answer: #3'). Do not call a tool to submit the answer."""

FINAL_ANSWER = re.compile(r"(?:Find|Final) Answer: #(\d+)")
VARIABLE_REF = re.compile(r"(?:variable\s*)?#(\d+)", re.IGNORECASE)
ENTITY_ID = re.compile(r"[mf]\.[0-9a-z_]+")


def _fn(name: str, description: str, **params: str) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {k: {"type": "string", "description": v} for k, v in params.items()},
                       "required": list(params), "additionalProperties": False}}}


# AgentBench's FC tool names and arguments, in its order; descriptions in our words.
TOOLS = [
    _fn("get_relations", "List the relations leaving an entity or a variable, to find the edges worth following.",
        variable="An entity name from the question or a variable such as #0."),
    _fn("get_neighbors", "Follow one relation from an entity or variable; the entities reached become a new "
        "variable. The relation must be one that get_relations listed for it.",
        variable="An entity name from the question or a variable such as #0.",
        relation="A relation listed by get_relations for that entity or variable."),
    _fn("intersection", "The entities that two variables of the same type have in common, as a new variable.",
        variable1="The first variable, e.g. #0.", variable2="The second variable, e.g. #1."),
    _fn("get_attributes", "List the numerical attributes of a variable, for argmax and argmin.",
        variable="A variable such as #0."),
    _fn("argmax", "The entity of a variable with the largest value of an attribute, as a new variable. The "
        "attribute must be one that get_attributes listed for it.",
        variable="A variable such as #0.", attribute="An attribute listed by get_attributes for that variable."),
    _fn("argmin", "The entity of a variable with the smallest value of an attribute, as a new variable. The "
        "attribute must be one that get_attributes listed for it.",
        variable="A variable such as #0.", attribute="An attribute listed by get_attributes for that variable."),
    _fn("count", "The number of entities in a variable, as a new variable holding a number.",
        variable="A variable such as #0."),
]


def clip(text: str, limit: int = 60) -> str:
    """An argument echoed in an error message, cut so a huge argument cannot flood the observation."""
    return text if len(text) <= limit else text[:limit] + f"...[{len(text) - limit} more characters]"


def f1(predicted: set[str], gold_answer: set[str]) -> float:
    tp = len(predicted & gold_answer)
    if tp == 0:
        return 0.0
    precision, recall = tp / len(predicted), tp / len(gold_answer)
    return 2 * precision * recall / (precision + recall)


class KGEpisode(Episode):
    max_turns = MAX_ROUNDS
    calls_per_message = "all"  # AgentBench's KG task runs every call of a message, in order

    def __init__(self, kb: KB, task: dict[str, Any], strict: bool = False,
                 example: list[dict[str, Any]] | None = None) -> None:
        self.kb, self.task = kb, task
        self.strict = strict  # refuse get_neighbors/argmax/argmin before get_relations/get_attributes
        self.example = example or []  # one-shot: a solved conversation between the system prompt and the question
        self.calls = 0  # tool calls that made or listed something (the oracle of AgentBench questions replays)
        self.variables: list[Variable] = []
        self.relations_seen: dict[str, set[str]] = {}  # program -> relations listed for it
        self.attributes_seen: dict[str, set[str]] = {}

    @property
    def tools(self) -> list[dict[str, Any]]:
        return TOOLS

    def opening(self) -> list[dict[str, Any]]:
        entities = ", ".join(self.task["entities"])
        return [{"role": "system", "content": INSTRUCTIONS.format(max_round=self.max_turns)}, *self.example,
                {"role": "user", "content": f"{self.task['question']}\nEntities: [{entities}]"}]

    # ------------------------------------------------------------------ tool calls
    def resolve(self, ref: str) -> Variable:
        """``#k`` -> variable k; a topic entity's name (or a raw entity id) -> that entity."""
        ref = ref.strip()
        if m := VARIABLE_REF.fullmatch(ref):
            k = int(m.group(1))
            if k >= len(self.variables):
                made = f"#0 to #{len(self.variables) - 1}" if self.variables else "none yet"
                raise ToolError(f"Variable #{k} does not exist (variables so far: {made}).")
            return self.variables[k]
        if ref in self.task["entities"]:
            return self.kb.entity(self.task["entities"][ref])
        if ENTITY_ID.fullmatch(ref) and self.kb.entity_type(ref) is not None:
            return self.kb.entity(ref)
        raise ToolError(f"{clip(ref)!r} is neither a variable (#0, #1, ...) nor an entity of this question "
                        f"[{', '.join(self.task['entities'])}].")

    def _new(self, var: Variable) -> str:
        self.variables.append(var)
        k = len(self.variables) - 1
        if var.is_number:
            return f"Observation: variable #{k}, which is a number"
        return f"Observation: variable #{k}, which are instances of {var.type}"

    def call(self, tool: ToolCall) -> ToolResult:
        result = self._call(tool)
        self.calls += 1
        return result

    def _call(self, tool: ToolCall) -> ToolResult:
        args, name = tool.arguments, tool.name
        if name == "intersection":
            a, b = args["variable1"].strip(), args["variable2"].strip()
            if not (VARIABLE_REF.fullmatch(a) and VARIABLE_REF.fullmatch(b)):
                raise ToolError("intersection takes two variables (#0, #1, ...), not entity names.")
            va, vb = self.resolve(a), self.resolve(b)
            if va.is_number or vb.is_number:
                raise ToolError("intersection: a count is a number, not a set of entities.")
            if va.type != vb.type:
                raise ToolError(f"intersection({a}, {b}): {a} holds {va.type} and {b} holds {vb.type}; "
                                "both variables must be of the same type.")
            return ToolResult(self._new(self.kb.intersection(va, vb)))
        var = self.resolve(args["variable"])
        ref = clip(args["variable"].strip())
        if name == "get_relations":
            relations = self.kb.get_relations(var)
            self.relations_seen[var.program] = set(relations)
            return ToolResult(f"Observation: [{', '.join(relations)}]")
        if name == "get_neighbors":
            relation = clip(args["relation"].strip(), 200)
            seen = self.relations_seen.get(var.program)
            if seen is None and not self.strict:  # AgentBench lists them itself when the agent has not
                seen = self.relations_seen[var.program] = set(self.kb.get_relations(var))
            if seen is None:
                raise ToolError(f"get_neighbors({ref}, {relation}): call get_relations({ref}) first; the relation "
                                "must be one it lists.")
            if relation not in seen:
                raise ToolError(f"{relation!r} is not a relation of {ref}. Its relations are: "
                                f"[{', '.join(sorted(seen))}].")
            return ToolResult(self._new(self.kb.get_neighbors(var, relation)))
        if name == "get_attributes":
            attributes = self.kb.get_attributes(var)
            self.attributes_seen[var.program] = set(attributes)
            return ToolResult(f"Observation: [{', '.join(attributes)}]")
        if name in ("argmax", "argmin"):
            attribute = clip(args["attribute"].strip(), 200)
            seen = self.attributes_seen.get(var.program)
            if seen is None and not self.strict:
                seen = self.attributes_seen[var.program] = set(self.kb.get_attributes(var))
            if seen is None:
                raise ToolError(f"{name}({ref}, {attribute}): call get_attributes({ref}) first; the attribute "
                                "must be one it lists.")
            if attribute not in seen:
                raise ToolError(f"{attribute!r} is not an attribute of {ref}. Its attributes are: "
                                f"[{', '.join(sorted(seen))}].")
            return ToolResult(self._new(self.kb.arg_extreme(var, attribute, largest=name == "argmax")))
        if name == "count":
            return ToolResult(self._new(self.kb.count(var)))
        raise ToolError(f"Unknown tool {name!r}.")  # the host checks names first; kept for direct callers

    # ------------------------------------------------------------------ the answer
    def reply(self, content: str) -> ToolResult:
        content = content.split("Observation:")[0].replace("\\_", "_")  # as AgentBench reads it
        found = FINAL_ANSWER.findall(content)
        if not found:
            raise ToolError("No valid function call and no final answer found. Call one of the tools, or answer "
                            "with 'Final Answer: #id'.")
        k = int(found[0])
        if k >= len(self.variables):
            # AgentBench ends the sample here (AGENT_VALIDATION_FAILED)
            return ToolResult(content=f"Invalid variable id #{k}: only {len(self.variables)} variable(s) exist.",
                              finish=True, reward=0.0, status=EpisodeStatus.INVALID_ACTION,
                              metrics={"f1": 0.0, "em": 0.0})
        predicted, expected = self.variables[k].answer(), gold(self.task)
        em = float(predicted == expected)
        return ToolResult(content=f"Answer #{k} submitted.", finish=True, reward=em, status=EpisodeStatus.COMPLETED,
                          metrics={"f1": f1(predicted, expected), "em": em, "answer_size": float(len(predicted))})

    # ------------------------------------------------------------------ oracle
    def oracle_call(self) -> ToolCall:
        """The next step of the task's program from the episode's current state (re-plans around any
        variables already made, so it also finishes episodes that another policy started). An AgentBench
        question has no program: its recorded ``actions`` are replayed, from a fresh episode."""
        names = {mid: name for name, mid in self.task["entities"].items()}
        if "program" not in self.task:
            actions = self.task.get("actions") or []
            if self.calls < len(actions):
                return parse_action(actions[self.calls], names)
            return ToolCall(name="", arguments={}, content=f"Final Answer: #{len(self.variables) - 1}")
        made = {v.program: i for i, v in enumerate(self.variables)}

        def plan(p: list[Any]) -> tuple[str, ToolCall | None]:
            op = p[0]
            if op == "ent":
                return names[p[1]], None
            if (k := made.get(s_expression(p))) is not None:
                return f"#{k}", None
            if op == "and":
                a, call = plan(p[1])
                if call:
                    return "", call
                b, call = plan(p[2])
                return "", call or ToolCall("intersection", {"variable1": a, "variable2": b})
            ref, call = plan(p[2] if op == "join" else p[1])
            if call:
                return "", call
            sub = s_expression(p[2] if op == "join" else p[1])
            if op == "join":
                if p[1] not in self.relations_seen.get(sub, ()):
                    return "", ToolCall("get_relations", {"variable": ref})
                return "", ToolCall("get_neighbors", {"variable": ref, "relation": p[1]})
            if op in ("argmax", "argmin"):
                if p[2] not in self.attributes_seen.get(sub, ()):
                    return "", ToolCall("get_attributes", {"variable": ref})
                return "", ToolCall(op, {"variable": ref, "attribute": p[2]})
            return "", ToolCall("count", {"variable": ref})

        ref, call = plan(self.task["program"])
        return call or ToolCall(name="", arguments={}, content=f"Final Answer: {ref}")


ACTION = re.compile(r"\s*(\w+)\((.*)\)\s*", re.S)


def parse_action(action: str, names: dict[str, str]) -> ToolCall:
    """``get_neighbors(m.09rl290,media_common.quotation.author)`` (AgentBench's recorded actions) as a call,
    entity ids given by their names in the question, as an agent gives them."""
    m = ACTION.fullmatch(action)
    if m is None:
        raise ValueError(f"not an action: {action!r}")
    tool = next((t["function"] for t in TOOLS if t["function"]["name"] == m.group(1)), None)
    if tool is None:
        raise ValueError(f"unknown tool in action {action!r}")
    values = [v.strip() for v in m.group(2).split(",")]
    params = list(tool["parameters"]["properties"])
    if len(values) != len(params):
        raise ValueError(f"action {action!r}: {tool['name']} takes {', '.join(params)}")
    return ToolCall(tool["name"], {k: names.get(v, v) for k, v in zip(params, values, strict=True)})


ONE_SHOT_PATH = Path(__file__).with_name("one_shot.json")


AGENTBENCH_ONE_SHOT_PATH = Path(__file__).with_name("agentbench_one_shot.json")


def one_shot_example() -> list[dict[str, Any]]:
    """The example conversation of ``env.kg.one_shot`` for generated questions: a question of the project's own
    graph solved with the tools (``python -m services.envs.kg one-shot`` writes it), in chat format, as
    AgentBench's ONE_SHOT."""
    return json.loads(ONE_SHOT_PATH.read_text(encoding="utf-8"))


def agentbench_one_shot() -> list[dict[str, Any]]:
    """AgentBench's own ONE_SHOT conversation (a Freebase question, Apache-2.0, kept as published with its
    source named in the file), for AgentBench's questions (split ``dev``): the opening its std split shows."""
    return json.loads(AGENTBENCH_ONE_SHOT_PATH.read_text(encoding="utf-8"))["messages"]


def record_example(env: KGEnv, task_id: str, split: str = "train") -> list[dict[str, Any]]:
    """Play the oracle on one question and keep the conversation (user question, assistant tool calls with
    a one-line thought, tool observations, the final answer)."""
    episode = env.open(task_id, split, 0)
    entities = ", ".join(episode.task["entities"])
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"{episode.task['question']}\nEntities: [{entities}]"}]
    for turn in range(episode.max_turns):
        call = episode.oracle_call()
        if not call.name:
            messages.append({"role": "assistant", "content": f"Thought: this variable answers the question.\n"
                                                             f"{call.content}"})
            if episode.reply(call.content).reward != 1.0:
                raise RuntimeError(f"the oracle's answer to {task_id} is not graded right")
            return messages
        thought = {"get_relations": "I look at the relations of {variable} to find the one to follow.",
                   "get_neighbors": "I follow {relation} from {variable}.",
                   "intersection": "The answer must be in both {variable1} and {variable2}.",
                   "get_attributes": "I look at the numerical attributes of {variable}.",
                   "argmax": "I take the member of {variable} with the largest {attribute}.",
                   "argmin": "I take the member of {variable} with the smallest {attribute}.",
                   "count": "I count the members of {variable}."}[call.name].format(**call.arguments)
        call_id = f"call_{turn}"
        messages.append({"role": "assistant", "content": f"Thought: {thought}", "tool_calls": [{
            "id": call_id, "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": episode.call(call).content})
    raise RuntimeError(f"the oracle did not answer {task_id} within {episode.max_turns} rounds")


def random_call(episode: KGEpisode, rng: random.Random) -> ToolCall:
    """A random but well-formed move, the floor a trained agent must beat: any tool, its arguments drawn
    from what the episode has shown so far (entities, variables, listed relations and attributes), or
    a final answer naming a random variable."""
    refs = list(episode.task["entities"]) + [f"#{k}" for k in range(len(episode.variables))]
    sets = [f"#{k}" for k, v in enumerate(episode.variables) if not v.is_number]
    choices = ["get_relations", "get_neighbors"] + (["intersection", "get_attributes", "argmax", "argmin", "count",
                                                    "answer"] if sets else [])
    tool = rng.choice(choices)
    if tool == "answer":
        return ToolCall(name="", arguments={}, content=f"Final Answer: #{rng.randrange(len(episode.variables))}")
    if tool == "intersection":
        return ToolCall(tool, {"variable1": rng.choice(sets), "variable2": rng.choice(sets)})
    ref = rng.choice(sets if tool in ("get_attributes", "argmax", "argmin", "count") else refs)
    try:
        program = episode.resolve(ref).program
    except ToolError:
        program = ""
    if tool == "get_neighbors":
        listed = sorted(episode.relations_seen.get(program, ())) or sorted(episode.kb.relations_vocab)
        return ToolCall(tool, {"variable": ref, "relation": rng.choice(listed)})
    if tool in ("argmax", "argmin"):
        listed = sorted(episode.attributes_seen.get(program, ())) or sorted(episode.kb.attributes_vocab)
        return ToolCall(tool, {"variable": ref, "attribute": rng.choice(listed)})
    return ToolCall(tool, {"variable": ref})


def play(episode: KGEpisode, policy: Any) -> ToolResult:
    """Run one episode in-process with ``policy(episode) -> ToolCall`` (the host's loop, minus NATS)."""
    result = ToolResult(content="")
    for _ in range(episode.max_turns):
        call = policy(episode)
        try:
            result = episode.call(call) if call.name else episode.reply(call.content)
        except ToolError as exc:
            result = ToolResult(content=f"Error: {exc}")
        if result.finish:
            return result
    return episode.limit_reached()


class KGEnv(TaskEnv):
    name = "kg"

    def __init__(self, cfg: EnvConfig, graph: Graph | None = None) -> None:
        t0 = time.perf_counter()
        self.cfg = cfg
        if graph is None and cfg.kg.ntriples:  # the user's Freebase graph: their questions, no generated ones
            from services.envs.kg.ntriples import open_ntriples

            graph = open_ntriples(cfg.kg.ntriples, cfg.data_dir)
        self.graph = graph or open_graph(cfg.data_dir)
        self.kb = KB(self.graph, result_cap=cfg.kg.result_cap, timeout_s=cfg.kg.query_timeout_s)
        generated = not cfg.kg.ntriples
        self.tasks = {"train": self._task_set("train", cfg.num_train_tasks) if generated else [],
                      "test": self._task_set("test", cfg.num_test_tasks) if generated else []}
        if cfg.kg.agentbench_file:
            self.tasks["dev"] = load_agentbench(Path(cfg.kg.agentbench_file).expanduser())
        self.by_id = {split: {t["qid"]: t for t in tasks} for split, tasks in self.tasks.items()}
        # generated questions get an example of our graph; AgentBench's questions (dev) the example it publishes
        self.examples = {"train": one_shot_example(), "test": one_shot_example(),
                         "dev": agentbench_one_shot()} if cfg.kg.one_shot else {}
        log.info("kg_env_ready", triples=self.graph.meta["triples"], train=len(self.tasks["train"]),
                 test=len(self.tasks["test"]), load_s=round(time.perf_counter() - t0, 2))

    def _task_set(self, split: str, size: int) -> list[dict[str, Any]]:
        """``size`` questions, a third per level, generated once per (graph, generator, split, size,
        seed) and cached beside the graph."""
        seed = self.cfg.kg.seed
        path = self.graph.path / f"tasks-g{GENERATOR_VERSION}-{split}-{size}-s{seed}.json"
        if path.is_file():
            return load_agentbench(path)
        # the generator must not trip over a per-call deadline meant for agents on a busy machine
        gen_kb = KB(self.graph, result_cap=self.kb.result_cap, timeout_s=max(30.0, self.kb.timeout_s))
        tasks = generate(gen_kb, split, size, seed)
        fd, tmp = tempfile.mkstemp(dir=self.graph.path, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(tasks, fh, ensure_ascii=False)
        os.replace(tmp, path)
        return tasks

    def task_ids(self, split: str) -> list[str]:
        keep = set(self.cfg.kg.levels)
        return [t["qid"] for t in self.tasks.get(split, []) if not keep or t.get("level") in keep]

    def task_level(self, task_id: str, split: str) -> TaskLevel:
        task = self.by_id[split][task_id]
        kind = str(task.get("s_expression") or "").lstrip("(").split(" ")[0].lower()  # its outermost operator
        return TaskLevel(int(task.get("level") or 0), kind)

    def open(self, task_id: str, split: str, seed: int) -> KGEpisode:
        task = self.by_id[split][task_id]  # KeyError -> 404 in the host
        return KGEpisode(self.kb, task, strict=self.cfg.kg.strict_prerequisites, example=self.examples.get(split))

    def oracle(self, episode: Episode) -> ToolCall:
        assert isinstance(episode, KGEpisode)
        return episode.oracle_call()


Config = KGTaskConfig
"""[env.kg]: the settings the task registry (shared/tasks.py) reads and checks."""


def make_env(cfg: EnvConfig) -> KGEnv:
    return KGEnv(cfg)


__all__ = ["Config", "KGEnv", "KGEpisode", "TOOLS", "f1", "make_env", "play", "random_call"]
