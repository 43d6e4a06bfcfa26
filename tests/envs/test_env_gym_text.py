"""Gymnasium-style text envs through the gym_text adapter, unchanged: Gymnasium's own FrozenLake (a
Discrete action space, ANSI rendering), a text game written for the tests (a ``Text`` space with a
charset), a TextArena game and a reasoning-gym dataset; and one of them served by the env host over a
real nats-server, bad actions and a crashing ``step`` included."""

from __future__ import annotations

import pytest

pytest.importorskip("gymnasium", reason="the gym extra: pip install 'jetrl[gym]' (make venv installs it)")

from services.envs.base import ToolCall, ToolError  # noqa: E402
from services.envs.gym_text import GymTextConfig, build_env  # noqa: E402
from services.envs.host import EnvHost  # noqa: E402
from shared.config import EnvConfig  # noqa: E402
from shared.envapi import EnvClient  # noqa: E402
from tests.procs import env_check  # noqa: E402

WORD_GAME = "tests.servers.word_game:WordGame"
FROZEN_LAKE = GymTextConfig(id="FrozenLake-v1", kwargs={"render_mode": "ansi", "is_slippery": False})
WINNING_PATH = ["2", "2", "1", "1", "1", "2"]  # right, right, down, down, down, right on the 4x4 map


def act(action: str) -> ToolCall:
    return ToolCall("act", {"action": action})


def test_frozen_lake_plays_to_the_goal_and_refuses_what_its_space_refuses() -> None:
    env = build_env(FROZEN_LAKE, "lake", num_train=3, num_test=2)
    assert env.task_ids("train") == ["seed-0", "seed-1", "seed-2"]
    assert env.task_ids("test") == ["seed-1000000", "seed-1000001"]  # never a training seed
    ep = env.open("seed-0", "train", seed=7)
    system, first = ep.opening()
    assert "integer from 0 to 3" in system["content"] and "integer from 0 to 3" in ep.tools[0]["function"]["description"]
    assert first["content"].count("\n") == 5 and "HFFG" in first["content"]  # the ansi map
    for bad, why in (("7", "not in the action space"), ("left", "not an integer")):
        with pytest.raises(ToolError, match=why):
            ep.call(act(bad))
    results = [ep.call(act(a)) for a in WINNING_PATH]
    assert [r.finish for r in results] == [False] * 5 + [True]
    assert (results[-1].reward, results[-1].status, results[-1].metrics["env_steps"]) == (1.0, "completed", 6.0)
    ep.close()
    with pytest.raises(KeyError):
        env.open("seed-0", "test", seed=0)


def test_truncation_and_the_turn_limit_keep_the_return() -> None:
    settings = GymTextConfig(id="FrozenLake-v1", kwargs={"render_mode": "ansi", "is_slippery": False},
                             max_episode_steps=2, max_turns=5)
    ep = build_env(settings, "lake", 1, 1).open("seed-0", "train", 0)
    assert not ep.call(act("0")).finish
    end = ep.call(act("0"))  # gymnasium's TimeLimit truncates
    assert (end.finish, end.status, end.reward) == (True, "task_limit_reached", 0.0)
    assert ep.max_turns == 5 and ep.limit_reached().status == "task_limit_reached"


def test_a_text_space_game_by_entry_point() -> None:
    env = build_env(GymTextConfig(entry_point=WORD_GAME, kwargs={"max_guesses": 3}), "words", 4, 4)
    ep = env.open("seed-2", "train", 0)
    word = ep.env.unwrapped.word
    with pytest.raises(ToolError, match="each one of 'abcdefghijklmnopqrstuvwxyz'"):
        ep.call(act("APPLE"))
    miss = "zzzzz" if word != "zzzzz" else "yyyyy"
    assert ep.call(act(miss)).content == f"{miss}: -----"
    win = ep.call(act(word))
    assert (win.finish, win.reward, win.content) == (True, 1.0, "Correct!")
    # the same task opens the same word on any replica: the seed is the task
    assert build_env(GymTextConfig(entry_point=WORD_GAME), "words", 4, 4).open("seed-2", "train", 1).env.unwrapped.word == word


