"""What ``jetrl up``, ``sft``, ``eval`` and ``probe`` print while a run goes (one line per training step, an
eval's progress bar) and when an eval ends (its tables)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import structlog

from jetrl.access import dashboard_link
from jetrl.outcome import RunOutcome, WaitNotice
from jetrl.supervisor import CrashLoop, Supervisor
from shared.auth import controller_token
from shared.bus import connect
from shared.config import JetRLConfig
from shared.messages import BadMessage, MetricsReport, decode, encode
from shared.progress import Progress, format_duration
from shared.signing import verifier_for
from shared.subjects import Subjects

log = structlog.get_logger()


def bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


async def follow_progress(cfg: JetRLConfig, url: str, sup: Supervisor, stop: asyncio.Event,
                           main_role: str = "trainer") -> int:
    subjects = Subjects(cfg.nats.prefix)
    # admin: besides reading, `jetrl up` reports its restarts on metrics.supervisor (it made the users)
    nc = await connect(cfg.nats, "jetrl-up", url=url, role="admin")
    reports: asyncio.Queue[MetricsReport] = asyncio.Queue()

    async def on_metrics(msg: Any) -> None:
        try:
            await reports.put(decode(msg.data, MetricsReport))
        except BadMessage:
            pass

    await nc.subscribe(subjects.metrics("trainer"), cb=on_metrics)
    outcome = RunOutcome(verifier_for(cfg.nats, "controller"))
    await outcome.follow(nc, subjects)
    started, rc = time.monotonic(), 0
    evaluation = EvalProgress(sup.run_dir, token=controller_token(cfg.controller)) if main_role == "controller" \
        else None
    url_file, announced = sup.run_dir / "controller.url", False
    waiting, stepped = WaitNotice(sup.run_dir, controller_token(cfg.controller)), False
    last_report = 0.0
    try:
        while not stop.is_set():
            if not announced and url_file.is_file():
                announced = True
                print(f"dashboard: {dashboard_link(url_file.read_text().strip(), controller_token(cfg.controller))}"
                      "  (live charts, replicas, trajectories)", flush=True)
            if evaluation is not None:
                await evaluation.poll()
            if not stepped:  # a first start may wait minutes for an env to build its data: say so
                await waiting.poll()
            try:
                r = await asyncio.wait_for(reports.get(), timeout=1.0)
                stepped = True
                tasks = sorted({k.split("/")[1] for k in r.values if k.startswith("task/") and k.endswith("/success")})
                per_task = "  ".join(f"{t}: success {r.values[f'task/{t}/success']:.2f} "
                                     f"reward {r.values[f'task/{t}/reward']:.2f}" for t in tasks)
                # with trainer.filter_flat_groups a step consumes more episodes than it trains on
                trained = int(r.values.get("train/trajectories", 0))
                seen = int(sum(r.values.get(f"task/{t}/episodes", 0) for t in tasks))
                episodes = f"episodes {seen} ({trained} trained)" if seen > trained else f"episodes {trained}"
                elapsed = time.monotonic() - started
                eta = elapsed / max(r.step, 1) * max(cfg.trainer.steps - r.step, 0)
                print(f"{bar(r.step, cfg.trainer.steps)}  step {r.step}  {per_task}  "
                      f"loss {r.values.get('train/loss', 0.0):+.4f}  {episodes}  "
                      f"{elapsed:.0f}s  eta {format_duration(eta)}", flush=True)
            except TimeoutError:
                pass
            if outcome.failure is not None:
                print(outcome.line(sup.run_dir), file=sys.stderr, flush=True)
                rc = 1
                break
            main = sup.procs[main_role]
            if main.poll() is not None and main.returncode == 0:
                if main_role == "trainer":
                    print(f"training finished: {cfg.trainer.steps} steps in {time.monotonic() - started:.0f}s; "
                          f"run directory {sup.run_dir}", flush=True)
                break
            try:
                restarted = sup.supervise(finished=None)
            except CrashLoop as exc:
                print(f"jetrl up: run failed: {exc}", file=sys.stderr, flush=True)
                rc = 1
                break
            if (restarted or time.monotonic() - last_report > 5.0) and sup.restarts and nc.is_connected:
                last_report = time.monotonic()
                try:  # the controller shows it in /status and /metrics; lost while NATS is down, sent again later
                    await nc.publish(subjects.metrics("supervisor"), encode(sup.report()))
                except Exception as exc:
                    log.warning("supervisor_report_failed", error=repr(exc))
    finally:
        if evaluation is not None and evaluation.bar is not None:
            evaluation.bar.close()
        await nc.close()
    return rc


class EvalProgress:
    """`jetrl eval` / `probe`: finished episodes against the controller's plan, per task, with an ETA
    (read from its /status every few seconds; a bar on a terminal, a line every 10 s otherwise)."""

    def __init__(self, run_dir: Path, every_s: float = 2.0, token: str = "") -> None:
        self.run_dir, self.every_s, self.token = run_dir, every_s, token
        self.bar: Progress | None = None
        self._last = 0.0

    async def poll(self) -> None:
        if time.monotonic() - self._last < self.every_s:
            return
        self._last = time.monotonic()
        try:
            url = (self.run_dir / "controller.url").read_text().strip()
            status = await asyncio.to_thread(get_json, f"{url}/status", self.token)
        except (OSError, ValueError):
            return  # the controller is not up yet
        planned = status.get("eval_planned") or {}
        if not planned:
            return
        if self.bar is None:
            self.bar = Progress("jetrl eval", total=sum(planned.values()), unit="episodes")
        done = {t: min(status["tasks"].get(t, {}).get("finished", 0), n) for t, n in planned.items()}
        self.bar.set(sum(done.values()), "  ".join(f"{t} {done[t]}/{n}" for t, n in sorted(planned.items())))


def get_json(url: str, token: str = "") -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=2) as resp:
        return json.load(resp)


def print_eval(report: dict[str, Any]) -> None:
    """One table per pass: per task, then per level and kind within it."""
    for name, by_task in report.items():
        print(f"\n{name}: {'task':18s} {'episodes':>8s} {'success':>8s} {'95% CI':>13s} {'well-formed':>11s} "
              f"{'turns':>6s}  {'pass@k' if name == 'sampled' else ''}")
        for task, r in by_task.items():
            lo, hi = r["success_ci95"]
            pass_k = next((f"{k} {v:.3f} [{r[k + '_ci95'][0]:5.3f},{r[k + '_ci95'][1]:5.3f}]" for k, v in r.items()
                           if k.startswith("pass@") and not k.endswith("_ci95")), "")
            unfinished = "" if r.get("complete", True) else f"  (stopped: {r['episodes']} of {r['planned']} episodes)"
            print(f"{'':{len(name) + 2}s}{task:18s} {r['episodes']:8d} {r['success']:8.3f} [{lo:5.3f},{hi:5.3f}] "
                  f"{r['well_formed_rate']:11.3f} {r['mean_turns']:6.2f}  {pass_k}{unfinished}")
            for part in ("by_level", "by_kind"):
                for key, b in r[part].items():
                    if len(r[part]) > 1:
                        label = f"  {part[3:]} {key}"
                        blo, bhi = b.get("success_ci95", (float("nan"), float("nan")))
                        print(f"{'':{len(name) + 2}s}{label:18s} {b['episodes']:8d} {b['success']:8.3f} "
                              f"[{blo:5.3f},{bhi:5.3f}] {b['well_formed_rate']:11.3f}")
