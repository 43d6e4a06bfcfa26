"""Scale-out path, the parts that run in the default tier: the weight broadcast into one replica over a
real nats-server (objects bigger than the server's per-client buffer, the bf16 option, a corrupt
object refused), and backend selection by config. vLLM and DeepSpeed have their own opt-in tiers
(tests/rollout/test_scale_out_vllm.py, tests/trainer/test_scale_out_deepspeed.py).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess

import pytest
import torch
from nats.js.api import ObjectMeta, ObjectMetaOptions

from services.rollout.engine import HFEngine
from services.rollout.worker import RolloutWorker
from shared.bus import connect, declare_topology
from shared.config import ConfigError, JetRLConfig, NatsConfig, load_config
from shared.digest import digest
from shared.messages import WeightsAnnouncement
from shared.model import (
    bytes_to_weights,
    load_model,
    load_tokenizer,
    quiet_transformers,
    resolve_model,
    weights_from_buffer,
    weights_to_bytes,
    weights_to_bytes_of,
)
from shared.natsd import EmbeddedNats
from shared.objectread import read_object
from shared.subjects import Subjects


async def test_read_object_bigger_than_the_servers_client_buffer(nc, subjects) -> None:
    """nats-server drops a client with more than 64 MiB undelivered; a reader that asked for a whole
    fp32 checkpoint at once was cut off as a slow consumer. Read in windows it arrives whole."""
    js = nc.jetstream()
    store = await js.object_store(subjects.weights_bucket)
    data = os.urandom(80 * 1024**2)
    name = "big.safetensors"
    await store.put(name, data, meta=ObjectMeta(name=name, options=ObjectMetaOptions(max_chunk_size=1024**2)))
    assert await read_object(js, subjects.weights_bucket, name) == data
    assert await read_object(js, subjects.weights_bucket, name, window_bytes=1) == data  # one chunk a batch


async def test_read_object_falls_back_to_nats_py_when_its_insides_are_missing(nc, subjects, monkeypatch) -> None:
    """The fast reader uses private attributes of nats-py; a version without one of them still reads every
    object (through ObjectStore.get), checks it against the digest, and says why once."""
    from structlog.testing import capture_logs

    from shared import objectread

    js = nc.jetstream()
    store = await js.object_store(subjects.weights_bucket)
    data = os.urandom(3 * 1024**2 + 7)
    await store.put("obj", data, meta=ObjectMeta(name="obj", options=ObjectMetaOptions(max_chunk_size=1024**2)))
    assert objectread.missing_internals(js) == []  # the nats-py this project installs has them all
    monkeypatch.setattr(objectread, "CLIENT_INTERNALS", (*objectread.CLIENT_INTERNALS, "_gone_in_a_new_release"))
    monkeypatch.setattr(objectread, "_slow_read_warned", False)
    with capture_logs() as logs:
        assert await read_object(js, subjects.weights_bucket, "obj", expected_digest=digest(data)) == data
        reused = bytearray(len(data))
        assert await read_object(js, subjects.weights_bucket, "obj", into=reused) is reused and reused == data
        with pytest.raises(ValueError, match="digest mismatch"):
            await read_object(js, subjects.weights_bucket, "obj", expected_digest=digest(data + b"x"))
    (warning,) = [e for e in logs if e["event"] == "object_read_fallback"]
    assert warning["missing"] == ["Client._gone_in_a_new_release"]


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command for a test certificate")
async def test_read_object_over_tls(tmp_path) -> None:
    """read_object's own connection speaks TLS as the client's does (the server's certificate checked
    against nats.tls_ca), and a read cancelled midway closes it without leaving anything behind."""
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    # EmbeddedNats appends its authorization text to the server's config as it is: a tls block fits there
    server = EmbeddedNats(tmp_path / "nats", authorization=f'tls {{\n  cert_file: "{cert}"\n  key_file: "{key}"\n}}\n')
    url = server.start()
    try:
        cfg = NatsConfig(url=url.replace("nats://", "tls://"), tls_ca=str(cert))
        client = await connect(cfg, "pytest-tls")
        js = client.jetstream()
        subjects = Subjects("tls")
        await declare_topology(js, subjects, cfg)
        store = await js.object_store(subjects.weights_bucket)
        data = os.urandom(20 * 1024**2 + 5)
        await store.put("obj", data, meta=ObjectMeta(name="obj", options=ObjectMetaOptions(max_chunk_size=1024**2)))
        assert await read_object(js, subjects.weights_bucket, "obj", expected_digest=digest(data)) == data
        read = asyncio.create_task(read_object(js, subjects.weights_bucket, "obj", window_bytes=1))
        await asyncio.sleep(0.05)
        read.cancel()
        with pytest.raises(asyncio.CancelledError):
            await read
        assert await read_object(js, subjects.weights_bucket, "obj") == data  # the client is still fine
        await client.close()
    finally:
        server.stop()


async def test_read_object_checks_one_digest(nc, subjects) -> None:
    """The announcement's digest (BLAKE3, or SHA-256 from an older trainer) when given, else the store's
    own SHA-256: a mismatch, or an algorithm nobody knows, is refused."""
    js = nc.jetstream()
    store = await js.object_store(subjects.weights_bucket)
    data = os.urandom(3 * 1024**2 + 17)
    await store.put("obj", data, meta=ObjectMeta(name="obj", options=ObjectMetaOptions(max_chunk_size=1024**2)))
    for algorithm in ("blake3", "sha256"):
        assert await read_object(js, subjects.weights_bucket, "obj", expected_digest=digest(data, algorithm)) == data
        with pytest.raises(ValueError, match=f"{algorithm} digest mismatch"):
            await read_object(js, subjects.weights_bucket, "obj", expected_digest=digest(data[1:], algorithm))
    with pytest.raises(ValueError, match="expected one of"):
        await read_object(js, subjects.weights_bucket, "obj", expected_digest="md5:" + "0" * 32)
    assert digest(data).startswith("blake3:")  # what the trainer writes
    assert await read_object(js, subjects.weights_bucket, "obj") == data  # the store's SHA-256


def test_weights_from_buffer_are_views_of_the_received_bytes() -> None:
    """Same tensors as safetensors' own loader, for both broadcast dtypes, without a copy: each tensor's
    memory lies inside the buffer."""
    gen = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(7, 5, generator=gen), "b.weight": torch.randn(3, generator=gen),
             "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4)}
    for dtype in ("float32", "bfloat16"):
        buf = bytearray(weights_to_bytes_of(state, dtype))
        views, reference = weights_from_buffer(buf), bytes_to_weights(bytes(buf))
        assert views.keys() == reference.keys() == state.keys()
        start = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
        for name, view in views.items():
            assert view.dtype == getattr(torch, dtype) and torch.equal(view, reference[name]), name
            if view.numel():
                assert start <= view.data_ptr() < start + len(buf), name


def test_weights_from_buffer_refuses_a_bad_object() -> None:
    good = bytearray(weights_to_bytes_of({"w": torch.ones(4, 4)}))
    header_len = int.from_bytes(good[:8], "little")
    with pytest.raises(ValueError, match="no safetensors object"):
        weights_from_buffer(bytearray(b"abc"))
    with pytest.raises(ValueError, match="header of"):
        weights_from_buffer(bytearray((10**9).to_bytes(8, "little")) + good[8:])
    with pytest.raises(ValueError, match="unreadable safetensors header"):
        weights_from_buffer(bytearray(header_len.to_bytes(8, "little")) + b"{" * header_len + good[8 + header_len:])
    with pytest.raises(ValueError, match="does not fit"):
        weights_from_buffer(good[:-4])  # the data is cut short
    lying = good.replace(b'"shape":[4,4]', b'"shape":[4,5]')
    with pytest.raises(ValueError, match="does not fit"):
        weights_from_buffer(lying)


@pytest.fixture(scope="module")
def tiny() -> dict:
    quiet_transformers()
    cfg = JetRLConfig()
    path = resolve_model(cfg.model)
    tok = load_tokenizer(path)
    engine = HFEngine(path, "hf-test", [tok.convert_tokens_to_ids("<|im_end|>")], tok.pad_token_id, threads=1)
    yield {"path": path, "tok": tok, "engine": engine}
    engine.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_broadcast_into_one_replica(nc, subjects, config, tiny, dtype: str) -> None:
    """The trainer's bytes, through the object store and the replica's loader, into the engine: every
    tensor arrives (tied lm_head included), bf16 at half the bytes and rounded to bf16."""
    js = nc.jetstream()
    source = load_model(tiny["path"])
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    data = weights_to_bytes(source, dtype)
    fp32_size = len(weights_to_bytes(source, "float32"))
    assert len(data) < 0.51 * fp32_size if dtype == "bfloat16" else len(data) == fp32_size
    store = await js.object_store(subjects.weights_bucket)
    version = tiny["engine"].policy_version + 1
    name = subjects.weights_object(version)
    await store.put(name, data)
    worker = RolloutWorker(nc, js, subjects, config.rollout, tiny["engine"], tiny["tok"], "rollout-test")
    await worker._load(WeightsAnnouncement(version=version, object_name=name, digest=digest(data), size=len(data),
                                           dtype=dtype))
    assert tiny["engine"].policy_version == version
    got = tiny["engine"].model.state_dict()
    for key, want in source.state_dict().items():
        expected = want.to(getattr(torch, dtype)).float()
        assert torch.equal(got[key], expected), key
    # The tied head is the embedding in the engine: the broadcast updated both.
    assert torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])
    generation = await tiny["engine"].generate(tiny["tok"].encode("hello"), 4, 0.0)
    assert generation.policy_version == version


async def test_next_version_is_read_into_the_last_ones_buffer(nc, subjects, config, tiny) -> None:
    """Fresh memory costs a page fault per 4 KiB, so a replica reads a version into the previous one's buffer,
    but only when nothing refers to it any more: a live view of the old bytes keeps them as they are."""
    js = nc.jetstream()
    store = await js.object_store(subjects.weights_bucket)
    worker = RolloutWorker(nc, js, subjects, config.rollout, tiny["engine"], tiny["tok"], "rollout-test")
    source = load_model(tiny["path"])
    gen = torch.Generator().manual_seed(5)
    loads, objects = [], []
    for step in range(3):
        with torch.no_grad():
            for p in source.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=gen))
        data = weights_to_bytes(source)
        objects.append(data)
        version = tiny["engine"].policy_version + 1
        name = subjects.weights_object(version)
        await store.put(name, data, meta=ObjectMeta(name=name, options=ObjectMetaOptions(max_chunk_size=1024**2)))
        if step == 2:  # someone still holds a tensor of version 2's bytes: they must survive version 3
            held = weights_from_buffer(worker._weights_buffer)["model.embed_tokens.weight"]
            held_before = held.clone()
        loads.append(await worker._load(WeightsAnnouncement(version=version, object_name=name, digest=digest(data),
                                                            size=len(data), dtype="float32")))
        got = tiny["engine"].model.state_dict()
        for key, want in source.state_dict().items():
            assert torch.equal(got[key], want), (step, key)
    assert [t.reused_buffer for t in loads] == [False, True, False]
    assert torch.equal(held, held_before)
    assert bytes(worker._weights_buffer) == objects[2]


async def test_corrupt_broadcast_is_refused(nc, subjects, config, tiny) -> None:
    js = nc.jetstream()
    data = weights_to_bytes(load_model(tiny["path"]))
    store = await js.object_store(subjects.weights_bucket)
    before = tiny["engine"].policy_version
    name = subjects.weights_object(before + 1)
    await store.put(name, data)
    worker = RolloutWorker(nc, js, subjects, config.rollout, tiny["engine"], tiny["tok"], "rollout-test")
    with pytest.raises(ValueError, match="digest"):
        await worker._load(WeightsAnnouncement(version=before + 1, object_name=name, digest=digest(data[:-1]),
                                               size=len(data), dtype="float32"))
    assert tiny["engine"].policy_version == before
    # an object the announcement vouches for, but shaped for another model: refused before any tensor is copied
    other = weights_to_bytes_of({"model.embed_tokens.weight": torch.zeros(3, 3)})
    await store.put(name, other)
    with pytest.raises(ValueError, match="do not match the model"):
        await worker._load(WeightsAnnouncement(version=before + 1, object_name=name, digest=digest(other),
                                               size=len(other), dtype="float32"))
    assert tiny["engine"].policy_version == before


def test_backends_are_chosen_by_config() -> None:
    cfg = load_config(overrides=["rollout.engine=vllm", "trainer.backend=deepspeed", "trainer.deepspeed.zero_stage=3",
                                 "rollout.device=cuda", "trainer.broadcast_dtype=bfloat16"], environ={})
    assert (cfg.rollout.engine, cfg.trainer.backend, cfg.trainer.deepspeed.zero_stage) == ("vllm", "deepspeed", 3)
    defaults = load_config(environ={})
    assert (defaults.rollout.engine, defaults.trainer.backend, defaults.rollout.device) == ("continuous", "torch", "cpu")
    with pytest.raises(ConfigError):
        load_config(overrides=["trainer.deepspeed.zero_stage=two"], environ={})

