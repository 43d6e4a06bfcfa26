"""A new weights version into several rollout replicas on one machine: seconds until all of them hold it.

An embedded nats-server (file store, as ``jetrl up`` runs it) and ``--replicas`` replica processes, each
with its own continuous engine on the model. For every round the driver puts a version of the model's
weights with 1 MiB chunks (as the trainer does), announces it to every replica at once, and waits until
each has reported that its engine holds it. Three read paths take turns, round by round, on the same
replicas:

* ``now``: ``RolloutWorker._load`` (``shared.objectread.read_object``'s own connection: each
  chunk from the socket into its place, one BLAKE3 pass as they arrive; read into the previous version's
  buffer when nothing refers to it any more).
* ``nats-py``: the same, but the chunks come through nats-py's pull ``fetch`` into a fresh buffer
  (``bench_weights.read_object_nats_py``).
* ``before``: the path in an earlier version (join, two SHA-256 passes, ``safetensors.torch.load``, ``.to`` + copy;
  ``bench_weights.load_before``).

CPU seconds of nats-server and of the replica processes (all their threads) over each round say where the
time went: on a 2-core machine the replicas' reads and the server's sends share the same two cores.

    python bench/bench_weights_fanout.py --replicas 4 --dtypes float32,bfloat16 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nats.js.api import ObjectMeta, ObjectMetaOptions  # noqa: E402

from bench.bench_weights import load_before, read_object_nats_py  # noqa: E402
from shared.bus import connect, declare_topology  # noqa: E402
from shared.config import ModelConfig, NatsConfig, RolloutConfig  # noqa: E402
from shared.digest import digest  # noqa: E402
from shared.messages import WeightsAnnouncement  # noqa: E402
from shared.model import (  # noqa: E402
    load_model,
    load_tokenizer,
    quiet_transformers,
    resolve_model,
    weights_from_buffer,
    weights_to_bytes,
)
from shared.natsd import EmbeddedNats  # noqa: E402
from shared.subjects import Subjects  # noqa: E402

PATHS = ("now", "nats-py", "before")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process so far (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
LOAD_SUBJECT = "bench.fanout.load"
DONE_SUBJECT = "bench.fanout.done"
READY_SUBJECT = "bench.fanout.ready"


# ------------------------------------------------------------------------------------------------ a replica
async def replica(url: str, index: int, model_name: str) -> None:
    """One rollout replica: its engine, a worker for today's path; loads what the driver announces."""
    from services.rollout.continuous import ContinuousEngine
    from services.rollout.worker import RolloutWorker, WeightsLoadTimes

    quiet_transformers()
    path = resolve_model(ModelConfig(name=model_name))
    tokenizer = load_tokenizer(path)
    # a small KV cache: the bench is about weights, and four engines' default caches would not fit here
    engine = ContinuousEngine(path, f"fanout-{index}", [tokenizer.convert_tokens_to_ids("<|im_end|>")], threads=1,
                              cache_tokens=4096)
    nc = await connect(NatsConfig(url=url), f"fanout-replica-{index}")
    js = nc.jetstream()
    subjects = Subjects("bench")
    worker = RolloutWorker(nc, js, subjects, RolloutConfig(), engine, tokenizer, f"fanout-{index}", model_path=path)
    jobs: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def on_load(msg: Any) -> None:
        await jobs.put(json.loads(msg.data))

    await nc.subscribe(LOAD_SUBJECT, cb=on_load)
    await nc.publish(READY_SUBJECT, str(index).encode())
    await nc.flush()
    while True:
        job = await jobs.get()
        if job.get("stop"):
            break
        version = job["version"]
        if job["path"] == "now":
            note = WeightsAnnouncement(version=version, object_name=job["name"], digest=job["digest"],
                                       size=job["size"], dtype=job["dtype"])
            times = await worker._load(note)
            assert times is not None
        elif job["path"] == "nats-py":
            started = time.perf_counter()
            data = await read_object_nats_py(js, subjects.weights_bucket, job["name"], expected_digest=job["digest"])
            received = time.perf_counter()
            await engine.update_weights(weights_from_buffer(data), version)
            times = WeightsLoadTimes(read_s=received - started, hold_s=time.perf_counter() - received)
        else:
            times = await load_before(js, subjects.weights_bucket, job["name"], job["sha256"], engine)
            engine.policy_version = version  # load_before copies into the model, as the engine's thread did
        assert engine.policy_version == version
        await nc.publish(DONE_SUBJECT, json.dumps({"replica": index, "held_at": time.time(), "read_s": times.read_s,
                                                   "hold_s": times.hold_s, "reused": times.reused_buffer}).encode())
        await nc.flush()
    engine.close()
    await nc.close()


