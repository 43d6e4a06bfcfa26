"""Weight broadcast into one rollout replica, over loopback to an embedded nats-server: MB/s.

Two parts, each a median over ``--repeats``:

1. Raw objects (random bytes) of several sizes and chunk sizes: the trainer's ``ObjectStore.put``, the
   replica's reader ``shared.bus.read_object``, and nats-py's ``ObjectStore.get`` (only up to
   ``--get-max-mb``: it is quadratic, and slow beyond that).
Wall-clock MB/s on a shared machine mostly measures its other tenants, so every read also reports
MB per CPU-second (this process plus the nats-server): what the path costs, whatever the load.

2. The real path into one replica: a trainer-side ``weights_to_bytes`` + put of a model's weights
   (fp32 and the bf16 broadcast option), then ``RolloutWorker._load``, i.e. read_object, digest check,
   ``bytes_to_weights`` and the engine's in-place update (``--engine continuous``, the default engine,
   or ``hf``), timed end to end. With ``--lora-rank R`` also a LoRA version as a LoRA run broadcasts it:
   the adapter alone (``lora_delta_bytes``, fp32), which the replica adds to its base weights
   (``merge_lora_delta``) before the same in-place update.

    python bench/bench_weights.py                      # the figures in docs/benchmarks/scale_out.md
    python bench/bench_weights.py --sizes 25 --repeats 3 --models tiny   # quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nats.js.api import ObjectMeta, ObjectMetaOptions  # noqa: E402

from services.rollout.continuous import ContinuousEngine  # noqa: E402
from services.rollout.engine import HFEngine  # noqa: E402
from services.rollout.worker import RolloutWorker  # noqa: E402
from shared.bus import connect, declare_topology, read_object  # noqa: E402
from shared.config import ModelConfig, NatsConfig, RolloutConfig  # noqa: E402
from shared.messages import WeightsAnnouncement  # noqa: E402
from shared.model import (  # noqa: E402
    LORA_TARGETS,
    add_lora,
    digest,
    load_model,
    load_tokenizer,
    lora_delta_bytes,
    quiet_transformers,
    resolve_model,
    weights_to_bytes,
)
from shared.natsd import EmbeddedNats  # noqa: E402
from shared.subjects import Subjects  # noqa: E402

MB = 1e6


SERVER_PID = 0  # the embedded nats-server, for its CPU time
CPU = {"last": 0.0}  # CPU seconds (this process + the server) of the last _timed call, median


def _cpu_seconds() -> float:
    """This process's CPU time plus the server's: on a shared, loaded machine the wall clock mostly
    measures the neighbours; CPU seconds per MB say what the path itself costs."""
    fields = Path(f"/proc/{SERVER_PID}/stat").read_text().rsplit(")", 1)[1].split()
    return time.process_time() + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _timed(coro_fn: Any, repeats: int) -> tuple[float, Any]:
    """Median wall seconds of ``repeats`` awaits of ``coro_fn()``, and the last result."""
    times, cpus, result = [], [], None
    for _ in range(repeats):
        started, cpu = time.perf_counter(), _cpu_seconds()
        result = await coro_fn()
        times.append(time.perf_counter() - started)
        cpus.append(_cpu_seconds() - cpu)
    CPU["last"] = statistics.median(cpus)
    return statistics.median(times), result


async def raw_objects(js: Any, subjects: Subjects, sizes_mb: list[float], chunks_kib: list[int], repeats: int,
                      get_max_mb: float) -> list[dict[str, Any]]:
    store = await js.object_store(subjects.weights_bucket)
    rows = []
    for size in sizes_mb:
        data = os.urandom(int(size * MB))
        for chunk in chunks_kib:
            name = f"raw-{size}-{chunk}"
            meta = ObjectMeta(name=name, options=ObjectMetaOptions(max_chunk_size=chunk * 1024))
            put_s, _ = await _timed(lambda: store.put(name, data, meta=meta), 1)  # noqa: B023
            read_s, got = await _timed(lambda: read_object(js, subjects.weights_bucket, name), repeats)  # noqa: B023
            assert got == data
            row = {"size_mb": size, "chunk_kib": chunk, "put_mb_s": size / put_s, "read_object_mb_s": size / read_s,
                   "read_object_s": read_s, "read_object_mb_per_cpu_s": size / CPU["last"]}
            if size <= get_max_mb:
                get_s, res = await _timed(lambda: store.get(name), min(repeats, 3))  # noqa: B023
                assert res.data == data
                row.update(get_mb_s=size / get_s, get_s=get_s, get_mb_per_cpu_s=size / CPU["last"])
            rows.append(row)
            print(json.dumps(row), flush=True)
            await store.delete(name)
    return rows


def lora_model(path: Path, rank: int) -> Any:
    """A LoRA-wrapped model whose adapter is not zero (as after training), so the replica's merge is real."""
    import torch

    model = add_lora(load_model(path), rank, 2.0 * rank, LORA_TARGETS)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 1e-3)
    return model


