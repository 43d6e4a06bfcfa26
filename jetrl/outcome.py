"""How ``jetrl up`` learns that its run has failed: the controller's ``failed`` event on ``run.control``
(its plan cannot go on: an env that never answered, a task without training tasks), said again every
few seconds, so a reader that connects late still hears it. The run then ends at once, with the reason
in one line and a non-zero exit. And what the run waits for before its first step (an env replica that
builds its task data), so a first start that takes minutes does not look dead."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path
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


class WaitNotice:
    """While the controller waits for an env replica that builds its task data, a line every ``every_s`` with
    its ``/status`` state (``jetrl: waiting for env mytask: building, mytask test questions 43 %``); nothing otherwise."""

    def __init__(self, run_dir: Path, token: str = "", every_s: float = 15.0) -> None:
        self.run_dir, self.token, self.every_s = run_dir, token, every_s
        self._last = -every_s

    async def poll(self) -> str | None:
        if time.monotonic() - self._last < self.every_s:
            return None
        self._last = time.monotonic()
        try:
            url = (self.run_dir / "controller.url").read_text().strip()
            state = str((await asyncio.to_thread(self._status, f"{url}/status")).get("state", ""))
        except (OSError, ValueError):
            return None  # the controller is not up yet
        if not state.startswith("waiting"):
            return None
        print(f"jetrl: {state}", flush=True)
        return state

    def _status(self, url: str) -> Any:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=2) as resp:
            return json.load(resp)
