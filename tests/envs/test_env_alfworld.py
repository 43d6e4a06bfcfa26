"""ALFWorld env: generated games on the real ALFWorld engine, the expert oracle, a random baseline, bad
actions, engine failures, replay, and the env served over NATS end to end.

Builds (once, cached under ~/.cache/jetrl/data) a catalogue of one game per task type and split (the
expert's result recorded on each); the larger sweeps (200 games per task type, latency, memory) are in bench/bench_env_alfworld.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("alfworld", reason="the alfworld extra is not installed (pip install -e '.[alfworld]')")

from services.envs.alfworld_env import AlfworldEnv, agentbench_task_ids, engine, gen, make_env, snap  # noqa: E402
from services.envs.alfworld_env.config import AlfworldTaskConfig  # noqa: E402
from services.envs.alfworld_env.pool import EngineDied  # noqa: E402
from services.envs.base import ToolCall, ToolError  # noqa: E402
from services.envs.host import EnvHost  # noqa: E402
from shared.config import EnvConfig  # noqa: E402
from shared.envapi import EnvClient  # noqa: E402
from tests.envs.host_turns import HostSession, assistant_calls  # noqa: E402
from tests.procs import env_check  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def env() -> Iterator[AlfworldEnv]:
    cfg = EnvConfig(task="alfworld", num_train_tasks=1, num_test_tasks=1, max_sessions=6,
                    sections={"alfworld": AlfworldTaskConfig(pool_size=2, prefetch=0)})
    env = make_env(cfg)
    yield env
    env.close()


def won(env: AlfworldEnv, split: str) -> list[str]:
    """Catalogue games the handcoded expert wins within the round limit (the catalogue keeps the others too)."""
    return [t for t in env.task_ids(split) if env.catalogue[split]["expert"][t]["won"]]


def play(env: AlfworldEnv, task_id: str, split: str, policy: str, seed: int = 0) -> tuple[float, str, int]:
    """One episode in-process: (reward, status, rounds) for the oracle or a random admissible policy."""
    rng = random.Random(seed)
    episode = env.open(task_id, split, seed)
    try:
        for turn in range(1, episode.max_turns + 1):
            call = env.oracle(episode) if policy == "oracle" else \
                ToolCall("take_action", {"action": rng.choice(episode.last.admissible)})
            result = episode.call(call)
            if result.finish:
                return result.reward, result.status, turn
        return 0.0, "task_limit_reached", episode.max_turns
    finally:
        episode.close()


# --------------------------------------------------------------------------------------------- generator
def test_generator_is_deterministic_and_follows_alfred_rules() -> None:
    task_id = "pick_heat_then_place_in_recep-Egg-None-DiningTable-11/trial_2"
    a, b = gen.build_game(task_id), gen.build_game(task_id)
    assert a == b
    assert gen.build_game(task_id.replace("trial_2", "trial_3"))["problem"] != a["problem"]
    assert a["traj_data"]["pddl_params"]["object_target"] == "Egg" and "heat" in a["game"]["grammar"]
    assert "(heatable egg" in a["problem"].lower() and "(receptacletype microwave" in a["problem"].lower()
    for bad in ("pick_heat_then_place_in_recep-Egg-None-DiningTable-201/trial_0",  # no heating in living rooms
                "pick_and_place_simple-Egg-None-Toilet-11/trial_0",  # no toilet in a kitchen
                "fly_to_the_moon-Egg-None-Moon-11/trial_0", "garbage"):
        with pytest.raises((KeyError, ValueError)):
            gen.build_game(bad)
    tuples = [t for s in gen.all_scenes() for t in gen.valid_tuples(s)]
    assert len(gen.all_scenes()) == 120 and {t[0] for t in tuples} == set(gen.TASK_TYPES)
    assert len(tuples) > 5000
    for t in random.Random(0).sample(tuples, 400):  # every valid tuple makes a game
        assert gen.build_game(f"{gen.tuple_name(t)}/trial_0")["traj_data"]["task_type"] == t[0]


def test_agentbench_tuples_are_covered(agentbench: Path) -> None:
    """AgentBench's training games are (task type, object, receptacle, scene) tuples our generator builds."""
    ids = agentbench_task_ids(agentbench / "alfworld" / "train_valid.json")
    assert set(ids) == {"pick_and_place", "pick_clean_then_place", "pick_heat_then_place", "pick_cool_then_place",
                        "look_at_obj", "pick_two_obj"}
    valid = {t for s in gen.all_scenes() for t in gen.valid_tuples(s)}
    flat = [gen.parse_task_id(t)[0] for v in ids.values() for t in v]
    covered = sum(t in valid for t in flat) / len(flat)
    assert covered > 0.99, covered  # only ALFRED's sliced-object games are outside ALFWorld's task set
    assert not {t[3] for t in flat} & gen.TEST_SCENES  # AgentBench trains on none of the held-out scenes


