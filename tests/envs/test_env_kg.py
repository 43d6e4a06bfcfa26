"""KG env on the real pyoxigraph store: graph facts, the seven tools, generated questions, oracle and
random baselines, bad actions and limits, and the env served over NATS end to end.

The graph is built once into the shared cache (~15-30 s cold on 2 cores, then opened in well under a second);
every test here shares one small env (12 train / 6 test questions).
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import uuid
from pathlib import Path

import pytest

from services.envs.base import ToolCall, ToolError
from services.envs.host import EnvHost
from services.envs.kg import TOOLS, KGEnv, play, random_call
from services.envs.kg.engine import KB, QueryLimit
from services.envs.kg.graph import NS, wordnet_available
from services.envs.kg.questions import (
    LEVELS,
    MAX_ANSWERS,
    execute,
    generate,
    gold,
    is_held_out,
    joins,
    load_agentbench,
    topics,
)
from shared.config import EnvConfig
from shared.envapi import EnvClient
from tests.envs.host_turns import HostSession, assistant_calls
from tests.procs import env_check


@pytest.fixture(scope="module")
def env() -> KGEnv:
    return KGEnv(EnvConfig(task="kg", num_train_tasks=12, num_test_tasks=6))


def find(env: KGEnv, name: str, type_: str) -> str:
    rows = list(env.graph.store.query(
        f'SELECT ?x WHERE {{ ?x <{NS}type.object.name> "{name}"@en . ?x <{NS}type.object.type> <{NS}{type_}> }}'))
    assert rows, f"{name} ({type_}) not in the graph"
    return rows[0][0].value[len(NS):]


def names(env: KGEnv, var) -> set[str]:
    return {env.kb.name(m) for m in var.entities}


# --------------------------------------------------------------------------------------------- graph
def test_graph_holds_real_geography_and_wordnet(env: KGEnv) -> None:
    meta = env.graph.meta
    assert meta["triples"] > 300_000 and meta["entities"] > 35_000
    france = env.kb.entity(find(env, "France", "location.country"))
    assert france.program.startswith("m.0") and "France" not in france.program  # opaque ids
    assert {"Germany", "Spain", "Italy", "Belgium"} <= names(env, env.kb.get_neighbors(
        france, "location.country.bordering_countries"))
    assert names(env, env.kb.get_neighbors(france, "location.country.capital")) == {"Paris"}
    assert "French" in names(env, env.kb.get_neighbors(france, "location.country.languages_spoken"))
    assert names(env, env.kb.get_neighbors(france, "location.country.currency_used")) == {"Euro"}
    assert "location.country.bordering_countries" in env.kb.get_relations(france)
    assert {"location.statistical_region.population", "location.location.area"} <= set(env.kb.get_attributes(france))
    # every stored edge has its reverse, as Freebase's reverse properties
    europe = env.kb.entity(find(env, "Europe", "location.continent"))
    assert france.program in env.kb.get_neighbors(europe, "location.continent.countries").entities
    if not wordnet_available():
        pytest.skip("WordNet (Debian wordnet-base, `make setup-kg`) is not installed: geography only")
    def reach(name: str, relation: str) -> set[str]:  # a lemma names several synsets: follow them all
        ids = [r[0].value[len(NS):] for r in env.graph.store.query(
            f'SELECT ?x WHERE {{ ?x <{NS}type.object.name> "{name}"@en . ?x <{NS}type.object.type> '
            f'<{NS}wordnet.synset> }}')]
        return set().union(*(names(env, env.kb.get_neighbors(env.kb.entity(m), relation)) for m in ids))

    assert {"puppy", "toy dog", "hunting dog"} <= reach("dog", "wordnet.synset.hyponyms")
    assert {"accelerator", "car door", "bumper"} <= reach("car", "wordnet.synset.part_meronyms")
    assert "river" in reach("Nile", "wordnet.synset.instance_of")
    # the bridge: a country's WordNet sense, and back
    sense = env.kb.get_neighbors(france, "location.country.wordnet_synset")
    assert "European country" in names(env, env.kb.get_neighbors(sense, "wordnet.synset.instance_of"))
    assert env.kb.get_neighbors(sense, "wordnet.synset.country").entities == france.entities


def test_ontology_gives_every_relation_a_domain_range_and_reverse(env: KGEnv) -> None:
    onto = env.graph.ontology
    for name, spec in onto["relations"].items():
        back = onto["relations"][spec["reverse"]]
        assert back["reverse"] == name and (back["domain"], back["range"]) == (spec["range"], spec["domain"])
        preds = spec["pred"] if isinstance(spec["pred"], list) else [spec["pred"]]
        assert spec["domain"] in onto["types"] and spec["range"] in onto["types"] and all("{}" in p for p in preds)
    rows = list(env.graph.store.query(
        f"SELECT ?d ?r WHERE {{ <{NS}location.country.capital> <http://www.w3.org/2000/01/rdf-schema#domain> ?d ; "
        f"<http://www.w3.org/2000/01/rdf-schema#range> ?r }}"))
    assert [(d.value[len(NS):], r.value[len(NS):]) for d, r in rows] == [("location.country", "location.citytown")]
    assert all(set(a["domains"]) <= set(onto["types"]) for a in onto["attributes"].values())


def test_tools_compile_to_bounded_sparql(env: KGEnv) -> None:
    usa = env.kb.entity(find(env, "United States", "location.country"))
    with pytest.raises(QueryLimit, match="more than 1000 entities"):
        env.kb.get_neighbors(usa, "location.country.cities")  # ~3k cities: refused, not truncated
    slow = KB(env.graph, result_cap=10**6, timeout_s=0.0)
    with pytest.raises(QueryLimit, match="ran past 0s"):
        slow.get_neighbors(usa, "location.country.cities")
    # argmax / argmin / count / intersection on a known set
    france = env.kb.entity(find(env, "France", "location.country"))
    germany = env.kb.entity(find(env, "Germany", "location.country"))
    n_fr = env.kb.get_neighbors(france, "location.country.bordering_countries")
    n_de = env.kb.get_neighbors(germany, "location.country.bordering_countries")
    both = env.kb.intersection(n_fr, n_de)
    assert {"Belgium", "Luxembourg", "Switzerland"} <= names(env, both) and "Spain" not in names(env, both)
    assert env.kb.count(both).value == len(both.entities)
    assert names(env, env.kb.arg_extreme(n_fr, "location.statistical_region.population", largest=True)) == {"Germany"}
    assert names(env, env.kb.arg_extreme(n_fr, "location.location.area", largest=False)) == {"Monaco"}


# --------------------------------------------------------------------------------------------- questions
def test_generated_questions_have_agentbench_shape_and_disjoint_splits(env: KGEnv) -> None:
    train, test = env.tasks["train"], env.tasks["test"]
    assert len(train) == 12 and len(test) == 6
    assert collections.Counter(t["level"] for t in train) == {level: 4 for level in LEVELS}
    for split, tasks in (("train", train), ("test", test)):
        for task in tasks:
            assert joins(task["program"]) == task["level"] + 1  # level = hops: 2, 3 or 4 joins
            assert 1 <= len(task["entities"]) <= 2 and set(task["entities"].values()) == set(topics(task["program"]))
            assert 1 <= len(task["answer"]) <= MAX_ANSWERS
            assert execute(env.kb, task["program"]).answer() == gold(task)  # gold = executing the program
            assert any(is_held_out(m) for m in topics(task["program"])) == (split == "test")
            assert task["question"].rstrip("?.") and task["s_expression"].startswith("(")
    train_topics = {m for t in train for m in topics(t["program"])}
    assert not any(is_held_out(m) for m in train_topics)
    # deterministic: the same seed gives the same questions
    assert generate(env.kb, "train", 3, seed=7) == generate(env.kb, "train", 3, seed=7)


def test_agentbench_format_loads_both_ways(env: KGEnv, agentbench: Path) -> None:
    dev = load_agentbench(agentbench / "knowledgegraph" / "dev.json")
    assert len(dev) == 20 and all(item["entities"] and gold(item) for item in dev)
    shapes = collections.Counter(a.split("(")[0] for item in dev for a in item["actions"])
    assert set(shapes) <= {t["function"]["name"] for t in TOOLS}  # their actions use our seven tool names
    ours = load_agentbench(next(env.graph.path.glob("tasks-*-train-12-*.json")))
    assert set(ours[0]) >= set(dev[0]) - {"source"} | {"program"}


# --------------------------------------------------------------------------------------------- policies
def test_oracle_solves_every_task_and_random_policy_does_not(env: KGEnv) -> None:
    for split in ("train", "test"):
        for task_id in env.task_ids(split):
            result = play(env.open(task_id, split, 0), env.oracle)
            assert (result.reward, result.status, result.metrics["f1"]) == (1.0, "completed", 1.0), task_id
    rng = random.Random(0)
    wins = [play(env.open(t, "train", 0), lambda ep: random_call(ep, rng)).reward
            for _ in range(4) for t in env.task_ids("train")]
    assert sum(wins) / len(wins) < 0.05


def test_oracle_recovers_after_other_moves(env: KGEnv) -> None:
    episode = env.open(env.task_ids("train")[-1], "train", 0)
    rng = random.Random(1)
    for _ in range(3):  # a few random moves first: the oracle re-plans from the state it finds
        try:
            call = random_call(episode, rng)
            episode.call(call) if call.name else None
        except ToolError:
            pass
    assert play(episode, env.oracle).reward == 1.0


def test_replaying_the_action_log_on_a_new_replica_rebuilds_the_session(env: KGEnv) -> None:
    task_id = env.task_ids("test")[-1]
    first, log = env.open(task_id, "test", 0), []
    while (call := env.oracle(first)).name:
        log.append(call)
        first.call(call)
    answer = call.content
    fresh = KGEnv(EnvConfig(task="kg", num_train_tasks=12, num_test_tasks=6))  # another replica, same data
    second = fresh.open(task_id, "test", 0)
    for logged in log:
        second.call(logged)
    assert second.variables == first.variables and second.relations_seen == first.relations_seen
    assert second.reply(answer).reward == 1.0


def test_bad_calls_give_clear_errors_and_the_episode_goes_on(env: KGEnv) -> None:
    task = next(t for t in env.tasks["train"] if t["program"][0] in ("and", "join"))
    episode = env.open(task["qid"], "train", 0)
    entity = next(iter(task["entities"]))
    expect = [
        (ToolCall("get_relations", {"variable": "#4"}), "Variable #4 does not exist"),
        (ToolCall("get_relations", {"variable": "Atlantis"}), "neither a variable"),
        (ToolCall("get_neighbors", {"variable": entity, "relation": "people.person.spouse"}),
         "is not a relation of"),  # listed implicitly first, as AgentBench does
        (ToolCall("intersection", {"variable1": entity, "variable2": "#0"}), "two variables"),
        (ToolCall("argmax", {"variable": "#0", "attribute": "x"}), "does not exist"),
    ]
    for call, message in expect:
        with pytest.raises(ToolError, match=message):
            episode.call(call)
    relations = episode.call(ToolCall("get_relations", {"variable": entity})).content
    assert relations.startswith("Observation: [")
    with pytest.raises(ToolError, match="is not a relation of"):
        episode.call(ToolCall("get_neighbors", {"variable": entity, "relation": "people.person.spouse"}))
    with pytest.raises(ToolError, match="No valid function call"):
        episode.reply("I think the answer is Paris.")
    assert play(episode, env.oracle).reward == 1.0  # the episode still finishes correctly


# --------------------------------------------------------------------------------------------- served
async def test_served_over_nats_oracle_episodes_and_bad_actions(env: KGEnv, config, subjects, nc) -> None:
    config.env.task, config.env.max_observation_chars, config.env.action_timeout_s = "kg", 300, 5.0
    host = EnvHost(env, config.env, subjects, "kg-r1")
    service = await host.serve(nc, nc.jetstream())
    client = EnvClient(nc, subjects, "kg", timeout_s=20)
    try:
        async def oracle_episode(task_id: str, split: str) -> float:
            sid = uuid.uuid4().hex
            started = await client.start(sid, task_id, split)
            assert [t["function"]["name"] for t in started.tools] == [
                "get_relations", "get_neighbors", "intersection", "get_attributes", "argmax", "argmin", "count"]
            assert started.max_turns == 15 and "\nEntities: [" in started.messages[-1]["content"]
            for _ in range(started.max_turns):
                step = await client.interact(started.replica_id, sid, await client.oracle(started.replica_id, sid))
                if step.finish:
                    assert step.status == "completed" and step.metrics["f1"] == step.reward
                    return step.reward
            return 0.0

        ids = [(t, "train") for t in env.task_ids("train")[:8]] + [(t, "test") for t in env.task_ids("test")[:4]]
        assert await asyncio.gather(*(oracle_episode(t, s) for t, s in ids)) == [1.0] * len(ids)

        task = env.tasks["train"][0]
        entity = next(iter(task["entities"]))
        sid = uuid.uuid4().hex
        rid = (await client.start(sid, task["qid"], "train")).replica_id

        def call(name: str, args: object) -> dict:
            return {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}

        bad = [
            (call("union", {"variable1": "#0", "variable2": "#1"}), "Unknown tool"),
            (call("get_neighbors", {"variable": entity}), "missing argument"),
            (call("count", {"variable": 0}), "must be of type string"),
            (call("get_relations", {"variable": "#9"}), "Variable #9 does not exist"),
            ({"role": "assistant", "content": "Let me think."}, "No valid function call"),
            (call("get_relations", {"variable": entity, "extra": 1}), "unexpected argument"),
        ]
        for message, expect in bad:
            step = await client.interact(rid, sid, message)
            assert not step.finish and expect in step.messages[0]["content"], (expect, step.messages)
        # a huge neighbour set is refused with the limit stated (raw entity ids work as in AgentBench)
        usa = find(env, "United States", "location.country")
        step = await client.interact(rid, sid, call("get_relations", {"variable": usa}))
        assert "location.country.cities" in step.messages[0]["content"]
        step = await client.interact(rid, sid, call("get_neighbors", {"variable": usa,
                                                                      "relation": "location.country.cities"}))
        assert not step.finish and "more than 1000 entities" in step.messages[0]["content"]
        # a query past the SPARQL deadline: a clear observation, the session goes on
        env.kb.timeout_s, saved = 0.0, env.kb.timeout_s
        try:
            step = await client.interact(rid, sid, call("get_relations", {"variable": entity}))
        finally:
            env.kb.timeout_s = saved
        assert not step.finish and "ran past 0s and was stopped" in step.messages[0]["content"]
        # a huge argument is not echoed back whole; a long observation is cut, and says so
        step = await client.interact(rid, sid, call("get_neighbors", {"variable": entity, "relation": "a" * 10**5}))
        assert "more characters" in step.messages[0]["content"] and len(step.messages[0]["content"]) < 400
        config.env.max_observation_chars = 40
        step = await client.interact(rid, sid, call("get_relations", {"variable": entity}))
        assert step.messages[0]["content"].startswith("Observation: [") and "truncated" in step.messages[0]["content"]
        assert len(step.messages[0]["content"]) < 100
        step = await client.interact(rid, sid, {"role": "assistant", "content": "Final Answer: #7"})
        assert step.finish and step.status == "invalid_action" and step.reward == 0.0
        assert step.metrics["invalid_actions"] == 9.0  # 6 bad calls, the huge set, the deadline, the huge argument

        # the turn limit: 15 rounds without an answer end the episode
        sid = uuid.uuid4().hex
        await client.start(sid, task["qid"], "train")
        for turn in range(15):
            step = await client.interact(rid, sid, call("get_relations", {"variable": entity}))
            assert step.finish == (turn == 14)
        assert step.status == "task_limit_reached" and step.reward == 0.0

        assert await oracle_episode(env.task_ids("test")[-1], "test") == 1.0
        health = await client.health()
        assert health.sessions == 0 and health.task_counts == {"train": 12, "test": 6}
    finally:
        await host.shutdown()
        await service.stop()


def test_levels_and_kinds_of_questions(env: KGEnv) -> None:
    ids = env.task_ids("train")
    levels = {env.task_level(i, "train").level for i in ids}
    assert levels == {1, 2, 3}
    assert {env.task_level(i, "train").kind for i in ids} >= {"join", "count"}
    env.cfg.kg.levels = [1]
    try:
        easy = env.task_ids("train")
    finally:
        env.cfg.kg.levels = []
    assert easy and all(env.task_level(i, "train").level == 1 for i in easy) and len(easy) < len(ids)


# ------------------------------------------------------------------------ AgentBench's behaviour
ROCKETS = {  # a small Freebase-shaped graph: (mid, type, name, {relation: [objects]}, {attribute: value})
    "m.0gas": ("spaceflight.rocket_engine_cycle", "Gas-generator cycle",
               {"spaceflight.rocket_engine_cycle.rocket_engines": ["m.0rd107", "m.0merlin", "m.0rs27"]}, {}),
    "m.0stg": ("spaceflight.rocket_engine_cycle", "Staged combustion cycle",
               {"spaceflight.rocket_engine_cycle.rocket_engines": ["m.0rs25"]}, {}),
    "m.0ker": ("spaceflight.rocket_fuel", "Kerosene",
               {"spaceflight.rocket_fuel.engines": ["m.0merlin", "m.0rs27x"]}, {}),
    "m.0rd107": ("spaceflight.bipropellant_rocket_engine", "RD-107",
                 {"spaceflight.rocket_engine.designed_by": ["m.0ener"]}, {"spaceflight.rocket_engine.thrust": 1000.0}),
    "m.0merlin": ("spaceflight.bipropellant_rocket_engine", "Merlin",
                  {"spaceflight.rocket_engine.designed_by": ["m.0spx"]}, {"spaceflight.rocket_engine.thrust": 845.0}),
    "m.0rs27": ("spaceflight.bipropellant_rocket_engine", "RS-27",
                {"spaceflight.rocket_engine.designed_by": ["m.0rdyne"]}, {"spaceflight.rocket_engine.thrust": 1054.0}),
    "m.0rs27x": ("spaceflight.bipropellant_rocket_engine", "RS-27A",
                 {"spaceflight.rocket_engine.designed_by": ["m.0rdyne"]}, {"spaceflight.rocket_engine.thrust": 1054.2}),
    "m.0rs25": ("spaceflight.bipropellant_rocket_engine", "RS-25",
                {"spaceflight.rocket_engine.designed_by": ["m.0rdyne"]}, {"spaceflight.rocket_engine.thrust": 2279.0}),
    "m.0ener": ("spaceflight.rocket_engine_designer", "NPO Energomash", {}, {}),
    "m.0spx": ("spaceflight.rocket_engine_designer", "SpaceX", {}, {}),
    "m.0rdyne": ("spaceflight.rocket_engine_designer", "Rocketdyne", {}, {}),
}
ROCKET_QUESTIONS = [
    {"qid": "rockets-0", "question": "the bipropellant rocket engine with kerosene and gas-generator cycle is "
     "designed by who?", "entities": {"Gas-generator cycle": "m.0gas", "Kerosene": "m.0ker"},
     "s_expression": "(JOIN (R spaceflight.rocket_engine.designed_by) (AND (JOIN (R spaceflight.rocket_engine_cycle."
     "rocket_engines) m.0gas) (JOIN (R spaceflight.rocket_fuel.engines) m.0ker)))",
     "actions": ["get_relations(m.0gas)", "get_neighbors(m.0gas,spaceflight.rocket_engine_cycle.rocket_engines)",
                 "get_relations(m.0ker)", "get_neighbors(m.0ker,spaceflight.rocket_fuel.engines)",
                 "intersection(#0,#1)", "get_relations(#2)", "get_neighbors(#2,spaceflight.rocket_engine.designed_by)"],
     "answer": [{"answer_type": "Entity", "answer_argument": "m.0spx", "entity_name": "SpaceX"}]},
    {"qid": "rockets-1", "question": "which gas-generator cycle engine has the most thrust?",
     "entities": {"Gas-generator cycle": "m.0gas"},
     "actions": ["get_neighbors(m.0gas,spaceflight.rocket_engine_cycle.rocket_engines)",  # no get_relations:
                 "argmax(#0,spaceflight.rocket_engine.thrust)"],  # AgentBench lists them implicitly
     "answer": [{"answer_type": "Entity", "answer_argument": "m.0rs27", "entity_name": "RS-27"}]},
    {"qid": "rockets-2", "question": "how many rocket engines use the gas-generator "
     "cycle?", "entities": {"Gas-generator cycle": "m.0gas"},
     "actions": ["get_neighbors(m.0gas,spaceflight.rocket_engine_cycle.rocket_engines)", "count(#0)"],
     "answer": [{"answer_type": "Value", "answer_argument": "3"}]},
]


def write_rockets(path: Path) -> None:
    reverse = {"spaceflight.rocket_engine_cycle.rocket_engines": "spaceflight.rocket_engine.cycle",
               "spaceflight.rocket_fuel.engines": "spaceflight.bipropellant_rocket_engine.fuel",
               "spaceflight.rocket_engine.designed_by": "spaceflight.rocket_engine_designer.rocket_engines"}
    lines = []
    for mid, (type_, name, links, attrs) in ROCKETS.items():
        lines.append(f"<{NS}{mid}> <{NS}type.object.type> <{NS}{type_}> .")
        lines.append(f"<{NS}{mid}> <{NS}type.object.name> {json.dumps(name)}@en .")
        for rel, objects in links.items():
            for obj in objects:
                lines.append(f"<{NS}{mid}> <{NS}{rel}> <{NS}{obj}> .")
                lines.append(f"<{NS}{obj}> <{NS}{reverse[rel]}> <{NS}{mid}> .")
        for attr, value in attrs.items():
            lines.append(f'<{NS}{mid}> <{NS}{attr}> "{value}"^^<http://www.w3.org/2001/XMLSchema#float> .')
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_freebase_questions_on_a_user_ntriples_graph(tmp_path: Path) -> None:
    """env.kg.ntriples + env.kg.agentbench_file: AgentBench-format questions served on the user's graph,
    the recorded actions replayed by the oracle, AgentBench's implicit prerequisites, strict mode."""
    write_rockets(tmp_path / "rockets.nt")
    (tmp_path / "questions.json").write_text(json.dumps(ROCKET_QUESTIONS))
    cfg = EnvConfig(task="kg", data_dir=str(tmp_path / "data"), num_train_tasks=10, num_test_tasks=10)
    cfg.kg.ntriples, cfg.kg.agentbench_file = str(tmp_path / "rockets.nt"), str(tmp_path / "questions.json")
    env = KGEnv(cfg)
    assert env.task_ids("train") == env.task_ids("test") == [] and env.task_ids("dev") == ["rockets-0", "rockets-1",
                                                                                            "rockets-2"]
    assert env.graph.ontology["relations"]["spaceflight.rocket_engine.designed_by"]["range"] == \
        "spaceflight.rocket_engine_designer"
    assert list(env.graph.ontology["attributes"]) == ["spaceflight.rocket_engine.thrust"]
    for qid in env.task_ids("dev"):
        assert play(env.open(qid, "dev", 0), env.oracle).reward == 1.0, qid
    episode = env.open("rockets-0", "dev", 0)
    assert episode.call(ToolCall("get_relations", {"variable": "Kerosene"})).content == \
        "Observation: [spaceflight.rocket_fuel.engines]"
    assert episode.call(ToolCall("get_neighbors", {"variable": "Gas-generator cycle", "relation":
                        "spaceflight.rocket_engine_cycle.rocket_engines"})).content == \
        "Observation: variable #0, which are instances of spaceflight.bipropellant_rocket_engine"
    assert episode.reply("Final Answer: #0").reward == 0.0  # the engines, not their designer
    assert KGEnv(cfg).graph.path == env.graph.path  # loaded once, then reopened
    cfg.kg.strict_prerequisites = True
    strict = KGEnv(cfg).open("rockets-1", "dev", 0)
    with pytest.raises(ToolError, match="call get_relations"):
        strict.call(ToolCall("get_neighbors", {"variable": "Gas-generator cycle",
                                               "relation": "spaceflight.rocket_engine_cycle.rocket_engines"}))


