"""The OS sandboxes' Debian rootfs: built once by mmdebstrap, cached, shared read-only by every episode as
the overlay's lower layer (the bwrap backend); the package lists are the Docker image's too."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import structlog

from services.envs.os_task.sandbox import SandboxError

log = structlog.get_logger()

# AgentBench's images: Ubuntu with these (the task prompt calls the OS "linux(ubuntu)").
BASE_PACKAGES = ["python3", "git", "vim-tiny", "curl", "wget", "zip", "unzip", "tree", "procps", "passwd"]
VARIANT_PACKAGES = {"default": BASE_PACKAGES, "packages": [*BASE_PACKAGES, "npm"]}

ROOTFS_RECIPE = 3  # bump when the build below changes: the cache key includes it
# Packages AgentBench's tasks `apt install` (its containers have a network; sandboxes do not): fetched from
# Debian's archive at build time into a local repository inside the rootfs, which becomes apt's only source,
# so `apt update` and `apt install sudo` work offline and `apt remove sudo` finds the package name.
OFFLINE_PACKAGES = ["sudo", "net-tools"]
LOCAL_REPO = "/var/lib/jetrl-apt"
OFFLINE_APT_HOOK = (
    f'set -e; mkdir -p "$1{LOCAL_REPO}"; '
    f'chroot "$1" sh -c "cd {LOCAL_REPO} && apt-get download -q {" ".join(OFFLINE_PACKAGES)}"; '
    f'chroot "$1" sh -c \'cd {LOCAL_REPO} && for f in *.deb; do dpkg-deb -f "$f"; echo "Filename: ./$f"; '
    'echo "Size: $(stat -c %s "$f")"; echo "SHA256: $(sha256sum "$f" | cut -d" " -f1)"; echo; done > Packages\'; '
    f'echo "deb [trusted=yes] file:{LOCAL_REPO} ./" > "$1/etc/apt/sources.list"; '
    'rm -f "$1"/etc/apt/sources.list.d/*; chroot "$1" apt-get update -q')


def rootfs_path(cache_dir: Path, variant: str, suite: str, mirror: str) -> Path:
    key = hashlib.sha256(json.dumps([ROOTFS_RECIPE, suite, mirror, VARIANT_PACKAGES[variant],
                                     OFFLINE_PACKAGES]).encode()).hexdigest()[:10]
    return cache_dir / f"rootfs-{variant}-{suite}-{key}"


def _run_with_progress(cmd: list[str], target: Path, label: str, env: dict[str, str]) -> tuple[int, str]:
    """Run a build that fills ``target`` (minutes: mmdebstrap), showing the megabytes written so far
    (``shared.progress``: a bar on a terminal, a line every 10 s in a log). Returns (exit status, stderr)."""
    from shared.progress import Progress

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    with Progress(label, total=None, unit="MB") as bar:
        while True:
            try:
                _, stderr = proc.communicate(timeout=2.0)
                break
            except subprocess.TimeoutExpired:
                bar.set(_tree_mb(target))
        bar.set(_tree_mb(target))
    return proc.returncode, stderr


def _tree_mb(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass  # files come and go while the build runs
    return total // 1_000_000


def ensure_rootfs(cache_dir: Path, variant: str = "default", suite: str = "bookworm",
                  mirror: str = "http://deb.debian.org/debian") -> Path:
    """The cached rootfs for ``variant``, built by mmdebstrap on first use (idempotent, locked)."""
    if variant not in VARIANT_PACKAGES:
        raise ValueError(f"unknown rootfs variant {variant!r}; known: {', '.join(VARIANT_PACKAGES)}")
    path = rootfs_path(cache_dir, variant, suite, mirror)
    if (path / ".jetrl-ready").exists():
        return path
    if shutil.which("mmdebstrap") is None:
        raise SandboxError("mmdebstrap is not installed (apt-get install mmdebstrap); run `make setup-os`")
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".lock-{path.name}", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another replica or test may be building the same one
        if (path / ".jetrl-ready").exists():
            return path
        tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        t0 = time.monotonic()
        log.info("os_rootfs_build", variant=variant, path=str(path))
        cmd = ["mmdebstrap", "--quiet", "--variant=minbase",
               f"--include={','.join(VARIANT_PACKAGES[variant])}",
               # keep dpkg/apt logs: an image that ran apt-get has them, and tasks ask about /var/log/*.log
               "--skip=cleanup/reproducible",
               # the local repository's package lists are the point of the hook: keep them
               "--skip=cleanup/apt/lists", f"--customize-hook={OFFLINE_APT_HOOK}",
               suite, str(tmp), mirror]
        returncode, stderr = _run_with_progress(cmd, tmp, f"os rootfs {variant}",
                                                env={**os.environ, "SOURCE_DATE_EPOCH": "1700000000"})
        if returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise SandboxError(f"mmdebstrap failed ({returncode}): {stderr[-2000:]}")
        (tmp / "run" / "jetrl").mkdir(parents=True, exist_ok=True)  # sandboxd's bind target
        (tmp / ".jetrl-ready").write_text(json.dumps({"variant": variant, "suite": suite, "mirror": mirror,
                                                       "packages": VARIANT_PACKAGES[variant],
                                                       "offline_apt": OFFLINE_PACKAGES}))
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
        log.info("os_rootfs_built", variant=variant, seconds=round(time.monotonic() - t0, 1))
        return path
