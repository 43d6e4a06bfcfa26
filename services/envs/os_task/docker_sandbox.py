"""The OS sandbox's docker backend (``env.os.backend = docker``): a container of an AgentBench-like image per
episode, sandboxd its pid 1, spoken to over the container's attached stdin/stdout. It behaves as the bwrap
backend does (``tests/envs/sandbox_checks.py`` runs the same checks on both): Docker's default capabilities less
MKNOD, no_new_privs, Docker's seccomp profile and masked /proc paths plus sandboxd's own folders of /proc/1,
Docker's open-file limit set explicitly, and apt served offline from a local repository in the image."""

from __future__ import annotations

import io
import json
import socket
import struct
import tarfile
import time
from typing import Any

import structlog

from services.envs.os_task.rootfs import LOCAL_REPO, OFFLINE_PACKAGES, VARIANT_PACKAGES
from services.envs.os_task.sandbox import SANDBOXD, SANDBOXD_HIDDEN, Limits, Sandbox, SandboxError, sandbox_nofile

log = structlog.get_logger()

# AgentBench's tasks `apt install` / `apt remove` (its containers have a network; ours do not): the packages are
# fetched at build time into a local repository, which becomes apt's only source with its lists kept, as the
# bwrap rootfs has it (OFFLINE_APT_HOOK)
OFFLINE_APT = (
    f"mkdir -p {LOCAL_REPO} && cd {LOCAL_REPO} && apt-get download -q {' '.join(OFFLINE_PACKAGES)} && "
    'for f in *.deb; do dpkg-deb -f "$f"; echo "Filename: ./$f"; echo "Size: $(stat -c %s "$f")"; '
    'echo "SHA256: $(sha256sum "$f" | cut -d" " -f1)"; echo; done > Packages && '
    f'echo "deb [trusted=yes] file:{LOCAL_REPO} ./" > /etc/apt/sources.list && rm -f /etc/apt/sources.list.d/* && '
    "rm -rf /var/lib/apt/lists/* && apt-get update -q && cd /")
# Docker's default masked paths (moby's oci defaults; runc skips those a kernel lacks): naming any replaces them all
DOCKER_MASKED = ["/proc/asound", "/proc/acpi", "/proc/interrupts", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
                 "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware",
                 "/sys/devices/virtual/powercap"]


DOCKERFILE = """FROM ubuntu:22.04
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip git vim curl wget zip unzip \
    tree procps passwd ca-certificates {extra} \\
    && {offline}
WORKDIR /root
"""
# Where ubuntu:22.04 cannot be pulled (no registry reachable): the Debian base image of `make setup-docker`
# (mmdebstrap + docker import) with the bwrap rootfs's packages, so both backends run the same system. PATH
# is the plain system one: the base's Python venv (/opt/python) is the JetRL image's, not the task's.
DEBIAN_DOCKERFILE = """FROM {base}
ENV DEBIAN_FRONTEND=noninteractive PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
RUN apt-get update && apt-get install -y --no-install-recommends {packages} ca-certificates \
    && {offline}
WORKDIR /root
CMD ["bash"]
"""
DEBIAN_BASE = "jetrl-base:bookworm-py3.11"  # built by scripts/docker_setup.sh
DEV_NODES = ("null", "zero", "full", "random", "urandom")


def build_docker_images(prefix: str = "jetrl-os", base: str | None = None,
                        variants: tuple[str, ...] = ("default", "packages")) -> list[str]:
    """Build ``<prefix>/default`` and ``<prefix>/packages`` (adds npm), as AgentBench's images: FROM
    ubuntu:22.04 when it can be pulled, else FROM ``base`` (default: the local Debian base image). Docker's
    layer cache makes a second call quick."""
    import docker  # optional: only the docker backend needs it

    client = docker.from_env()
    if base is None:
        try:
            client.images.pull("ubuntu", tag="22.04")
        except Exception as exc:  # no registry here: the local Debian base
            log.info("os_docker_no_ubuntu_image", error=str(exc)[:200], base=DEBIAN_BASE)
            base = DEBIAN_BASE
    if base is not None:
        try:
            client.images.get(base)
        except Exception as exc:
            raise SandboxError(f"base image {base!r} not found: `make setup-docker` builds it") from exc
    tags = []
    for variant in variants:
        tag = f"{prefix}/{variant}"
        if base is None:
            text = DOCKERFILE.format(extra="npm" if variant == "packages" else "", offline=OFFLINE_APT)
        else:
            text = DEBIAN_DOCKERFILE.format(base=base, packages=" ".join(VARIANT_PACKAGES[variant]), offline=OFFLINE_APT)
        t0 = time.monotonic()
        # host network for apt-get: works on engines started without a bridge (--bridge=none) too
        client.images.build(fileobj=io.BytesIO(text.encode()), tag=tag, rm=True, network_mode="host")
        log.info("os_docker_image_built", tag=tag, base=base or "ubuntu:22.04", seconds=round(time.monotonic() - t0, 1))
        tags.append(tag)
    return tags