def test_one_shot_example_is_a_solved_conversation_of_our_graph(env: KGEnv) -> None:
    """env.kg.one_shot puts services/envs/kg/one_shot.json between the system prompt and the question; the
    example's calls, replayed on our graph, give the observations it shows and end in a right answer."""
    from services.envs.kg import ONE_SHOT_PATH, one_shot_example
    from shared.chat import render_opening

    example = one_shot_example()
    cfg = EnvConfig(task="kg", num_train_tasks=12, num_test_tasks=6)
    cfg.kg.one_shot = True
    opening = KGEnv(cfg, graph=env.graph).open(env.task_ids("test")[0], "test", 0).opening()
    assert opening[1:-1] == example and opening[0]["role"] == "system" and opening[-1]["role"] == "user"
    text = render_opening(opening, TOOLS)
    assert "<tool_call>" in text and "<tool_response>" in text and text.count("<|im_start|>assistant") == \
        sum(m["role"] == "assistant" for m in example) + 1
    question = example[0]["content"].split("\nEntities: ")[0]
    task = next(t for t in env.tasks["train"] if t["question"] == question)
    episode = env.open(task["qid"], "train", 0)
    observations: list[str] = []
    for m in example[1:]:
        if m["role"] == "tool":
            assert observations[-1] == m["content"]  # the observation of the call just before
        elif m.get("tool_calls"):
            fn = m["tool_calls"][0]["function"]
            observations.append(episode.call(ToolCall(fn["name"], json.loads(fn["arguments"]))).content)
        else:
            assert episode.reply(m["content"]).reward == 1.0
    assert ONE_SHOT_PATH.is_file()