def test_catalogue_splits_and_task_types(env: AlfworldEnv) -> None:
    for split in ("train", "test"):
        ids = env.task_ids(split)
        assert len(ids) == 6 and [env.task_info(t)["task_type"] for t in ids] == gen.TASK_TYPES
        assert {env.task_info(t)["split"] for t in ids} == {split}
    assert {env.task_info(t)["scene"] for t in env.task_ids("test")} <= gen.TEST_SCENES
    assert {env.task_info(t)["difficulty"] for t in env.task_ids("train")} == {1, 2, 3}
    with pytest.raises(KeyError):
        env.open(env.task_ids("test")[0], "train", 0)  # a test-scene game is not in the train split
    with pytest.raises(KeyError):
        env.open("pick_and_place_simple-Egg-None-Toilet-11/trial_0", "train", 0)


# --------------------------------------------------------------------------------------------- episodes
def test_oracle_wins_the_games_its_expert_run_won_and_random_policy_far_less(env: AlfworldEnv) -> None:
    """The catalogue no longer drops games the expert loses; the oracle (the same expert) wins exactly those
    the catalogue records as won."""
    games = [(t, "test") for t in env.task_ids("test")]  # one per task type; train games play elsewhere
    oracle, rand = [], []
    for i, (task_id, split) in enumerate(games):  # random right after oracle: the game is ready in the pool
        oracle.append(play(env, task_id, split, "oracle"))
        if i % 3 == 0:
            rand.append(play(env, task_id, split, "random", seed=i))
    expert = env.catalogue["test"]["expert"]
    assert [r for r, _, _ in oracle] == [float(expert[t]["won"]) for t, _ in games]
    assert all(n <= env.max_turns for _, _, n in oracle) and won(env, "test")
    assert sum(r for r, _, _ in rand) <= 1  # the 200-game sweep is in bench/bench_env_alfworld.py
    assert env.pool.stats["hits"] >= len(rand)


def test_opening_tools_and_observations_follow_agentbench(env: AlfworldEnv) -> None:
    episode = env.open(env.task_ids("train")[0], "train", 0)
    try:
        assert [t["function"]["name"] for t in episode.tools] == ["take_action"]
        assert episode.tools[0]["function"]["parameters"]["required"] == ["action"] and episode.max_turns == 20
        system, user = episode.opening()
        assert system["role"] == "system" and "household" in system["content"]
        assert user["content"].startswith("Here is your task. You are in the middle of a room.")
        assert "Your task is to: " in user["content"] and " AVAILABLE ACTIONS: go to " in user["content"]
        assert "Welcome to TextWorld" not in user["content"]
        result = episode.call(ToolCall("take_action", {"action": episode.last.admissible[0]}))
        assert result.content.startswith("You arrive at ") and " AVAILABLE ACTIONS: " in result.content
        assert not result.finish and result.metrics["won"] == 0.0
    finally:
        episode.close()


