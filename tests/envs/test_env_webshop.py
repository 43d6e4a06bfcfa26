"""WebShop-like env: WebShop's reward by hand, the generated catalogue and its BM25 search, the page flow
and buttons, frozen splits, oracle vs random, replay, and the env served over NATS with bad actions."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from services.envs.base import ToolCall, ToolError
from services.envs.host import EnvHost
from services.envs.webshop import NUM_TEST_GOALS, WebShopEnv, make_env
from services.envs.webshop.catalog import Catalog, build, catalog_path, generate, query_terms
from services.envs.webshop.goals import DIFFICULTIES, normalize_color, option_matches, reward, title_nouns
from services.envs.webshop.shop import ShopEpisode
from shared.config import EnvConfig
from shared.envapi import EnvClient, EnvError
from tests.procs import env_check

# sha256 of the test split (ids, instructions, targets, attributes, options, price bounds). It changes
# only when the generator or the goal sampler changes: then the split is no longer the frozen one.
TEST_SPLIT_DIGEST = "8ec1667bbb8df457"


def search(keywords: str) -> ToolCall:
    return ToolCall("search_action", {"keywords": keywords})


def click(value: str) -> ToolCall:
    return ToolCall("click_action", {"value": value})


@pytest.fixture(scope="module")
def env():
    e = make_env(EnvConfig(num_train_tasks=100))  # the default 52k catalogue, built once and cached
    yield e
    e.close()


def play(env: WebShopEnv, task_id: str, split: str, policy) -> tuple[float, dict[str, float], list[ToolCall]]:
    ep = env.open(task_id, split, 0)
    log: list[ToolCall] = []
    for _ in range(ep.max_turns):
        call = policy(ep)
        log.append(call)
        try:
            result = ep.call(call)
        except ToolError:
            continue
        if result.finish:
            return result.reward, result.metrics, log
    return 0.0, {}, log


# ----------------------------------------------------------------------------------------------- #
# Reward: WebShop's formula on hand-made products
# ----------------------------------------------------------------------------------------------- #
PRODUCT = {
    "asin": "B0TEST0001", "query": "shampoo", "price": 18.99,
    "product_category": "Beauty & Personal Care › Hair Care › Shampoo & Conditioner › Shampoos",
    "title": "Lumora Salon Grade Shampoo, Sulfate Free, Tea Tree - 8 Fl Oz",
    "attributes": ["sulfate free", "tea tree", "dry hair", "paraben free"],
    "bullets": ["SULFATE FREE: gentle.", "DRY HAIR: restores.", "PARABEN FREE - clean."],
    "description": "The Lumora shampoo brings together sulfate free, tea tree and dry hair.",
    "options": {"size": ["8 fl oz", "16.9 fl oz"], "scent": ["lavender", "citrus"]},
}
GOAL = {"query": "shampoo", "name": PRODUCT["title"], "product_category": PRODUCT["product_category"],
        "attributes": ["sulfate-free", "dry hair"], "goal_options": {"size": "16.9 fl oz", "scent": "lavender"},
        "price_upper": 30.0}


def test_reward_follows_webshop_formula() -> None:
    # everything matches: (2 attrs + 2 options + price) / (2 + 2 + 1) * r_type 1
    r, info = reward(PRODUCT, GOAL, {"size": "16.9 fl oz", "scent": "lavender"})
    assert r == 1.0 and info["r_type"] == 1.0
    # one option wrong and over the price bound: (2 + 1 + 0) / 5
    r, info = reward(dict(PRODUCT, price=31.0), GOAL, {"size": "8 fl oz", "scent": "lavender"})
    assert r == pytest.approx(3 / 5) and info["r_price"] == 0.0 and info["r_option"] == 0.5
    # an attribute found only in the description still counts (WebShop's substring fallback)
    goal = dict(GOAL, attributes=["brings together", "argan oil"], goal_options={})
    r, _ = reward(PRODUCT, goal, {})
    assert r == pytest.approx((1 + 0 + 1) / (2 + 0 + 1))
    # a different kind of product: no shared nouns -> r_type 0 -> reward 0
    other = dict(PRODUCT, title="Vexa Leather Office Chair", query="office chair",
                 product_category="Home & Kitchen › Furniture › Home Office Furniture › Desk Chairs")
    r, info = reward(other, GOAL, {"size": "16.9 fl oz", "scent": "lavender"})
    assert info["r_type"] == 0.0 and r == 0.0
    # same category, few shared nouns: title_score <= 0.2 but category match -> r_type 1
    assert title_nouns(GOAL["name"]) == ["lumora", "shampoo", "sulfate", "tea", "tree", "fl", "oz"]
    cousin = dict(PRODUCT, title="Karia Repairing Conditioner with Coconut Oil", query="conditioner",
                  product_category="Beauty & Personal Care › Hair Care › Shampoo & Conditioner › Conditioners")
    _, info = reward(cousin, GOAL, {})
    assert info["title_score"] == 0.0 and info["r_type"] == 0.0  # no shared noun at all: WebShop says 0
    cousin["title"] = "Karia Shampoo and Conditioner Set"
    _, info = reward(cousin, GOAL, {})
    assert info["title_score"] == pytest.approx(1 / 7) and info["category_match"] and info["r_type"] == 1.0
    # title score in [0.1, 0.2] without query/category match -> 0.5
    cousin.update(query="x", product_category="A › B")
    _, info = reward(cousin, GOAL, {})
    assert info["r_type"] == 0.5


def test_option_matching_normalises_colours_and_is_fuzzy_like_webshop() -> None:
    assert normalize_color("dark navy blue") == "blue"  # WebShop's COLOR_SET order: blue before dark, navy
    assert option_matches(["navy blue"], ["royal blue"]) == 1  # both reduce to "blue"
    assert option_matches(["x-small"], ["small"]) == 1  # token-set ratio 100: WebShop's leniency, kept
    assert option_matches(["large"], ["small"]) == 0
    assert option_matches([], ["small"]) == 0


# ----------------------------------------------------------------------------------------------- #
# Catalogue and search
# ----------------------------------------------------------------------------------------------- #
def test_catalogue_is_deterministic_has_families_and_builds_once(tmp_path: Path) -> None:
    small = generate(400)
    assert [p.asin for p in small] == [p.asin for p in generate(400)]
    assert len({p.asin for p in generate(3000)}) == 3000
    assert {p.category for p in small} == {"beauty", "food", "fashion", "furniture", "electronics"}
    assert {p.role for p in small} == {"target", "attr_swap", "option_miss", "price_over", "type_swap"}
    # a prefix of a bigger catalogue is the smaller one (so test targets do not move with the size)
    assert [p.title for p in generate(1000)[:400]] == [p.title for p in small]
    fam = [p for p in small if p.family == 3]
    target = next(p for p in fam if p.role == "target")
    over = next(p for p in fam if p.role == "price_over")
    assert over.price > target.price + 30 and over.attributes == target.attributes

    path = catalog_path(str(tmp_path), 500)
    assert build(path, 500)["built"] and not build(path, 500)["built"]
    cat = Catalog(path)
    try:
        assert cat.num_products == 500
        p = cat.product(small[0].asin)
        assert p is not None and p["title"] == small[0].title and p["options"] == small[0].options
        assert cat.search(small[0].title)[0] == small[0].asin  # its own title ranks it first
    finally:
        cat.close()


def test_replicas_starting_together_build_the_catalogue_once(tmp_path: Path) -> None:
    code = ("import json, sys; from services.envs.webshop.catalog import build, catalog_path; "
            "print(json.dumps(build(catalog_path(sys.argv[1], 300), 300)))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[2]) for _ in range(3)]
    outs = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    assert sorted(o["built"] for o in outs) == [False, False, True]
    assert [p.name for p in (tmp_path / "webshop").glob("*.sqlite")] == [Path(outs[0]["path"]).name]
    cat = Catalog(Path(outs[0]["path"]))
    assert cat.num_products == 300
    cat.close()


def test_search_is_bm25_over_webshop_fields_and_survives_odd_queries(env) -> None:
    cat = env.catalog
    assert cat.num_products >= 50_000
    hits = cat.search("sulfate free shampoo")
    assert len(hits) == 50
    top = cat.product(hits[0])
    assert "shampoo" in top["title"].lower() and "sulfate free" in top["attributes"]
    assert cat.search("the and of a") == []  # stop words only: nothing, as Lucene
    assert query_terms("Sulfate-FREE shampoo, the best!!") == ["sulfate", "free", "shampoo", "best"]
    for odd in ['"unbalanced', "NEAR(a b", "shampoo*", "-x OR AND", "col:value", "'; DROP TABLE products; --",
                "\x00\n\t", "ß☃ 日本"]:
        assert isinstance(cat.search(odd), list)
    assert len(query_terms("w" * 10 + " x" * 10_000)) <= 32


# ----------------------------------------------------------------------------------------------- #
# Splits and goals
# ----------------------------------------------------------------------------------------------- #
def test_splits_are_frozen_disjoint_and_cover_three_levels(env) -> None:
    test_ids = env.task_ids("test")
    assert len(test_ids) == NUM_TEST_GOALS and len(env.task_ids("train")) == 300
    goals = [env.goal(t, "test") for t in test_ids]
    assert {g["difficulty"] for g in goals} == set(DIFFICULTIES)
    assert {g["category"] for g in goals} == {"beauty", "food", "fashion", "furniture", "electronics"}
    assert len({g["asin"] for g in goals}) == NUM_TEST_GOALS  # one distinct target each
    train_families = {env.catalog.product(env.goal(t, "train")["asin"])["family"] for t in env.task_ids("train")}
    test_families = {env.catalog.product(g["asin"])["family"] for g in goals}
    assert not train_families & test_families
    # difficulty shows in the goals: more attributes and options, hidden attributes for hard
    by = {d: [g for g in goals if g["difficulty"] == d] for d in DIFFICULTIES}
    assert all(len(g["attributes"]) == 1 for g in by["easy"]) and all(len(g["attributes"]) == 3 for g in by["hard"])
    assert sum(len(g["goal_options"]) for g in by["hard"]) > sum(len(g["goal_options"]) for g in by["easy"])
    assert len({g["instruction_text"].split(" a")[0] for g in goals}) > 5  # varied templates
    frozen = [(t, g["instruction_text"], g["asin"], g["attributes"], g["goal_options"], g["price_upper"])
              for t, g in zip(test_ids, goals, strict=True)]
    digest = hashlib.sha256(json.dumps(frozen).encode()).hexdigest()[:16]
    assert digest == TEST_SPLIT_DIGEST, digest
    with pytest.raises(KeyError):
        env.open("test-easy-99999", "test", 0)
    with pytest.raises(KeyError):
        env.open(test_ids[0], "train", 0)


# ----------------------------------------------------------------------------------------------- #
# Pages, buttons, oracle, random, replay
# ----------------------------------------------------------------------------------------------- #
def test_page_flow_and_buttons_are_webshops(env) -> None:
    ep = env.open(env.task_ids("test")[1], "test", 0)
    assert isinstance(ep, ShopEpisode)
    opening = ep.opening()
    assert opening[0]["role"] == "system" and "search_action" in opening[0]["content"]
    assert opening[1]["content"].startswith("The initial observation:\nWebShop [SEP] Instruction: [SEP] ")
    assert "{'has_search_bar': True, 'clickables': ['search']}" in opening[1]["content"]
    with pytest.raises(ToolError, match="call search_action"):
        ep.call(click("search"))
    with pytest.raises(ToolError, match="Empty search"):
        ep.call(search("   "))
    out = ep.call(search("wireless earbuds")).content
    assert out.startswith("Action: search[wireless earbuds]\n\nObservation:\nBack to Search [SEP] Page 1 "
                          "(Total results: 50) [SEP] Next > [SEP] ")
    assert ep.clickables()[:2] == ["back to search", "next >"] and len(ep.clickables()) == 12
    with pytest.raises(ToolError, match="no search bar"):
        ep.call(search("shampoo"))
    ep.call(click("Next >"))  # case does not matter, as in WebShop (it lowercases the argument)
    assert "Page 2 (Total results: 50) [SEP] < Prev [SEP] Next >" in ep.observation()
    ep.call(click("< prev"))
    assert ep.page_no == 1
    with pytest.raises(ToolError, match="not clickable"):
        ep.call(click("b0nonexist"))
    asin = ep.page_asins()[0]
    item = ep.call(click(asin.lower())).content
    product = env.catalog.product(asin)
    assert f"{product['title']} [SEP] Price: {product['price_tag']} [SEP] Rating: " in item
    assert item.split("Available Actions:")[0].rstrip().endswith("Description [SEP] Features [SEP] Reviews [SEP] Buy Now")
    name, values = next(iter(product["options"].items()))
    assert f"< Prev [SEP] {name} [SEP] {values[0]}" in item
    assert ep.clickables()[:6] == ["back to search", "< prev", "description", "features", "reviews", "buy now"]
    ep.call(click(values[-1]))
    assert ep.options == {name: values[-1]}
    assert product["bullets"][0] in ep.call(click("features")).content
    assert ep.clickables() == ["back to search", "< prev"]
    ep.call(click("< prev"))
    assert ep.page == "item" and ep.options == {name: values[-1]}  # back on the item, choice kept
    assert product["description"] in ep.call(click("description")).content
    ep.call(click("< prev"))
    assert "out of 5 stars" in ep.call(click("reviews")).content
    ep.call(click("< prev"))
    ep.call(click("< prev"))
    assert ep.page == "results" and ep.options == {}
    ep.call(click("back to search"))
    assert ep.page == "search" and ep.available_actions() == "{'has_search_bar': True, 'clickables': ['search']}"
    assert ep.call(search("zzzz qqqq")).content.count("Total results: 0") == 1  # nothing found: an empty page
    assert ep.clickables() == ["back to search"]


def test_oracle_solves_generated_goals_and_random_clicker_does_not(env) -> None:
    rng = random.Random(0)
    # a sample here; bench/bench_env_webshop.py plays all 200 test goals and 150 train goals
    ids = [(t, "test") for t in env.task_ids("test")[:60]] + [(t, "train") for t in rng.sample(env.task_ids("train"), 24)]
    oracle = [play(env, t, s, env.oracle) for t, s in ids]
    assert all(r == 1.0 for r, _, _ in oracle), [(t, r) for (t, _), (r, _, _) in zip(ids, oracle, strict=True) if r < 1]
    assert max(len(log) for _, _, log in oracle) <= 12

    def random_clicker(ep: ShopEpisode) -> ToolCall:
        if ep.page == "search":
            words = ep.goal["instruction_text"].split()
            return search(" ".join(rng.sample(words, 3)))
        return click(rng.choice(ep.clickables()))

    randoms = [play(env, t, s, random_clicker)[0] for t, s in ids]
    assert sum(randoms) / len(randoms) < 0.4 and sum(r == 1.0 for r in randoms) / len(randoms) < 0.2


def test_pages_fit_the_observation_limit(env) -> None:
    """A results or item page is never cut by the host at the webshop limit."""
    limit = EnvConfig().webshop.max_observation_chars
    longest = 0
    for t in env.task_ids("test")[::5]:
        ep = env.open(t, "test", 0)
        longest = max(longest, len(ep.call(search(env.goal(t, "test")["instruction_text"])).content))
        for asin in ep.page_asins()[:3]:
            longest = max(longest, len(ep.call(click(asin.lower())).content))
            ep.call(click("< prev"))
    assert 1000 < longest <= limit, longest


def test_wrong_purchases_lose_reward(env) -> None:
    goal_id = next(t for t in env.task_ids("test") if env.goal(t, "test")["goal_options"]
                   and env.goal(t, "test")["price_upper"] < 1e6)
    goal = env.goal(goal_id, "test")
    target = env.catalog.product(goal["asin"])
    family = {role: env.catalog.product(a) for role, a in env.catalog.family_asins(target["family"]).items()}
    assert family["target"] == target
    r_no_options, _ = reward(target, goal, {})
    r_over, info = reward(family["price_over"], goal, goal["goal_options"])
    assert r_no_options < 1.0 and r_over < 1.0 and info["r_price"] == 0.0
    if "option_miss" in family:  # none of the target's option values (where the pool had others)
        miss = family["option_miss"]
        # WebShop's fuzzy match takes "3x-large" for "x-large": pick values it does not confuse
        chosen = {k: next((v for v in vs if not option_matches([v], list(goal["goal_options"].values()))), vs[0])
                  for k, vs in miss["options"].items()}
        if len(chosen) and not option_matches(list(chosen.values()), list(goal["goal_options"].values())):
            assert reward(miss, goal, chosen)[0] < 1.0
    type_swap = family.get("type_swap")
    if type_swap is not None:
        assert reward(type_swap, goal, goal["goal_options"])[0] < 1.0
    # every bounded test goal has a look-alike over its price bound
    for g in (env.goal(t, "test") for t in env.task_ids("test")):
        if g["price_upper"] < 1e6:
            fam = env.catalog.family_asins(env.catalog.product(g["asin"])["family"])
            assert env.catalog.product(fam["price_over"])["price"] > g["price_upper"]


def test_replay_of_an_action_log_rebuilds_the_state(env) -> None:
    task_id = env.task_ids("test")[2]
    ep = env.open(task_id, "test", 0)
    log, seen = [], []
    for call in [search("zzz"), click("back to search")]:
        ep.call(call)
        log.append(call)
    while True:
        call = env.oracle(ep)
        if call.arguments.get("value") == "buy now":
            break
        seen.append(ep.call(call).content)
        log.append(call)
    fresh = make_env(EnvConfig(num_train_tasks=1))  # another replica: same catalogue file, same goals
    again = fresh.open(task_id, "test", 7)
    replayed = [again.call(c).content for c in log][2:]
    assert replayed == seen and again.options == ep.options and again.asin == ep.asin
    assert again.call(click("buy now")).reward == 1.0
    fresh.close()


# ----------------------------------------------------------------------------------------------- #
# Served over NATS
# ----------------------------------------------------------------------------------------------- #
async def test_served_over_nats_oracle_episodes_and_bad_actions(config, subjects, nc) -> None:
    config.env.num_train_tasks = 10
    env = make_env(config.env)
    assert config.env.task_value("webshop", "max_observation_chars") == config.env.webshop.max_observation_chars
    host = EnvHost(env, config.env, subjects, "webshop-r1")
    service = await host.serve(nc, nc.jetstream())
    client = EnvClient(nc, subjects, "webshop", timeout_s=20)
    try:
        async def oracle_episode(task_id: str, split: str) -> float:
            sid = uuid.uuid4().hex
            started = await client.start(sid, task_id, split)
            assert [t["function"]["name"] for t in started.tools] == ["search_action", "click_action"]
            assert started.max_turns == 20 and "Instruction:" in started.messages[-1]["content"]
            for _ in range(started.max_turns):
                step = await client.interact(started.replica_id, sid, await client.oracle(started.replica_id, sid))
                if step.finish:
                    assert step.status == "completed" and step.metrics["success"] == 1.0
                    return step.reward
            return 0.0

        ids = [(t, "train") for t in env.task_ids("train")[:6]] + [(t, "test") for t in env.task_ids("test")[:6]]
        assert await asyncio.gather(*(oracle_episode(t, s) for t, s in ids)) == [1.0] * len(ids)

        sid = uuid.uuid4().hex
        started = await client.start(sid, env.task_ids("test")[0], "test")
        rid = started.replica_id

        def call(name: str, args: object) -> dict:
            return {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}

        huge = "shampoo " * 20_000
        bad = [
            (call("buy_everything", {}), "Unknown tool"),
            (call("search_action", {"query": "x"}), "missing argument"),
            (call("click_action", {"value": 3}), "must be of type string"),
            ({"role": "assistant", "content": "I will search now."}, "No executable tool calls"),
            (call("click_action", {"value": "buy now"}), "not clickable"),
            (call("search_action", {"keywords": ""}), "Empty search"),
        ]
        for message, expect in bad:
            step = await client.interact(rid, sid, message)
            assert not step.finish and expect in step.messages[0]["content"], (expect, step.messages)
        # a huge search: the echo is cut and the page still comes back whole, within the limit
        step = await client.interact(rid, sid, call("search_action", {"keywords": huge}))
        content = step.messages[0]["content"]
        assert not step.finish and "Total results: 50" in content
        assert len(content) <= config.env.webshop.max_observation_chars
        # the same session still finishes normally, and the replica serves a new one
        step = await client.interact(rid, sid, call("click_action", {"value": "back to search"}))
        for _ in range(10):
            step = await client.interact(rid, sid, await client.oracle(rid, sid))
            if step.finish:
                break
        assert step.finish and step.status == "completed" and step.reward == 1.0
        assert step.metrics["invalid_actions"] == 6.0
        # a call past the time limit ends its episode (env_timeout): its search still runs in its thread,
        # and no later call may run beside it
        sid = uuid.uuid4().hex
        await client.start(sid, env.task_ids("test")[1], "test")
        config.env.action_timeout_s = 1e-6
        long_query = " ".join(env.goal(t, "test")["instruction_text"] for t in env.task_ids("test")[:4])
        step = await client.interact(rid, sid, call("search_action", {"keywords": long_query}))
        config.env.action_timeout_s = 10.0
        assert step.finish and step.status == "env_timeout" and "longer than" in step.messages[0]["content"]
        with pytest.raises(EnvError, match="404"):
            await client.interact(rid, sid, call("click_action", {"value": "back to search"}))
        await asyncio.sleep(0.5)  # the search lands, then the session is freed
        assert await oracle_episode(env.task_ids("test")[7], "test") == 1.0
        # the turn limit ends an episode with reward 0
        sid = uuid.uuid4().hex
        await client.start(sid, env.task_ids("test")[3], "test")
        steps = [await client.interact(rid, sid, call("click_action", {"value": "nothing"})) for _ in range(20)]
        assert not any(s.finish for s in steps[:-1])
        assert steps[-1].finish and steps[-1].status == "task_limit_reached" and steps[-1].reward == 0.0
        health = await client.health()
        assert health.sessions == 0 and health.task_counts == {"train": 30, "test": 200}
    finally:
        await host.shutdown()
        await service.stop()


def test_levels_are_goal_difficulties() -> None:
    catalog_env = make_env(EnvConfig(num_train_tasks=6))
    levels = {catalog_env.task_level(i, "train") for i in catalog_env.task_ids("train")}
    assert {(lv.level, lv.kind) for lv in levels} == {(1, "easy"), (2, "medium"), (3, "hard")}
    cfg = EnvConfig(num_train_tasks=6)
    cfg.webshop.levels = [1]
    easy = make_env(cfg)
    assert easy.task_ids("train") and all(easy.task_level(i, "train").kind == "easy" for i in easy.task_ids("train"))
    assert len(easy.task_ids("test")) < len(catalog_env.task_ids("test"))


def test_env_check_passes() -> None:
    """`jetrl env-check webshop` on the cached default catalogue."""
    out = env_check("webshop", "--env.num_train_tasks=6", "--env.num_test_tasks=3", timeout_s=600)
    assert "oracle test" in out and "env-check webshop: 11 passed" in out
