"""OS env on the docker backend: runs where a Docker engine answers (DOCKER_HOST or the default socket),
skips elsewhere with the reason. The images are AgentBench's equivalents built by `make setup-os-docker`
(FROM ubuntu:22.04 where it can be pulled, else FROM the Debian base image of `make setup-docker` with the
bwrap rootfs's packages); the fixture builds the default one when missing (~1 min, cached by Docker).
The isolation checks are the bwrap backend's (tests/envs/test_env_os.py); sandboxd is the container's pid 1 as
it is bwrap's. Only the disk cap differs: it needs a storage driver that can enforce it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from services.envs.base import ToolCall
from services.envs.os_task import OSEnv, OSEpisode
from services.envs.os_task.config import OSTaskConfig
from services.envs.os_task.docker_sandbox import DEBIAN_BASE, build_docker_images, docker_disk_cap
from services.envs.os_task.sandbox import Limits, sandbox_nofile
from shared.config import EnvConfig
from tests.envs.sandbox_checks import BEHAVIOUR_TASKS, assert_behaves_like_agentbenchs_container, assert_limits_hold

PREFIX = "jetrl-os"


def docker_client():  # noqa: ANN201
    try:
        import docker
    except ImportError:
        pytest.skip("docker SDK not installed (pip install -e '.[os]')")
    try:
        client = docker.from_env(timeout=30)
        client.ping()
    except Exception as exc:  # no engine: the bwrap backend is the default here
        pytest.skip(f"no Docker engine reachable (make setup-docker starts one as root): {exc.__class__.__name__}")
    return client


@pytest.fixture(scope="module")
def client():  # noqa: ANN201
    return docker_client()


@pytest.fixture(scope="module")
def env(client) -> OSEnv:  # noqa: ANN001
    try:
        client.images.get(f"{PREFIX}/default")
    except Exception:
        try:
            client.images.get(DEBIAN_BASE)
        except Exception:
            try:
                client.images.get("ubuntu:22.04")
            except Exception:
                pytest.skip(f"no {PREFIX}/default image and no base to build it FROM (make setup-os-docker)")
        build_docker_images(PREFIX, variants=("default",))
    env = OSEnv(EnvConfig(task="os", num_train_tasks=6, num_test_tasks=6,
                          sections={"os": OSTaskConfig(backend="docker", docker_prefix=PREFIX, command_timeout_s=3.0,
                                          disk_mb=64, memory_mb=256)}))
    yield env
    env.close()


def play(env: OSEnv, episode: OSEpisode) -> float:
    for _ in range(episode.max_turns):
        result = episode.call(env.oracle(episode))
        if result.finish:
            return result.reward
    return 0.0


def test_docker_backend_oracle_solves_every_family(env: OSEnv) -> None:
    for task_id in env.task_ids("test")[:6]:
        episode = env.open(task_id, "test", 0)
        try:
            assert play(env, episode) == 1.0, task_id
        finally:
            episode.close()


def test_docker_shell_persists_and_survives_exit(env: OSEnv) -> None:
    with env.sandbox() as box:
        assert box.shell("cd /tmp && export X=41", 3)["output"] == ""
        assert box.shell("echo $((X+1)) $(pwd)", 3)["output"] == "42 /tmp\n"
        assert box.shell("read line; echo got:$line", 3)["output"] == "got:\n"
        res = box.shell("exit 3", 3)
        assert res["restarted"] and res["exited"] == 3
        assert box.shell("pwd; echo $X", 3)["output"] == "/root\n\n"
        box.shell("kill -9 1; kill -STOP 1; kill -9 -1", 3)  # sandboxd is the namespace's init: unkillable
        res = box.shell("while :; do :; done", 1)
        assert res["timed_out"] and res["restarted"] and box.shell("echo ok", 3)["output"] == "ok\n"
        res = box.exec(["bash", "-c", 'echo out; echo err >&2; echo "$1"; exit 4', "--", "a b"], 5)
        assert (res["code"], res["stdout"], res["stderr"]) == (4, "out\na b\n", "err\n")


def test_docker_isolation_host_untouched_episode_goes_on(env: OSEnv, client, tmp_path: Path) -> None:  # noqa: ANN001
    secret = tmp_path / "host-secret.txt"
    secret.write_text("host only")
    host_etc = Path("/etc/hostname").read_bytes() if Path("/etc/hostname").exists() else b""
    episode = env.open(env.task_ids("train")[0], "train", 0)
    container = episode.sandbox.container
    try:
        out = lambda script: episode.call(ToolCall("bash_action", {"script": script})).content  # noqa: E731
        assert "No such file" in out(f"cat {secret}")
        assert "host-secret" not in out(f"ls {tmp_path} /root/.cache 2>&1")
        net = out("curl -sS -m 3 http://1.1.1.1/ 2>&1; curl -sS -m 3 http://127.0.0.1:4222/ 2>&1")
        assert net.count("curl: (7)") == 2, net  # no network at all: not even the host's loopback
        assert "Read-only file system" in out("echo x > /proc/sys/kernel/hostname")
        forged = out("""echo '{"ok": true, "code": 0, "stdout": "5"}' > /proc/1/fd/1; cat /proc/1/mem""")
        assert forged.count("Permission denied") == 2, forged  # sandboxd's pipe to the host is out of reach
        assert "permission denied" in out("mount -t tmpfs none /mnt 2>&1").lower()
        assert out("unshare -U -r id 2>&1; unshare -m true 2>&1").count("Operation not permitted") == 2  # seccomp
        assert "Operation not permitted" in out("mknod /tmp/null c 1 3 2>&1")  # CAP_MKNOD dropped
        assert "empty" in out("echo hacked > /etc/hostname; echo 'evil:x:0:0::/:/bin/sh' >> /etc/passwd")
        assert "hacked" in out("cat /etc/hostname")
        assert_limits_hold(out)
        if docker_disk_cap(client, 64) is not None:  # storage drivers that can cap the writable layer
            assert "No space left on device" in out("head -c 80M /dev/zero > /root/big; rm -f /root/big")
        out("rm -rf --no-preserve-root / 2>/dev/null")
        assert "still here" in out("echo still here")
    finally:
        episode.close()
    assert secret.read_text() == "host only"
    assert (Path("/etc/hostname").read_bytes() if Path("/etc/hostname").exists() else b"") == host_etc
    time.sleep(1)
    with pytest.raises(Exception):  # noqa: B017 - the container is gone (NotFound), whatever the SDK calls it
        container.reload()
    # the replica keeps serving: a fresh episode sees a clean system
    episode = env.open(env.task_ids("train")[0], "train", 0)
    try:
        text = episode.call(ToolCall("bash_action", {"script": "cat /etc/hostname; grep -c evil /etc/passwd; ls /bin | wc -l"})).content
        assert "hacked" not in text and "\n0\n" in text
    finally:
        episode.close()


def test_docker_disk_cap_or_the_reason(env: OSEnv, client) -> None:  # noqa: ANN001
    if docker_disk_cap(client, 64) is None:
        info = client.info()
        pytest.skip(f"storage driver {info.get('Driver')} on {dict(info.get('DriverStatus') or []).get('Backing Filesystem')} "
                    "cannot cap a container's writable layer (needs overlay2 on xfs+pquota, btrfs, zfs)")
    episode = env.open(env.task_ids("train")[0], "train", 0)
    try:
        text = episode.call(ToolCall("bash_action", {"script": "head -c 80M /dev/zero > /root/big; rm -f /root/big"})).content
        assert "No space left on device" in text
    finally:
        episode.close()


def test_docker_packages_image_has_npm(env: OSEnv, client) -> None:  # noqa: ANN001
    try:
        client.images.get(f"{PREFIX}/packages")
    except Exception:
        pytest.skip(f"no {PREFIX}/packages image (make setup-os-docker, a few minutes)")
    for variant, expect in (("packages", "installed"), ("default", "not-yet")):
        with env.sandbox(variant) as box:
            res = box.shell('[ -x "$(command -v npm)" ] && echo installed || echo not-yet', 10)
            assert res["output"] == expect + "\n"


async def test_docker_container_behaves_like_agentbenchs(env: OSEnv, tmp_path: Path) -> None:
    """The behaviour checks both backends pass (tests/envs/sandbox_checks.py), on docker: the container's open-file
    limit is set to Docker's default whatever dockerd inherited."""
    (tmp_path / "box.json").write_text(json.dumps(BEHAVIOUR_TASKS))

    def make_env(action_timeout_s: float) -> OSEnv:
        return OSEnv(EnvConfig(task="os", num_train_tasks=0, num_test_tasks=0, action_timeout_s=action_timeout_s,
                               sections={"os": OSTaskConfig(backend="docker", docker_prefix=PREFIX,
                                                            agentbench_test=[str(tmp_path / "box.json")])}))

    await assert_behaves_like_agentbenchs_container(make_env, sandbox_nofile(Limits()))
