"""How ``jetrl up`` learns that its run has failed: the controller's ``failed`` event on ``run.control``
(its plan cannot go on: an env that never answered, a task without training tasks), said again every
few seconds, so a reader that connects late still hears it. The run then ends at once, with the reason
in one line and a non-zero exit."""

from __future__ import annotations

from typing import Any

from nats.aio.client import Client

from shared.messages import BadMessage, RunControl, decode
from shared.subjects import Subjects


class RunOutcome:
    """The first failure the controller announced, if any."""

    def __init__(self) -> None:
        self.failure: str | None = None

    async def follow(self, nc: Client, subjects: Subjects) -> None:
        async def on_control(msg: Any) -> None:
            try:
                event = decode(msg.data, RunControl)
            except BadMessage:
                return
            if event.event == "failed" and self.failure is None:
                self.failure = str(event.info.get("reason") or "the controller gave no reason")

        await nc.subscribe(subjects.run_control, cb=on_control)

    def line(self, run_dir: Any) -> str:
        return f"jetrl: run failed: {self.failure} (controller log: {run_dir}/logs/controller.log)"
