"""Fault suite: real processes, a real nats-server, real faults. ``make test-faults``.

* ``jetrl up`` with every service kind and the nats-server itself killed (SIGKILL) one after the other
  while it trains: the run reaches its last step; counted by episode id, no episode is lost (every job
  the controller published has its trajectory stored, or is still queued in JOBS for a later run) or
  stored twice, none ended ``env_error``, and every death was restarted and counted.
* >= 10,000 malformed messages over every subject a service consumes: no service crashes, and the
  run still trains afterwards.
* A schema-valid poison trajectory (a token id outside the vocabulary) is dead-lettered with the
  reason, and the trainer goes on.

The figures are in docs/benchmarks/faults.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from shared.bus import connect
from shared.config import JetRLConfig, save_config
from shared.envapi import EnvClient
from shared.messages import DeadLetter, EpisodeJob, Trajectory, TurnInfo, decode, encode
from shared.natsd import EmbeddedNats
from shared.subjects import Subjects
from tests.procs import log_tails

pytestmark = pytest.mark.faults

REPO = Path(__file__).resolve().parents[2]


def fault_config(run_dir: Path, steps: int) -> JetRLConfig:
    """The db task on the tiny model, small groups, short redelivery times: a fault costs seconds."""
    cfg = JetRLConfig()
    cfg.run.dir = str(run_dir)
    cfg.nats.prefix = "faults"
    cfg.run.tasks = {"db": 1.0}
    cfg.controller.group_size = 2
    cfg.controller.max_inflight = 4
    # no backlog: every step needs freshly played episodes, so a step after a fault proves the run recovered
    # from it, on a fast machine or a slow one
    cfg.controller.max_backlog = 2
    cfg.rollout.max_new_tokens = 12
    cfg.rollout.concurrency = 2
    cfg.rollout.job_ack_wait_s = 8.0
    cfg.rollout.env_timeout_s = 10.0
    cfg.env.num_train_tasks = 8
    cfg.env.num_test_tasks = 4
    cfg.env.invalid_action_ends_episode = True
    cfg.trainer.steps = steps
    cfg.trainer.min_groups = 1
    cfg.trainer.max_groups = 2
    cfg.trainer.lr = 1e-3
    cfg.trainer.ack_wait_s = 6.0
    cfg.supervisor.restart_backoff_s = 0.5
    return cfg


def children(pid: int) -> list[int]:
    """Direct children of a process (Linux /proc)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def steps_done(run_dir: Path) -> int:
    try:
        return max((json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()),
                   default=0)
    except (OSError, ValueError):
        return 0


async def stream_messages(nc, stream: str, subject: str) -> list[bytes]:
    """Every message of a stream subject (an ordered ephemeral read)."""
    js = nc.jetstream()
    info = await js.stream_info(stream)
    out: list[bytes] = []
    if not info.state.messages:
        return out
    sub = await js.subscribe(subject, ordered_consumer=True, stream=stream)
    try:
        while len(out) < info.state.messages:
            out.append((await sub.next_msg(timeout=5.0)).data)
    except Exception:
        pass
    await sub.unsubscribe()
    return out


async def account(run_dir: Path, prefix: str) -> dict[str, object]:
    """Restart the run's own JetStream store and count its episodes (``count_episodes``)."""
    with EmbeddedNats(run_dir / "nats", log_file=run_dir / "nats" / "audit.log") as url:
        nc = await connect(JetRLConfig().nats, "audit", url=url)
        try:
            return await count_episodes(nc, Subjects(prefix))
        finally:
            await nc.close()


async def count_episodes(nc, subjects: Subjects) -> dict[str, object]:
    """Count, by episode id: jobs published (JOBS' last sequence: the controller publishes each job once,
    deduplicated by episode id), jobs still queued, trajectories stored, and dead letters."""
    js = nc.jetstream()
    jobs_info = await js.stream_info(subjects.jobs_stream)
    queued = []  # a work-queue stream takes no ordered consumer: read what is left message by message
    if jobs_info.state.messages:
        for seq in range(jobs_info.state.first_seq, jobs_info.state.last_seq + 1):
            try:
                queued.append(decode((await js.get_msg(subjects.jobs_stream, seq)).data, EpisodeJob).episode_id)
            except Exception:  # acked and removed
                pass
    raw_trajs = await stream_messages(nc, subjects.traj_stream, subjects.traj(">"))
    trajs = [decode(d, Trajectory) for d in raw_trajs]
    letters = [decode(d, DeadLetter) for d in await stream_messages(nc, subjects.dlq_stream,
                                                                     subjects.dead_letter(">"))]
    stored = [t.episode_id for t in trajs]
    published = int(jobs_info.state.last_seq)
    return {"published": published, "queued": len(queued), "stored": len(set(stored)),
            "stored_twice": len(stored) - len(set(stored)),
            "lost": published - len(set(stored) | set(queued)),
            "env_error": sum(t.status == "env_error" for t in trajs),
            "dead_letters": len(letters), "statuses": sorted({t.status for t in trajs})}


