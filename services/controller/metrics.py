"""``GET /metrics``: the run in Prometheus's text format, named by Prometheus's conventions.

* Cumulative counts are counters named ``..._total`` (episodes published, finished by status, env
  interactions, generated tokens, restarts); figures that go up and down are gauges.
* Units are in the name, in base units (``_seconds``, ``_ratio``): a trainer figure ``train/step_s``
  is ``jetrl_trainer_step_seconds``.
* One family per quantity: every trainer figure is its own family (``jetrl_trainer_loss``,
  ``jetrl_trainer_grad_norm``, ...), per-task ones with a ``task`` label, never one family whose
  ``name`` label holds the quantity.

Throughput is what Prometheus derives from the counters: ``rate(jetrl_env_interactions_total[1m])``
(env steps/s per task), ``rate(jetrl_rollout_generated_tokens_total[1m])`` (tokens/s the policy
sampled), ``rate(jetrl_episodes_finished_total[1m])``; each rollout replica's own counters carry its
``replica`` label. ``tests/controller/test_prometheus.py`` checks a scrape with ``promtool check metrics``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.controller.controller import Controller


def metric_name(*parts: str) -> str:
    """``jetrl_<parts>`` in snake case, a trailing ``_s`` unit spelled ``_seconds``."""
    name = "_".join(re.sub(r"[^a-zA-Z0-9_]", "_", p).strip("_").lower() for p in ("jetrl", *parts) if p)
    return re.sub(r"_s$", "_seconds", name)


class _Families:
    """Families by name, each created on first use with its type, help and label names."""

    def __init__(self) -> None:
        self.by_name: dict[str, Metric] = {}

    def add(self, kind: type[Metric], name: str, help_text: str, labels: dict[str, str], value: float) -> None:
        family = self.by_name.get(name)
        if family is None:
            family = self.by_name[name] = kind(name, help_text, labels=list(labels))
        family.add_metric(list(labels.values()), float(value))


class RunCollector(Collector):
    """Everything from the controller's books and the latest reports, read at each scrape."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    def collect(self) -> Iterator[Metric]:
        c, s = self.controller, self.controller.status()
        f = _Families()
        f.add(GaugeMetricFamily, "jetrl_policy_version", "latest published policy version", {}, s["policy_version"])
        f.add(CounterMetricFamily, "jetrl_trainer_steps", "training steps the trainer has reported", {},
              c.trainer_step)
        f.add(CounterMetricFamily, "jetrl_trajectories_duplicate", "trajectories seen twice (deduplicated)", {},
              s["duplicate_trajectories"])
        f.add(CounterMetricFamily, "jetrl_episodes_lost", "episodes whose jobs never reported back", {},
              s["episodes_lost"])
        f.add(GaugeMetricFamily, "jetrl_run_failed", "1 when the controller's plan has failed (see /status)", {},
              float(s["state"].startswith("failed")))
        for task, t in s["tasks"].items():
            label = {"task": task}
            f.add(CounterMetricFamily, "jetrl_episodes_published", "episodes published as jobs", label, t["published"])
            f.add(CounterMetricFamily, "jetrl_episodes_succeeded", "finished episodes that succeeded", label,
                  t["succeeded"])
            for status, n in sorted(t["statuses"].items()):
                f.add(CounterMetricFamily, "jetrl_episodes_finished", "finished episodes by final status",
                      {"task": task, "status": status}, n)
            f.add(GaugeMetricFamily, "jetrl_episodes_inflight", "episodes published and not finished", label,
                  s["inflight_by_task"].get(task, 0))
            f.add(GaugeMetricFamily, "jetrl_task_success_ratio", "success rate of finished episodes", label,
                  t["success_rate"])
            f.add(GaugeMetricFamily, "jetrl_task_reward_mean", "mean reward of finished episodes", label,
                  t["mean_reward"])
            f.add(CounterMetricFamily, "jetrl_env_interactions", "env interact calls of finished episodes (turns)",
                  label, t["turns"])
            f.add(CounterMetricFamily, "jetrl_rollout_generated_tokens",
                  "tokens the policy sampled in finished episodes", label, t["generated_tokens"])
        for service, count in s["service_restarts"].items():
            if service != "total":  # a sum is PromQL's to make
                f.add(CounterMetricFamily, "jetrl_service_restarts", "restarts of a service by `jetrl up`",
                      {"service": service}, count)
        for report in list(c.latest_metrics.values()):
            if report.role == "rollout":
                self._rollout(f, report.replica_id, report.values)
        self._trainer(f, s["trainer"])
        yield from f.by_name.values()

    @staticmethod
    def _rollout(f: _Families, replica: str, values: dict[str, float]) -> None:
        label = {"replica": replica}
        for key, value in values.items():
            if key == "rollout/active_episodes":
                f.add(GaugeMetricFamily, "jetrl_rollout_active_episodes", "episodes a replica is playing", label, value)
            elif key == "rollout/episodes_done":
                f.add(CounterMetricFamily, "jetrl_rollout_episodes", "episodes a replica has finished", label, value)
            elif key.startswith("rollout/turns_"):
                f.add(CounterMetricFamily, "jetrl_rollout_turns", "turns a replica generated, by engine source",
                      {"replica": replica, "source": key.removeprefix("rollout/turns_")}, value)
            elif key.startswith("engine/"):  # the continuous engine's running totals
                f.add(CounterMetricFamily, metric_name("rollout_engine", key.removeprefix("engine/")),
                      f"the continuous engine's {key.removeprefix('engine/')} so far", label, value)

    @staticmethod
    def _trainer(f: _Families, values: dict[str, Any]) -> None:
        """The latest step's figures: ``train/<x>`` is ``jetrl_trainer_<x>``; ``task/<t>/<x>`` is
        ``jetrl_trainer_task_<x>{task=t}``; ``task/<t>/adv_hist/<i>`` one family with a ``bin`` label."""
        for key, value in values.items():
            parts = key.split("/")
            if parts[0] == "train" and len(parts) == 2:
                f.add(GaugeMetricFamily, metric_name("trainer", parts[1]), f"trainer {key} at its latest step", {},
                      value)
            elif parts[0] == "task" and len(parts) == 3:
                f.add(GaugeMetricFamily, metric_name("trainer_task", parts[2]),
                      f"trainer task/<task>/{parts[2]} at its latest step", {"task": parts[1]}, value)
            elif parts[0] == "task" and len(parts) == 4:
                f.add(GaugeMetricFamily, metric_name("trainer_task", parts[2]),
                      f"trainer task/<task>/{parts[2]}/<bin> at its latest step", {"task": parts[1], "bin": parts[3]},
                      value)


def run_registry(controller: Controller) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)  # per app: several controllers (tests) never collide
    registry.register(RunCollector(controller))
    return registry
