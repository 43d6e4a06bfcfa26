"""Status API: ``GET /status`` (JSON) and ``GET /metrics`` (Prometheus text), served by litestar; the
dashboard and trajectory viewer (``services/controller/dashboard.py``) on the same server."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

from litestar import Litestar, MediaType, Request, Response, get
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from services.controller.controller import Controller
from services.controller.dashboard import dashboard_routes
from services.controller.metrics import run_registry

PAGES = ("/", "/dashboard")


def bearer_guard(token: str) -> Callable[[Request[Any, Any, Any]], Awaitable[Response[Any] | None]]:
    """Refuse (401) a request without ``Authorization: Bearer <token>`` (or ``?token=<token>``, for the
    dashboard in a browser: the page passes it on to its API calls); compared in constant time. Only
    ``/static`` (the page's script and style, in the repository for anyone to read) is open."""
    expected = f"Bearer {token}".encode()

    async def check(request: Request[Any, Any, Any]) -> Response[Any] | None:
        if request.url.path.startswith("/static/"):
            return None
        given = request.headers.get("authorization", "").encode("utf-8", "replace")
        if hmac.compare_digest(given, expected):
            return None
        # a browser opening /dashboard?token=... (EventSource cannot send headers)
        query = f"Bearer {request.query_params.get('token', '')}".encode("utf-8", "replace")
        if hmac.compare_digest(query, expected):
            return None
        if request.url.path in PAGES:  # a person at a browser: say where the token is
            return Response("This run's dashboard needs its token: open the link `jetrl up` printed "
                            "(/dashboard?token=...); the token is in <run>/controller.token.\n", status_code=401,
                            media_type=MediaType.TEXT, headers={"WWW-Authenticate": "Bearer"})
        # JSON whatever the route's own media type (/metrics is text: a dict there would be a 500)
        return Response({"error": "missing or wrong bearer token"}, status_code=401, media_type=MediaType.JSON,
                        headers={"WWW-Authenticate": "Bearer"})

    return check


def create_app(controller: Controller, token: str = "") -> Litestar:
    """``token``: every request must carry it as a bearer token (``controller.http_token``); empty = open."""
    registry = run_registry(controller)

    @get("/status")
    async def status() -> dict[str, Any]:
        return controller.status()

    @get("/metrics")
    async def metrics() -> Response[bytes]:
        # the content type as Prometheus's own exposition gives it, once (litestar would add a second charset)
        return Response(generate_latest(registry), headers={"content-type": CONTENT_TYPE_LATEST})

    return Litestar([status, metrics, *dashboard_routes(controller)],
                    before_request=bearer_guard(token) if token else None)