def test_every_service_and_nats_killed_under_jetrl_up_the_run_finishes_and_loses_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    steps = 14
    cfg = fault_config(run_dir, steps)
    cfg_path = tmp_path / "faults.toml"
    save_config(cfg, cfg_path)
    out = open(tmp_path / "up.out", "w")
    up = subprocess.Popen([sys.executable, "-m", "jetrl.cli", "up", "--config", str(cfg_path), "--rollouts", "2"],
                          cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    # one fault at a time, each once the run has recovered from the one before: two training steps on
    # freshly played episodes after it; (kind, process to SIGKILL)
    plan = ["services.envs", "services.rollout", "services.trainer", "services.controller", "nats-server"]
    killed: list[tuple[str, int, int, float]] = []
    started = time.monotonic()
    last_step, last_kill = -1, 0.0
    try:
        while plan and up.poll() is None and time.monotonic() - started < 900:
            step = steps_done(run_dir)
            if step >= max(1, last_step + 2):
                victim = next((p for p in children(up.pid) if plan[0] in cmdline(p)), None)
                if victim is not None:
                    os.kill(victim, signal.SIGKILL)
                    last_step, last_kill = step, time.monotonic()
                    killed.append((plan.pop(0), step, victim, round(last_kill - started, 1)))
            time.sleep(0.2)
        rc = up.wait(timeout=max(10, 900 - (time.monotonic() - started)))
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.wait(timeout=60)
        out.close()
    elapsed = time.monotonic() - started
    text = (tmp_path / "up.out").read_text()
    logs = log_tails(run_dir, 2500)
    assert rc == 0, f"{text}\n{logs}"
    assert [k[0] for k in killed] == ["services.envs", "services.rollout", "services.trainer",
                                      "services.controller", "nats-server"], text
    assert f"training finished: {steps} steps" in text
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rows} == set(range(1, steps + 1)), rows
    restarts = json.loads((run_dir / "restarts.json").read_text())
    assert {"env-db-0", "trainer", "controller", "nats-server"} <= set(restarts), restarts
    assert any(name.startswith("rollout-") for name in restarts), restarts

    books = asyncio.run(account(run_dir, cfg.nats.prefix))
    print(json.dumps({"killed": killed, "restarts": restarts, "seconds": round(elapsed, 1), **books}))
    (tmp_path.parent / "faults-kill.json").write_text(json.dumps({"killed": killed, "restarts": restarts,
                                                                  "seconds": round(elapsed, 1), **books}))
    assert books["stored_twice"] == 0
    assert books["lost"] == 0, books
    assert books["env_error"] == 0, books
    assert books["published"] >= 2 * steps