def test_bad_actions_give_engine_observations_not_crashes(env: AlfworldEnv) -> None:
    task_id = env.task_ids("train")[0]
    episode = env.open(task_id, "train", 0)
    try:
        # nonsense: no admissible command is close, so the engine itself answers
        result = episode.call(ToolCall("take_action", {"action": "xyzzy"}))
        assert result.content.startswith("Nothing happens.") and not result.finish
        # a near miss is mapped to the closest admissible command, as AgentBench's process_action does
        target = next(a for a in episode.last.admissible if a.startswith("go to "))
        assert snap(target.replace("go to", "GO TO the") + "\nthen more", episode.last.admissible) == target
        result = episode.call(ToolCall("take_action", {"action": "  " + target.upper() + "\nand then..."}))
        assert result.content.startswith("You arrive at ")
        for args, expect in (({"action": ""}, "non-empty string"), ({"action": "go " * 5000}, "characters long")):
            with pytest.raises(ToolError, match=expect):
                episode.call(ToolCall("take_action", args))
        with pytest.raises(ToolError, match="Unknown tool"):
            episode.call(ToolCall("put", {"action": "x"}))
        assert episode.nothing_happens == 1
    finally:
        episode.close()
    env.snap_actions = False
    try:
        episode = env.open(task_id, "train", 0)
        result = episode.call(ToolCall("take_action", {"action": "go to the " + target[len("go to "):]}))
        assert result.content.startswith("Nothing happens.")  # typed as is, without snapping
        # AgentBench: the same output three times in a row (after the first round) ends the episode
        for i in range(3):
            result = episode.call(ToolCall("take_action", {"action": "look"}))
            assert result.finish == (i == 2)
        assert result.status == "invalid_action" and result.reward == 0.0
        episode.close()
    finally:
        env.snap_actions = True


def test_replay_rebuilds_the_session_state(env: AlfworldEnv) -> None:
    task_id = env.task_ids("test")[2]
    episode = env.open(task_id, "test", 0)
    for _ in range(5):
        episode.call(env.oracle(episode))
    log, last = list(episode.actions), episode.last
    episode.close()
    replayed = env.replay(task_id, "test", 0, log)
    try:
        assert replayed.last == last and replayed.actions == log
        assert replayed.call(env.oracle(replayed)).content  # and it plays on
    finally:
        replayed.close()


def test_a_dead_or_stuck_engine_fails_its_episode_only(env: AlfworldEnv) -> None:
    task_id = won(env, "train")[0]
    episode = env.open(task_id, "train", 0)
    episode.proc.proc.kill()  # the engine process dies mid-episode
    with pytest.raises(EngineDied):
        episode.call(ToolCall("take_action", {"action": "look"}))
    episode.close()
    episode = env.open(task_id, "train", 0)
    saved, env.pool.step_timeout_s = env.pool.step_timeout_s, 0.0  # an engine step that never returns in time
    try:
        with pytest.raises(EngineDied, match="took longer"):
            episode.call(ToolCall("take_action", {"action": "look"}))
    finally:
        env.pool.step_timeout_s = saved
        episode.close()
    assert play(env, task_id, "train", "oracle")[0] == 1.0  # the replica keeps serving
    assert env.pool.stats["died"] >= 2
    # an engine process is replaced after recycle_after episodes (the engine leaks ~5 MB a game)
    recycled, env.pool.recycle_after = env.pool.stats["recycled"], 1
    try:
        assert play(env, task_id, "train", "oracle")[0] == 1.0
    finally:
        env.pool.recycle_after = 50
    assert env.pool.stats["recycled"] == recycled + 1