def test_an_agentbench_dev_question_on_a_freebase_slice(agentbench: Path, tmp_path: Path) -> None:
    """One of AgentBench's own dev questions (grailqa 4300563004000), served as published on the slice of
    Freebase it needs (written here from its s-expression and answer): its recorded actions reach the gold."""
    dev = load_agentbench(agentbench / "knowledgegraph" / "dev.json")
    question = next(q for q in dev if q["qid"] == "4300563004000_grailqa")
    triples = [("m.09rl290", "type.object.type", "media_common.quotation"),
               ("m.09rl290", "media_common.quotation.author", "m.0j50kb6"),
               ("m.0j50kb6", "type.object.type", "basketball.basketball_player"),
               ("m.0j50kb6", "media_common.quotation_author.quotations", "m.09rl290"),
               ("m.0j50kb6", "basketball.basketball_player.position_s", "m.05ch8k4"),
               ("m.05ch8k4", "type.object.type", "basketball.basketball_position"),
               ("m.05ch8k4", "basketball.basketball_position.players", "m.0j50kb6"),
               ("m.0bbc7k1", "type.object.type", "basketball.basketball_player"),  # another player, another
               ("m.0bbc7k1", "basketball.basketball_player.position_s", "m.02sf_r")]  # position
    lines = [f"<{NS}{s}> <{NS}{p}> <{NS}{o}> ." for s, p, o in triples]
    lines.append(f'<{NS}m.05ch8k4> <{NS}type.object.name> "Guard"@en .')
    (tmp_path / "slice.nt").write_text("\n".join(lines) + "\n")
    (tmp_path / "dev.json").write_text(json.dumps([question]))
    cfg = EnvConfig(task="kg", data_dir=str(tmp_path / "data"))
    cfg.kg.ntriples, cfg.kg.agentbench_file = str(tmp_path / "slice.nt"), str(tmp_path / "dev.json")
    env = KGEnv(cfg)
    episode = env.open(question["qid"], "dev", 0)
    assert episode.opening()[-1]["content"].startswith("what position did pat connaughton")
    result = play(episode, env.oracle)
    assert (result.reward, result.metrics["f1"]) == (1.0, 1.0) and episode.calls == len(question["actions"])


