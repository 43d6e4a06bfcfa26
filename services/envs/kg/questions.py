"""KG questions: sample programs in AgentBench's shape mix, execute them for gold, verbalise them.

A program is a nested list, the JSON twin of AgentBench's logic form::

    ["ent", mid] | ["join", relation, p] | ["and", p, q] | ["argmax" | "argmin", p, attribute] | ["count", p]

Sampling works backwards from an anchor entity (so the answer is never empty): a walk of k steps
along stored edges ends at a topic entity, and the reverse of each step, read forwards from the
topic, reaches a set that holds the anchor. Two walks from one anchor make an intersection.
Shapes follow AgentBench's KG mix (about 62 % intersection, 22 % argmax/argmin, 16 % count); the
level is the number of joins (level 1: 2 joins, 2: 3, 3: 4). A program is kept only if every step
stays within the result cap, the answer has 1..``MAX_ANSWERS`` members, each intersection branch
matters, and an argmax/argmin has a single winner.

Tasks are stored in AgentBench's own item format (qid, question, entities, answer, s_expression,
actions), plus ``program`` and ``level``; ``load_agentbench`` reads that format, ours or theirs.
Test questions are those whose topic entities include a held-out entity; train never uses one.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

from services.envs.base import ToolError
from services.envs.kg.engine import KB, Variable, iri, values
from services.envs.kg.graph import NAME, NS, TYPE
from shared.progress import Progress

GENERATOR_VERSION = 5
MAX_ANSWERS = 10
MAX_TRIES = 2000
LEVELS = (1, 2, 3)
SHAPES = {"intersection": 0.62, "argmax": 0.11, "argmin": 0.11, "count": 0.16}
HELD_OUT_PERCENT = 15
# how often each type is picked as an anchor; geography rejects more candidates (one branch often
# contains the other), so it is picked more to end up about even with WordNet
ANCHOR_TYPES = {"location.country": 6.0, "location.citytown": 4.0, "language.human_language": 2.0,
                "finance.currency": 1.0, "time.time_zone": 1.0, "location.administrative_division": 1.0,
                "location.geographic_region": 0.6, "location.continent": 0.4, "wordnet.synset": 5.0}


def is_held_out(mid: str) -> bool:
    """A fixed, hash-chosen share of entities appears as a topic only in test questions."""
    return int(hashlib.sha1(mid.encode()).hexdigest(), 16) % 100 < HELD_OUT_PERCENT


# --------------------------------------------------------------------------------------------- #
# Executing and describing programs
# --------------------------------------------------------------------------------------------- #
def execute(kb: KB, program: list[Any]) -> Variable:
    """Run a program with the tools' own semantics (so the oracle's replay reproduces the gold)."""
    op = program[0]
    if op == "ent":
        return kb.entity(program[1])
    if op == "join":
        return kb.get_neighbors(execute(kb, program[2]), program[1])
    if op == "and":
        return kb.intersection(execute(kb, program[1]), execute(kb, program[2]))
    if op in ("argmax", "argmin"):
        return kb.arg_extreme(execute(kb, program[1]), program[2], largest=op == "argmax")
    if op == "count":
        return kb.count(execute(kb, program[1]))
    raise ValueError(f"unknown program op {op!r}")


def s_expression(program: list[Any]) -> str:
    op = program[0]
    if op == "ent":
        return program[1]
    if op == "join":
        return f"(JOIN (R {program[1]}) {s_expression(program[2])})"
    if op == "and":
        return f"(AND {s_expression(program[1])} {s_expression(program[2])})"
    if op in ("argmax", "argmin"):
        return f"({op.upper()} {s_expression(program[1])} {program[2]})"
    return f"(COUNT {s_expression(program[1])})"


def topics(program: list[Any]) -> list[str]:
    if program[0] == "ent":
        return [program[1]]
    return [m for p in program[1:] if isinstance(p, list) for m in topics(p)]


def joins(program: list[Any]) -> int:
    own = 1 if program[0] == "join" else 0
    return own + sum(joins(p) for p in program[1:] if isinstance(p, list))


def describe(program: list[Any], ontology: dict[str, Any], names: dict[str, str],
             rng: random.Random | None = None) -> str:
    """A noun phrase for the set a program denotes, e.g. 'languages that are spoken in the
    countries that border France'. A relation with several phrasings gets one drawn from ``rng``."""
    op = program[0]
    if op == "join":
        spec = ontology["relations"][program[1]]
        return f"{spec['noun']} {phrase(spec, rng).format(subject(program[2], ontology, names, rng))}"
    if op == "and":
        a, b = program[1], program[2]
        spec_b = ontology["relations"][b[1]]
        return (f"{describe(a, ontology, names, rng)} and "
                f"{phrase(spec_b, rng).format(subject(b[2], ontology, names, rng))}")
    raise ValueError(f"cannot describe {op}")


