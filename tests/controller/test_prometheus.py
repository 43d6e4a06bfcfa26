"""The controller's ``/metrics`` as Prometheus reads it (services/controller/metrics.py), against a real
nats-server with real messages on the real subjects: behind a token it answers 401 (not a 500), its
content type carries one charset, prometheus_client's own parser reads it, and ``promtool check metrics``
(Debian's prometheus package; `make system-deps` installs it) finds nothing against Prometheus's naming
rules: counters ``_total``, units in names, one family per quantity."""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.controller.api import create_app
from services.controller.controller import Controller
from shared.bus import publish_metrics
from shared.messages import MetricsReport, encode
from tests.controller.test_dashboard import served, traj


async def scrape(nc, config, subjects) -> tuple[int, str, str, str]:
    """(status without the token, its content type, the scrape's content type, the scrape's text)."""
    js = nc.jetstream()
    controller = Controller(nc, js, subjects, config, "controller-test")
    await controller.follow_metrics_and_weights()
    tracker = asyncio.create_task(controller.track_trajectories())
    try:
        for t in (traj("e-db", "db", 1.0, [1, 2, 3]), traj("e-kg", "kg", 0.0, [0, 3], invalid=1.0)):
            await js.publish(subjects.traj(t.task), encode(t), headers={"Nats-Msg-Id": t.episode_id})
        await publish_metrics(nc, subjects, "trainer", "trainer-x", 4, {
            "train/loss": 0.5, "train/step_s": 2.5, "train/grad_norm": 1.25, "train/staleness_mean": 1.5,
            "task/db/success": 0.5, "task/db/adv_hist/0": 3.0, "task/db/adv_hist/1": 1.0})
        await publish_metrics(nc, subjects, "rollout", "rollout-x", 4, {
            "rollout/episodes_done": 7.0, "rollout/active_episodes": 2.0, "rollout/turns_current": 12.0,
            "engine/sampled_tokens": 300.0, "engine/busy_s": 4.5})
        await nc.publish(subjects.metrics("supervisor"), encode(MetricsReport(
            role="supervisor", replica_id="jetrl-up", step=2, values={"restarts/rollout-0": 2.0,
                                                                       "restarts/total": 2.0})))
        for _ in range(100):
            await asyncio.sleep(0.05)
            if len(controller.finished) == 2 and len(controller.latest_metrics) == 3:
                break
        async with served(create_app(controller, "tok")) as client:
            refused = await client.get("/metrics")
            ok = await client.get("/metrics", headers={"Authorization": "Bearer tok"})
    finally:
        tracker.cancel()
    assert ok.status_code == 200
    return refused.status_code, refused.headers["content-type"], ok.headers["content-type"], ok.text


async def test_metrics_follow_prometheus_conventions(nc, config, subjects) -> None:
    refused, refused_type, content_type, text = await scrape(nc, config, subjects)
    assert refused == 401 and refused_type.startswith("application/json")
    assert content_type.count("charset") == 1 and content_type.startswith("text/plain; version=")

    families = {f.name: f for f in text_string_to_metric_families(text)}
    kinds = {name: f.type for name, f in families.items()}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    # cumulative counts are counters (exposed as ..._total), the rest gauges
    for name in ("jetrl_episodes_published", "jetrl_episodes_finished", "jetrl_episodes_succeeded",
                 "jetrl_env_interactions", "jetrl_rollout_generated_tokens", "jetrl_service_restarts",
                 "jetrl_rollout_episodes", "jetrl_rollout_engine_sampled_tokens", "jetrl_trainer_steps"):
        assert kinds[name] == "counter", name
    assert samples[("jetrl_episodes_finished_total", (("status", "completed"), ("task", "db")))] == 1
    assert samples[("jetrl_env_interactions_total", (("task", "db"),))] == 3  # one interact call a turn
    assert samples[("jetrl_rollout_generated_tokens_total", (("task", "db"),))] == 6
    assert samples[("jetrl_service_restarts_total", (("service", "rollout-0"),))] == 2
    assert not any(key[0] == "jetrl_service_restarts_total" and ("service", "total") in key[1] for key in samples)
    assert samples[("jetrl_rollout_engine_busy_seconds_total", (("replica", "rollout-x"),))] == 4.5
    # one family per trainer quantity, the unit in its name
    assert kinds["jetrl_trainer_step_seconds"] == "gauge" and kinds["jetrl_trainer_loss"] == "gauge"
    assert samples[("jetrl_trainer_step_seconds", ())] == 2.5
    assert samples[("jetrl_trainer_staleness_mean", ())] == 1.5
    assert samples[("jetrl_trainer_task_success", (("task", "db"),))] == 0.5
    assert samples[("jetrl_trainer_task_adv_hist", (("bin", "1"), ("task", "db")))] == 1.0
    assert not any("name" in f.samples[0].labels for f in families.values() if f.samples)
    assert all(name.startswith("jetrl_") for name in families)

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("no promtool (Debian's prometheus package; `make system-deps` installs it as root)")
    lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert lint.returncode == 0 and not lint.stdout.strip() and not lint.stderr.strip(), lint.stdout + lint.stderr
