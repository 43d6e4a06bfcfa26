"""The operator's dashboard and trajectory viewer (services/controller/dashboard.py).

* Against a real nats-server, in one process: real messages on the real subjects (trajectories on
  TRAJ, events on EPISODES, trainer and rollout metrics, a dead letter, heartbeats) and the JSON the
  page reads: per-task series, rates, staleness, advantages, invalid tool calls, replicas with their
  weight versions, DLQ counts; episode list filters; one episode turn by turn; the live follow (SSE).
* In a real browser (Debian's chromium, headless, driven by playwright): a real small run of every
  service; the dashboard's charts and replica table show real numbers, a trajectory opens turn by
  turn; screenshots go to the run directory. Skips with the reason when chromium or playwright is
  missing (the Makefile's system-deps installs chromium where it can).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from services.controller.api import create_app
from services.controller.controller import Controller
from shared.bus import heartbeat_loop, publish_metrics
from shared.config import JetRLConfig, save_config
from shared.delivery import dead_letter
from shared.messages import ActionEvent, ObservationEvent, Trajectory, TurnInfo, encode
from tests.procs import stop_processes

REPO = Path(__file__).resolve().parents[2]
DOCS_IMG = REPO / "docs" / "img"


def traj(episode: str, task: str, reward: float, versions: list[int], invalid: float = 0.0,
         split: str = "train") -> Trajectory:
    n = 2 + 2 * len(versions)
    turns = [TurnInfo(start=2 + 2 * i, end=4 + 2 * i, engine_id=f"engine-{v % 2}", policy_version=v)
             for i, v in enumerate(versions)]
    mask = [0, 0] + [1] * (2 * len(versions))
    return Trajectory(episode_id=episode, group_id="g-" + episode, task=task, task_id=f"{task}-1", split=split,
                      group_size=1, tokens=list(range(n)), logprobs=[0.0, 0.0] + [-0.5] * (2 * len(versions)),
                      loss_mask=mask, prompt_len=2, turns=turns, reward=reward, status="completed",
                      replica_id="rollout-x", metrics={"invalid_actions": invalid})


@asynccontextmanager
async def served(app: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The app on a real socket in this event loop, as the controller serves it (its handlers read NATS
    with the controller's client, so they must run on the loop that client belongs to)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    # a browser's keep-alive connections must not hold the shutdown: at most 5 s for them
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.05)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=20) as client:
            yield client
    finally:
        server.should_exit = True
        await task


async def test_dashboard_json_from_real_streams(nc, config, subjects) -> None:
    js = nc.jetstream()
    controller = Controller(nc, js, subjects, config, "controller-test")
    await controller.follow_metrics_and_weights()
    jobs = [asyncio.create_task(c) for c in (
        controller.track_trajectories(), controller.watch_replicas(every_s=0.2),
        controller.board.follow(nc, js, lambda: len(controller.finished), every_s=0.2),
        heartbeat_loop(js, subjects, "rollout", "rollout-x", {"engine_id": "engine-0"}, every_s=0.2))]
    try:
        controller.policy_version = 3
        # one finished episode per task, each on its real subject; a running one on EPISODES only
        for t in (traj("e-db", "db", 1.0, [1, 2, 3]), traj("e-kg", "kg", 0.0, [0, 3], invalid=1.0, split="test")):
            await js.publish(subjects.traj(t.task), encode(t), headers={"Nats-Msg-Id": t.episode_id})
        for turn in range(2):
            await js.publish(subjects.action("db", "e-live"), encode(ActionEvent(
                episode_id="e-live", task="db", turn=turn, replica_id="rollout-x", engine_id=f"engine-{turn}",
                policy_version=2 + turn, opening=[{"role": "user", "content": "How many rows?"}] if turn == 0 else [],
                message={"role": "assistant", "content": f"thinking {turn}",
                                                  "tool_calls": [{"function": {"name": "execute_sql",
                                                                               "arguments": "{\"sql\": \"SELECT 1\"}"}}]})))
            await js.publish(subjects.observation("db", "e-live"), encode(ObservationEvent(
                episode_id="e-live", task="db", turn=turn, messages=[{"role": "tool", "content": f"rows {turn}"}],
                reward=0.0, finish=False, status="running")))
        nested = b"\x91" * 1000 + b"\x00"  # an event no reader can decode: listed, never a 500
        await js.publish(subjects.observation("db", "e-live"), nested)
        await js.publish(subjects.action("db", "e-bad"), nested)
        t0 = time.time()
        for step in (1, 2):
            await publish_metrics(nc, subjects, "trainer", "trainer-x", step, {
                "task/db/success": 0.5 * step, "task/db/reward": 0.25 * step, "train/step_s": 1.0,
                "train/staleness_hist/3": float(step), "train/staleness_hist/7": 2.0,
                "task/db/adv_mean_raw": 0.1, "task/db/adv_std_raw": 0.9,
                **{f"task/db/adv_hist/{i}": float(i) for i in range(10)}})
        await publish_metrics(nc, subjects, "rollout", "rollout-x", 2, {"rollout/episodes_done": 5.0})
        await dead_letter(js, subjects, service="trainer", origin_subject="x", reason="bad", payload=b"?")
        await dead_letter(js, subjects, service="trainer", origin_subject="x", reason="bad", payload=b"?")
        await dead_letter(js, subjects, service="rollout", origin_subject="x", reason="bad", payload=b"?")
        for _ in range(50):
            await asyncio.sleep(0.2)
            if (len(controller.finished) == 2 and sum(controller.board.dlq.values()) == 3 and controller.replicas
                    and "e-live" in controller.board.live and len(controller.board.trainer_rows) == 2):
                break

        async with served(create_app(controller)) as client:
            page = await client.get("/dashboard")
            assert page.status_code == 200 and "/static/dashboard.js" in page.text
            assert "function lineChart" in (await client.get("/static/dashboard.js")).text
            d = (await client.get("/api/dashboard")).json()
            assert d["series"]["task/db/success"] == [[1, 0.5], [2, 1.0]]
            assert d["series"]["train/step_s"] == [[1, 1.0], [2, 1.0]]
            assert len(d["busy"]) == 1 and 0 < d["busy"][0][1] <= 1.0
            assert d["tasks"] == ["db", "kg"]
            # staleness on arrival against policy v3: db turns 2, 1, 0 behind; kg 3 and 0
            assert d["staleness"]["arrival"][:4] == [2, 1, 1, 1] and sum(d["staleness"]["arrival"]) == 5
            # what the trainer trained on, summed over its steps' reports: 1 + 2 turns 3 behind, 2 + 2 turns 7
            assert d["staleness"]["trained"] == [0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0]
            assert d["advantages"]["db"]["hist"] == [float(i) for i in range(10)]
            assert d["invalid_tool_calls"]["kg"]["rate"] == 0.5 and d["invalid_tool_calls"]["db"]["rate"] == 0.0
            assert d["dlq"] == {"rollout": 1, "trainer": 2}
            rollout = next(r for r in d["replicas"] if r["replica_id"] == "rollout-x")
            assert rollout["policy_version"] == 2 and rollout["age_s"] < 5
            assert d["rates"] and d["rates"][-1]["episodes_per_s"] > 0 and d["rates"][-1]["tokens_per_s"] > 0
            assert d["live_episodes"] == 1 and time.time() - t0 < 30

            listed = (await client.get("/api/episodes")).json()
            assert [e["episode_id"] for e in listed["episodes"]] == ["e-live", "e-kg", "e-db"]
            assert listed["tasks"] == ["db", "kg"]
            ids = {q: [e["episode_id"] for e in (await client.get(f"/api/episodes?{q}")).json()["episodes"]]
                   for q in ("task=kg", "split=test", "status=running", "min_reward=0.5", "max_reward=0.5",
                             "min_version=1", "max_version=2", "status=completed&task=db")}
            assert ids == {"task=kg": ["e-kg"], "split=test": ["e-kg"], "status=running": ["e-live"],
                           "min_reward=0.5": ["e-db"], "max_reward=0.5": ["e-kg"], "min_version=1": ["e-live", "e-db"],
                           "max_version=2": [], "status=completed&task=db": ["e-db"]}
            one = (await client.get("/api/episodes/e-live")).json()
            assert one["running"] and one["task"] == "db"
            assert one["opening"] == [{"role": "user", "content": "How many rows?"}]  # turn 0 carries the task
            assert [(t["turn"], t["engine_id"], t["policy_version"]) for t in one["turns"]] == [
                (0, "engine-0", 2), (1, "engine-1", 3)]
            assert one["turns"][1]["action"]["tool_calls"][0]["function"]["name"] == "execute_sql"
            assert one["turns"][1]["observation"] == [{"role": "tool", "content": "rows 1"}]
            assert (await client.get("/api/episodes/nope")).status_code == 404
            assert [e["reason"] for e in one["unreadable_events"]] == ["expected a msgpack map, got list"]
            bad = await client.get("/api/episodes/e-bad")
            assert bad.status_code == 422 and "expected a msgpack map" in bad.json()["detail"], bad.text

            # follow: the two turns so far, then the final one as it is published, then the end
            async def finish_later() -> None:
                await asyncio.sleep(0.5)
                await js.publish(subjects.observation("db", "e-live"), encode(ObservationEvent(
                    episode_id="e-live", task="db", turn=2, messages=[], reward=1.0, finish=True,
                    status="completed")))

            finisher = asyncio.create_task(finish_later())
            body = (await asyncio.wait_for(client.get("/api/episodes/e-live/follow"), timeout=15)).text
            await finisher
            events = [line.removeprefix("event: ") for line in body.splitlines() if line.startswith("event: ")]
            assert events == ["turn"] * 5 + ["end"]
            assert '"finish": true' in body and '"reward": 1.0' in body
    finally:
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)


# ------------------------------------------------------------------------------------------ browser
def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.load(resp)


async def test_panels_in_a_browser_show_what_was_trained_and_why_the_run_failed(nc, config, subjects) -> None:
    """Chromium on the page, the controller in this process on real NATS streams, behind its token: the
    staleness panel shows what the trainer trained on (7 versions behind) beside what arrived (0), a failed
    run is a red pill with its reason in full, an env replica still building says how far it is."""
    browser_path = _chromium()
    if browser_path is None:
        pytest.skip("no chromium on this machine (apt-get install chromium; `make system-deps` does it as root)")
    playwright_api = pytest.importorskip("playwright.async_api", reason="PyPI playwright is not installed")
    js = nc.jetstream()
    controller = Controller(nc, js, subjects, config, "controller-test")
    await controller.follow_metrics_and_weights()
    building = {"task": "kg", "state": "building", "build": "kg test questions", "percent": 43.0}
    jobs = [asyncio.create_task(c) for c in (
        controller.track_trajectories(), controller.watch_replicas(every_s=0.2),
        heartbeat_loop(js, subjects, "env-kg", "env-kg-test", building, every_s=0.2))]
    try:
        controller.policy_version = 9
        # a trainer-bound run: episodes arrive fresh (played with v9), the trainer trains on them 7 versions on
        await js.publish(subjects.traj("db"), encode(traj("e-db", "db", 1.0, [9, 9])), headers={"Nats-Msg-Id": "e-db"})
        await publish_metrics(nc, subjects, "trainer", "trainer-x", 2, {
            "train/step_s": 1.0, "train/staleness_mean": 7.0, "train/staleness_hist/7": 5.0})
        reason = "env service for task 'kg' did not answer within 120s (controller.env_wait_s)"
        controller.fail(RuntimeError(reason))
        for _ in range(50):
            await asyncio.sleep(0.1)
            if controller.finished and controller.board.trainer_rows and controller.replicas:
                break
        async with served(create_app(controller, "tok")) as client, playwright_api.async_playwright() as pw, \
                AsyncExitStack() as stack:
            browser = await pw.chromium.launch(executable_path=browser_path, headless=True, timeout=60000,
                                               args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
            stack.push_async_callback(browser.close)
            page = await browser.new_page(viewport={"width": 1400, "height": 1200})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(f"{client.base_url}/dashboard?token=tok")
            await page.wait_for_selector("#chart-staleness svg", state="attached", timeout=20000)
            trained = await page.eval_on_selector_all("#chart-staleness rect title", "ts => ts.map(t => t.textContent)")
            arrival = await page.eval_on_selector_all("#chart-staleness-arrival rect title",
                                                      "ts => ts.map(t => t.textContent)")
            assert "7: 5" in trained and "0: 0" in trained, trained
            assert "0: 2" in arrival and "7: 0" in arrival, arrival
            pill = await page.query_selector("#run-state")
            assert await pill.get_attribute("class") == "pill pill-bad" and (await pill.inner_text()).startswith("failed")
            color = await page.eval_on_selector("#run-state", "e => getComputedStyle(e).backgroundColor")
            assert color == "rgb(198, 40, 40)"  # red, not the grey of a running run
            assert await page.inner_text("#run-problem") == f"The run failed: {reason}"
            await page.wait_for_selector("table.replicas tr[data-role='env-kg']", timeout=20000)
            row = await page.eval_on_selector("table.replicas tr[data-role='env-kg']",
                                              "r => [...r.cells].map(c => c.innerText)")
            assert row[-1] == "building, kg test questions 43 %", row
            assert not errors, errors
    finally:
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        if controller._failure_announcer is not None:
            controller._failure_announcer.cancel()


@pytest.mark.slow
def test_dashboard_in_a_real_browser_during_a_real_run(config: JetRLConfig, tmp_path: Path) -> None:
    browser_path = _chromium()
    if browser_path is None:
        pytest.skip("no chromium on this machine (apt-get install chromium; `make system-deps` does it as root)")
    playwright_api = pytest.importorskip("playwright.sync_api", reason="PyPI playwright is not installed")

    # A small real run: every service its own process. The trainer keeps stepping while the page is read
    # (stopped with the rest at the end): a trainer done with its steps leaves the replicas table, and
    # with 3 steps it sometimes left before the page looked for it.
    cfg = config
    cfg.run.tasks = {"db": 1.0}
    cfg.controller.group_size, cfg.controller.max_inflight = 2, 4
    cfg.rollout.max_new_tokens, cfg.rollout.concurrency = 12, 2
    cfg.trainer.steps, cfg.trainer.min_groups, cfg.trainer.lr = 1000, 1, 1e-3
    cfg.trainer.kl_coef = 0.01  # all-zero rewards still make a real step: versions only come from optimizer steps
    cfg.env.num_train_tasks, cfg.env.num_test_tasks = 8, 4
    roles = [("env-db", ["services.envs", "db"]), ("rollout", ["services.rollout"]),
             ("trainer", ["services.trainer"]), ("controller", ["services.controller"])]
    update_docs = bool(os.environ.get("JETRL_UPDATE_DOCS_IMG"))
    # an untrained model's episodes end at its first unusable tool call: short episodes, quick steps
    cfg.env.invalid_action_ends_episode = not update_docs
    if update_docs:  # the pictures in docs/: cross-policy turns from a second (stale) engine, in two colours
        cfg.rollout.cross_policy_prob = 0.5
        roles.append(("stale", ["services.rollout", "--rollout.engine_kind=stale", "--rollout.serve_jobs=false"]))
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = tmp_path / "dash.toml"
    save_config(cfg, cfg_path)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    started = time.monotonic()
    for name, module in roles:
        with open(run_dir / f"{name}.log", "ab") as fh:
            procs[name] = subprocess.Popen([sys.executable, "-m", *module, "--config", str(cfg_path)], cwd=REPO,
                                           stdout=fh, stderr=subprocess.STDOUT,
                                           env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "controller.url").is_file():
            assert time.monotonic() < deadline and procs["controller"].poll() is None, "controller did not start"
            time.sleep(0.2)
        url = (run_dir / "controller.url").read_text().strip()
        d: dict = {}
        while True:  # two trainer steps and some finished episodes: every chart has something to draw
            try:
                d = _get(f"{url}/api/dashboard")
            except OSError:  # the URL is written before the server listens
                d = {}
            if d and len(d["series"].get("task/db/success", [])) >= 2 and d["status"]["episodes_finished"] >= 4:
                break
            dead = [n for n, p in procs.items() if p.poll() is not None]
            assert not dead and time.monotonic() < deadline, f"run stalled: {dead} {d.get('status')}"
            time.sleep(0.5)

        ready_s = time.monotonic() - started
        print(f"ready after {ready_s:.0f} s: {d['status']}", flush=True)
        with playwright_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=browser_path, headless=True,
                                         args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
            page = browser.new_page(viewport={"width": 1400, "height": 1500})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{url}/dashboard")
            # charts drawn from the run's numbers: a polyline per task, points counted on the element
            page.wait_for_selector("#chart-success svg polyline[data-series='db']", state="attached", timeout=20000)
            assert int(page.get_attribute("#chart-success", "data-points")) >= 2
            assert int(page.get_attribute("#chart-step-time", "data-points")) >= 2
            page.wait_for_selector("#chart-tokens-rate svg polyline", state="attached", timeout=20000)
            assert int(page.get_attribute("#chart-staleness", "data-points")) > 0  # turns counted
            finished = int(page.inner_text(".card[data-key='episodes finished'] .v"))
            assert finished >= 4
            db_row = page.inner_text("table.tasks tbody tr").split()  # db, published, finished, ...
            assert db_row[0] == "db" and int(db_row[2]) >= 4
            # replicas with a heartbeat age in seconds; the rollout's weight version comes with its metrics
            page.wait_for_function("""() => { const r = document.querySelector("table.replicas tr[data-role='rollout']");
                                       return r && /^[1-9]\\d*$/.test(r.cells[4].innerText); }""", timeout=20000)
            cells = page.eval_on_selector("table.replicas tr[data-role='rollout']",
                                          "r => [...r.cells].map(c => c.innerText)")
            role, replica, _, heartbeat_age, version, engine = cells
            assert role == "rollout" and replica.startswith("rollout-") and replica in engine
            assert heartbeat_age.endswith(" s") and 0 <= float(heartbeat_age[:-2]) < 10
            assert int(version) >= 1  # its engine loaded a trained policy version
            roles = page.eval_on_selector_all("table.replicas tr[data-role]", "rs => rs.map(r => r.dataset.role)")
            assert {"controller", "trainer", "rollout", "env-db"} <= set(roles)
            page.wait_for_timeout(500)
            page.screenshot(path=str(run_dir / "dashboard.png"), full_page=True)

            # the trajectory viewer: the list, then one episode turn by turn with engine and version
            page.click("#nav-episodes")
            page.wait_for_selector("table.episodes tr[data-episode]", timeout=20000)
            page.select_option("#episode-filter select[name='task']", "db")
            page.click("#episode-filter button[type='submit']")
            page.wait_for_timeout(300)
            page.screenshot(path=str(run_dir / "trajectories.png"), full_page=True)
            episode_id = page.get_attribute("table.episodes tbody tr:not(:has(.status-running))", "data-episode")
            assert episode_id
            page.click(f"table.episodes tr[data-episode='{episode_id}']")
            page.wait_for_selector("#episode-turns .turn", timeout=20000)
            turns = page.query_selector_all("#episode-turns .turn")
            assert turns and all(t.get_attribute("data-engine") for t in turns)
            assert "policy v" in turns[0].inner_text() and episode_id in page.inner_text("#episode-title")
            assert page.query_selector("#episode-turns .turn pre.observation") is not None
            assert page.query_selector_all("#engine-legend .badge")  # the colour key of the engines
            assert page.inner_text("#episode-opening-messages pre.opening")  # the task the episode was about
            assert "[object" not in page.inner_text("body")
            page.screenshot(path=str(run_dir / "trajectory.png"), full_page=True)
            assert not errors, errors
            browser.close()
        print(f"run ready for the page after {ready_s:.0f} s; browser part {time.monotonic() - started - ready_s:.0f} s")
        if update_docs:  # refresh the pictures in docs/ from this run
            DOCS_IMG.mkdir(parents=True, exist_ok=True)
            for name in ("dashboard.png", "trajectories.png", "trajectory.png"):
                shutil.copy(run_dir / name, DOCS_IMG / name)
    finally:
        stop_processes(procs.values(), timeout_s=30)