def phrase(spec: dict[str, Any], rng: random.Random | None) -> str:
    preds = spec["pred"] if isinstance(spec["pred"], list) else [spec["pred"]]
    return rng.choice(preds) if rng is not None else preds[0]


def subject(program: list[Any], ontology: dict[str, Any], names: dict[str, str],
            rng: random.Random | None = None) -> str:
    return names[program[1]] if program[0] == "ent" else "the " + describe(program, ontology, names, rng)


TEMPLATES = {
    "set": ["What are the {d}?", "Name the {d}.", "Which are the {d}?", "Find all {d}.", "List the {d}.",
            "Identify the {d}."],
    "count": ["How many {d} are there?", "What is the number of {d}?", "Count the {d}.",
              "Give the number of {d}."],
    "extreme": ["Which of the {d} {phrase}?", "Among the {d}, which one {phrase}?", "What is the {adj} of the {d}?",
                "Find the {adj} of the {d}."],
}


def verbalise(program: list[Any], ontology: dict[str, Any], names: dict[str, str], rng: random.Random) -> str:
    op = program[0]
    if op == "count":
        text = rng.choice(TEMPLATES["count"]).format(d=describe(program[1], ontology, names, rng))
    elif op in ("argmax", "argmin"):
        attr = ontology["attributes"][program[2]]
        key = "max" if op == "argmax" else "min"
        text = rng.choice(TEMPLATES["extreme"]).format(d=describe(program[1], ontology, names, rng),
                                                       phrase=attr[key], adj=attr[f"adj_{key}"])
    else:
        text = rng.choice(TEMPLATES["set"]).format(d=describe(program, ontology, names, rng))
    return text[0].upper() + text[1:]


def actions(program: list[Any], names: dict[str, str]) -> list[str]:
    """The oracle's calls in AgentBench's ``actions`` notation (e.g. ``get_neighbors(France,r)``)."""
    out: list[str] = []

    def go(p: list[Any]) -> str:
        op = p[0]
        if op == "ent":
            return names[p[1]]
        if op == "join":
            ref = go(p[2])
            out.extend([f"get_relations({ref})", f"get_neighbors({ref},{p[1]})"])
        elif op == "and":
            a, b = go(p[1]), go(p[2])
            out.append(f"intersection({a},{b})")
        elif op in ("argmax", "argmin"):
            ref = go(p[1])
            out.extend([f"get_attributes({ref})", f"{op}({ref},{p[2]})"])
        else:
            out.append(f"count({go(p[1])})")
        return f"#{sum(1 for a in out if not a.startswith(('get_relations', 'get_attributes'))) - 1}"

    go(program)
    return out


