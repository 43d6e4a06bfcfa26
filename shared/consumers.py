"""The durable consumers of a run, defined once: who reads which stream through which durable, with what
delivery settings. Where the server has per-role users (``shared.auth``) the admin creates every durable
(``jetrl up`` before any service starts, ``jetrl topology`` in compose) and a service only binds to its own:
a service that may create or update a consumer could redirect or starve another role's durable. On an open
server each service creates (or updates) its own, as ``declare_durables`` does for the admin.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import structlog
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from shared.config import JetRLConfig, RolloutConfig, TrainerConfig
from shared.subjects import Subjects

log = structlog.get_logger()

JOB_MAX_DELIVER = 5
"""Deliveries of one job before the server gives up on it (the rollout turns it into an ``env_error``)."""


def job_lanes(cfg: RolloutConfig, tasks: Sequence[str]) -> dict[str, int]:
    """Lane -> its slots per replica: one lane per task with ``rollout.task_concurrency``, else ``">"``
    (every task's jobs) alone."""
    caps = cfg.task_concurrency
    if not caps:
        return {">": cfg.concurrency}
    if not tasks:
        raise ValueError("rollout.task_concurrency needs the run's tasks (run.tasks)")
    return {task: caps.get(task, caps.get("*", cfg.concurrency)) for task in tasks}


def job_consumer_name(subjects: Subjects, lane: str) -> str:
    return subjects.rollout_consumer if lane == ">" else subjects.rollout_lane_consumer(lane)


def job_consumer(subjects: Subjects, cfg: RolloutConfig, lane: str) -> ConsumerConfig:
    """One lane's durable on JOBS, shared by every rollout replica."""
    return ConsumerConfig(durable_name=job_consumer_name(subjects, lane), ack_policy=AckPolicy.EXPLICIT,
                          ack_wait=cfg.job_ack_wait_s, max_deliver=JOB_MAX_DELIVER, deliver_policy=DeliverPolicy.ALL,
                          max_ack_pending=-1, filter_subject=subjects.jobs(lane))


def trainer_consumer(subjects: Subjects, cfg: TrainerConfig) -> ConsumerConfig:
    """The trainer's durable on TRAJ."""
    return ConsumerConfig(durable_name=subjects.trainer_consumer, ack_policy=AckPolicy.EXPLICIT,
                          ack_wait=cfg.ack_wait_s, max_deliver=cfg.max_deliver, deliver_policy=DeliverPolicy.ALL,
                          max_ack_pending=-1, filter_subject=subjects.traj(">"))


def controller_consumer(subjects: Subjects) -> ConsumerConfig:
    """The controller's durable on TRAJ (episode lifecycle)."""
    return ConsumerConfig(durable_name=subjects.controller_consumer, ack_policy=AckPolicy.EXPLICIT,
                          deliver_policy=DeliverPolicy.ALL, filter_subject=subjects.traj(">"), max_ack_pending=-1)


def run_durables(subjects: Subjects, cfg: JetRLConfig) -> list[tuple[str, ConsumerConfig]]:
    """(stream, config) of every durable the run's config asks for."""
    lanes = job_lanes(cfg.rollout, list(cfg.run.tasks))  # as each rollout replica computes them
    jobs = [(subjects.jobs_stream, job_consumer(subjects, cfg.rollout, lane)) for lane in lanes]
    return [*jobs, (subjects.traj_stream, trainer_consumer(subjects, cfg.trainer)),
            (subjects.traj_stream, controller_consumer(subjects))]


async def declare_durables(js: JetStreamContext, subjects: Subjects, cfg: JetRLConfig) -> None:
    """Create or update every durable of the run (the admin's part of the topology). A resumed run's
    durables get today's settings (ack wait, max deliver)."""
    for stream, config in run_durables(subjects, cfg):
        await js.add_consumer(stream, config)


async def bind_durable(js: JetStreamContext, stream: str, config: ConsumerConfig, *, may_create: bool,
                       wait_s: float = 120.0) -> JetStreamContext.PullSubscription:
    """Pull from the durable ``config.durable_name`` of ``stream``. ``may_create``: the client creates or
    updates it first (an open server); otherwise it only binds, waiting for the admin to have made it."""
    name = str(config.durable_name)
    if may_create:
        await js.add_consumer(stream, config)
    else:
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            try:
                await js.consumer_info(stream, name)
                break
            except NotFoundError:
                if asyncio.get_running_loop().time() > deadline:
                    raise RuntimeError(f"durable consumer {name} of stream {stream} was not created within "
                                       f"{wait_s:.0f} s: the admin creates every durable (jetrl up does; compose: "
                                       "the topology service, with the run's config)") from None
                log.info("waiting_for_durable", stream=stream, consumer=name)
                await asyncio.sleep(1.0)
    return await js.pull_subscribe_bind(durable=name, stream=stream)