def test_agentbench_questions_open_with_agentbench_s_published_one_shot(env: KGEnv, tmp_path: Path) -> None:
    """env.kg.one_shot: AgentBench's own questions (split dev) open with the example AgentBench publishes
    (its ONE_SHOT, as published), generated ones with the example of our graph."""
    from services.envs.kg import agentbench_one_shot, one_shot_example

    (tmp_path / "questions.json").write_text(json.dumps(ROCKET_QUESTIONS))
    cfg = EnvConfig(task="kg", num_train_tasks=12, num_test_tasks=6)
    cfg.kg.one_shot, cfg.kg.agentbench_file = True, str(tmp_path / "questions.json")
    served = KGEnv(cfg, graph=env.graph)
    published = agentbench_one_shot()
    assert published[0]["content"].startswith("Question: the bipropellant rocket engine with kerosene and "
                                              "gas-generator cycle is designed by who?")
    assert published[-1]["content"].endswith("Final Answer: #3") and len(published) == 14
    dev = served.open("rockets-0", "dev", 0).opening()
    assert dev[1:-1] == published and dev[-1]["content"].startswith(ROCKET_QUESTIONS[0]["question"])
    assert served.open(env.task_ids("test")[0], "test", 0).opening()[1:-1] == one_shot_example()
    from shared.chat import render_opening

    text = render_opening(dev, TOOLS)
    assert text.count("<|im_start|>assistant") == sum(m["role"] == "assistant" for m in published) + 1