# --------------------------------------------------------------------------------------------- #
# Sampling
# --------------------------------------------------------------------------------------------- #
class Sampler:
    def __init__(self, kb: KB) -> None:
        self.kb = kb
        self.ontology = kb.graph.ontology
        self.by_type: dict[str, list[str]] = {}
        for type_ in ANCHOR_TYPES:
            q = f"SELECT ?x WHERE {{ ?x {iri(TYPE)} {iri(type_)} }}"
            self.by_type[type_] = sorted(kb.select(q, "entities of a type", cap=10**7))
        self.anchor_types = [t for t in ANCHOR_TYPES if self.by_type[t]]
        self.names: dict[str, str] = {}
        self._degrees: dict[str, dict[str, int]] = {}
        self._neighbours: dict[tuple[str, str], list[str]] = {}

    def relation_degrees(self, mid: str) -> dict[str, int]:
        """Out-relations of an entity and how many neighbours each reaches (one grouped query, cached:
        walks keep passing through the same hubs)."""
        if mid not in self._degrees:
            q = f"SELECT ?r (COUNT(?o) AS ?n) WHERE {{ {iri(mid)} ?r ?o . FILTER(isIRI(?o)) }} GROUP BY ?r"
            out = {}
            for row in self.kb.store.query(q):
                rel = row[0].value[len(NS):]
                if rel in self.kb.relations_vocab and "lexical_category" not in rel:  # skip 10k-wide hubs
                    out[rel] = int(row[1].value)
            self._degrees[mid] = dict(sorted(out.items()))
        return dict(self._degrees[mid])

    def neighbours(self, mid: str, rel: str) -> list[str]:
        key = (mid, rel)
        if key not in self._neighbours:
            q = f"SELECT ?o WHERE {{ {iri(mid)} {iri(rel)} ?o }} ORDER BY ?o"
            self._neighbours[key] = [row[0].value[len(NS):] for row in self.kb.store.query(q)]
        return self._neighbours[key]

    def step(self, mid: str, rng: random.Random, avoid: str | None = None,
             held: bool | None = None) -> tuple[str, str] | None:
        """A random relation of ``mid`` (uniform over relations, not edges) and a random neighbour;
        with ``held`` set, only a neighbour that is (or is not) a held-out entity will do."""
        degrees = self.relation_degrees(mid)
        degrees.pop(avoid, None)
        rels = list(degrees)
        rng.shuffle(rels)
        for rel in rels:
            if held is None:
                return rel, self.neighbours(mid, rel)[rng.randrange(degrees[rel])]
            fits = [n for n in self.neighbours(mid, rel) if is_held_out(n) == held]
            if fits:
                return rel, rng.choice(fits)
        return None

    def name(self, mid: str) -> str:
        if mid not in self.names:
            rows = list(self.kb.store.query(f"SELECT ?n WHERE {{ {iri(mid)} {iri(NAME)} ?n }}"))
            self.names[mid] = rows[0][0].value if rows else mid
        return self.names[mid]

    def walk(self, anchor: str, steps: int, rng: random.Random, held: bool | None = None,
             avoid_first: str | None = None) -> list[Any] | None:
        """A program of ``steps`` joins from some topic entity whose result holds ``anchor``; ``held``
        steers the last step so that the topic is (or is not) a held-out entity. A walk that runs into
        a dead end (a province has only its country) starts again, a few times."""
        for _ in range(8):
            cur, program_rels, came_by = anchor, [], avoid_first
            for i in range(steps):
                # going straight back along the edge just taken would teach nothing: avoid it
                picked = self.step(cur, rng, avoid=came_by, held=held if i == steps - 1 else None)
                if picked is None:
                    break
                rel, cur = picked
                came_by = self.ontology["relations"][rel]["reverse"]
                program_rels.append(came_by)
            else:
                program: list[Any] = ["ent", cur]
                for rel in reversed(program_rels):
                    program = ["join", rel, program]
                return program
        return None

    def sample(self, level: int, shape: str, split: str, rng: random.Random) -> list[Any] | None:
        """One candidate program of this shape with ``level + 1`` joins, or None. A test program has a
        held-out topic (its first walk ends on one); a train program has none."""
        first, second = (True, None) if split == "test" else (False, False)
        n_joins = level + 1
        if shape in ("argmax", "argmin"):
            types = [t for t in self.anchor_types if t in ("location.country", "location.citytown", "wordnet.synset")]
        else:
            types = self.anchor_types
        anchor_type = rng.choices(types, weights=[ANCHOR_TYPES[t] for t in types])[0]
        two_topics = shape == "intersection" or rng.random() < 0.4
        for _ in range(5):  # two branches need an anchor with two ways out (many WordNet leaves have one)
            anchor = rng.choice(self.by_type[anchor_type])
            if not two_topics or len(self.relation_degrees(anchor)) >= 2:
                break
        else:
            return None
        post = 1 if shape == "intersection" and n_joins >= 3 and rng.random() < 0.3 else 0
        if two_topics:
            left = rng.randint(1, n_joins - post - 1)
            a = self.walk(anchor, left, rng, held=first)
            if a is None:
                return None
            # the second branch leaves the anchor by another relation, or it mostly repeats the first
            first_step = self.ontology["relations"][a[1]]["reverse"]  # a's outermost join, walked backwards
            b = self.walk(anchor, n_joins - post - left, rng, held=second, avoid_first=first_step)
            if b is None or a == b:
                return None
            base: list[Any] = ["and", a, b]
        else:
            base = self.walk(anchor, n_joins, rng, held=first)
            if base is None:
                return None
        if post:
            degrees = self.relation_degrees(anchor)
            if not degrees:
                return None
            base = ["join", rng.choice(list(degrees)), base]
        if shape == "intersection":
            return base
        if shape == "count":
            return ["count", base]
        attrs = [a for a, spec in self.ontology["attributes"].items() if anchor_type in spec["domains"]]
        return [shape, base, rng.choice(attrs)]

    def check(self, program: list[Any]) -> Variable | None:
        """Execute; None if any step is too big or the answer is not a clean, well-posed one."""
        try:
            inner = next((p for p in (program, program[1], program[2] if program[0] == "join" else None)
                          if isinstance(p, list) and p and p[0] == "and"), None)
            if inner is not None:  # wherever the intersection sits (top, under a join, a count, an argmax)
                a, b = execute(self.kb, inner[1]), execute(self.kb, inner[2])
                both = a.entities & b.entities
                if not both or both == a.entities or both == b.entities:
                    return None  # an intersection that one branch alone answers is not one
            if program[0] in ("argmax", "argmin", "count"):
                base = execute(self.kb, program[1])
                if len(base.entities) < 2:
                    return None
                if program[0] != "count":
                    q = (f"SELECT DISTINCT ?x WHERE {{ VALUES ?x {{ {values(base.entities)} }} "
                         f"?x {iri(program[2])} ?v }} LIMIT 2")
                    if len(self.kb.select(q, "attribute holders")) < 2:
                        return None
            result = execute(self.kb, program)
        except ToolError:
            return None
        if result.is_number:
            return result if result.value and result.value >= 2 else None
        if not 1 <= len(result.entities) <= MAX_ANSWERS:
            return None
        if program[0] in ("argmax", "argmin") and len(result.entities) != 1:
            return None
        return result


