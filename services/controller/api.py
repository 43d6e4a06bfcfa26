"""Status API: ``GET /status`` (JSON) and ``GET /metrics`` (Prometheus text), served by litestar."""

from __future__ import annotations

from typing import Any

from litestar import Litestar, MediaType, Response, get
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from services.controller.controller import Controller


def create_app(controller: Controller) -> Litestar:
    registry = CollectorRegistry()  # per app, so several controllers (tests) never collide
    episodes = Gauge("jetrl_episodes", "episodes by state", ["state"], registry=registry)
    task_episodes = Gauge("jetrl_task_episodes", "episodes by task and state", ["task", "state"], registry=registry)
    task_success = Gauge("jetrl_task_success_rate", "success rate of finished episodes", ["task"], registry=registry)
    policy = Gauge("jetrl_policy_version", "latest published policy version", registry=registry)
    duplicates = Gauge("jetrl_duplicate_trajectories", "trajectories seen twice (deduplicated)", registry=registry)
    trainer = Gauge("jetrl_trainer", "latest trainer metrics", ["name"], registry=registry)
    restarts = Gauge("jetrl_service_restarts", "restarts of a service by `jetrl up` (service=total: all)",
                     ["service"], registry=registry)

    @get("/status")
    async def status() -> dict[str, Any]:
        return controller.status()

    @get("/metrics", media_type=MediaType.TEXT)
    async def metrics() -> Response[bytes]:
        s = controller.status()
        episodes.labels("published").set(s["episodes_published"])
        episodes.labels("finished").set(s["episodes_finished"])
        episodes.labels("inflight").set(s["episodes_inflight"])
        for task, t in s["tasks"].items():
            task_episodes.labels(task, "published").set(t["published"])
            task_episodes.labels(task, "finished").set(t["finished"])
            task_success.labels(task).set(t["success_rate"])
        policy.set(s["policy_version"])
        duplicates.set(s["duplicate_trajectories"])
        for name, value in s["trainer"].items():
            trainer.labels(name).set(value)
        for service, count in s["service_restarts"].items():
            restarts.labels(service).set(count)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return Litestar([status, metrics])
