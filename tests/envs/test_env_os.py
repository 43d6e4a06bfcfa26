"""OS env: real bwrap sandboxes over the cached Debian rootfs (built by the same code as `make setup-os`
when missing), AgentBench's grading, the generator and oracle, isolation, and the env served over NATS."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from services.envs.base import ToolCall, ToolError
from services.envs.host import EnvHost
from services.envs.os_task import OSEnv, OSEpisode
from services.envs.os_task.config import OSTaskConfig
from services.envs.os_task.rootfs import rootfs_path
from services.envs.os_task.sandbox import BwrapSandbox, SandboxError
from services.envs.os_task.tasks import (
    COMPARISONS,
    FAMILIES,
    Script,
    Unavailable,
    content_key,
    generate,
    generate_split,
    parse_agentbench,
)
from shared.config import EnvConfig
from shared.envapi import EnvClient, EnvError
from tests.envs.sandbox_checks import BEHAVIOUR_TASKS, assert_behaves_like_agentbenchs_container, assert_limits_hold
from tests.procs import env_check

ALL_COMMANDS = ("bwrap", "mmdebstrap", "unshare", "mount")


def sandbox_missing() -> str | None:
    if os.geteuid() != 0:
        return "the bwrap sandbox mounts an overlay in its own mount namespace: needs root"
    missing = [c for c in ALL_COMMANDS if shutil.which(c) is None]
    return f"{', '.join(missing)} not installed (make setup-os)" if missing else None


@pytest.fixture(scope="module")
def env() -> OSEnv:
    if reason := sandbox_missing():
        pytest.skip(reason)
    cfg = EnvConfig(task="os", num_train_tasks=6, num_test_tasks=6,
                    sections={"os": OSTaskConfig(command_timeout_s=3.0, disk_mb=64, memory_mb=256)})
    env = OSEnv(cfg)
    env.rootfs("default")  # built once (mmdebstrap, ~30 s-2 min) and cached, as `make setup-os` does
    yield env
    env.close()


def play(env: OSEnv, episode: OSEpisode) -> tuple[float, int]:
    for turn in range(1, episode.max_turns + 1):
        result = episode.call(env.oracle(episode))
        if result.finish:
            return result.reward, turn
    return 0.0, episode.max_turns


def solve(env: OSEnv, task_id: str, split: str) -> float:
    episode = env.open(task_id, split, 0)
    try:
        return play(env, episode)[0]
    finally:
        episode.close()


# --------------------------------------------------------------------------------------------- pure parts
def test_named_comparisons_follow_agentbench() -> None:
    assert COMPARISONS["integer-match"]("7", " 7\n") and not COMPARISONS["integer-match"]("7", "8")
    assert not COMPARISONS["integer-match"]("", "0") and not COMPARISONS["integer-match"]("seven", "7")
    assert COMPARISONS["string-match"]("a\r\nb \n", "a\nb") and not COMPARISONS["string-match"]("a", "b")
    assert COMPARISONS["size-match"]("4.0K", "4096") and COMPARISONS["size-match"]("1536KB", "1.5M")
    assert not COMPARISONS["size-match"]("4K", "4M") and not COMPARISONS["size-match"]("", "")
    assert COMPARISONS["containing"]("the answer is 42", "42") and not COMPARISONS["containing"]("4", "42")
    assert COMPARISONS["in"]("42", "the answer is 42") and not COMPARISONS["in"]("43", "the answer is 42")


def test_agentbench_formats_load_as_agentbench_does(tmp_path: Path) -> None:
    task = parse_agentbench({"description": "d", "create": {"local": "default", "init": {"code": "touch /x"}},
                             "start": "sleep 5 &", "evaluation": {"match": " 3 "}}, "t1")
    assert task.init == [Script("bash", "touch /x")] and task.start == Script("bash", "sleep 5 &")
    assert task.match == {"answer": " 3 ", "strip": True} and task.wants_answer
    task = parse_agentbench({"description": "d", "evaluation": {
        "check": [None, {"language": "python", "file": "check/size-match.py"}], "example": {"code": "du -sh ."}}}, "t2")
    assert task.check == [None, Script("builtin", "size-match")] and task.example == Script("bash", "du -sh .")
    (tmp_path / "check").mkdir()
    (tmp_path / "check" / "0.sh").write_text("test -x /usr/local/bin/calc")
    task = parse_agentbench({"description": "d", "evaluation": {"check": {"file": "check/0.sh"}}}, "t3", tmp_path)
    assert task.check == [Script("bash", "test -x /usr/local/bin/calc")] and not task.wants_answer
    with pytest.raises(Unavailable, match="check/1.sh is not available"):
        parse_agentbench({"description": "d", "evaluation": {"check": {"file": "check/1.sh"}}}, "t4", tmp_path)
    with pytest.raises(Unavailable, match="example script, which is missing"):
        parse_agentbench({"description": "d", "evaluation": {"check": [None, {"file": "check/integer-match.py"}]}}, "t5")


def test_generator_is_deterministic_three_levels_disjoint_splits() -> None:
    assert generate("text", 2, "train", 5) == generate("text", 2, "train", 5)
    train = generate_split("train", 30)
    test = generate_split("test", 12, exclude={content_key(t) for t in train})
    assert len(train) == 30 * len(FAMILIES) and len(test) == 12 * len(FAMILIES)
    assert not {content_key(t) for t in train} & {content_key(t) for t in test}
    assert {(t.family, t.level) for t in train} == {(f, lv) for f in FAMILIES for lv in (1, 2, 3)}
    assert len({t.task_id for t in train + test}) == len(train + test)


# --------------------------------------------------------------------------------------------- sandbox
def test_shell_persists_and_survives_exit_and_stdin_reads(env: OSEnv) -> None:
    with env.sandbox() as box:
        assert box.shell("cd /tmp && export X=41", 3)["output"] == ""
        assert box.shell("echo $((X+1)) $(pwd)", 3)["output"] == "42 /tmp\n"
        assert box.shell("read line; echo got:$line", 3)["output"] == "got:\n"  # stdin is /dev/null
        res = box.shell("exit 3", 3)
        assert res["restarted"] and res["exited"] == 3
        assert box.shell("pwd; echo $X", 3)["output"] == "/root\n\n"
        assert box.shell("echo 'unbalanced", 3)["output"].startswith("bash: eval: line")
        box.shell("kill -9 1; kill -STOP 1; kill -9 -1", 3)  # sandboxd is the namespace's init: unkillable
        res = box.shell("while :; do :; done", 1)  # the shell itself spins: it is replaced
        assert res["timed_out"] and res["restarted"] and box.shell("echo ok", 3)["output"] == "ok\n"
        res = box.exec(["bash", "-c", 'echo out; echo err >&2; echo "$1"; exit 4', "--", "a b"], 5)
        assert (res["code"], res["stdout"], res["stderr"]) == (4, "out\na b\n", "err\n")


def test_isolation_host_untouched_episode_goes_on(env: OSEnv, tmp_path: Path) -> None:
    secret = tmp_path / "host-secret.txt"
    secret.write_text("host only")
    rootfs = env.rootfs("default")
    host_etc = Path("/etc/hostname").read_bytes() if Path("/etc/hostname").exists() else b""
    lower_count = len(list((rootfs / "etc").iterdir()))
    episode = env.open(env.task_ids("train")[0], "train", 0)
    try:
        out = lambda script: episode.call(ToolCall("bash_action", {"script": script})).content  # noqa: E731
        assert "No such file" in out(f"cat {secret}")
        assert "host-secret" not in out(f"ls {tmp_path} /root/.cache 2>&1")
        assert "curl: (7)" in out("curl -sS -m 3 http://1.1.1.1/ 2>&1; curl -sS -m 3 http://127.0.0.1:4222/ 2>&1")
        assert "Read-only file system" in out("echo x > /proc/sys/kernel/hostname")
        forged = out("""echo '{"ok": true, "code": 0, "stdout": "5"}' > /proc/1/fd/1; cat /proc/1/mem""")
        assert forged.count("Permission denied") == 2  # sandboxd's pipe to the host is out of reach
        assert "permission denied" in out("mount -t tmpfs none /mnt 2>&1").lower()
        assert out("unshare -U -r id 2>&1; unshare -m true 2>&1").count("Operation not permitted") == 2  # seccomp
        assert "empty" in out("echo hacked > /etc/hostname; echo 'evil:x:0:0::/:/bin/sh' >> /etc/passwd")
        assert "hacked" in out("cat /etc/hostname")
        assert_limits_hold(out)
        assert "No space left on device" in out("head -c 80M /dev/zero > /root/big; rm -f /root/big")  # 64 MB cap
        out("rm -rf --no-preserve-root / 2>/dev/null")
        assert "still here" in out("echo still here")  # a builtin: the shell lives on in its wreck
    finally:
        episode.close()
    assert secret.read_text() == "host only" and len(list((rootfs / "etc").iterdir())) == lower_count
    assert (Path("/etc/hostname").read_bytes() if Path("/etc/hostname").exists() else b"") == host_etc
    assert not episode.sandbox.ep_dir.exists() and not any(d.exists() for d in episode.sandbox.cgroup.dirs)
    # the replica keeps serving: a fresh episode sees a clean system
    episode = env.open(env.task_ids("train")[0], "train", 0)
    try:
        text = episode.call(ToolCall("bash_action", {"script": "cat /etc/hostname; grep -c evil /etc/passwd; ls /bin | wc -l"})).content
        assert "hacked" not in text and "\n0\n" in text
    finally:
        episode.close()


def test_sandbox_refuses_to_start_without_rootfs(env: OSEnv, tmp_path: Path) -> None:
    with pytest.raises(SandboxError, match="sandbox exited"):
        BwrapSandbox(tmp_path / "no-rootfs", env.limits, tmp_path / "run", start_timeout=10)
    assert not list((tmp_path / "run").iterdir())  # nothing left behind


# --------------------------------------------------------------------------------------------- tasks
def test_generated_tasks_oracle_solves_and_wrong_answers_fail(env: OSEnv) -> None:
    ids = [t for t in env.task_ids("test")]
    picked = {}
    for task_id in ids:
        task = env.tasks["test"][task_id]
        picked.setdefault((task.family, task.level), task_id)
    assert len(picked) == 3 * len(FAMILIES)
    with ThreadPoolExecutor(4) as pool:
        rewards = dict(zip(picked.values(), pool.map(lambda t: solve(env, t, "test"), picked.values()), strict=True))
    assert rewards == {t: 1.0 for t in picked.values()}

    def wrong(task_id: str) -> float:
        episode = env.open(task_id, "test", 0)
        try:
            if episode.task.wants_answer:  # gold from the fresh sandbox, tampering cannot change it
                episode.call(ToolCall("bash_action", {"script": "rm -rf /root/* /srv /opt /home/* /var/tmp/*"}))
                return episode.call(ToolCall("answer_action", {"answer": episode.gold.strip() + "x"})).reward
            return episode.call(ToolCall("finish_action", {"thought": "done"})).reward  # nothing done
        finally:
            episode.close()

    one_each = [picked[k] for k in (("files", 1), ("search", 2), ("users", 3),  # answers, and actions:
                                    ("permissions", 2), ("processes", 3), ("text", 3))]
    with ThreadPoolExecutor(4) as pool:
        assert set(pool.map(wrong, one_each)) == {0.0}


def test_agentbench_training_tasks_init_gold_check(agentbench: Path) -> None:
    """A spread of the 1,000 training tasks: init -> gold (example) -> check passes; gold +- 1 and empty
    answers fail. The full sweep is `python bench/bench_env_os.py agentbench`."""
    if reason := sandbox_missing():
        pytest.skip(reason)
    path = agentbench / "os_interaction" / "train_0317" / "training.json"
    env = OSEnv(EnvConfig(task="os", num_train_tasks=0, num_test_tasks=0,
                          sections={"os": OSTaskConfig(agentbench_train=[str(path)])}))
    ids = env.task_ids("train")
    assert len(ids) == 1000 and not env.skipped
    sample = ids[::67]

    def grade_three(task_id: str) -> tuple[float, float, float, float]:
        episode = env.open(task_id, "train", 0)
        try:
            reward, _ = play(env, episode)
            gold = (episode.last_output or "").strip()
            cmp = episode.task.check[-1].code
            if cmp == "integer-match":
                plus, minus = str(int(gold) + 1), str(int(gold) - 1)
            else:
                plus, minus = gold + "1", "x" + gold
            return reward, *(float(episode.judge(a)[0]) for a in (plus, minus, ""))
        finally:
            episode.close()

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(grade_three, sample))
    assert [r[0] for r in results] == [1.0] * len(sample)
    assert all(r[1:] == (0.0, 0.0, 0.0) for r in results)
    env.close()


def test_agentbench_dev_tasks_with_start_and_match(agentbench: Path) -> None:
    """dev.json: background `start` programs, match answers, users; tasks whose scripts are not shipped are
    skipped with the reason."""
    if reason := sandbox_missing():
        pytest.skip(reason)
    env = OSEnv(EnvConfig(task="os", num_train_tasks=0, num_test_tasks=0,
                          sections={"os": OSTaskConfig(agentbench_test=[str(agentbench / "os_interaction" / "data" / "dev.json")])}))
    assert len(env.task_ids("test")) == 23 and all("not available" in r for r in env.skipped.values())
    with ThreadPoolExecutor(4) as pool:
        rewards = list(pool.map(lambda t: solve(env, t, "test"), env.task_ids("test")))
    assert rewards == [1.0] * 23
    env.close()


def test_replaying_the_action_log_on_a_new_replica_rebuilds_the_session(env: OSEnv) -> None:
    task_id = next(t for t in env.task_ids("train") if t.startswith("gen-text-l3"))
    log = [ToolCall("bash_action", {"script": s}) for s in (
        "mkdir -p /root/w && cd /root/w && export STEP=2", "printf 'a\\nb\\n' > f && chmod 640 f && useradd -m kim",
        "sort -r f > g; ln -s g h")]
    probe = ToolCall("bash_action", {"script": "pwd; echo $STEP; id kim; find / -xdev -newer /etc/hostname "
                                               "-printf '%p %s %m\\n' 2>/dev/null | grep -v '^/proc' | sort | md5sum"})
    states = []
    for replica in (env, OSEnv(env.cfg)):  # another replica: same task ids, same rootfs
        episode = replica.open(task_id, "train", 0)
        try:
            for call in log:
                episode.call(call)
            states.append(episode.call(probe).content)
        finally:
            episode.close()
    assert states[0] == states[1] and "/root/w\n2\nuid=" in states[0]


def test_packages_variant_has_npm(env: OSEnv) -> None:
    if not (rootfs_path(env.cache_dir, "packages", env.cfg.os.suite, env.cfg.os.mirror) / ".jetrl-ready").exists():
        pytest.skip("the packages rootfs is not built (make setup-os-packages, a few minutes)")
    item = {"description": "Is npm installed?", "create": {"local": "packages"}, "evaluation": {
        "check": [None, {"language": "python", "file": "check/string-match.py"}],
        "example": "[ -x \"$(command -v npm)\" ] && echo installed || echo not-yet"}}
    for image, expect in (("packages", "installed"), ("default", "not-yet")):
        task = parse_agentbench({**item, "create": {"local": image}}, f"npm-{image}")
        episode = OSEpisode(task, env.sandbox(task.image), env.cfg)
        try:
            episode.prepare()
            assert play(env, episode)[0] == 1.0 and episode.example_output == expect + "\n"
        finally:
            episode.close()


def test_bad_calls_are_observations_not_crashes(env: OSEnv) -> None:
    episode = env.open(env.task_ids("train")[0], "train", 0)
    try:
        with pytest.raises(ToolError, match="Unknown tool"):
            episode.call(ToolCall("python_action", {"code": "1"}))
        big = episode.call(ToolCall("bash_action", {"script": "yes abcdefghij | head -c 5000000; echo"})).content
        assert len(big) <= env.cfg.max_observation_chars and "truncated because the output is too long" in big
        assert "5000001 characters" in big
        assert episode.call(ToolCall("bash_action", {"script": "true"})).content == "The output of the OS is empty."
        assert play(env, episode)[0] == 1.0  # the episode still solves
    finally:
        episode.close()


# --------------------------------------------------------------------------------------------- served
async def test_served_over_nats_oracle_episodes_and_bad_actions(env: OSEnv, config, subjects, nc) -> None:
    config.env.task, config.env.action_timeout_s = "os", 6.0
    env.cfg.action_timeout_s = 6.0
    host = EnvHost(env, config.env, subjects, "os-r1")
    service = await host.serve(nc, nc.jetstream())
    client = EnvClient(nc, subjects, "os", timeout_s=30)

    def call(name: str, args: object) -> dict:
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}

    try:
        async def oracle_episode(task_id: str, split: str) -> float:
            sid = uuid.uuid4().hex
            started = await client.start(sid, task_id, split)
            assert [t["function"]["name"] for t in started.tools] == ["bash_action", "answer_action", "finish_action"]
            assert started.max_turns == 8 and "My problem is:" in started.messages[-1]["content"]
            for _ in range(started.max_turns):
                step = await client.interact(started.replica_id, sid, await client.oracle(started.replica_id, sid))
                if step.finish:
                    assert step.status == "completed"
                    return step.reward
            return 0.0

        ids = [(t, "train") for t in env.task_ids("train")[:4]] + [(t, "test") for t in env.task_ids("test")[:4]]
        assert await asyncio.gather(*(oracle_episode(t, s) for t, s in ids)) == [1.0] * len(ids)

        sid = uuid.uuid4().hex
        rid = (await client.start(sid, env.task_ids("train")[0], "train")).replica_id
        bad = [
            (call("rm_action", {"path": "/"}), "Unknown tool"),
            (call("bash_action", {}), "missing argument"),
            (call("bash_action", {"script": 7}), "must be of type string"),
            (call("finish_action", {"thought": "done", "answer": "1"}), "unexpected argument"),
            ({"role": "assistant", "content": "ls"}, "No tool call"),
        ]
        for message, expect in bad:
            step = await client.interact(rid, sid, message)
            assert not step.finish and expect in step.messages[0]["content"], (expect, step.messages)
        step = await client.interact(rid, sid, call("bash_action", {"script": "sleep 100"}))
        assert not step.finish and "was stopped" in step.messages[0]["content"]
        step = await client.interact(rid, sid, call("bash_action", {"script": "seq 1 1000000"}))
        assert "truncated" in step.messages[0]["content"] and len(step.messages[0]["content"]) <= 800
        step = await client.interact(rid, sid, call("answer_action", {"answer": "definitely wrong"}))
        assert step.finish and step.reward == 0.0 and step.status == "completed"

        # slow commands in many sessions run side by side, not queued behind each other
        sids = [uuid.uuid4().hex for _ in range(10)]
        for s in sids:
            await client.start(s, env.task_ids("train")[0], "train")
        t0 = time.monotonic()
        steps = await asyncio.gather(*(client.interact("os-r1", s, call("bash_action", {"script": "sleep 3; echo ok"}))
                                       for s in sids))
        assert all("ok" in st.messages[0]["content"] for st in steps) and time.monotonic() - t0 < 5.9  # queued: >= 6 s
        for s in sids:
            await client.cancel("os-r1", s)

        # the round limit: 8 bash actions without an answer end the episode
        sid = uuid.uuid4().hex
        rid = (await client.start(sid, env.task_ids("train")[1], "train")).replica_id
        for _ in range(8):
            step = await client.interact(rid, sid, call("bash_action", {"script": "echo hi"}))
        assert step.finish and step.status == "task_limit_reached" and step.reward == 0.0
        health = await client.health()
        assert health.task == "os" and health.sessions == 0 and health.sessions_started >= 20
    finally:
        await service.stop()
        await host.shutdown()


async def test_service_entry_point_serves_and_stops_cleanly(env: OSEnv, config, subjects, nc, tmp_path: Path) -> None:
    """`python -m services.envs os` as its own process: oracle episode over NATS, SIGTERM closes the
    sandboxes it holds."""
    argv = [sys.executable, "-m", "services.envs", "os", f"--nats.url={config.nats.url}",
            f"--nats.prefix={config.nats.prefix}", "--env.num_train_tasks=3", "--env.num_test_tasks=3",
            "--run.log_level=warning"]
    proc = subprocess.Popen(argv, cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    client = EnvClient(nc, subjects, "os", timeout_s=30)
    try:
        for _ in range(100):
            try:
                await client.health()
                break
            except EnvError:
                await asyncio.sleep(0.2)
        task_id = env.task_ids("test")[0]
        started = await client.start("s1", task_id, "test")
        for _ in range(started.max_turns):
            step = await client.interact(started.replica_id, "s1", await client.oracle(started.replica_id, "s1"))
            if step.finish:
                break
        assert step.finish and step.reward == 1.0
        await client.start("s2", task_id, "test")  # left open: shutdown must close its sandbox
        assert (await client.health()).sessions == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0].decode()
    assert proc.returncode == 0, out[-2000:]
    run_dir = env.cache_dir / "run" / str(proc.pid)
    assert not run_dir.exists() or not any(run_dir.iterdir())


def test_levels_and_families_of_generated_tasks() -> None:
    cfg = EnvConfig(task="os", num_train_tasks=18, num_test_tasks=6)
    everything = OSEnv(cfg)
    levels = [everything.task_level(i, "train") for i in everything.task_ids("train")]
    assert {lv.level for lv in levels} == {1, 2, 3} and len({lv.kind for lv in levels}) > 2
    cfg.os.levels = [1]
    easy = OSEnv(cfg)
    ids = easy.task_ids("train")
    assert ids and all(easy.task_level(i, "train").level == 1 for i in ids) and len(ids) < len(levels)


# --------------------------------------------------------------------------- AgentBench's layout
def write_agentbench_layout(root: Path) -> None:
    """A small copy of AgentBench's os_interaction layout: two files both named new.json under data/<N>/,
    each with a check script of the same name in its own scripts/<N>/ folder, and data/dev.json."""
    for n, word in (("1", "one"), ("2", "two")):
        (root / "data" / n).mkdir(parents=True)
        (root / "scripts" / n / "check").mkdir(parents=True)
        (root / "scripts" / n / "check" / "1.sh").write_text(f'[ "$(cat /root/word)" = {word} ]\n')
        items = [{"description": f"Write {word} to /root/word.", "create": {"local": "default"},
                  "evaluation": {"check": {"file": "check/1.sh"}, "example": {"code": f"echo {word} > /root/word"}}},
                 {"description": "How many files are in /root/d?",
                  "create": {"init": {"code": "mkdir /root/d && touch /root/d/a /root/d/b"}},
                  "evaluation": {"check": [None, {"language": "python", "file": "check/integer-match.py"}],
                                 "example": "ls /root/d | wc -l"}}]
        (root / "data" / n / "new.json").write_text(json.dumps(items))
    (root / "scripts" / "dev" / "example").mkdir(parents=True)
    (root / "scripts" / "dev" / "example" / "0.sh").write_text("echo dev > /root/word\n")
    (root / "data" / "dev.json").write_text(json.dumps([{
        "description": "Write dev to /root/word.",
        "evaluation": {"check": {"code": '[ "$(cat /root/word)" = dev ]'}, "example": {"file": "example/0.sh"}}}]))


def test_agentbench_layout_finds_scripts_and_keeps_ids_apart(tmp_path: Path) -> None:
    write_agentbench_layout(tmp_path)
    env = OSEnv(EnvConfig(task="os", num_train_tasks=0, num_test_tasks=0, sections={"os": OSTaskConfig(
        agentbench_test=[str(tmp_path / "data" / "*" / "new.json"), str(tmp_path / "data" / "dev.json")])}))
    ids = env.task_ids("test")
    assert ids == ["ab-1-new-00000", "ab-1-new-00001", "ab-2-new-00000", "ab-2-new-00001", "ab-dev-00000"]
    assert not env.skipped
    assert env.tasks["test"]["ab-1-new-00000"].check[0].code.strip().endswith("= one ]")  # scripts/1, not 2
    assert env.tasks["test"]["ab-2-new-00000"].check[0].code.strip().endswith("= two ]")
    assert env.tasks["test"]["ab-dev-00000"].example.code == "echo dev > /root/word\n"
    env.close()
    # an explicit scripts folder (AgentBench's script_dir) wins over the layout
    env = OSEnv(EnvConfig(task="os", num_train_tasks=0, num_test_tasks=0, sections={"os": OSTaskConfig(
        agentbench_train=[f"{tmp_path / 'data' / '1' / 'new.json'}={tmp_path / 'scripts' / '2'}"])}))
    assert env.tasks["train"]["ab-1-new-00000"].check[0].code.strip().endswith("= two ]")
    env.close()
    # the same file twice (or two files with the same id) is an error, never an overwrite
    with pytest.raises(ValueError, match="ab-1-new-00000 .* also the id"):
        OSEnv(EnvConfig(task="os", num_train_tasks=0, num_test_tasks=0, sections={"os": OSTaskConfig(
            agentbench_train=[str(tmp_path / "data" / "1" / "new.json")],
            agentbench_test=[str(tmp_path / "data" / "1" / "*.json")])}))
    with pytest.raises(FileNotFoundError, match="no AgentBench task file matches"):
        OSEnv(EnvConfig(task="os", num_train_tasks=0, num_test_tasks=0,
                        sections={"os": OSTaskConfig(agentbench_test=[str(tmp_path / "nothing" / "*.json")])}))


async def test_sandbox_behaves_like_agentbenchs_container(tmp_path: Path) -> None:
    """The behaviour checks both backends pass (tests/envs/sandbox_checks.py), on bwrap."""
    if reason := sandbox_missing():
        pytest.skip(reason)
    (tmp_path / "box.json").write_text(json.dumps(BEHAVIOUR_TASKS))

    def make_env(action_timeout_s: float) -> OSEnv:
        env = OSEnv(EnvConfig(task="os", num_train_tasks=0, num_test_tasks=0, action_timeout_s=action_timeout_s,
                              sections={"os": OSTaskConfig(agentbench_test=[str(tmp_path / "box.json")])}))
        env.rootfs("default")
        return env

    host_hard = int(subprocess.run(["sh", "-c", "ulimit -Hn"], capture_output=True, text=True).stdout)
    want = 1 << 20 if _can_raise_nofile() else min(1 << 20, host_hard)  # a container host may lack the cap
    await assert_behaves_like_agentbenchs_container(make_env, want)


def _can_raise_nofile() -> bool:
    from services.envs.os_task.sandbox import CAP_SYS_RESOURCE, has_cap

    return has_cap(CAP_SYS_RESOURCE)


def test_env_check_passes(env: OSEnv) -> None:
    """`jetrl env-check os`, a bwrap sandbox per session (the fixture skips where there is none, and builds
    the rootfs once)."""
    out = env_check("os", "--episodes=1", "--env.num_train_tasks=6", "--env.num_test_tasks=3")
    assert "1/1 solved" in out and "env-check os: 11 passed" in out
