"""Fuzz a live ``jetrl up`` run with a rollout's credentials, on loopback, bounded in count and time.

    PYTHONPATH=. .venv/bin/python bench/fuzz_rollout.py --messages 5000 --seconds 120

Starts ``jetrl up`` (tiny model, db task, per-role users) in a temporary run directory, waits for its
second training step, then publishes up to ``--messages`` hostile messages within ``--seconds`` on every
subject the rollout role may publish on (the episode events, trajectories, metrics, dead letters, its
registry keys, env and generation-pool requests): random bytes, msgpack nested past the codec's bound,
container bombs, truncations, valid messages of the wrong kind, valid messages with mutated fields and
bytes. Afterwards the run must train two more steps with no service restarted. Prints one JSON line of
figures (docs/benchmarks/faults.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from shared.bus import connect
from shared.config import NatsConfig, save_config
from shared.envapi import EnvClient
from shared.messages import ActionEvent, EnvInteract, EnvStart, GenerateRequest, MetricsReport, Trajectory, TurnInfo
from shared.subjects import Subjects
from tests.system.test_faults import fault_config, steps_done

REPO = Path(__file__).resolve().parent.parent


def samples() -> dict[str, dict]:
    """A valid message for each kind the fuzzer bends (as plain maps)."""
    traj = Trajectory(episode_id="f", group_id="fg", task="db", task_id="t", split="train", group_size=2,
                      tokens=[1, 2, 3, 4], logprobs=[0.0, 0.0, -0.1, -0.2], loss_mask=[0, 0, 1, 1], prompt_len=2,
                      turns=[TurnInfo(start=2, end=4, engine_id="x", policy_version=0)], reward=0.0,
                      status="completed", replica_id="r", messages=[{"role": "user", "content": "q"}])
    return {k: msgspec.to_builtins(v) for k, v in {
        "trajectory": traj, "action": ActionEvent(episode_id="f", task="db", turn=0, replica_id="r", engine_id="e",
                                                 policy_version=0, message={"role": "assistant", "content": "x"}),
        "metrics": MetricsReport(role="rollout", replica_id="r", step=1, values={"a": 1.0}),
        "env_start": EnvStart(session_id="fz", task_id="t"), "env_interact": EnvInteract(session_id="fz", message={}),
        "generate_request": GenerateRequest(prompt=[1, 2], max_new_tokens=4, temperature=1.0)}.items()}


def hostile(rng: random.Random, good: dict) -> bytes:
    pick = rng.randrange(12)
    if pick == 0:
        return rng.randbytes(rng.randrange(0, 2000))
    if pick == 1:  # nested past the bound, as the whole message or inside a field
        deep = b"\x91" * rng.choice([65, 200, 1000, 100_000]) + b"\x00"
        return deep if rng.random() < 0.5 else msgspec.msgpack.encode(dict(good, extra=0))[:-1] + deep
    if pick == 2:  # a container bomb: a huge count, or many empty containers
        return rng.choice([b"\xdd\xff\xff\xff\xff", b"\xdc\xff\xff" + b"\x90" * 65535,
                           msgspec.msgpack.encode(dict(good, messages=[[]] * 150_000))])
    if pick == 3:
        data = msgspec.msgpack.encode(good)
        return data[: rng.randrange(1, len(data))]
    if pick == 4:  # flipped bytes
        data = bytearray(msgspec.msgpack.encode(good))
        for _ in range(rng.randrange(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    if pick == 5:
        return msgspec.msgpack.encode(dict(good, kind=rng.choice(["weights", "nope", "", 7])))
    if pick == 6:
        return msgspec.msgpack.encode(dict(good, v=rng.choice([0, 2, 10**9, "1"])))
    if pick == 7:
        field = rng.choice([k for k in good if k not in ("kind", "v")])
        return msgspec.msgpack.encode(dict(good, **{field: rng.choice([None, -1, 2**64 - 1, "x" * 10_000, [[]], {}])}))
    if pick == 8:
        return msgspec.msgpack.encode(rng.choice([[1, 2], 3, "s", None, 1.5, b"b"]))
    if pick == 9:  # a trajectory with lengths that disagree or ids past any vocabulary
        t = dict(good, tokens=[rng.randrange(1 << 31) for _ in range(6)])
        return msgspec.msgpack.encode(t)
    if pick == 10:
        return msgspec.msgpack.encode({"kind": good.get("kind"), "v": 1})
    return msgspec.msgpack.encode(dict(good, **{"x" * rng.randrange(1, 300): rng.randrange(10)}))


async def fuzz(url: str, run_dir: Path, prefix: str, count: int, seconds: float, seed: int) -> dict:
    subjects = Subjects(prefix)
    nc = await connect(NatsConfig(url=url, prefix=prefix, auth_dir=str(run_dir / "nats" / "auth")), "fuzzer",
                       role="rollout")
    js = nc.jetstream()
    replica = (await EnvClient(nc, subjects, "db", timeout_s=10.0).health()).replica_id
    goods = samples()
    # subject -> (kind of message its readers expect, how it is sent)
    targets = [(subjects.action("db", "fz-0"), "action", "js"), (subjects.observation("db", "fz-0"), "action", "js"),
               (subjects.traj("db"), "trajectory", "js"), (subjects.dead_letter("rollout"), "metrics", "js"),
               (subjects.registry_entries("rollout", "fz-0"), "metrics", "js"),
               (subjects.metrics("rollout"), "metrics", "core"), (subjects.env_start("db"), "env_start", "req"),
               (subjects.env_tasks("db"), "env_start", "req"), (subjects.env_interact("db", replica), "env_interact", "req"),
               (subjects.env_cancel("db", replica), "env_interact", "req"),
               (subjects.env_oracle("db", replica), "env_interact", "req"), (subjects.gen_pool(), "generate_request", "req")]
    rng = random.Random(seed)
    sink = nc.new_inbox()
    replies: dict[str, int] = {}  # error code (or "ok") -> replies

    async def on_reply(msg) -> None:
        code = (msg.headers or {}).get("Nats-Service-Error-Code", "ok")
        replies[code] = replies.get(code, 0) + 1

    await nc.subscribe(f"{sink}.*", cb=on_reply)  # one reply subject a request: a responder may answer each once
    sent = 0
    started = time.monotonic()
    while sent < count and time.monotonic() - started < seconds:
        subject, kind, how = targets[sent % len(targets)]
        data = hostile(rng, goods[kind])[: 8 * 1024 * 1024]
        try:
            if how == "js":
                await js.publish(subject, data, headers={"Nats-Msg-Id": f"fz-{sent}"})
            else:
                await nc.publish(subject, data, reply=f"{sink}.{sent}" if how == "req" else "")
        except Exception as exc:  # refused by the server (too big for a stream): counted, not fatal
            replies[type(exc).__name__] = replies.get(type(exc).__name__, 0) + 1
        sent += 1
        if sent % 200 == 0:
            await nc.flush()
    await nc.flush()
    fuzz_s = round(time.monotonic() - started, 1)
    requests = sum(1 for i in range(sent) if targets[i % len(targets)][2] == "req")
    settled, last = time.monotonic(), -1
    while time.monotonic() - settled < 60 and sum(replies.values()) < requests:  # the replicas catch up
        if sum(replies.values()) != last:
            last, quiet = sum(replies.values()), time.monotonic()
        elif time.monotonic() - quiet > 10:
            break
        await asyncio.sleep(0.5)
    await nc.close()
    return {"messages": sent, "subjects": len(targets), "fuzz_s": fuzz_s, "requests": requests, "replies": replies}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=38)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="jetrl-fuzz-"))
    run_dir = root / "run"
    cfg = fault_config(run_dir, steps=10_000)
    cfg.nats.prefix = "fuzz"
    save_config(cfg, root / "fuzz.toml")
    up = subprocess.Popen([sys.executable, "-m", "jetrl.cli", "up", "--config", str(root / "fuzz.toml"), "--rollouts", "1"],
                          cwd=REPO, stdout=open(root / "up.out", "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while steps_done(run_dir) < 2:
            if time.monotonic() > deadline or up.poll() is not None:
                raise SystemExit(f"the run did not reach step 2; see {root}")
            time.sleep(1.0)
        url = (run_dir / "nats.url").read_text().split()[0]
        before = steps_done(run_dir)
        figures = asyncio.run(fuzz(url, run_dir, cfg.nats.prefix, args.messages, args.seconds, args.seed))
        after_fuzz = steps_done(run_dir)
        deadline = time.monotonic() + 300
        while steps_done(run_dir) < after_fuzz + 2 and time.monotonic() < deadline and up.poll() is None:
            time.sleep(1.0)
        restarts = json.loads((run_dir / "restarts.json").read_text()) if (run_dir / "restarts.json").exists() else {}
        logs = {p.stem: p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log")}
        figures.update(dead_letters={n: text.count("event='dead_letter'") for n, text in logs.items()},
                       task_failed=sum(text.count("task_failed") for text in logs.values()),
                       tracebacks=sum(text.count("Traceback") for text in logs.values()))
        figures.update(steps=[before, after_fuzz, steps_done(run_dir)], restarts=restarts, run_dir=str(root),
                       still_training=steps_done(run_dir) >= after_fuzz + 2 and up.poll() is None)
        print(json.dumps(figures))
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.wait(timeout=120)


if __name__ == "__main__":
    main()