# ------------------------------------------------------------------------------------------------ the driver
async def driver(args: argparse.Namespace) -> list[dict[str, Any]]:
    quiet_transformers()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="jetrl-bench-fanout-") as tmp:
        server = EmbeddedNats(Path(tmp))
        url = server.start()
        nc = await connect(NatsConfig(url=url), "fanout-driver")
        js = nc.jetstream()
        subjects = Subjects("bench")
        await declare_topology(js, subjects, NatsConfig(url=url))
        store = await js.object_store(subjects.weights_bucket)
        ready: set[str] = set()
        done: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        async def on_ready(msg: Any) -> None:
            ready.add(msg.data.decode())

        async def on_done(msg: Any) -> None:
            await done.put(json.loads(msg.data))

        await nc.subscribe(READY_SUBJECT, cb=on_ready)
        await nc.subscribe(DONE_SUBJECT, cb=on_done)
        logs = [open(Path(tmp) / f"replica-{i}.log", "w") for i in range(args.replicas)]  # noqa: SIM115
        procs = [subprocess.Popen([sys.executable, __file__, "--replica", str(i), "--url", url, "--model", args.model],
                                  stdout=logs[i], stderr=subprocess.STDOUT) for i in range(args.replicas)]
        try:
            while len(ready) < args.replicas:
                if any(p.poll() is not None for p in procs):
                    for log in logs:
                        log.flush()
                    tails = [(Path(tmp) / f"replica-{i}.log").read_text()[-2000:] for i in range(args.replicas)]
                    raise RuntimeError("a replica exited before it was ready:\n" + "\n".join(tails))
                await asyncio.sleep(0.5)
            model = load_model(resolve_model(ModelConfig(name=args.model)))
            print(json.dumps({"replicas": len(ready), "load_average": os.getloadavg()}), flush=True)
            version = 0
            for dtype in args.dtypes:
                data = weights_to_bytes(model, dtype)
                note_digest, sha256_hex = digest(data), hashlib.sha256(data).hexdigest()
                times: dict[str, list[dict[str, Any]]] = {p: [] for p in args.paths}
                # round 0 is a warm-up, not counted: today's path reads into the last version's buffer from
                # the second version on, as a replica does through a run
                for round_ in range(args.repeats + 1):
                    for path in args.paths:
                        version += 1
                        name = f"policy-{version}"
                        meta = ObjectMeta(name=name, options=ObjectMetaOptions(max_chunk_size=1024 * 1024))
                        await store.put(name, data, meta=meta)
                        await asyncio.sleep(1.0)  # the put's work is done before the clock starts
                        job = {"path": path, "version": version, "name": name, "digest": note_digest,
                               "sha256": sha256_hex, "size": len(data), "dtype": dtype}
                        assert server.proc is not None
                        server_cpu, replicas_cpu = cpu_seconds(server.proc.pid), sum(cpu_seconds(p.pid) for p in procs)
                        started = time.time()
                        await nc.publish(LOAD_SUBJECT, json.dumps(job).encode())
                        reports = [await asyncio.wait_for(done.get(), 300) for _ in range(args.replicas)]
                        all_held = max(r["held_at"] for r in reports) - started
                        # where the CPU went while the version spread: the server's sending, the replicas' reading
                        server_cpu = cpu_seconds(server.proc.pid) - server_cpu
                        replicas_cpu = sum(cpu_seconds(p.pid) for p in procs) - replicas_cpu
                        row = {"dtype": dtype, "path": path, "round": round_, "all_held_s": all_held,
                               "first_held_s": min(r["held_at"] for r in reports) - started,
                               "read_s": statistics.median(r["read_s"] for r in reports),
                               "hold_s": statistics.median(r["hold_s"] for r in reports),
                               "reused": sum(r["reused"] for r in reports), "server_cpu_s": server_cpu,
                               "replicas_cpu_s": replicas_cpu, "load_average": os.getloadavg()[0]}
                        print(json.dumps(row), flush=True)
                        if round_:
                            times[path].append(row)
                        await store.delete(name)
                size_mb = len(data) / 1e6
                for path in args.paths:
                    got = times[path]
                    all_held = statistics.median(r["all_held_s"] for r in got)
                    rows.append({"dtype": dtype, "path": path, "size_mb": size_mb, "all_held_s": all_held,
                                 "first_held_s": statistics.median(r["first_held_s"] for r in got),
                                 "read_s": statistics.median(r["read_s"] for r in got),
                                 "hold_s": statistics.median(r["hold_s"] for r in got),
                                 "aggregate_mb_s": args.replicas * size_mb / all_held,
                                 "server_cpu_s": statistics.median(r["server_cpu_s"] for r in got),
                                 "replicas_cpu_s": statistics.median(r["replicas_cpu_s"] for r in got),
                                 "reused": f"{sum(r['reused'] for r in got)}/{args.replicas * len(got)}"})
            await nc.publish(LOAD_SUBJECT, json.dumps({"stop": True}).encode())
            await nc.flush()
            for p in procs:
                p.wait(timeout=60)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            await nc.close()
            server.stop()
    return rows


def markdown(rows: list[dict[str, Any]], replicas: int) -> str:
    out = [f"| dtype | object | read path | all {replicas} hold it | first holds it | read s (median replica) "
           f"| received -> held s | {replicas} x object / all-held time | nats-server CPU s | replicas' CPU s "
           "| read into the last buffer |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['dtype']} | {r['size_mb']:.1f} MB | {r['path']} | {r['all_held_s']:.2f} s | "
                   f"{r['first_held_s']:.2f} s | {r['read_s']:.2f} | {r['hold_s']:.2f} | {r['aggregate_mb_s']:.0f} MB/s | "
                   f"{r['server_cpu_s']:.2f} | {r['replicas_cpu_s']:.2f} | {r['reused']} |")
    return "\n".join(out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16"])
    parser.add_argument("--paths", type=lambda s: s.split(","), default=list(PATHS), help=f"of {', '.join(PATHS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--replica", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--url", default="", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.replica >= 0:
        asyncio.run(replica(cli.url, cli.replica, cli.model))
    else:
        result = asyncio.run(driver(cli))
        print()
        print(markdown(result, cli.replicas))
