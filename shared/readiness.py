"""What an env replica tells the registry while it builds its data, before it serves.

A first start may build task data for minutes (a generated knowledge graph and its question sets: ~3 min on 2 busy cores).
The replica heartbeats from the moment it is connected, with ``state = "building"`` and the stage and
percent of the build in progress (every ``shared.progress.Progress`` of the build reports here), then
``state = "ready"`` once it serves. The controller reads these heartbeats and waits for a replica that
is building instead of giving up after ``controller.env_wait_s``; ``jetrl up`` and the dashboard show
the stage.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from shared.progress import listen

T = TypeVar("T")

BUILDING, READY = "building", "ready"


def is_building(info: dict[str, Any]) -> bool:
    return info.get("state") == BUILDING


def describe_build(info: dict[str, Any]) -> str:
    """``building, questions 43 %`` (or without the percent while a stage has no count)."""
    stage, percent = info.get("build") or "", info.get("percent")
    text = f"building, {stage}" if stage else "building"
    return f"{text} {percent:.0f} %" if isinstance(percent, (int, float)) else text


async def build_announced(info: dict[str, Any], build: Callable[[], T]) -> T:
    """Run ``build`` in a worker thread while ``info`` (the dict the heartbeat loop sends) says what
    stage it is at; ``info["state"]`` is ``ready`` once it returns."""

    def on_progress(label: str, done: int, total: int | None) -> None:
        info.update(build=label, percent=round(100.0 * min(done, total) / total, 1) if total else None)

    info.update(state=BUILDING, build="", percent=None)
    unlisten = listen(on_progress)
    try:
        result = await asyncio.to_thread(build)
    finally:
        unlisten()
    for key in ("build", "percent"):
        info.pop(key, None)
    info["state"] = READY
    return result
