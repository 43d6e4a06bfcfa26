"""[trainer]: what the trainer trains on and how; the DeepSpeed backend's own keys in [trainer.deepspeed]."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.config.fields import opt, section

Dtype = Literal["float32", "bfloat16"]


@dataclass
class DeepSpeedConfig:
    """The DeepSpeed backend (``trainer.backend = "deepspeed"``): ZeRO over several ranks, launched with torchrun
    or deepspeed (services/trainer/deepspeed_backend.py)."""

    zero_stage: Literal[1, 2, 3] = opt(2, "ZeRO stage (3 gathers full weights for each broadcast)")
    dtype: Dtype = opt("float32", "training dtype (master weights stay fp32)")
    dist_backend: str = opt("", "torch.distributed backend; empty = nccl on GPUs, gloo on the CPU")


@dataclass
class TrainerConfig:
    steps: int = opt(2, "training steps, then the trainer exits and the run ends", ge=0)
    lr: float = opt(1e-5, "AdamW learning rate", ge=0)
    weight_decay: float = opt(0.0, "AdamW weight decay")
    warmup_steps: int = opt(0, "linear learning-rate warm-up over this many steps (0 = none); helps a fresh optimizer "
                               "on a warm-started model", ge=0)
    betas: list[float] = opt([0.9, 0.999], "AdamW betas")
    max_grad_norm: float = opt(1.0, "gradient clipping norm")
    min_groups: int = opt(2, "a step starts once at least this many complete groups are ready", ge=1)
    max_groups: int = opt(64, "a step takes at most this many groups (dynamic batch upper bound)", ge=1)
    clip_eps: float = opt(0.2, "PPO clip range", ge=0)
    task_norm: Literal["scale", "paper", "off"] = opt("scale", "task advantage normalisation: scale (each task's "
                                                               "tokens divided by their standard deviation, tokens "
                                                               "of zero-signal groups left out and left at 0: no "
                                                               "sign changes), paper (AgentRL: per-task zero mean / "
                                                               "unit variance over every token) or off")
    micro_batch_tokens: int = opt(4096, "packed tokens per forward/backward chunk (gradient accumulation); a "
                                        "shared prefix counts once", ge=1)
    shared_prefix: bool = opt(True, "run the common opening of trajectories (a group's task, a task's system "
                                    "prompt) once per micro-batch, with gradient, instead of once per trajectory")
    lora_rank: int = opt(0, "LoRA adapter rank (PEFT); 0 = full fine-tuning. With LoRA only the adapter trains, "
                            "is checkpointed and is broadcast", ge=0)
    lora_alpha: float = opt(32.0, "LoRA alpha (the adapter's update is scaled by alpha / rank)")
    lora_targets: list[str] = opt(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                  "modules that get LoRA adapters")
    checkpoint_every: int = opt(1, "save a checkpoint every N steps (0 = only at the end)", ge=0)
    torch_threads: int = opt(2, "torch intra-op threads for training", ge=1)
    broadcast_dtype: Dtype = opt("float32", "dtype of broadcast weights")
    mode: Literal["rl", "sft"] = opt("rl", "rl (GRPO-style policy gradient) or sft (cross-entropy on successful "
                                                 "trajectories)")
    loss: Literal["decoupled", "ppo"] = opt("decoupled", "decoupled (PPO clip vs proximal policy + truncated IS to "
                                                          "behaviour) or ppo")
    is_cap: float = opt(2.0, "decoupled PPO: truncation of the behaviour importance weight", gt=0)
    dual_clip: float = opt(0.0, "dual-clip constant c > 1 for negative advantages; 0 = off", ge=0)
    kl_coef: float = opt(0.0, "weight of the k3 KL penalty to the initial (reference) model; 0 = no reference", ge=0)
    minibatches: int = opt(1, "optimizer steps per batch (the proximal policy is fixed for all of them)", ge=1)
    filter_flat_groups: bool = opt(False, "rl: a group whose episodes all got the same reward (no policy-gradient "
                                          "signal) is acked and left out, and does not count towards min_groups, "
                                          "so every step trains on groups with signal (DAPO's dynamic sampling; "
                                          "with kl_coef > 0 their KL gradient is left out too)")
    max_staleness: dict[str, int] = opt({}, "task -> most versions a turn may lag ('*' = every task); empty = no "
                                            "bound", ge=0)
    max_tokens: dict[str, int] = opt({}, "task -> longest trajectory (tokens) the trainer takes ('*' = every task); a "
                                         "longer one is dead-lettered, never trained on; unset: "
                                         "rollout.max_context_tokens, which no trajectory of a rollout exceeds", ge=1)
    staleness_mode: Literal["drop", "downweight"] = opt("drop", "beyond the bound: drop the trajectory or "
                                                                 "downweight its tokens")
    staleness_downweight: float = opt(0.5, "token weight of a too-stale trajectory in downweight mode", ge=0, le=1)
    sft_min_reward: float = opt(1.0, "sft: train only on trajectories with at least this reward")
    sft_context_weight: float = opt(0.0, "sft: weight of the cross-entropy on the tokens after the system message "
                                         "that the agent did not write (task, tool results); > 0 teaches a small "
                                         "model from scratch to read and copy from its context", ge=0)
    group_timeout_s: float = opt(300.0, "an incomplete group older than this is trained on as it is", gt=0)
    ack_wait_s: float = opt(15.0, "trajectories held this long without an ack or an in_progress heartbeat are "
                                  "redelivered (the trainer touches what it holds every ack_wait_s / 4, so a "
                                  "crashed trainer's batch comes back within this)", gt=0)
    max_deliver: int = opt(5, "deliveries of one trajectory to the trainer; its last delivery is dead-lettered "
                              "instead of trained on (a poison message cannot crash the trainer forever)", ge=1)
    dedupe_window: int = opt(100000, "episode ids the trainer remembers to drop a duplicate trajectory (bounded)")
    keep_weight_versions: int = opt(3, "weight objects kept in the object store", ge=1)
    keep_checkpoints: int = opt(3, "newest checkpoints kept in <run>/checkpoints (0 = all)", ge=0)
    backend: Literal["torch", "deepspeed"] = opt("torch", "torch (one process, the default) or deepspeed (ZeRO, "
                                                          "several ranks, rank 0 serves: [trainer.deepspeed])")
    deepspeed: DeepSpeedConfig = section(DeepSpeedConfig)
