"""Status API: ``GET /status`` (JSON) and ``GET /metrics`` (Prometheus text), served by litestar; the
dashboard and trajectory viewer (``services/controller/dashboard.py``) on the same server."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

from litestar import Litestar, MediaType, Request, Response, get
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from services.controller.controller import Controller
from services.controller.dashboard import dashboard_routes

PUBLIC_PATHS = ("/", "/dashboard")


def bearer_guard(token: str) -> Callable[[Request[Any, Any, Any]], Awaitable[Response[Any] | None]]:
    """Refuse (401) a request without ``Authorization: Bearer <token>`` (or ``?token=<token>``, for the
    dashboard in a browser); compared in constant time."""
    expected = f"Bearer {token}".encode()

    async def check(request: Request[Any, Any, Any]) -> Response[Any] | None:
        if request.url.path in PUBLIC_PATHS or request.url.path.startswith("/static/"):
            return None  # the page and its script hold no data; every figure comes from a guarded /api call
        given = request.headers.get("authorization", "").encode("utf-8", "replace")
        if hmac.compare_digest(given, expected):
            return None
        # a browser opening /dashboard?token=... (EventSource cannot send headers); the page passes it on
        query = f"Bearer {request.query_params.get('token', '')}".encode("utf-8", "replace")
        if hmac.compare_digest(query, expected):
            return None
        return Response({"error": "missing or wrong bearer token"}, status_code=401,
                        headers={"WWW-Authenticate": "Bearer"})

    return check


def create_app(controller: Controller, token: str = "") -> Litestar:
    """``token``: every request must carry it as a bearer token (``controller.http_token``); empty = open."""
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

    return Litestar([status, metrics, *dashboard_routes(controller)],
                    before_request=bearer_guard(token) if token else None)