async def into_replica(nc: Any, js: Any, subjects: Subjects, model_name: str, dtypes: list[str],
                       repeats: int, engine_kind: str = "continuous", lora_rank: int = 0) -> list[dict[str, Any]]:
    """The trainer's publish and the replica's load, as the services run them."""
    path = resolve_model(ModelConfig(name=model_name))
    model = load_model(path)
    tokenizer = load_tokenizer(path)
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    engine = (ContinuousEngine(path, "bench", stop, threads=2) if engine_kind == "continuous"
              else HFEngine(path, "bench", stop, tokenizer.pad_token_id, threads=2))
    # model_path: where a LoRA replica reads the base weights it adds an adapter to (once, then kept)
    worker = RolloutWorker(nc, js, subjects, RolloutConfig(), engine, tokenizer, "bench-replica", model_path=path)
    store = await js.object_store(subjects.weights_bucket)
    rows = []
    versions = [("full", dtype) for dtype in dtypes] + ([("lora", "float32")] if lora_rank else [])
    try:
        for fmt, dtype in versions:
            started = time.perf_counter()
            if fmt == "lora":
                adapted = lora_model(path, lora_rank)
                started = time.perf_counter()
                data = await asyncio.to_thread(lora_delta_bytes, adapted, dtype)
            else:
                data = await asyncio.to_thread(weights_to_bytes, model, dtype)
            serialise_s = time.perf_counter() - started
            name = f"policy-{model_name}-{fmt}-{dtype}"
            put_s, _ = await _timed(lambda: store.put(name, data), 1)  # noqa: B023
            note_digest = digest(data)
            size = len(data) / MB
            times = []
            for _ in range(repeats):
                note = WeightsAnnouncement(version=engine.policy_version + 1, object_name=name, digest=note_digest,
                                           size=len(data), dtype=dtype, format=fmt)
                started = time.perf_counter()
                await worker._load(note)
                times.append(time.perf_counter() - started)
                assert engine.policy_version == note.version
            read_s, _ = await _timed(lambda: read_object(js, subjects.weights_bucket, name), repeats)  # noqa: B023
            read_cpu = CPU["last"]
            load_s = statistics.median(times)
            row = {"model": model_name, "dtype": dtype if fmt == "full" else f"LoRA r{lora_rank} adapter ({dtype})",
                   "size_mb": size, "serialise_s": serialise_s, "put_s": put_s,
                   "read_object_mb_s": size / read_s, "read_object_mb_per_cpu_s": size / read_cpu,
                   "replica_load_s": load_s, "replica_mb_s": size / load_s}
            rows.append(row)
            print(json.dumps(row), flush=True)
            await store.delete(name)
    finally:
        engine.close()
    return rows


def markdown(raw: list[dict[str, Any]], real: list[dict[str, Any]]) -> str:
    out = ["| object | chunk | put MB/s | read_object MB/s | read_object MB per CPU-s | ObjectStore.get MB/s "
           "| ObjectStore.get MB per CPU-s |", "|---|---|---|---|---|---|---|"]
    for r in raw:
        get = (f"{r['get_mb_s']:.1f} | {r['get_mb_per_cpu_s']:.0f}" if "get_mb_s" in r
               else "not run (quadratic) | -")
        out.append(f"| {r['size_mb']:g} MB | {r['chunk_kib']} KiB | {r['put_mb_s']:.0f} | "
                   f"{r['read_object_mb_s']:.0f} | {r['read_object_mb_per_cpu_s']:.0f} | {get} |")
    out += ["", "| model | dtype | bytes | serialise s | put s | read_object MB/s | read_object MB per CPU-s "
            "| into replica s | into replica MB/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in real:
        out.append(f"| {r['model']} | {r['dtype']} | {r['size_mb']:.1f} MB | {r['serialise_s']:.2f} | "
                   f"{r['put_s']:.2f} | {r['read_object_mb_s']:.0f} | {r['read_object_mb_per_cpu_s']:.0f} | "
                   f"{r['replica_load_s']:.2f} | {r['replica_mb_s']:.0f} |")
    return "\n".join(out)


async def main(args: argparse.Namespace) -> None:
    quiet_transformers()
    global SERVER_PID
    with tempfile.TemporaryDirectory(prefix="jetrl-bench-weights-") as tmp:
        server = EmbeddedNats(Path(tmp))
        url = server.start()
        SERVER_PID = server.proc.pid
        print(json.dumps({"load_average": os.getloadavg(), "cpus": os.cpu_count()}), flush=True)
        nc = await connect(NatsConfig(url=url), "bench-weights")
        js = nc.jetstream()
        subjects = Subjects("bench")
        await declare_topology(js, subjects, NatsConfig(url=url))
        raw = await raw_objects(js, subjects, args.sizes, args.chunks, args.repeats, args.get_max_mb)
        real = []
        for model in args.models:
            real += await into_replica(nc, js, subjects, model, args.dtypes, args.repeats, args.engine, args.lora_rank)
        await nc.close()
        server.stop()
        print(json.dumps({"load_average": os.getloadavg()}), flush=True)
    print()
    print(markdown(raw, real))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=lambda s: [float(x) for x in s.split(",")], default=[25.0, 100.0, 270.0],
                        help="raw object sizes, MB")
    parser.add_argument("--chunks", type=lambda s: [int(x) for x in s.split(",")], default=[128, 1024, 4096],
                        help="object-store chunk sizes, KiB (128 = nats-py's default, what the trainer uses)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--get-max-mb", type=float, default=25.0, help="largest object read with ObjectStore.get")
    parser.add_argument("--models", type=lambda s: s.split(","), default=["tiny", "smollm2"])
    parser.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16"])
    parser.add_argument("--engine", choices=["continuous", "hf"], default="continuous")
    parser.add_argument("--lora-rank", type=int, default=16, help="also broadcast a LoRA adapter (0 = no)")
    asyncio.run(main(parser.parse_args()))
