"""Held messages on a real nats-server (``shared/keepalive.py``): the trainer's intake keeps the trajectories
of a waiting group from being redelivered past their ack wait while it lives, and they come back within one
ack wait once it stops touching them. (A rollout job touched through one slow turn: tests/rollout/test_serve.py.)"""

from __future__ import annotations

import asyncio

import pytest
from nats.errors import TimeoutError as NatsTimeout

from services.trainer.intake import Intake
from shared.consumers import bind_durable, trainer_consumer
from shared.messages import Trajectory, TurnInfo, encode


def trajectory(episode_id: str) -> Trajectory:
    return Trajectory(episode_id=episode_id, group_id="g1", task="db", task_id="t", split="train", group_size=2,
                      tokens=[1, 2, 3], logprobs=[0.0, -0.5, -0.5], loss_mask=[0, 1, 1], prompt_len=1,
                      turns=[TurnInfo(start=1, end=3, engine_id="e", policy_version=0)], reward=1.0,
                      status="completed", replica_id="r")


async def test_the_trainer_keeps_a_waiting_groups_trajectories_until_it_stops(nc, subjects, config) -> None:
    config.trainer.ack_wait_s = 1.0
    js = nc.jetstream()
    sub = await bind_durable(js, subjects.traj_stream, trainer_consumer(subjects, config.trainer), may_create=True)
    await js.publish(subjects.traj("db"), encode(trajectory("e1")))
    intake = Intake(js, subjects, config.trainer, {}, {}, None)
    (msg,) = await sub.fetch(1, timeout=5)
    await intake.take(msg)  # its group waits for a second episode: held, not acked
    assert intake.held() == [msg]
    stop = asyncio.Event()
    keeper = asyncio.create_task(intake.keep_held(stop))
    await asyncio.sleep(2.5)  # 2.5 ack waits
    with pytest.raises(NatsTimeout):  # nothing redelivered while the intake holds it
        await sub.fetch(1, timeout=0.5)
    stop.set()
    await asyncio.wait_for(keeper, timeout=2.0)  # ends within one round once told to stop
    (again,) = await sub.fetch(1, timeout=3.0)  # untouched now: back within its ack wait
    assert again.data == msg.data and again.metadata.num_delivered == 2
    await again.ack_sync()
