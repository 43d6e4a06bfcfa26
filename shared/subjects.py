"""Every NATS name JetRL uses: subjects, streams, consumers, KV and object-store buckets.

A subject string anywhere else in the code base is a bug. docs/architecture.md draws the map.

Data flows one way: controller -> JOBS -> rollout <-> env services -> TRAJ -> trainer, and only the
weight announcement runs back (trainer -> rollout). Everything is namespaced under a *prefix*
(default ``jetrl``) so that several runs, or several tests, can share one nats-server.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


def check_token(value: str, what: str) -> str:
    """A subject token: letters, digits, '_' and '-' only (no dots, spaces or wildcards)."""
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {value!r} is not a valid subject token (letters, digits, _ and - only)")
    return value


def role_family(role: str) -> str:
    """The NATS user role a service role belongs to: ``env-<task>`` (a task's env) is an ``env``."""
    return role.split("-", 1)[0]


@dataclass(frozen=True)
class Subjects:
    """All names for one run namespace. ``Subjects("jetrl")`` is the default run."""

    prefix: str = "jetrl"

    def __post_init__(self) -> None:
        check_token(self.prefix, "prefix")

    # ---- streams (upper-case names derived from the prefix so runs do not collide) ----
    @property
    def _stream_prefix(self) -> str:
        return self.prefix.upper().replace("-", "_")

    @property
    def jobs_stream(self) -> str:
        """Work-queue stream of episode assignments (controller -> rollout)."""
        return f"{self._stream_prefix}_JOBS"

    @property
    def episodes_stream(self) -> str:
        """Every action and observation of every episode, in order (audit, replay, live view)."""
        return f"{self._stream_prefix}_EPISODES"

    @property
    def traj_stream(self) -> str:
        """Finished trajectories (rollout -> trainer, and any tool that wants them)."""
        return f"{self._stream_prefix}_TRAJ"

    @property
    def dlq_stream(self) -> str:
        """Dead letters: messages that could not be decoded or processed, with the reason."""
        return f"{self._stream_prefix}_DLQ"

    # ---- consumers ----
    rollout_consumer: str = "rollout"
    """The one durable pull consumer on JOBS that every rollout replica shares (load balancing)."""

    def rollout_lane_consumer(self, task: str) -> str:
        """A task's own durable consumer on JOBS (``rollout.task_concurrency``: per-task lanes), shared by
        every rollout replica; a run uses either these or ``rollout_consumer``, never both (JOBS is a work queue)."""
        return f"{self.rollout_consumer}-{check_token(task, 'task')}"

    trainer_consumer: str = "trainer"
    """The trainer's durable pull consumer on TRAJ."""
    controller_consumer: str = "controller"
    """The controller's durable consumer on TRAJ (episode lifecycle: completed episodes)."""

    # ---- subjects ----
    def jobs(self, task: str = "*") -> str:
        return f"{self.prefix}.jobs.{task}"

    def action(self, task: str = "*", episode_id: str = "*") -> str:
        return f"{self.prefix}.act.{task}.{episode_id}"

    def observation(self, task: str = "*", episode_id: str = "*") -> str:
        return f"{self.prefix}.obs.{task}.{episode_id}"

    def episode_events(self, task: str = "*", episode_id: str = "*") -> list[str]:
        return [self.action(task, episode_id), self.observation(task, episode_id)]

    @property
    def episode_stream_subjects(self) -> list[str]:
        return [f"{self.prefix}.act.>", f"{self.prefix}.obs.>"]

    def traj(self, task: str = "*") -> str:
        return f"{self.prefix}.traj.{task}"

    def dead_letter(self, origin: str = "*") -> str:
        return f"{self.prefix}.dlq.{origin}"

    @property
    def weights_published(self) -> str:
        return f"{self.prefix}.weights.published"

    @property
    def training_finished(self) -> str:
        """The trainer's own "training done" (``TrainingFinished``): the only thing that ends a run."""
        return f"{self.prefix}.trainer.finished"

    def metrics(self, role: str = "*") -> str:
        return f"{self.prefix}.metrics.{role}"

    @property
    def run_control(self) -> str:
        """Run-level announcements from the controller (plan started, run finished)."""
        return f"{self.prefix}.run.control"

    # ---- env services (NATS micro services, request/reply, not persisted) ----
    def env_service_name(self, task: str) -> str:
        return f"{self.prefix}-env-{task}"

    def env_start(self, task: str) -> str:
        """Queue-group endpoint: any replica of the env may take a new session."""
        return f"{self.prefix}.env.{task}.start"

    def env_tasks(self, task: str) -> str:
        """Queue-group endpoint: the task ids of a split (the controller samples from them)."""
        return f"{self.prefix}.env.{task}.tasks"

    def env_health(self, task: str) -> str:
        return f"{self.prefix}.env.{task}.health"

    def env_interact(self, task: str, replica_id: str) -> str:
        """Replica-pinned endpoint: a session lives on the replica that started it."""
        return f"{self.prefix}.env.{task}.{replica_id}.interact"

    def env_cancel(self, task: str, replica_id: str) -> str:
        return f"{self.prefix}.env.{task}.{replica_id}.cancel"

    def env_oracle(self, task: str, replica_id: str) -> str:
        """The scripted expert's next assistant message for a session (demonstrations, tests)."""
        return f"{self.prefix}.env.{task}.{replica_id}.oracle"

    # ---- generation pool (cross-policy sampling) ----
    def gen_pool(self, pool: str = "default") -> str:
        """Queue-group endpoint served by every engine of a pool: a request reaches one engine drawn
        at random (NATS picks a queue member at random), current or stale alike."""
        return f"{self.prefix}.gen.{check_token(pool, 'pool')}"

    gen_queue_group: str = "engines"

    # ---- KV and object store ----
    @property
    def policy_kv(self) -> str:
        """KV bucket; key ``version`` holds the latest published policy version."""
        return f"{self.prefix}-policy"

    policy_version_key: str = "version"

    @property
    def policy_entry(self) -> str:
        """The subject a policy-KV write of ``policy_version_key`` is published on (NATS ADR-8): readers
        subscribe to it instead of watching the bucket through a consumer of their own."""
        return f"$KV.{self.policy_kv}.{self.policy_version_key}"

    @property
    def registry_kv(self) -> str:
        """KV bucket of live replicas, one key per replica, expiring when heartbeats stop."""
        return f"{self.prefix}-registry"

    @staticmethod
    def registry_key(role: str, replica_id: str) -> str:
        """A replica's registry key, ``<user role>.<replica_id>`` (``env.env-mytask-host-12`` for role ``env-mytask``): the
        role is read from the key, which that role's users alone may write (shared/auth.py), never from the
        heartbeat's body."""
        return f"{role_family(check_token(role, 'role'))}.{check_token(replica_id, 'replica id')}"

    def registry_entries(self, role: str = "*", replica_id: str = "*") -> str:
        """The subjects registry writes are published on (``$KV.<bucket>.<role>.<replica_id>``)."""
        return f"{self.registry_entry_prefix}{role}.{replica_id}"

    @property
    def registry_entry_prefix(self) -> str:
        return f"$KV.{self.registry_kv}."

    @property
    def weights_bucket(self) -> str:
        """Object-store bucket holding policy weights (safetensors), one object per version."""
        return f"{self.prefix}-weights"

    @staticmethod
    def weights_object(version: int) -> str:
        return f"policy-{version:08d}.safetensors"

    # ---- JetStream advisories (NATS's own names) ----
    @staticmethod
    def max_deliveries_advisory(stream: str, consumer: str) -> str:
        """Published by the server when a message of ``stream`` ran out of deliveries on ``consumer``
        (JSON with ``stream_seq``): the rollout turns an exhausted job into a dead letter and an
        ``env_error`` trajectory, so its group completes."""
        return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{consumer}"

    # ---- object-store internals (NATS ADR-20), for readers that bypass nats-py's ObjectStore ----
    @staticmethod
    def object_stream(bucket: str) -> str:
        """The stream behind an object-store bucket; ``shared.objectread.read_object`` pulls chunks from it."""
        return f"OBJ_{bucket}"

    @staticmethod
    def object_chunks(bucket: str, nuid: str) -> str:
        """The subject holding one object's chunks (``nuid`` from the object's info), in order."""
        return f"$O.{bucket}.C.{nuid}"
