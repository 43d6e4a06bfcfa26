"""Weight broadcast into one rollout replica, over loopback to an embedded nats-server: MB/s.

Two parts, each a median over ``--repeats``:

1. Raw objects (random bytes) of several sizes and chunk sizes: the trainer's ``ObjectStore.put``, the
   replica's reader ``shared.objectread.read_object`` (its own connection) alternating with
   the same reader through nats-py's pull ``fetch`` (``read_object_nats_py``, how it read before), both
   checking the BLAKE3 digest, each into a fresh buffer; and nats-py's ``ObjectStore.get`` (only up to
   ``--get-max-mb``: it is quadratic, and slow beyond that).
Wall-clock MB/s on a shared machine mostly measures its other tenants, so every read also reports
MB per CPU-second (this process plus the nats-server): what the path costs, whatever the load.

2. The real path into one replica: a trainer-side ``weights_to_bytes`` + put of a model's weights
   (fp32 and the bf16 broadcast option), then ``RolloutWorker._load`` (read_object hashing each chunk
   into one buffer, from the second load on the previous version's, ``weights_from_buffer`` views, the
   engine's in-place copy; ``--engine continuous``,
   the default engine, or ``hf``), alternating on the same object with ``load_before``, the replica's
   path in an earlier version (join, two SHA-256 passes, ``safetensors.torch.load``, ``.to`` + ``copy_``).
   Reported: received -> held (the object in memory to the engine holding it) and end to end. With
   ``--lora-rank R`` also a LoRA version as a LoRA run broadcasts it: the adapter alone
   (``lora_delta_bytes``, fp32), which the replica adds to its base weights (``merge_lora_delta``)
   before the same in-place update (today's path only).

    python bench/bench_weights.py                      # the figures in docs/benchmarks/scale_out.md
    python bench/bench_weights.py --sizes 100 --chunks 1024 --models tiny,smollm2 --repeats 3  # weights.md
    python bench/bench_weights.py --sizes 651 --chunks 1024 --models smollm2 --repeats 5 --get-max-mb 0
    python bench/bench_weights.py --sizes 25 --repeats 3 --models tiny   # quick look
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, ObjectMeta, ObjectMetaOptions  # noqa: E402

from services.rollout.continuous import ContinuousEngine  # noqa: E402
from services.rollout.engine import HFEngine  # noqa: E402
from services.rollout.worker import RolloutWorker, WeightsLoadTimes  # noqa: E402
from shared.bus import connect, declare_topology  # noqa: E402
from shared.config import ModelConfig, NatsConfig, RolloutConfig  # noqa: E402
from shared.digest import digest, new_hasher, split_digest  # noqa: E402
from shared.messages import WeightsAnnouncement  # noqa: E402
from shared.model import (  # noqa: E402
    LORA_TARGETS,
    add_lora,
    load_model,
    load_tokenizer,
    lora_delta_bytes,
    quiet_transformers,
    resolve_model,
    weights_to_bytes,
)
from shared.natsd import EmbeddedNats  # noqa: E402
from shared.objectread import read_object  # noqa: E402
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
            # the two readers alternate on the same object, so both see the same neighbours; each checks the
            # BLAKE3 digest a replica gets in the announcement
            note_digest = digest(data)
            own: list[tuple[float, float]] = []
            nats_py: list[tuple[float, float]] = []
            for _ in range(repeats):
                for reader, times in ((read_object, own), (read_object_nats_py, nats_py)):
                    seconds, got = await _timed(
                        lambda: reader(js, subjects.weights_bucket, name, expected_digest=note_digest), 1)  # noqa: B023
                    assert got == data
                    del got
                    times.append((seconds, CPU["last"]))
            read_s, read_cpu = (statistics.median(t[i] for t in own) for i in (0, 1))
            nats_py_s, nats_py_cpu = (statistics.median(t[i] for t in nats_py) for i in (0, 1))
            row = {"size_mb": size, "chunk_kib": chunk, "put_mb_s": size / put_s, "read_object_mb_s": size / read_s,
                   "read_object_s": read_s, "read_object_mb_per_cpu_s": size / read_cpu,
                   "nats_py_mb_s": size / nats_py_s, "nats_py_s": nats_py_s, "nats_py_mb_per_cpu_s": size / nats_py_cpu}
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


# ------------------------------------------------- read_object through nats-py, for comparison
async def read_object_nats_py(js: Any, bucket: str, name: str, window_bytes: int = 16 * 1024**2,
                              expected_digest: str | None = None) -> bytearray:
    """``shared.objectread.read_object`` before its own connection: the chunks through
    nats-py's pull ``fetch`` in 16 MiB batches, each copied into the buffer and hashed as it arrives."""
    store = await js.object_store(bucket)
    info = await store.get_info(name)
    if expected_digest is not None:
        algorithm, want = split_digest(expected_digest)
    else:
        algorithm, want = "sha256", base64.urlsafe_b64decode(info.digest.split("=", 1)[1]).hex()
    hasher = new_hasher(algorithm)
    buf = bytearray(info.size)
    view = memoryview(buf)
    sub = await js.pull_subscribe(
        Subjects.object_chunks(bucket, info.nuid), stream=Subjects.object_stream(bucket),
        config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL, inactive_threshold=30.0),
        pending_bytes_limit=1024**3, pending_msgs_limit=1_000_000)
    per_batch = max(1, window_bytes // -(-info.size // info.chunks))
    got = filled = 0
    try:
        while got < info.chunks:
            for msg in await sub.fetch(min(per_batch, info.chunks - got), timeout=10.0):
                end = filled + len(msg.data)
                view[filled:end] = msg.data
                hasher.update(msg.data)
                filled, got = end, got + 1
    finally:
        await sub.unsubscribe()
        view.release()
    if filled != info.size or hasher.hexdigest() != want:
        raise ValueError("digest mismatch")
    return buf


# ----------------------------------------------------------------- the replica's path in an earlier version, for comparison
async def read_object_before(js: Any, bucket: str, name: str, window_bytes: int = 16 * 1024**2) -> bytes:
    """``shared.objectread.read_object`` as it was: the chunks joined into one ``bytes``, then a SHA-256 pass
    against the store's digest."""
    store = await js.object_store(bucket)
    info = await store.get_info(name)
    sub = await js.pull_subscribe(
        Subjects.object_chunks(bucket, info.nuid), stream=Subjects.object_stream(bucket),
        config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL, inactive_threshold=30.0),
        pending_bytes_limit=1024**3, pending_msgs_limit=1_000_000)
    chunks: list[bytes] = []
    per_batch = max(1, window_bytes // -(-info.size // info.chunks))
    try:
        while len(chunks) < info.chunks:
            chunks.extend(m.data for m in await sub.fetch(min(per_batch, info.chunks - len(chunks)), timeout=10.0))
    finally:
        await sub.unsubscribe()
    data = b"".join(chunks)
    expected = base64.urlsafe_b64decode(info.digest.split("=", 1)[1])
    if len(data) != info.size or hashlib.sha256(data).digest() != expected:
        raise ValueError("digest mismatch")
    return data


def load_weights_into_before(model: Any, state: dict[str, Any]) -> None:
    """``load_weights_into`` as it was: each tensor converted by ``.to`` (a temporary for bf16), then copied;
    a tied ``lm_head`` copied twice."""
    import torch

    own = model.state_dict()
    with torch.no_grad():
        for name, tensor in state.items():
            own[name].copy_(tensor.to(own[name].dtype))


async def load_before(js: Any, bucket: str, name: str, sha256_hex: str, engine: Any) -> WeightsLoadTimes:
    """The replica's load in an earlier version: read (join + SHA-256), SHA-256 again against the announcement,
    ``safetensors.torch.load`` (a copy of every tensor), then ``.to`` + ``copy_`` into the model. The engine is
    idle during the bench, so the copy runs in a helper thread as the engine's own thread ran it."""
    from safetensors.torch import load

    started = time.perf_counter()
    data = await read_object_before(js, bucket, name)
    received = time.perf_counter()
    if hashlib.sha256(data).hexdigest() != sha256_hex:
        raise ValueError("digest mismatch")
    state = load(data)
    await asyncio.to_thread(load_weights_into_before, engine.model, state)
    return WeightsLoadTimes(read_s=received - started, hold_s=time.perf_counter() - received)


async def into_replica(nc: Any, js: Any, subjects: Subjects, model_name: str, dtypes: list[str],
                       repeats: int, engine_kind: str = "continuous", lora_rank: int = 0) -> list[dict[str, Any]]:
    """The trainer's publish and the replica's load, as the services run them; the path in an earlier version
    (``load_before``) and today's (``RolloutWorker._load``) alternate on the same object, ``repeats`` times each."""
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
            # 1 MiB chunks, as the trainer writes them (services/trainer/weights.py)
            meta = ObjectMeta(name=name, options=ObjectMetaOptions(max_chunk_size=1024 * 1024))
            put_s, _ = await _timed(lambda: store.put(name, data, meta=meta), 1)  # noqa: B023
            started = time.perf_counter()
            note_digest = digest(data)
            digest_s = time.perf_counter() - started
            sha256_hex = hashlib.sha256(data).hexdigest()
            size = len(data) / MB
            before: list[WeightsLoadTimes] = []
            now: list[WeightsLoadTimes] = []
            for _ in range(repeats):
                if fmt == "full":  # the old path had the same LoRA merge: compared on full weights only
                    before.append(await load_before(js, subjects.weights_bucket, name, sha256_hex, engine))
                note = WeightsAnnouncement(version=engine.policy_version + 1, object_name=name, digest=note_digest,
                                           size=len(data), dtype=dtype, format=fmt)
                times = await worker._load(note)
                assert times is not None and engine.policy_version == note.version
                now.append(times)
            row = {"model": model_name, "dtype": dtype if fmt == "full" else f"LoRA r{lora_rank} adapter ({dtype})",
                   "size_mb": size, "serialise_s": serialise_s, "put_s": put_s, "digest_s": digest_s,
                   **_path_figures("now", now, size), **(_path_figures("before", before, size) if before else {})}
            rows.append(row)
            print(json.dumps(row), flush=True)
            await store.delete(name)
    finally:
        engine.close()
    return rows


def _path_figures(label: str, loads: list[WeightsLoadTimes], size_mb: float) -> dict[str, float]:
    read_s = statistics.median(t.read_s for t in loads)
    hold_s = statistics.median(t.hold_s for t in loads)
    total_s = statistics.median(t.read_s + t.hold_s for t in loads)
    return {f"{label}_read_s": read_s, f"{label}_hold_s": hold_s, f"{label}_total_s": total_s,
            f"{label}_held_mb_s": size_mb / hold_s, f"{label}_total_mb_s": size_mb / total_s}


def markdown(raw: list[dict[str, Any]], real: list[dict[str, Any]]) -> str:
    out = ["| object | chunk | put MB/s | read_object MB/s | read_object MB per CPU-s | through nats-py MB/s "
           "| through nats-py MB per CPU-s | ObjectStore.get MB/s | ObjectStore.get MB per CPU-s |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in raw:
        get = (f"{r['get_mb_s']:.1f} | {r['get_mb_per_cpu_s']:.0f}" if "get_mb_s" in r
               else "not run (quadratic) | -")
        out.append(f"| {r['size_mb']:g} MB | {r['chunk_kib']} KiB | {r['put_mb_s']:.0f} | "
                   f"{r['read_object_mb_s']:.0f} | {r['read_object_mb_per_cpu_s']:.0f} | {r['nats_py_mb_s']:.0f} | "
                   f"{r['nats_py_mb_per_cpu_s']:.0f} | {get} |")
    out += ["", "received -> held: from the object in the replica's memory to the engine holding it; end to end: "
            "from the first read to the engine holding it (medians).", "",
            "| model | dtype | bytes | serialise s | put s | digest s (trainer) | before: read s | before: received "
            "-> held | before: end to end | now: read s | now: received -> held | now: end to end |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in real:
        before = (f"{r['before_read_s']:.2f} | {r['before_hold_s']:.2f} s, {r['before_held_mb_s']:.0f} MB/s | "
                  f"{r['before_total_s']:.2f} s, {r['before_total_mb_s']:.0f} MB/s" if "before_read_s" in r
                  else "- | - | -")
        out.append(f"| {r['model']} | {r['dtype']} | {r['size_mb']:.1f} MB | {r['serialise_s']:.2f} | "
                   f"{r['put_s']:.2f} | {r['digest_s']:.2f} | {before} | {r['now_read_s']:.2f} | "
                   f"{r['now_hold_s']:.2f} s, {r['now_held_mb_s']:.0f} MB/s | "
                   f"{r['now_total_s']:.2f} s, {r['now_total_mb_s']:.0f} MB/s |")
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
    parser.add_argument("--sizes", type=lambda s: [float(x) for x in s.split(",") if x], default=[25.0, 100.0, 270.0],
                        help="raw object sizes, MB")
    parser.add_argument("--chunks", type=lambda s: [int(x) for x in s.split(",")], default=[128, 1024, 4096],
                        help="object-store chunk sizes, KiB (128 = nats-py's default, what the trainer uses)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--get-max-mb", type=float, default=25.0, help="largest object read with ObjectStore.get")
    parser.add_argument("--models", type=lambda s: [m for m in s.split(",") if m], default=["tiny", "smollm2"],
                        help="models to broadcast into a replica ('' = raw objects only)")
    parser.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16"])
    parser.add_argument("--engine", choices=["continuous", "hf"], default="continuous")
    parser.add_argument("--lora-rank", type=int, default=16, help="also broadcast a LoRA adapter (0 = no)")
    asyncio.run(main(parser.parse_args()))