# ----------------------------------------------------------------------------------------- malformed
def spawn(args: list[str], config_path: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as fh:
        return subprocess.Popen([sys.executable, "-m", *args, "--config", str(config_path)], cwd=REPO,
                                stdout=fh, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def malformed(rng: random.Random, kind: str, good: dict[str, object]) -> bytes:
    """One bad message for a consumer of ``kind`` messages, ``good`` being a valid one's fields."""
    pick = rng.randrange(10)
    if pick == 0:
        return rng.randbytes(rng.randrange(0, 300))
    if pick == 1:
        return msgspec.msgpack.encode(rng.choice([[1, 2, 3], 7, "text", None, 1.5, {"x": 1}]))
    if pick == 2:
        return msgspec.msgpack.encode({k: v for k, v in good.items() if k != "kind"})
    if pick == 3:
        return msgspec.msgpack.encode({**good, "kind": rng.choice(["nope", "", "trajectory\x00", "weights" * 50])})
    if pick == 4:
        return msgspec.msgpack.encode({**good, "v": rng.choice([0, 2, 99, -1, "1"])})
    if pick == 5:
        field = rng.choice([k for k in good if k not in ("kind", "v")])
        return msgspec.msgpack.encode({**good, field: rng.choice([None, "x", -10**12, [None], {"a": []}, 2.5])})
    if pick == 6:
        data = msgspec.msgpack.encode(good)
        return data[: rng.randrange(1, len(data))]
    if pick == 7:  # a valid message of another kind
        return encode(EpisodeJob(episode_id="x", group_id="g", task="db", task_id="t")) if kind != "episode_job" \
            else msgspec.msgpack.encode({"kind": "metrics", "v": 1, "role": "r", "replica_id": "r", "step": 1,
                                         "values": {}})
    if pick == 8:  # missing required fields only
        return msgspec.msgpack.encode({"kind": kind, "v": 1})
    return msgspec.msgpack.encode({**good, **{k: "z" * rng.randrange(1, 5000)
                                              for k in rng.sample([k for k in good if k not in ("kind", "v")], 1)}})


def bad_trajectory(rng: random.Random, good: dict[str, object]) -> bytes:
    """Schema-level refusals: negative token ids, masks of 2, NaN or positive logprobs, spans outside."""
    t = json.loads(json.dumps(good))
    pick = rng.randrange(5)
    if pick == 0:
        t["tokens"][1] = -5
    elif pick == 1:
        t["loss_mask"][2] = 2
    elif pick == 2:
        t["logprobs"][3] = rng.choice([float("nan"), float("inf"), 3.0])
    elif pick == 3:
        t["turns"][0]["end"] = 10**6
    else:
        t["tokens"] = t["tokens"][:2]
    return msgspec.msgpack.encode(t)


def test_ten_thousand_malformed_messages_crash_nothing_a_poison_trajectory_is_dead_lettered_and_sigterm_is_quick(
        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    server = EmbeddedNats(tmp_path / "nats")
    url = server.start()
    cfg = fault_config(run_dir, steps=10_000)  # trains until stopped: through the flood and after it
    cfg.nats.url, cfg.nats.prefix = url, "flood"
    cfg.trainer.group_timeout_s = 20.0
    cfg_path = tmp_path / "flood.toml"
    save_config(cfg, cfg_path)
    subjects = Subjects(cfg.nats.prefix)
    roles = {"env": ["services.envs", "db"], "rollout": ["services.rollout"], "trainer": ["services.trainer"],
             "controller": ["services.controller"]}
    procs = {name: spawn(args, cfg_path, run_dir / "logs" / f"{name}.log") for name, args in roles.items()}
    rng = random.Random(16)
    counts: dict[str, int] = {}
    answered = {"coded": 0, "other": 0}

    def logs() -> str:
        return log_tails(run_dir)

    async def flood() -> None:
        nc = await connect(cfg.nats, "flood")
        js = nc.jetstream()
        deadline = time.monotonic() + 300
        env_replica = ""
        while not env_replica:  # wait for every role: the env answers, the trainer's consumer exists
            assert time.monotonic() < deadline, logs()
            assert all(p.poll() is None for p in procs.values()), logs()
            try:
                health = await EnvClient(nc, subjects, "db", timeout_s=2.0).health()
                await js.consumer_info(subjects.traj_stream, subjects.trainer_consumer)
                await js.consumer_info(subjects.jobs_stream, subjects.rollout_consumer)
                env_replica = health.replica_id
            except Exception:
                await asyncio.sleep(1.0)

        sink = nc.new_inbox()

        async def on_reply(msg) -> None:
            answered["coded" if msg.headers and "Nats-Service-Error-Code" in msg.headers else "other"] += 1

        await nc.subscribe(sink, cb=on_reply)
        good_traj = msgspec.to_builtins(Trajectory(
            episode_id="e", group_id="g", task="db", task_id="t", split="train", group_size=2, tokens=[1, 2, 3, 4, 5],
            logprobs=[0.0, 0.0, -0.1, -0.2, -0.3], loss_mask=[0, 0, 1, 1, 1], prompt_len=2,
            turns=[TurnInfo(start=2, end=5, engine_id="x", policy_version=0)], reward=0.0, status="completed",
            replica_id="r"))
        goods = {
            "episode_job": {"kind": "episode_job", "v": 1, "episode_id": "e", "group_id": "g", "task": "db",
                            "task_id": "t"},
            "trajectory": good_traj,
            "weights": {"kind": "weights", "v": 1, "version": 1, "object_name": "o", "digest": "d", "size": 1,
                        "dtype": "float32"},
            "metrics": {"kind": "metrics", "v": 1, "role": "trainer", "replica_id": "r", "step": 1, "values": {}},
            "heartbeat": {"kind": "heartbeat", "v": 1, "role": "rollout", "replica_id": "r", "pid": 1, "host": "h",
                          "started_at": 0.0},
            "env_start": {"kind": "env_start", "v": 1, "session_id": "s", "task_id": "t"},
            "env_interact": {"kind": "env_interact", "v": 1, "session_id": "s", "message": {}},
            "env_cancel": {"kind": "env_cancel", "v": 1, "session_id": "s"},
            "env_oracle": {"kind": "env_oracle", "v": 1, "session_id": "s"},
            "env_task_list": {"kind": "env_task_list", "v": 1, "split": "train"},
            "generate_request": {"kind": "generate_request", "v": 1, "prompt": [1], "max_new_tokens": 4,
                                 "temperature": 1.0},
        }
        # subject -> (what its consumer expects, how to send: stream publish, core publish, request, KV put)
        targets = [
            (subjects.traj("db"), "trajectory", "js"),
            (subjects.jobs("db"), "episode_job", "js"),
            (subjects.weights_published, "weights", "core"),
            (subjects.metrics("trainer"), "metrics", "core"),
            (subjects.metrics("rollout"), "metrics", "core"),
            (subjects.env_start("db"), "env_start", "req"),
            (subjects.env_tasks("db"), "env_task_list", "req"),
            (subjects.env_interact("db", env_replica), "env_interact", "req"),
            (subjects.env_cancel("db", env_replica), "env_cancel", "req"),
            (subjects.env_oracle("db", env_replica), "env_oracle", "req"),
            (subjects.gen_pool(), "generate_request", "req"),
            (subjects.max_deliveries_advisory(subjects.jobs_stream, subjects.rollout_consumer), "advisory", "core"),
            (subjects.policy_kv, "weights", "kv"),
            (subjects.registry_kv, "heartbeat", "kv"),
        ]
        policy = await js.key_value(subjects.policy_kv)
        registry = await js.key_value(subjects.registry_kv)
        per_target = 10_500 // len(targets) + 1
        for subject, kind, how in targets:
            for i in range(per_target):
                if kind == "advisory":
                    data = rng.choice([rng.randbytes(40), b"{}", b'{"stream_seq": "x"}', b'{"stream_seq": 999999}'])
                elif kind == "trajectory" and i % 3 == 0:
                    data = bad_trajectory(rng, good_traj)
                else:
                    data = malformed(rng, kind, goods.get(kind, {}))
                if how == "js":
                    await js.publish(subject, data, headers={"Nats-Msg-Id": f"flood-{subject}-{i}"})
                elif how == "core":
                    await nc.publish(subject, data)
                elif how == "req":
                    await nc.publish(subject, data, reply=sink)
                elif subject == subjects.policy_kv:
                    await policy.put(subjects.policy_version_key, data)
                else:
                    await registry.put(f"flood-{i % 50}", data)
                counts[subject] = counts.get(subject, 0) + 1
                if i % 500 == 0:
                    await nc.flush()
        # the poison: schema-valid, with a token id outside the tiny model's vocabulary
        poison = dict(good_traj, episode_id="poison-0", group_id="poison", group_size=1,
                      tokens=[1, 2, 10**7, 4, 5])
        await js.publish(subjects.traj("db"), msgspec.msgpack.encode(poison), headers={"Nats-Msg-Id": "poison-0"})
        await nc.flush()
        await asyncio.sleep(3.0)
        await nc.close()

    try:
        t0 = time.monotonic()
        asyncio.run(flood())
        flood_s = round(time.monotonic() - t0, 1)
        assert sum(counts.values()) >= 10_000
        alive = {name: p.poll() for name, p in procs.items()}
        assert all(rc is None for rc in alive.values()), f"{alive}\n{logs()}"
        after_flood = steps_done(run_dir)
        deadline = time.monotonic() + 300
        while steps_done(run_dir) < after_flood + 2:  # the run still trains after the flood
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs.values()), logs()
            time.sleep(1.0)

        async def letters() -> list[DeadLetter]:
            nc = await connect(cfg.nats, "audit")
            out = [decode(d, DeadLetter) for d in await stream_messages(nc, subjects.dlq_stream,
                                                                         subjects.dead_letter(">"))]
            await nc.close()
            return out

        dlq = asyncio.run(letters())
        poisoned = [d for d in dlq if d.service == "trainer" and "outside the vocabulary" in d.reason]
        assert len(poisoned) == 1 and b"poison-0" in poisoned[0].payload
        # SIGTERM: within 10 s with NATS up (rollout, trainer), and with NATS gone (env, controller)
        quit_s: dict[str, float] = {}
        for name in ("rollout", "trainer", "env", "controller"):
            if name == "env":
                server.proc.kill()
                server.proc.wait()
            t0 = time.monotonic()
            procs[name].send_signal(signal.SIGTERM)
            procs[name].wait(timeout=30)
            quit_s[name] = round(time.monotonic() - t0, 2)
        figures = {"messages": sum(counts.values()), "subjects": len(counts), "flood_s": flood_s,
                   "steps_before_and_after": [after_flood, steps_done(run_dir)], "service_replies": answered,
                   "dead_letters": len(dlq), "by_service": {s: sum(d.service == s for d in dlq)
                                                            for s in sorted({d.service for d in dlq})},
                   "sigterm_exit_s": quit_s}
        print(json.dumps(figures))
        (tmp_path.parent / "faults-flood.json").write_text(json.dumps(figures))
        # the trainer finishes the step it is in and saves <run>/model first: it has longer
        assert all(s <= 10.0 for name, s in quit_s.items() if name != "trainer") and quit_s["trainer"] <= 60, quit_s
        assert answered["coded"] >= 0.9 * sum(n for s, n in counts.items() if ".env." in s)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        server.stop()