def test_memoized_text_and_cached_translation_change_nothing(env: AlfworldEnv, tmp_path: Path) -> None:
    """Play a game on the stock engine and on the sped-up one (fresh processes): identical transcripts."""
    games = {t: json.loads(gen.write_game(env.root, t).read_text())["walkthrough"] for t in won(env, "test")}
    task_id = min(games, key=lambda t: len(games[t]))  # the shortest: the stock engine is slow
    path, walkthrough = gen.game_dir(env.root, task_id) / "game.tw-pddl", games[task_id]
    script = (
        "import json, sys\n"
        "from services.envs.alfworld_env import engine\n"
        "path, task_id, out, sas, cmds = sys.argv[1:6]  # read first: the PDDL translator rewrites argv\n"
        "def play():\n"
        "    g = engine.Game(); steps = [g.load(path, task_id)]\n"
        "    for cmd in json.loads(cmds) + ['xyzzy', 'inventory']:\n"
        "        steps.append(g.step(cmd))\n"
        "    return [[s.observation, s.admissible, s.won, s.expert] for s in steps]\n"
        "runs = [play()]  # the stock engine\n"
        "engine.memoize_text_parsing(); engine.cache_translations(sas)\n"
        "runs.append(play())  # sped up; translates and writes the translation to disk\n"
        "engine.cache_translations(sas + '/')  # a fresh in-memory cache on the same directory\n"
        "runs.append(play())  # reads the translation from disk\n"
        "json.dump(runs, open(out, 'w'))\n")
    out = tmp_path / "runs.json"
    subprocess.run([sys.executable, "-c", script, str(path), task_id, str(out), str(tmp_path / "sas"),
                    json.dumps(walkthrough)], cwd=REPO, check=True, timeout=300)
    outs = json.loads(out.read_text())
    assert list((tmp_path / "sas").rglob("*.pkl.z"))
    assert outs[0] == outs[1] == outs[2]
    assert outs[0][len(walkthrough)][2] is True  # the stored walkthrough wins the game


# --------------------------------------------------------------------------------------------- over NATS
async def test_served_over_nats_oracle_episodes_and_bad_actions(env: AlfworldEnv, config, subjects, nc) -> None:
    config.env.task, config.env.action_timeout_s = "alfworld", 10.0
    host = EnvHost(env, config.env, subjects, "alfworld-r1")
    service = await host.serve(nc, nc.jetstream())
    client = EnvClient(nc, subjects, "alfworld", timeout_s=60)
    try:
        async def oracle_episode(task_id: str, split: str) -> tuple[float, str]:
            sid = uuid.uuid4().hex
            started = await client.start(sid, task_id, split)
            assert [t["function"]["name"] for t in started.tools] == ["take_action"] and started.max_turns == 20
            for _ in range(started.max_turns):
                step = await client.interact(started.replica_id, sid, await client.oracle(started.replica_id, sid))
                if step.finish:
                    return step.reward, step.status
            return 0.0, "unfinished"

        ids = [(t, "test") for t in won(env, "test")[:3]] + [(won(env, "train")[-1], "train")]
        assert await asyncio.gather(*(oracle_episode(t, s) for t, s in ids)) == [(1.0, "completed")] * len(ids)

        sid = uuid.uuid4().hex
        rid = (await client.start(sid, env.task_ids("train")[0], "train")).replica_id

        def call(name: str, args: object) -> dict:
            return {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}

        bad = [
            (call("move", {"action": "look"}), "Unknown tool"),
            (call("take_action", {}), "missing argument"),
            (call("take_action", {"action": 3}), "must be of type string"),
            (call("take_action", {"action": "look", "why": "x"}), "unexpected argument"),
            ({"role": "assistant", "content": "ACTION: look"}, "No tool call found"),
            (call("take_action", {"action": "x" * 10**5}), "characters long"),
        ]
        for message, expect in bad:
            step = await client.interact(rid, sid, message)
            assert not step.finish and expect in step.messages[0]["content"], (expect, step.messages)
        step = await client.interact(rid, sid, call("take_action", {"action": "xyzzy"}))
        assert step.messages[0]["content"].startswith("Nothing happens.") and not step.finish
        config.env.alfworld.max_observation_chars = 60  # a long observation is cut, and says so
        step = await client.interact(rid, sid, call("take_action", {"action": "inventory"}))
        assert "truncated" in step.messages[0]["content"] and len(step.messages[0]["content"]) < 120
        config.env.alfworld.max_observation_chars = 4000
        health = await client.health()
        assert health.task_counts == {"train": 6, "test": 6} and health.sessions == 1
        cancelled = await client.cancel(rid, sid)
        assert cancelled.status == "cancelled" and step.metrics["invalid_actions"] == 6.0
        assert (await client.health()).sessions == 0
    finally:
        await service.stop()
        for session in list(host.sessions.values()):  # not host.shutdown(): the module fixture owns the env
            await host._close(session, "cancelled")


