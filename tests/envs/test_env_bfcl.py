"""BFCL as an env: bfcl-eval's own data and checkers grade the answers we give them; the ground truth
replayed through the env scores 1, wrong answers 0; a small slice runs end to end against a real model."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("bfcl_eval", reason="bfcl-eval is installed by `make venv` (pip install --no-deps bfcl-eval)")

from services.envs.bfcl import BFCLEnv, MultiTurnEpisode  # noqa: E402
from shared.config import JetRLConfig  # noqa: E402
from tests.procs import env_check  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def env() -> BFCLEnv:
    cfg = JetRLConfig()
    cfg.env.bfcl.categories = ["simple_python", "multiple", "parallel", "irrelevance", "multi_turn_base"]
    cfg.env.bfcl.per_category = 3
    return BFCLEnv(cfg.env)


def call(name: str, args: dict[str, Any], i: int = 0) -> dict[str, Any]:
    return {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def reply(*calls: dict[str, Any], content: str = "") -> dict[str, Any]:
    return {"role": "assistant", "content": content, **({"tool_calls": list(calls)} if calls else {})}


def as_call(source: str, tools: list[dict[str, Any]], i: int = 0) -> dict[str, Any]:
    """A ground-truth call string (``mv(source='a', destination='b')``) as an API tool call."""
    node = ast.parse(source).body[0].value
    args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    if node.args:  # positional arguments: in the order of the tool's schema
        props = next(t for t in tools if t["function"]["name"] == node.func.id)["function"]["parameters"]["properties"]
        args.update(zip(props, (ast.literal_eval(a) for a in node.args), strict=False))
    return call(node.func.id, args, i)


def test_split_interleaves_the_categories_and_has_no_training_tasks(env: BFCLEnv) -> None:
    ids = env.task_ids("test")
    assert ids[:5] == ["simple_python_0", "multiple_0", "parallel_0", "irrelevance_0", "multi_turn_base_0"]
    assert len(ids) == 15 and env.task_ids("train") == []
    assert env.task_level("parallel_2", "test").kind == "parallel"
    with pytest.raises(KeyError):
        env.open("simple_python_0", "train", 0)


def test_single_turn_answers_are_graded_by_bfcls_ast_checker(env: BFCLEnv) -> None:
    ep = env.open("simple_python_0", "test", 0)  # calculate_triangle_area(base=10, height=5)
    tool = ep.tools[0]["function"]
    assert ep.tools[0]["type"] == "function" and tool["parameters"]["type"] == "object"  # BFCL "dict" -> object
    assert "Python 3 syntax" in tool["description"]
    right = ep.respond(reply(call("calculate_triangle_area", {"base": 10, "height": 5})))
    assert (right.finish, right.reward, right.content) == (True, 1.0, "BFCL: correct")
    wrong = ep.respond(reply(call("calculate_triangle_area", {"base": 10, "height": 6})))
    assert wrong.reward == 0.0 and "height" in wrong.content
    assert ep.respond(reply(content="The area is 25.")).reward == 0.0  # no call: wrong
    # a '.' in a function name is '_' in the tool (OpenAI's name rule), and graded that way
    dotted = env.open("simple_python_1", "test", 0)
    assert [t["function"]["name"] for t in dotted.tools] == ["math_factorial"]
    assert dotted.respond(reply(call("math_factorial", {"number": 5}))).reward == 1.0
    # parallel: both calls, any order; one of them is not enough
    par = env.open("parallel_0", "test", 0)
    both = [call("spotify_play", {"artist": "Maroon 5", "duration": 15}, 0),
            call("spotify_play", {"artist": "Taylor Swift", "duration": 20}, 1)]
    assert par.respond(reply(*both)).reward == 1.0
    assert "wrong_count" in par.respond(reply(both[0])).content
    # irrelevance: right when no call is made
    irr = env.open("irrelevance_0", "test", 0)
    assert irr.respond(reply(content="I cannot do that with these tools.")).reward == 1.0
    assert irr.respond(reply(call("determine_body_mass_index", {"weight": 70.0, "height": 1.8}))).reward == 0.0


def test_multi_turn_ground_truth_replayed_through_the_env_is_correct(env: BFCLEnv) -> None:
    ep = env.open("multi_turn_base_0", "test", 0)
    assert isinstance(ep, MultiTurnEpisode) and len(ep.tools) > 10
    truth = env.answers["multi_turn_base_0"]
    for turn_index, turn in enumerate(truth):
        for source in turn:
            result = ep.respond(reply(as_call(source, ep.tools)))
            assert not result.finish and result.role == "tool" and "Error" not in result.content, (source, result)
        end = ep.respond(reply(content="Done."))
        if turn_index < len(truth) - 1:  # the next user turn comes back as a user message
            assert end.role == "user" and not end.finish and end.content == ep.turns[turn_index + 1][0]
    assert (end.finish, end.reward, end.content) == (True, 1.0, "BFCL: correct")
    # the episode's simulated APIs are gone once it is graded
    space = vars(env.bfcl.multi_turn_utils)
    assert not [n for n in space if n.startswith(ep.instance_name)]


def test_multi_turn_wrong_and_unknown_calls(env: BFCLEnv) -> None:
    ep = env.open("multi_turn_base_0", "test", 0)
    unknown = ep.respond(reply(call("__import__('os').system", {"command": "true"})))
    assert "do not exist were not run" in unknown.content and not unknown.finish
    for _ in ep.turns:  # answer every user turn with text only: the state never matches
        end = ep.respond(reply(content="I will not do it."))
    assert end.finish and end.reward == 0.0 and "empty_turn_model_response" in end.content


@pytest.mark.bfcl_model
def test_jetrl_eval_suite_bfcl_runs_a_slice_against_smollm2(tmp_path: Path) -> None:
    """`jetrl eval --suite bfcl` with SmolLM2 through every service: one entry of each single-turn category,
    per-category accuracy in the report. ~2 min on 2 busy cores: `make test-bfcl`, not `make test` (which
    runs a BFCL slice through `jetrl serve` instead: tests/rollout/test_serve.py)."""
    run_dir = tmp_path / "bfcl"
    proc = subprocess.run(
        [sys.executable, "-m", "jetrl.cli", "eval", "--suite", "bfcl", "--rollouts", "1", f"--run.dir={run_dir}",
         "--model.name=smollm2", "--env.bfcl.per_category=1",
         '--env.bfcl.categories=["simple_python", "multiple", "parallel", "irrelevance"]',
         "--rollout.max_new_tokens=64", "--rollout.max_context_tokens=4096"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((run_dir / "eval.json").read_text())["greedy"]["bfcl"]
    assert report["episodes"] == 4 and report["statuses"] == {"completed": 4}
    assert set(report["by_kind"]) == {"simple_python", "multiple", "parallel", "irrelevance"}
    for kind in report["by_kind"].values():
        assert kind["success"] in (0.0, 1.0) and len(kind["success_ci95"]) == 2


def test_unreadable_calls_count_against_the_well_formed_rate() -> None:
    from services.envs.calls import malformed

    assert malformed({"role": "assistant", "content": "", "invalid_tool_call": "not JSON"})
    assert malformed(reply({"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}))
    assert malformed(reply({"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}))
    assert not malformed(reply(call("f", {"x": 1}))) and not malformed(reply(content="no call"))


def test_env_check_passes() -> None:
    """`jetrl env-check bfcl`: an eval-only task (a test split, no oracle): bad calls are graded, the episode ends."""
    out = env_check("bfcl", "--env.bfcl.per_category=1")
    assert "--    oracle test" in out and "ended: status completed" in out and "env-check bfcl: 9 passed" in out
