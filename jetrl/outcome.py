"""How ``jetrl up`` learns that its run has failed: the controller's ``failed`` event on ``run.control``
(its plan cannot go on: an env that never answered, a task without training tasks), said again every
few seconds, so a reader that connects late still hears it. The run then ends at once, with the reason
in one line and a non-zero exit."""

from __future__ import annotations

from typing import Any

import structlog
from nats.aio.client import Client

from shared.messages import BadMessage, RunControl, decode
from shared.signing import SignatureError, Verifier
from shared.subjects import Subjects

log = structlog.get_logger()


class RunOutcome:
    """The first failure the controller announced, if any."""

    def __init__(self, verifier: Verifier | None = None) -> None:
        self.failure: str | None = None
        self.verifier = verifier  # the controller's signature, where the run has keys (shared/signing.py)
        self.refused = 0

    async def follow(self, nc: Client, subjects: Subjects) -> None:
        async def on_control(msg: Any) -> None:
            try:
                event = decode(msg.data, RunControl)
                if self.verifier is not None:
                    self.verifier.check(event)
            except BadMessage:
                return
            except SignatureError as exc:  # not the controller's word: the run goes on
                self.refused += 1
                log.warning("unsigned_run_control_refused", reason=str(exc))
                return
            if event.event == "failed" and self.failure is None:
                self.failure = str(event.info.get("reason") or "the controller gave no reason")

        await nc.subscribe(subjects.run_control, cb=on_control)

    def line(self, run_dir: Any) -> str:
        return f"jetrl: run failed: {self.failure} (controller log: {run_dir}/logs/controller.log)"
