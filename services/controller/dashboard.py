"""The operator's web UI on the controller's HTTP server: a live dashboard and a trajectory viewer.

* ``GET /`` and ``GET /dashboard``: one HTML page (``static/index.html``) with a little vanilla JS
  (``static/dashboard.js``) that draws its charts as inline SVG. No build step, no CDN: every file the
  page loads is served from ``/static`` here.
* ``GET /api/dashboard``: every number the dashboard shows (``RunBoard.snapshot``); the page polls it.
* ``GET /api/episodes?task=&split=&status=&min_reward=&max_reward=&min_version=&max_version=&limit=``:
  running and finished episodes, newest first (``status=running``: only those still playing).
* ``GET /api/episodes/{id}``: one episode turn by turn, from the EPISODES stream; events that cannot be
  read are listed (``unreadable_events``), and an episode with nothing else answers 422 with the reason.
* ``GET /api/episodes/{id}/follow``: the same as server-sent events, one per event, live until the
  episode finishes (``event: turn``, then ``event: end``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

from litestar import Request, Router, get
from litestar.exceptions import ClientException, NotFoundException, ValidationException
from litestar.response import Redirect, Response, ServerSentEvent
from litestar.response.sse import ServerSentEventMessage
from litestar.static_files import create_static_files_router

from services.controller.board import EpisodeFilter, event_json
from services.controller.controller import Controller

STATIC = Path(__file__).resolve().parent / "static"


def dashboard_routes(controller: Controller) -> list[Any]:
    board = controller.board

    @get("/", include_in_schema=False)
    async def root(request: Request[Any, Any, Any]) -> Redirect:
        token = request.query_params.get("token")  # the link with the token keeps it
        return Redirect(path="/dashboard" + (f"?token={quote(token)}" if token else ""))

    @get("/dashboard", include_in_schema=False)
    async def page() -> Response[bytes]:
        return Response((STATIC / "index.html").read_bytes(), media_type="text/html; charset=utf-8")

    @get("/api/dashboard")
    async def snapshot() -> dict[str, Any]:
        return board.snapshot(controller.status())

    @get("/api/episodes")
    async def episodes(request: Request[Any, Any, Any]) -> dict[str, Any]:
        q = request.query_params

        def number(name: str, kind: type[float] | type[int]) -> Any:
            text = q.get(name) or ""
            try:
                return kind(text) if text else None
            except ValueError:
                raise ValidationException(f"query parameter {name}={text!r} is not a number") from None

        f = EpisodeFilter(task=q.get("task") or None, split=q.get("split") or None, status=q.get("status") or None,
                          min_reward=number("min_reward", float), max_reward=number("max_reward", float),
                          min_version=number("min_version", int), max_version=number("max_version", int),
                          limit=max(1, min(number("limit", int) or 100, 2000)))
        return {"episodes": board.list_episodes(f), "tasks": sorted({e.task for e in board.episodes.values()}
                                                                    | {e.task for e in board.live.values()}),
                "statuses": sorted({e.status for e in board.episodes.values()})}

    @get("/api/episodes/{episode_id:str}")
    async def episode(request: Request[Any, Any, Any]) -> dict[str, Any]:
        episode_id = request.path_params["episode_id"]
        out = await board.read_episode(controller.js, episode_id)
        if not out["turns"] and out["summary"] is None and not out["running"]:
            if out["unreadable_events"]:  # there is such an episode, but nothing of it can be shown
                raise ClientException(status_code=422, detail=f"episode {episode_id!r}: its events in the EPISODES "
                                      f"stream cannot be read ({out['unreadable_events'][0]['reason']})")
            raise NotFoundException(f"no episode {episode_id!r} in the EPISODES stream")
        return out

    @get("/api/episodes/{episode_id:str}/follow")
    async def follow(request: Request[Any, Any, Any]) -> ServerSentEvent:
        episode_id = request.path_params["episode_id"]

        async def events() -> AsyncIterator[ServerSentEventMessage]:
            async for event in board.episode_events(controller.js, episode_id, follow=True):
                yield ServerSentEventMessage(event="turn", data=json.dumps(dict(event_json(event), turn=event.turn)))
            yield ServerSentEventMessage(event="end", data=json.dumps({"episode_id": episode_id}))

        return ServerSentEvent(events())

    static = create_static_files_router(path="/static", directories=[STATIC], include_in_schema=False)
    return [Router(path="/", route_handlers=[root, page, snapshot, episodes, episode, follow]), static]
