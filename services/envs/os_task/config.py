"""[env.os]: this task's own settings, read by the task registry (shared/tasks.py) from the
package's ``Config`` and checked key by key; the task's code reads them as ``cfg.os``."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import opt


@dataclass
class OSTaskConfig:
    """[env.os]: bash in a sandbox per episode."""

    backend: str = opt("bwrap", "sandbox per episode: bwrap (bubblewrap + overlayfs, no Docker) | docker")
    suite: str = opt("bookworm", "Debian suite of the bwrap rootfs (built once by mmdebstrap, cached)")
    mirror: str = opt("http://deb.debian.org/debian", "Debian mirror for the rootfs build")
    docker_prefix: str = opt("jetrl-os", "docker backend images are <prefix>/default and <prefix>/packages")
    command_timeout_s: float = opt(8.0, "wall-clock limit of one bash_action (kept below env.action_timeout_s)")
    check_timeout_s: float = opt(300.0, "wall-clock limit of each grading script (answer_action / finish_action); "
                                        "AgentBench has none, and env.action_timeout_s does not cut a grading")
    memory_mb: int = opt(1024, "memory cap of one episode's sandbox (AgentBench: 1 GiB)")
    pids: int = opt(256, "process cap of one episode's sandbox (a fork bomb stops here)")
    disk_mb: int = opt(512, "size of one episode's writable layer (tmpfs under the overlay)")
    cpus: float = opt(1.0, "CPU share of one episode's sandbox")
    agentbench_train: list[str] = opt([], "AgentBench OS task files (.json/.jsonl) added to the train split; each "
                                          "a file or glob, optionally =SCRIPTS_DIR (else AgentBench's layout: "
                                          "data/<N>/*.json -> scripts/<N>/)", path=True)
    agentbench_test: list[str] = opt([], "AgentBench OS task files (.json/.jsonl) added to the test split (as "
                                         "agentbench_train)", path=True)
    levels: list[int] = opt([], "difficulty levels the generated splits keep (1-3); empty = all")
