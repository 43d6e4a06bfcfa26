"""OS env on the docker backend: runs where a Docker engine answers (DOCKER_HOST or the default socket),
skips elsewhere. Uses the AgentBench-like images of `make setup-os-docker` when present; otherwise (no
registry here) it imports the bwrap rootfs as an image, which exercises the same backend code."""

from __future__ import annotations

import io
import shutil
import tarfile
import time
from pathlib import Path

import pytest

from services.envs.base import ToolCall
from services.envs.os_task import OSEnv
from shared.config import EnvConfig, OSTaskConfig


def docker_client():  # noqa: ANN201
    try:
        import docker
    except ImportError:
        pytest.skip("docker SDK not installed (pip install -e '.[os]')")
    try:
        client = docker.from_env(timeout=5)
        client.ping()
    except Exception as exc:  # no engine: the bwrap backend is the default here
        pytest.skip(f"no Docker engine reachable: {exc.__class__.__name__}")
    return client


def stream_tar(root: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(root, arcname=".")
    return buf.getvalue()


@pytest.fixture(scope="module")
def env() -> OSEnv:
    client = docker_client()
    prefix = "jetrl-os"
    try:
        client.images.get(f"{prefix}/default")
    except Exception:
        prefix = "jetrl-os-rootfs"
        try:
            client.images.get(f"{prefix}/default")
        except Exception:
            if shutil.which("mmdebstrap") is None:
                pytest.skip("no jetrl-os/default image and no mmdebstrap to build a rootfs to import")
            rootfs = OSEnv(EnvConfig(task="os", num_train_tasks=0, num_test_tasks=0)).rootfs("default")
            client.images.import_image(src=stream_tar(rootfs), repository=f"{prefix}/default")
    env = OSEnv(EnvConfig(task="os", num_train_tasks=3, num_test_tasks=3,
                          os=OSTaskConfig(backend="docker", docker_prefix=prefix, command_timeout_s=3.0)))
    yield env
    env.close()


def test_docker_backend_oracle_isolation_and_cleanup(env: OSEnv) -> None:
    for task_id in env.task_ids("test")[:6]:
        episode = env.open(task_id, "test", 0)
        try:
            for _ in range(episode.max_turns):
                result = episode.call(env.oracle(episode))
                if result.finish:
                    break
            assert result.finish and result.reward == 1.0, task_id
        finally:
            episode.close()
    episode = env.open(env.task_ids("train")[0], "train", 0)
    container = episode.sandbox.container
    try:
        out = lambda script: episode.call(ToolCall("bash_action", {"script": script})).content  # noqa: E731
        assert "Couldn't connect" in out("curl -sS -m 3 http://1.1.1.1/ 2>&1") or "resolve" in out("curl -sS -m 3 http://example.com 2>&1")
        t0 = time.monotonic()
        assert "was stopped" in out("sleep 1000") and time.monotonic() - t0 < 7
        assert "/root" in out("cd /tmp; exit 1") and "/root" in out("pwd")
    finally:
        episode.close()
    time.sleep(1)
    with pytest.raises(Exception):  # noqa: B017 - the container is gone (NotFound), whatever the SDK calls it
        container.reload()
