"""Signed control messages (shared/signing.py), on a real nats-server: whatever reaches the controller, a
rollout or `jetrl up` past the bus's permissions (a delivery the server makes on a client's behalf, a leaked
credential), an announcement, a policy-KV entry, a TrainingFinished or a run.control message that is not
signed by its one signer is refused, counted and dead-lettered, and the run goes on with the signed ones."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import pytest

from jetrl.outcome import RunOutcome
from services.controller.controller import Controller
from services.rollout.engine import Generation
from services.rollout.worker import RolloutWorker
from services.trainer.trainer import Trainer
from shared.config import ModelConfig
from shared.messages import (
    DeadLetter,
    RunControl,
    TrainingFinished,
    Trajectory,
    TurnInfo,
    WeightsAnnouncement,
    decode,
    encode,
)
from shared.model import load_model, load_tokenizer, quiet_transformers, resolve_model
from shared.signing import (
    SignatureError,
    Signer,
    Verifier,
    generate_signing_keys,
    signer_for,
    signing_key_path,
    verifier_for,
)

HUGE = 10**6


@pytest.fixture(scope="module")
def model_path():
    quiet_transformers()
    return resolve_model(ModelConfig())


def signed_config(config, tmp_path: Path, signer: str | None = None):
    public = generate_signing_keys(tmp_path / "keys")
    config.nats.trainer_public_key, config.nats.controller_public_key = public["trainer"], public["controller"]
    if signer:
        config.nats.signing_key_file = str(signing_key_path(tmp_path / "keys", signer))
    return config


def test_a_signature_holds_for_one_message_of_one_run(tmp_path: Path) -> None:
    public = generate_signing_keys(tmp_path)
    assert generate_signing_keys(tmp_path) == public  # a resumed run keeps its keys
    assert oct(signing_key_path(tmp_path, "trainer").stat().st_mode & 0o777) == "0o600"
    signer = Signer.from_file(signing_key_path(tmp_path, "trainer"), "run-a")
    check = Verifier(public["trainer"], "run-a", "trainer").check
    done = signer.sign(TrainingFinished(step=3, policy_version=3, replica_id="t"))
    assert check(decode(encode(done), TrainingFinished)) == done
    for bad, why in ((TrainingFinished(step=3, policy_version=3, replica_id="t"), "unsigned"),
                     (msgspec.structs.replace(done, step=HUGE), "not the trainer's"),
                     (msgspec.structs.replace(done, signature="00" * 64), "not the trainer's"),
                     (msgspec.structs.replace(done, signature="zz"), "not the trainer's")):
        with pytest.raises(SignatureError, match=why):
            check(bad)
    with pytest.raises(SignatureError):  # the same message, another run
        Verifier(public["trainer"], "run-b", "trainer").check(done)
    with pytest.raises(SignatureError):  # the controller's key does not vouch for the trainer
        Verifier(public["controller"], "run-a", "trainer").check(done)
    assert Verifier("", "run-a", "trainer").check(bad) is bad  # an unsigned run checks nothing


async def test_the_controller_and_jetrl_up_refuse_unsigned_control_messages(nc, config, subjects, tmp_path) -> None:
    signed_config(config, tmp_path)
    config.trainer.steps = 5
    controller = Controller(nc, nc.jetstream(), subjects, config, "controller-test")
    await controller.follow_metrics_and_weights()
    outcome = RunOutcome(verifier_for(config.nats, "controller"))
    await outcome.follow(nc, subjects)
    forged = TrainingFinished(step=HUGE, policy_version=HUGE, replica_id="trainer-forged")
    await nc.publish(subjects.training_finished, encode(forged))
    await nc.publish(subjects.weights_published, encode(WeightsAnnouncement(
        version=HUGE, object_name="x", digest="0" * 64, size=1, dtype="float32")))
    await nc.publish(subjects.run_control, encode(RunControl(event="failed", info={"reason": "forged"})))
    deadline = time.monotonic() + 5
    while controller.refused_signatures < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)
    assert not controller.training_done and controller.policy_version == 0
    assert controller.status()["refused_signatures"] == 2 and outcome.failure is None and outcome.refused == 1
    info = await nc.jetstream().stream_info(subjects.dlq_stream, subjects_filter=subjects.dead_letter("controller"))
    assert info.state.messages == 2
    trainer_signer = Signer.from_file(signing_key_path(tmp_path / "keys", "trainer"), subjects.prefix)
    await nc.publish(subjects.training_finished, encode(trainer_signer.sign(TrainingFinished(
        step=5, policy_version=5, replica_id="trainer-x"))))
    controller_signed = signer_for(signed_config(config, tmp_path, "controller").nats)
    await nc.publish(subjects.run_control, encode(controller_signed.sign(RunControl(event="failed",
                                                                                   info={"reason": "real"}))))
    while (not controller.training_done or outcome.failure is None) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert controller.trainer_finished.step == 5 and outcome.failure == "real"


async def test_a_rollout_loads_the_trainers_signed_weights_and_refuses_a_forged_entry(
        nc, config, subjects, model_path, tmp_path) -> None:
    signed_config(config, tmp_path, "trainer")
    js = nc.jetstream()
    trainer = Trainer(nc, js, subjects, config.trainer, load_model(model_path), tmp_path / "trainer", "trainer-test")
    trainer.publisher.signer = signer_for(config.nats)
    config.rollout.engine = "oracle"  # no engine: what matters is what it takes for the policy's newest version
    worker = RolloutWorker(nc, js, subjects, config.rollout, None, load_tokenizer(model_path), "rollout-test")
    worker.trainer_verifier = verifier_for(config.nats, "trainer")
    taken: list[WeightsAnnouncement] = []

    async def load(note: WeightsAnnouncement) -> None:
        taken.append(note)

    worker._load = load  # type: ignore[method-assign]  # what follow_weights hands over to be loaded
    follower = asyncio.create_task(worker.follow_weights(poll_s=0.2))
    await asyncio.sleep(0.3)
    kv = await js.key_value(subjects.policy_kv)
    forged = WeightsAnnouncement(version=HUGE, object_name="policy-forged", digest="0" * 64, size=4, dtype="float32")
    await kv.put(subjects.policy_version_key, encode(forged))  # past the bus's permissions, as it may come
    trainer.policy_version = 1
    await trainer.publisher.publish(trainer.model, trainer.policy_version)
    deadline = time.monotonic() + 20
    while not taken and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)
    follower.cancel()
    assert [n.version for n in taken] == [1] and taken[0].signature
    assert worker.refused_signatures == 1  # counted once, though the poll read it again
    letters = await js.pull_subscribe(subjects.dead_letter("rollout"), stream=subjects.dlq_stream)
    letter = decode((await letters.fetch(1, timeout=2))[0].data, DeadLetter)
    assert "unsigned weights" in letter.reason and letter.origin_subject == subjects.policy_entry
    # a restarted trainer takes the signed entry's digest as its own: turns still played with it are checked
    fresh = Trainer(nc, js, subjects, config.trainer, trainer.model, tmp_path / "trainer", "trainer-2")
    fresh.policy_verifier = verifier_for(config.nats, "trainer")
    await fresh.adopt_announced_version()
    assert fresh.policy_version == 1 and fresh.publisher.digests == {1: taken[0].digest}


async def test_the_trainer_refuses_a_turn_that_names_other_weights_than_it_published(
        nc, config, subjects, model_path, tmp_path) -> None:
    js = nc.jetstream()
    trainer = Trainer(nc, js, subjects, config.trainer, load_model(model_path), tmp_path / "trainer", "trainer-test")
    trainer.policy_version = 1
    await trainer.publisher.publish(trainer.model, trainer.policy_version)
    digest = trainer.publisher.digests[1]
    kv = await js.key_value(subjects.policy_kv)
    assert decode((await kv.get(subjects.policy_version_key)).value, WeightsAnnouncement).digest == digest

    def played(version: int, weights_digest: str) -> Trajectory:
        return Trajectory(episode_id="e", group_id="g", task="db", task_id="t", split="train", group_size=1,
                          tokens=[1, 2, 3], logprobs=[0.0, -0.5, -0.1], loss_mask=[0, 1, 1], prompt_len=1,
                          turns=[TurnInfo(start=1, end=3, policy_version=version, engine_id="e",
                                          weights_digest=weights_digest)], reward=1.0, status="completed",
                          replica_id="r")

    assert trainer.intake.check(played(1, digest)) is None and trainer.intake.check(played(0, "")) is None
    for wrong in ("", "blake3:" + "0" * 64):  # none named, or weights the trainer never published as version 1
        assert "is not the digest of the weights published as version 1" in trainer.intake.check(played(1, wrong))
    assert trainer.counters["train/digest_mismatch"] == 2
    # the rollout side: its engine's turns name the digest of the version it loaded
    config.rollout.engine = "oracle"
    worker = RolloutWorker(nc, js, subjects, config.rollout, None, load_tokenizer(model_path), "rollout-test")
    worker.weights_digests[1] = digest
    assert worker.with_digest(Generation([5], [-0.1], "stop", "e", 1)).weights_digest == digest
    assert worker.with_digest(Generation([5], [-0.1], "stop", "e", 0)).weights_digest == ""