# ------------------------------------------------------------------------------ ALFWorld's own files
def test_game_files_and_tuples_serve_alfworlds_own_layout(env: AlfworldEnv, tmp_path: Path) -> None:
    """env.alfworld.game_files takes ALFWorld's layout (json_2.1.1/<split>/<task>/<trial>/game.tw-pddl beside
    traj_data.json) by glob, as split dev; the generator takes (type, object, receptacle, scene) tuples."""
    tuples = [gen.parse_task_id(t)[0] for t in won(env, "test")[:2]]
    ids = gen.task_ids_for(tuples)
    assert ids == [f"{gen.tuple_name(t)}/trial_0" for t in tuples]
    with pytest.raises(ValueError, match="not a game"):
        gen.task_ids_for([("pick_and_place_simple", "Egg", "Toilet", 11)])
    for k, task_id in enumerate(ids):  # copy the games out as ALFWorld ships them (trial folders by date)
        src = gen.game_dir(env.root, task_id)
        gen.write_game(env.root, task_id)
        dst = tmp_path / "json_2.1.1" / "valid_unseen" / task_id.split("/")[0] / f"trial_T2019090{k}_000000_000000"
        dst.mkdir(parents=True)
        for name in ("game.tw-pddl", "traj_data.json", "initial_state.pddl"):
            (dst / name).write_bytes((src / name).read_bytes())
    cfg = EnvConfig(task="alfworld", num_train_tasks=1, num_test_tasks=1, max_sessions=2,
                    sections={"alfworld": AlfworldTaskConfig(pool_size=1, prefetch=0,
                                                game_files=[str(tmp_path / "json_2.1.1" / "**" / "game.tw-pddl")])})
    files_env = make_env(cfg)
    try:
        dev = files_env.task_ids("dev")
        assert len(dev) == 2 and all(t.split("/")[1].startswith("trial_T2019") for t in dev)
        assert files_env.task_info(dev[0])["scene"] in gen.TEST_SCENES
        assert [play(files_env, t, "dev", "oracle")[0] for t in dev] == [1.0, 1.0]
    finally:
        files_env.close()
    with pytest.raises(FileNotFoundError, match="no file matches"):
        make_env(EnvConfig(task="alfworld", num_train_tasks=1, num_test_tasks=1,
                           sections={"alfworld": AlfworldTaskConfig(game_files=[str(tmp_path / "none" / "*.tw-pddl")])}))


def test_planner_oracle_wins_the_games_the_expert_loses(env: AlfworldEnv) -> None:
    """env.alfworld.oracle = planner: the full-knowledge planner wins every catalogue game within 20 rounds
    (the catalogue records it beside the expert's result), through the env too."""
    for split in ("train", "test"):
        assert all(env.catalogue[split]["expert"][t]["planner_won"] for t in env.task_ids(split)), split
    lost = [t for t in env.task_ids("test") if t not in won(env, "test")]
    cfg = EnvConfig(task="alfworld", num_train_tasks=1, num_test_tasks=1, max_sessions=2,
                    sections={"alfworld": AlfworldTaskConfig(pool_size=1, prefetch=0, oracle="planner")})
    planner_env = make_env(cfg)
    try:
        for task_id in lost[:2] or env.task_ids("test")[:1]:
            reward, status, rounds = play(planner_env, task_id, "test", "oracle")
            assert (reward, status) == (1.0, "completed") and rounds <= 20, task_id
    finally:
        planner_env.close()