def test_settings_that_name_no_env_fail_at_start() -> None:
    with pytest.raises(ValueError, match="exactly one of id or entry_point"):
        build_env(GymTextConfig(), "g", 1, 1)
    with pytest.raises(ValueError, match="pkg.mod:Class"):
        build_env(GymTextConfig(entry_point="tests.servers.word_game:Nope"), "g", 1, 1)
    with pytest.raises(ValueError, match="source 'atari'"):
        build_env(GymTextConfig(source="atari", id="Pong"), "g", 1, 1)
    with pytest.raises(ValueError, match="test seeds"):
        build_env(GymTextConfig(entry_point=WORD_GAME, test_seed_offset=10), "g", 11, 1)


def test_a_textarena_game_through_the_same_adapter() -> None:
    pytest.importorskip("textarena")
    env = build_env(GymTextConfig(source="textarena", id="GuessTheNumber-v0-train"), "guess", 2, 2)
    ep = env.open("seed-1", "train", 0)
    assert "Guess The Number" in ep.opening()[1]["content"]
    target = ep.env.game.game_number
    low = ep.call(act("[1]" if target != 1 else "[2]"))
    assert low.content in ("The target number is higher.", "The target number is lower.")  # only what is new
    win = ep.call(act(f"[{target}]"))
    assert (win.finish, win.reward, win.status) == (True, 1.0, "completed") and "Congratulations" in win.content


def test_a_reasoning_gym_dataset_is_scored_by_its_own_rule() -> None:
    pytest.importorskip("reasoning_gym")
    env = build_env(GymTextConfig(source="reasoning_gym", id="basic_arithmetic"), "arith", 2, 2)
    right = env.open("seed-0", "train", 0)
    answer = right.env.entry["answer"]
    assert right.opening()[1]["content"] == right.env.entry["question"]
    assert right.call(act(answer)).reward == 1.0
    assert env.open("seed-0", "train", 0).call(act("no idea")).reward == 0.0
    # the whitespace around a tool argument is not part of the answer; the dataset's partial credit stays
    assert env.open("seed-0", "train", 0).call(act(f" {answer}\n")).reward == 1.0
    assert env.open("seed-0", "train", 0).call(act(f"{answer}.0")).reward == pytest.approx(len(answer) / (len(answer) + 2))
    expert = env.open("seed-1000001", "test", 0)  # the dataset knows its answers: the oracle submits them
    assert "final answer only" in expert.opening()[0]["content"]
    assert expert.call(env.oracle(expert)).reward == 1.0
    with pytest.raises(NotImplementedError):
        lake = build_env(FROZEN_LAKE, "lake", 1, 1)
        lake.oracle(lake.open("seed-0", "train", 0))


async def test_served_over_nats_bad_calls_are_observations_and_a_crash_is_env_error(nc, subjects) -> None:
    env = build_env(GymTextConfig(entry_point=WORD_GAME), "words", 2, 2)
    host = EnvHost(env, EnvConfig(task="words", max_sessions=4, worker_threads=2), subjects, "env-words-1")
    service = await host.serve(nc, nc.jetstream())
    client = EnvClient(nc, subjects, "words", timeout_s=10.0)

    def message(action: object) -> dict:
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "act", "arguments": {"action": action}}}]}

    try:
        started = await client.start("a", "seed-0")
        assert [t["function"]["name"] for t in started.tools] == ["act"] and started.max_turns == 30
        wrong_type = await client.interact(started.replica_id, "a", message(5), turn=0)
        assert not wrong_type.finish and "must be of type string" in wrong_type.messages[0]["content"]
        no_call = await client.interact(started.replica_id, "a", {"role": "assistant", "content": "hi"}, turn=1)
        assert not no_call.finish and no_call.metrics["invalid_actions"] == 2.0
        crashed = await client.interact(started.replica_id, "a", message("crash"), turn=2)
        assert crashed.finish and crashed.status == "env_error" and crashed.reward == 0.0
        assert "engine crashed" in crashed.messages[0]["content"]
        assert host.sessions == {}
    finally:
        await service.stop()
        await host.shutdown()


def test_env_check_passes() -> None:
    """`jetrl env-check gym` on a reasoning-gym dataset (whose oracle submits the dataset's answer)."""
    out = env_check("gym", "--env.gym.source=reasoning_gym", "--env.gym.id=basic_arithmetic",
                    "--env.num_train_tasks=4", "--env.num_test_tasks=2")
    assert "2/2 solved" in out and "env-check gym: 11 passed" in out