def docker_disk_cap(client: Any, disk_mb: int) -> dict[str, str] | None:
    """``storage_opt`` capping a container's writable layer, where the engine can (overlay2 on xfs with
    pquota, btrfs, zfs, devicemapper); None elsewhere (overlay2 on ext4 here): the cap is then not enforced."""
    info = client.info()
    driver = info.get("Driver", "")
    backing = dict(info.get("DriverStatus") or []).get("Backing Filesystem", "")
    if driver in ("btrfs", "zfs", "devicemapper") or (driver == "overlay2" and backing == "xfs"):
        return {"size": f"{disk_mb}m"}
    return None


HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{hostname}\n"


def _tar(files: dict[str, bytes]) -> bytes:
    """A tar of these files (a name ending in / is a folder), as put_archive takes it."""
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        for name, body in files.items():
            info = tarfile.TarInfo(name.rstrip("/"))
            if name.endswith("/"):
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode = len(body), 0o644
                tar.addfile(info, io.BytesIO(body))
    return data.getvalue()


class DockerSandbox(Sandbox):
    def __init__(self, image: str, limits: Limits, hostname: str = "sandbox", start_timeout: float = 30.0) -> None:
        import docker  # optional: only the docker backend needs it

        self.hostname = hostname
        self.client = docker.from_env()
        config = json.dumps({"hostname": hostname, "nofile": limits.nofile, "fsize": limits.file_mb << 20,
                             "pids": limits.pids})
        # sandboxd is the container's pid 1, as in bwrap: the kernel ignores kill -9 from inside the pid
        # namespace, and orphans (a fork bomb's) are reparented to it and reaped. It speaks over the
        # container's attached stdin/stdout; the file goes in before the start.
        api = self.client.api
        nofile = sandbox_nofile(limits)
        host_config = api.create_host_config(
            auto_remove=True, mem_limit=f"{limits.memory_mb}m", memswap_limit=f"{limits.memory_mb}m",
            pids_limit=limits.pids, nano_cpus=int(limits.cpus * 1e9),
            # as the bwrap backend: Docker's default caps less MKNOD, no_new_privs (Docker's default seccomp
            # profile and /proc/sys read-only come with every container)
            cap_drop=["MKNOD"], security_opt=["no-new-privileges:true"],
            # Docker's default (LimitNOFILE=1048576), not whatever this engine's dockerd inherited
            ulimits=[docker.types.Ulimit(name="nofile", soft=nofile, hard=nofile)],
            # bind-mounted like bwrap's --dev: `rm -rf /` cannot unlink them (sandboxd's shell reads /dev/null)
            binds={f"/dev/{d}": {"bind": f"/dev/{d}", "mode": "rw"} for d in DEV_NODES},
            **({"storage_opt": disk} if (disk := docker_disk_cap(self.client, limits.disk_mb)) else {}))
        # runc masks these as it sets up the container, while pid 1 is already the process that execs sandboxd:
        # /proc/1/... is sandboxd's, as it is under bwrap (an API field the SDK has no argument for)
        host_config["MaskedPaths"] = [*DOCKER_MASKED, *SANDBOXD_HIDDEN]
        created = api.create_container(
            image, entrypoint=["python3", "-I", "/run/jetrl/sandboxd.py"], command=[], stdin_open=True, tty=False,
            user="root", environment={"JETRL_SANDBOX": config}, working_dir="/root", hostname=hostname,
            network_disabled=True, labels={"created_by": "jetrl-os"}, volumes=[f"/dev/{d}" for d in DEV_NODES],
            host_config=host_config)
        self.container = self.client.containers.get(created["Id"])
        self.closed = False
        try:
            # /etc/hosts names the hostname, as a container with a network has it and as under bwrap (sudo looks
            # it up); without a network Docker writes none
            hosts = HOSTS.format(hostname=hostname).encode()
            self.container.put_archive("/run", _tar({"jetrl/": b"", "jetrl/sandboxd.py": SANDBOXD.read_bytes()}))
            self.container.put_archive("/etc", _tar({"hosts": hosts}))
            self.sock: socket.socket = self.container.attach_socket(
                params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})._sock
            self._frames = b""
            self._buf = b""
            self.container.start()
            hello = json.loads(self._recv(start_timeout))
            if hello.get("op") != "ready":
                raise SandboxError(f"sandbox did not start: {hello}")
        except BaseException:
            self.close()
            raise

    def _send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _recv(self, timeout: float) -> bytes:
        """Demultiplex Docker's attach stream (8-byte frame headers) into stdout lines."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            while len(self._frames) >= 8:
                kind, size = struct.unpack(">BxxxL", self._frames[:8])
                if len(self._frames) < 8 + size:
                    break
                if kind == 1:
                    self._buf += self._frames[8:8 + size]
                self._frames = self._frames[8 + size:]
            if b"\n" in self._buf:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise SandboxError(f"sandbox did not answer within {timeout:g}s")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(1 << 16)
            except TimeoutError:
                continue
            if not chunk:
                raise SandboxError("sandbox connection closed")
            self._frames += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        sock = getattr(self, "sock", None)
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass
        try:  # force-remove: also a container that was created but never started (auto_remove needs a start)
            self.container.remove(force=True)
        except Exception as exc:  # already gone
            log.debug("os_docker_remove_failed", error=str(exc))
