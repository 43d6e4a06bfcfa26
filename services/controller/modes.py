"""What the controller does once it serves: evaluate and exit, or plan episodes until it is stopped."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import structlog

from services.controller.controller import Controller
from shared.lifecycle import supervise

log = structlog.get_logger()


async def evaluate(controller: Controller, stop: asyncio.Event, run_dir: Path) -> None:
    """Every task of the eval split, then the report in <run>/eval.json (``jetrl eval`` waits for it); stopped
    before the end, what finished in <run>/eval.partial.json (each task's report says if it is ``complete``)."""
    try:
        report = await controller.run_eval(stop)
    except RuntimeError as exc:  # no env answered: say so and wait to be stopped, not crash-loop
        controller.fail(exc)
        await stop.wait()
        return
    if stop.is_set():  # stopped before the end: what finished, in a file of its own (eval.json is a whole report)
        (run_dir / "eval.partial.json").write_text(json.dumps(report, indent=2) + "\n")
        log.info("eval_stopped", complete={name: [t for t, r in by_task.items() if r["complete"]]
                                           for name, by_task in report.items()})
        return
    (run_dir / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    log.info("eval_done", report=report)


async def publish_until_stopped(controller: Controller, stop: asyncio.Event) -> None:
    """Publish the plan's episodes until ``stop``; a plan that fails is logged and shown on /status
    (``Controller.fail``), and the controller keeps serving so that ``jetrl up`` hears why."""
    publisher = supervise(controller.publish_jobs(stop), "job_publisher", None)

    def publisher_done(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            controller.fail(task.exception())

    publisher.add_done_callback(publisher_done)
    await stop.wait()
    publisher.cancel()
    log.info("controller_stopping", **{k: v for k, v in controller.status().items() if k != "trainer"})
