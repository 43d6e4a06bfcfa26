"""``python -m services.envs.os_task.setup default|packages|docker [--env.key=value ...]``: build the
bwrap rootfs (cached; a second run is a no-op) or the Docker images, and print where it is."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from services.envs.os_task.docker_sandbox import build_docker_images
from services.envs.os_task.rootfs import ensure_rootfs
from shared.config import from_argv


def main(argv: list[str]) -> None:
    cfg, (what,) = from_argv(argv, positional=1)
    env = cfg.env
    if what == "docker":
        # JETRL_BASE_IMAGE: a base to build FROM instead of ubuntu:22.04 (make setup-docker's Debian one)
        print("\n".join(build_docker_images(env.os.docker_prefix, os.environ.get("JETRL_BASE_IMAGE") or None)))
        return
    cache = Path(env.data_dir or Path.home() / ".cache" / "jetrl" / "data").expanduser() / "os"
    print(ensure_rootfs(cache, what, env.os.suite, env.os.mirror))


if __name__ == "__main__":
    main(sys.argv[1:])