async def test_several_calls_in_one_message_all_run_in_order_as_agentbench(env: KGEnv) -> None:
    """AgentBench's KG task runs every call of a message in order, each answered: a later call may use the
    variable an earlier one of the same message made."""
    task = env.tasks["train"][0]
    entity = next(iter(task["entities"]))
    relation = env.open(task["qid"], "train", 0).call(ToolCall("get_relations", {"variable": entity})).content
    relation = relation.removeprefix("Observation: [").split(",")[0].rstrip("]")
    calls = [("get_relations", {"variable": entity}), ("get_neighbors", {"variable": entity, "relation": relation}),
             ("get_relations", {"variable": "#0"})]
    session = HostSession(env, EnvConfig(task="kg", num_train_tasks=12, num_test_tasks=6))
    try:
        await session.start(task["qid"], "train")
        step = await session.turn(assistant_calls(*calls[:2], ("no_such_tool", {}), calls[2]))
        assert [m["tool_call_id"] for m in step.messages] == ["c0", "c1", "c2", "c3"] and not step.finish
        assert "variable #0" in step.messages[1]["content"] and "no_such_tool" in step.messages[2]["content"]
        assert step.messages[3]["content"].startswith("Observation: [")
        assert step.metrics["turns"] == 1.0
    finally:
        await session.close()


def test_env_check_passes() -> None:
    """`jetrl env-check kg` on the generated graph (built once and cached, as the tests above use it)."""
    out = env_check("kg", "--env.num_train_tasks=6", "--env.num_test_tasks=3", timeout_s=600)
    assert "oracle test" in out and "env-check kg: 11 passed" in out