def make_task(sampler: Sampler, program: list[Any], result: Variable, qid: str, level: int,
              rng: random.Random) -> dict[str, Any] | None:
    mids = list(dict.fromkeys(topics(program)))
    names = {m: sampler.name(m) for m in mids}
    if len(set(names.values())) != len(names):
        return None  # two topic entities with one name could not both be referred to by name
    answer = ([{"answer_argument": str(result.value), "answer_type": "Value"}] if result.is_number else
              [{"answer_argument": m, "answer_type": "Entity", "entity_name": sampler.name(m)}
               for m in sorted(result.entities)])
    return {"qid": qid, "question": verbalise(program, sampler.ontology, names, rng),
            "entities": {names[m]: m for m in mids}, "answer": answer, "s_expression": s_expression(program),
            "actions": actions(program, names), "source": "jetrl-kg", "level": level, "program": program}


def shape_schedule(count: int, rng: random.Random) -> list[str]:
    """``count`` shapes in AgentBench's proportions (largest remainders), shuffled. Each slot is then
    sampled until a question of its shape sticks, so the mix holds exactly, not just on average."""
    quota = {k: int(w * count) for k, w in SHAPES.items()}
    for k in sorted(SHAPES, key=lambda k: SHAPES[k] * count - quota[k], reverse=True)[: count - sum(quota.values())]:
        quota[k] += 1
    shapes = [k for k, q in quota.items() for _ in range(q)]
    rng.shuffle(shapes)
    return shapes


def generate(kb: KB, split: str, size: int, seed: int) -> list[dict[str, Any]]:
    """``size`` questions of one split, a third per level, deterministic in (graph, seed, split)."""
    sampler = Sampler(kb)
    tasks: list[dict[str, Any]] = []
    seen: set[str] = set()
    bar = Progress(f"kg {split} questions", total=size, unit="questions")
    for n, level in enumerate(LEVELS):
        rng = random.Random(f"{seed}:{split}:{level}")
        count = size // len(LEVELS) + (n < size % len(LEVELS))
        for i, shape in enumerate(shape_schedule(count, rng)):
            for _ in range(MAX_TRIES):
                program = sampler.sample(level, shape, split, rng)
                if program is None:
                    continue
                if (split == "test") != any(is_held_out(m) for m in topics(program)):
                    continue
                key = json.dumps(program)
                if key in seen:
                    continue
                result = sampler.check(program)
                if result is None:
                    continue
                task = make_task(sampler, program, result, f"{split}-{level}-{i:04d}", level, rng)
                if task is not None:
                    seen.add(key)
                    tasks.append(task)
                    bar.update()
                    break
            else:
                bar.close("failed")
                raise RuntimeError(f"no {shape} question of level {level} after {MAX_TRIES} tries")
    bar.close()
    return tasks


def load_agentbench(path: Path) -> list[dict[str, Any]]:
    """Questions in AgentBench's KG format (a JSON list of items with qid, question, entities, answer,
    s_expression, actions), as AgentBench's ``dev.json`` and our own cached task files are."""
    items = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(items, list):
        raise ValueError(f"{path}: expected a JSON list of questions")
    for item in items:
        missing = [k for k in ("qid", "question", "entities", "answer") if k not in item]
        if missing:
            raise ValueError(f"{path}: question {item.get('qid', '?')} lacks {', '.join(missing)}")
    return items


def gold(task: dict[str, Any]) -> set[str]:
    return {a["answer_argument"] for a in task["answer"]}