def test_no_generated_games_on_a_fresh_data_dir(tmp_path: Path) -> None:
    """num_train_tasks = num_test_tasks = 0 (real game files only, or none yet) on a data_dir never used:
    empty splits, no error."""
    env = make_env(EnvConfig(task="alfworld", data_dir=str(tmp_path / "fresh"), num_train_tasks=0,
                             num_test_tasks=0, sections={"alfworld": AlfworldTaskConfig(pool_size=1, prefetch=0)}))
    try:
        assert env.task_ids("train") == env.task_ids("test") == []
    finally:
        env.close()


def test_levels_and_games_per_type_size_the_catalogue(env: AlfworldEnv) -> None:
    """env.alfworld.levels keeps the task types of those difficulties; num_train_games / num_test_games give
    each split's games per task type, over env.num_train_tasks / num_test_tasks; a type's games are the
    first ones of the full catalogue."""
    easy = ["pick_and_place_simple", "look_at_obj_in_light"]
    cfg = EnvConfig(task="alfworld", num_train_tasks=5, num_test_tasks=5, max_sessions=2, sections={
        "alfworld": AlfworldTaskConfig(levels=[1], num_train_games=2, num_test_games=1, pool_size=1, prefetch=0)})
    small = make_env(cfg)
    try:
        assert [small.task_info(t)["task_type"] for t in small.task_ids("train")] == [easy[0]] * 2 + [easy[1]] * 2
        assert [small.task_info(t)["task_type"] for t in small.task_ids("test")] == easy
        assert small.task_ids("test") == env.task_ids("test")[:2]  # the full catalogue's first game of each
        assert small.task_ids("train")[::2] == env.task_ids("train")[:2]
    finally:
        small.close()
    with pytest.raises(ValueError, match="env.alfworld.levels"):
        make_env(EnvConfig(task="alfworld", sections={"alfworld": AlfworldTaskConfig(levels=[4])}))


async def test_several_calls_in_one_message_run_the_first_as_agentbench(env: AlfworldEnv) -> None:
    """AgentBench's ALFWorld task runs a message's first call and drops the others: one answer, one round."""
    task_id = won(env, "train")[0] if won(env, "train") else env.task_ids("train")[0]
    session = HostSession(env, env.cfg)
    try:
        started = await session.start(task_id, "train")
        assert started.max_turns == 20
        step = await session.turn(assistant_calls(("take_action", {"action": "look"}),
                                                  ("take_action", {"action": "inventory"})))
        assert [m["tool_call_id"] for m in step.messages] == ["c0"] and not step.finish
        assert "not carrying" not in step.messages[0]["content"] and step.metrics["turns"] == 1.0  # no inventory
    finally:
        await session.close()


def test_expert_finds_the_lamp_and_a_mug_within_agentbenchs_rounds(env: AlfworldEnv) -> None:
    """The handcoded expert looks for a lamp where rooms keep one, and for a mug or a bowl (receptacle classes
    too) where such objects go: it wins these look_at games of AgentBench's test tuples within 20 rounds
    (searching every receptacle from the end of the room's list, it would need 25 and 24)."""
    for task_id in ("look_at_obj_in_light-CD-None-DeskLamp-308/trial_0",
                    "look_at_obj_in_light-Mug-None-DeskLamp-308/trial_0"):
        won, actions = engine.play_expert(str(gen.write_game(env.root, task_id)), task_id, 20)
        assert won and len(actions) <= 20, (task_id, actions)
        assert "use desklamp 1" in actions[-1]


def test_env_check_passes() -> None:
    """`jetrl env-check alfworld`: one game per split, the planner oracle (it always wins; the handcoded
    expert may not, within max_rounds), one engine process."""
    out = env_check("alfworld", "--episodes=1", "--env.num_train_tasks=1", "--env.num_test_tasks=1",
                    "--env.alfworld.pool_size=1", "--env.alfworld.prefetch=0", "--env.alfworld.oracle=planner",
                    timeout_s=600)
    assert "oracle test                  1/1 solved" in out and "env-check alfworld: 11 passed" in out
