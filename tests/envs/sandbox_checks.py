"""Checks every OS sandbox backend must pass (bwrap: tests/envs/test_env_os.py, docker: tests/envs/test_env_os_docker.py):
isolation, given ``out(command) -> output`` of a shell inside the sandbox, and behaving as AgentBench's
container does, given an env of the backend."""

from __future__ import annotations

import time
from collections.abc import Callable

from services.envs.base import ToolCall
from services.envs.os_task import OSEnv
from tests.envs.host_turns import HostSession, assistant_calls


def assert_limits_hold(out: Callable[[str], str]) -> None:
    """The time limit stops a command, a fork bomb is capped and ended, a memory hog is stopped, and the
    shell answers after each."""
    t0 = time.monotonic()
    stopped = out("sleep 1000")
    assert "ran longer than the 3s limit and was stopped" in stopped and time.monotonic() - t0 < 8
    t0 = time.monotonic()
    out(":(){ :|:& };:")  # a fork bomb: capped by the pids limit, then ended
    assert "alive" in out("echo alive") and time.monotonic() - t0 < 10
    assert int(out("ps -e --no-headers | wc -l").split()[-1]) < 20
    hog = out("python3 -c 'b = bytearray(512 << 20); print(len(b))' 2>&1")  # past the 256 MB cap
    assert str(512 << 20) not in hog and ("Killed" in hog or "MemoryError" in hog or "was stopped" in hog)
    assert "alive" in out("echo alive")


# AgentBench-format tasks the behaviour checks open: `su - user` in start, a gold counting processes, a check
# slower than the action time limit reading finish_action's thought, the same check quick (a wrong thought)
BEHAVIOUR_TASKS = [
    {"description": "What does ~/test print?",
     "start": "useradd -s /bin/bash -d /home/jack -m jack && cd /home/jack && echo 'echo love' > test && "
              "chmod 000 test && chown jack test && su - jack", "evaluation": {"match": "love"}},
    {"description": "How many processes are running?", "create": {"init": "for i in 1 2 3; do (sleep 60) & done"},
     "evaluation": {"check": [None, {"language": "python", "file": "check/integer-match.py"}],
                    "example": "ps -A | wc -l"}},
    {"description": "Say when you are done.",
     "evaluation": {"check": [{"language": "bash", "code": 'sleep 3; [ "$1" = "all done" ]'}]}},
    {"description": "Say when you are done.", "evaluation": {"check": [{"language": "bash", "code": '[ "$1" = "all done" ]'}]}},
]  # (`ps -ef | grep bash | grep -v grep | wc -l` is left out: a shell's children show its command line
# until they exec, so that count races, for the agent as for the check, here as in Docker)
BEHAVIOUR_ACTION_TIMEOUT_S = 2.5  # the host's limit of one tool call in these checks: the slow check runs past it


async def assert_behaves_like_agentbenchs_container(make_env: Callable[[float], OSEnv], nofile: int) -> None:
    """`find /` as root passes, apt works offline, the open-file limit is ``nofile`` (Docker's where the host
    lets root raise it), `su - user` in `start` switches the agent's shell, a gold that counts processes sees
    what the agent saw, a check runs past the action time limit and reads finish_action's thought, and a
    message's first call runs (AgentBench's rule for the task). ``make_env(action_timeout_s)``: an env of the
    backend serving ``BEHAVIOUR_TASKS`` as split test (ids ab-box-0000N) with that ``env.action_timeout_s``."""
    env = make_env(10.0)
    try:
        await _behaves_like_agentbenchs_container(env, nofile)
    finally:
        env.close()
    env = make_env(BEHAVIOUR_ACTION_TIMEOUT_S)
    try:
        await _grades_past_the_action_timeout(env)
    finally:
        env.close()


async def _behaves_like_agentbenchs_container(env: OSEnv, nofile: int) -> None:
    ep = env.open("ab-box-00000", "test", 0)
    try:
        def sh(script: str) -> str:
            return ep.call(ToolCall("bash_action", {"script": script})).content.split("\n\n", 1)[-1]

        assert sh("whoami; pwd") == "jack\n/home/jack\n"
        assert sh("~/test; echo rc=$?").endswith("rc=126\n")  # jack may not run it (mode 000)
        assert sh("exit; true") == "The output of the OS is empty."
        assert sh("whoami") == "root\n"
        assert sh("find / -name no-such-file >/dev/null; echo rc=$?") == "rc=0\n"
        # apt works offline for what AgentBench's tasks install (a local repository, its lists kept)
        assert sh("apt-get remove -y -q sudo >/dev/null 2>&1 && apt-get update -q >/dev/null 2>&1 && "
                  "apt-get install -y -q sudo >/dev/null 2>&1; echo rc=$?; sudo whoami 2>&1") == "rc=0\nroot\n"
        assert sh("ulimit -n; ulimit -Hn") == f"{nofile}\n{nofile}\n"
        if nofile > 123_321:  # an AgentBench init opens this many descriptors at once
            assert sh("python3 -c 'import os; print(len([os.open(\"/dev/null\", 0) for _ in range(123321)]))'") \
                == "123321\n"
        assert ep.call(ToolCall("answer_action", {"answer": "love"})).reward == 1.0
    finally:
        ep.close()
    ep = env.open("ab-box-00001", "test", 0)
    try:
        seen = int(ep.call(ToolCall("bash_action", {"script": ep.oracle_script()})).content.split()[-1])
        assert ep.judge(str(seen + 1))[0] is False and ep.judge(str(seen - 1))[0] is False
        assert ep.call(ToolCall("answer_action", {"answer": str(seen)})).reward == 1.0
    finally:
        ep.close()


async def _grades_past_the_action_timeout(env: OSEnv) -> None:
    session = HostSession(env, env.cfg)
    try:
        await session.start("ab-box-00002", "test")
        step = await session.turn(assistant_calls(("bash_action", {"script": "echo one"}),
                                                  ("bash_action", {"script": "echo two"})))
        assert [m["content"] for m in step.messages] == ["The output of the OS:\n\none\n"] and not step.finish
        t0 = time.monotonic()
        step = await session.turn(assistant_calls(("finish_action", {"thought": "all done"})))
        assert (step.finish, step.status, step.reward) == (True, "completed", 1.0), step.messages
        assert time.monotonic() - t0 > BEHAVIOUR_ACTION_TIMEOUT_S
    finally:
        await session.close()
    session = HostSession(env, env.cfg)
    try:
        await session.start("ab-box-00003", "test")
        step = await session.turn(assistant_calls(("finish_action", {"thought": "not yet"})))
        assert (step.finish, step.reward) == (True, 0.0)
    finally:
        await session.close()
