"""Sandboxes for OS episodes: a private root shell per episode, without Docker or with it.

``bwrap`` (the default): the lower layer is a Debian rootfs built once by mmdebstrap and cached (rootfs.py); each
episode mounts a size-capped tmpfs and an overlay on it inside its own ``unshare --mount`` namespace
(bwrap 0.8 has no overlay flag), then bwrap binds the overlay as ``/`` with new pid/net/uts/ipc
namespaces, a fresh /proc and /dev, Docker's default capabilities less CAP_MKNOD, no_new_privs, a
seccomp filter, /proc/sys read-only and Docker's masked /proc files. A cgroup caps memory, processes
and CPU. Inside runs ``sandboxd.py`` as pid 1. When the episode ends the namespace dies, and with it
the tmpfs holding the upper dir. The sandbox's root is the host's uid 0 (no user namespace: tasks
chown to many uids), as in Docker without userns-remap; the caps, seccomp and masks are what keep it in.

``docker`` (``docker_sandbox.py``): a container of an AgentBench-like image with sandboxd as its pid 1; the same
JSON-lines protocol and the same behaviour, so episodes do not know which one they run on.
"""

from __future__ import annotations

import json
import os
import resource
import select
import shutil
import signal
import struct
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger()

SANDBOXD = Path(__file__).with_name("sandboxd.py")
# Docker's default capability set, less CAP_MKNOD (bwrap's /dev has no devices cgroup behind it).
CAPS = ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP",
        "CAP_NET_BIND_SERVICE", "CAP_NET_RAW", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE", "CAP_SETFCAP"]
# Docker's masked /proc paths: real root could write some of them (sysrq-trigger reboots the host).
PROC_MASKED = ["/proc/sysrq-trigger", "/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug",
               "/proc/latency_stats"]


# sandboxd (pid 1) is non-dumpable, so root in the sandbox may not list these folders of it, and `find / ...`
# would exit 1 where Docker's (dumpable) `sleep infinity` lets it pass: both backends lay empty read-only
# folders over them (its fd links stay unreadable: the pipe to the host must stay private)
SANDBOXD_HIDDEN = ["/proc/1/fdinfo", "/proc/1/map_files", "/proc/1/task/1/fdinfo"]

# --------------------------------------------------------------------------------------------- #
# seccomp: a cBPF filter (bwrap --seccomp) refusing what Docker's default profile refuses and more:
# kernel keyrings, bpf, perf, modules, mounts and new namespaces (also clone(CLONE_NEWUSER)),
# io_uring, userfaultfd, clock and swap changes. Built here by hand: no libseccomp needed.
# --------------------------------------------------------------------------------------------- #
SYSCALLS_X86_64_EPERM = [
    103, 153, 155, 156, 159, 163, 164, 165, 166, 167, 168, 169, 172, 173, 174, 175, 176, 177, 178, 179, 180, 212,
    227, 246, 248, 249, 250, 272, 279, 298, 303, 304, 305, 308, 310, 311, 312, 313, 320, 321, 323, 425, 426, 427,
    428, 429, 430, 431, 432, 433, 438, 442]
SYS_CLONE, SYS_CLONE3, CLONE_NEWUSER = 56, 435, 0x10000000
EPERM, ENOSYS = 1, 38


def seccomp_program() -> bytes | None:
    """The filter as bwrap reads it (an array of struct sock_filter), or None off x86_64."""
    if os.uname().machine != "x86_64":
        return None
    ld_abs, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, kill, errno = 0x7FFF0000, 0x80000000, 0x00050000
    ops: list[tuple[int, int, int, int]] = []
    ops.append((ld_abs, 0, 0, 4))  # seccomp_data.arch
    ops.append((jeq, 1, 0, 0xC000003E))  # AUDIT_ARCH_X86_64
    ops.append((ret, 0, 0, kill))
    ops.append((ld_abs, 0, 0, 0))  # seccomp_data.nr
    ops.append((jge, 0, 1, 0x40000000))  # the x32 ABI: refuse it whole
    ops.append((ret, 0, 0, errno | EPERM))
    for nr in SYSCALLS_X86_64_EPERM:
        ops.append((jeq, 0, 1, nr))
        ops.append((ret, 0, 0, errno | EPERM))
    ops.append((jeq, 0, 1, SYS_CLONE3))  # glibc falls back to clone() on ENOSYS, whose flags we can see
    ops.append((ret, 0, 0, errno | ENOSYS))
    ops.append((jeq, 0, 3, SYS_CLONE))
    ops.append((ld_abs, 0, 0, 16))  # args[0], low half: the clone flags
    ops.append((jset, 0, 1, CLONE_NEWUSER))
    ops.append((ret, 0, 0, errno | EPERM))
    ops.append((ret, 0, 0, allow))
    return b"".join(struct.pack("<HBBI", code, jt, jf, k) for code, jt, jf, k in ops)


CAP_SYS_RESOURCE = 24


def has_cap(bit: int) -> bool:
    """Whether this process holds the capability (a replica in a container may lack some of root's)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> bit & 1)
    except (OSError, ValueError):
        pass
    return False


def sandbox_nofile(limits: Limits) -> int:
    """The open-file limit (soft = hard) a sandbox starts with: inside, nobody may raise a hard limit (no
    CAP_SYS_RESOURCE), so it is set from outside, as Docker's is; a replica without CAP_SYS_RESOURCE (in a
    container) cannot go past its own hard limit."""
    if has_cap(CAP_SYS_RESOURCE):
        return limits.nofile
    return min(limits.nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1])


class SandboxError(RuntimeError):
    """The sandbox failed or died (not the agent's command failing)."""


@dataclass
class Limits:
    memory_mb: int = 1024
    pids: int = 256
    cpus: float = 1.0
    disk_mb: int = 512
    file_mb: int = 256
    nofile: int = 1 << 20  # Docker's default (LimitNOFILE=1048576 of dockerd 20-24, AgentBench's era)


# --------------------------------------------------------------------------------------------- #
# cgroups: memory and process caps per episode (v2, or v1 as on this machine)
# --------------------------------------------------------------------------------------------- #
class Cgroup:
    ROOT = Path("/sys/fs/cgroup")

    def __init__(self, name: str, limits: Limits) -> None:
        self.dirs: list[Path] = []
        try:
            if (self.ROOT / "cgroup.controllers").exists():
                parent = self.ROOT / "jetrl-os"
                parent.mkdir(exist_ok=True)
                for controller in ("memory", "pids", "cpu"):  # one by one: a host may lack one
                    for d in (self.ROOT, parent):
                        try:
                            (d / "cgroup.subtree_control").write_text(f"+{controller}")
                        except OSError:
                            pass
                d = parent / name
                d.mkdir()
                self.dirs = [d]
                for file, value in (("memory.max", str(limits.memory_mb << 20)), ("memory.swap.max", "0"),
                                    ("pids.max", str(limits.pids)), ("cpu.max", f"{int(limits.cpus * 1e5)} 100000")):
                    if (d / file).exists():
                        (d / file).write_text(value)
                if not (d / "memory.max").exists():
                    raise OSError("no memory controller in the cgroup v2 hierarchy")
            else:
                mem, pids = self.ROOT / "memory" / "jetrl-os" / name, self.ROOT / "pids" / "jetrl-os" / name
                cpu = self.ROOT / "cpu" / "jetrl-os" / name
                for d in (mem, pids, cpu):
                    d.mkdir(parents=True)
                    self.dirs.append(d)
                (cpu / "cpu.cfs_period_us").write_text("100000")
                (cpu / "cpu.cfs_quota_us").write_text(str(int(limits.cpus * 100000)))
                (mem / "memory.limit_in_bytes").write_text(str(limits.memory_mb << 20))
                if (mem / "memory.memsw.limit_in_bytes").exists():
                    (mem / "memory.memsw.limit_in_bytes").write_text(str(limits.memory_mb << 20))
                (pids / "pids.max").write_text(str(limits.pids))
        except OSError as exc:
            self.remove()
            self.dirs = []
            log.warning("os_cgroup_unavailable", error=str(exc))

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def pids(self) -> set[int]:
        out: set[int] = set()
        for f in self.procs_files:
            try:
                out.update(int(p) for p in Path(f).read_text().split())
            except OSError:
                pass
        return out

    def kill_all(self) -> None:
        for _ in range(50):
            left = self.pids()
            if not left:
                return
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.02)

    def remove(self) -> None:
        for d in self.dirs:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


# --------------------------------------------------------------------------------------------- #
# The host end of the sandboxd protocol
# --------------------------------------------------------------------------------------------- #
class Sandbox:
    """One episode's machine: ``shell`` runs a script in the persistent bash, ``exec`` a fresh process."""

    hostname = "sandbox"

    def _send(self, data: bytes) -> None:
        raise NotImplementedError

    def _recv(self, timeout: float) -> bytes:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _request(self, req: dict[str, Any], timeout: float) -> dict[str, Any]:
        """One request, one reply carrying the request's random id: a line that does not carry it (a
        forgery, or a stale reply) is a broken sandbox, never an answer."""
        req = {**req, "id": uuid.uuid4().hex}
        try:
            self._send(json.dumps(req).encode() + b"\n")
            reply = json.loads(self._recv(timeout))
        except (OSError, ValueError) as exc:
            raise SandboxError(f"sandbox connection failed: {exc}") from None
        if not reply.get("ok"):
            raise SandboxError(f"sandbox refused {req.get('op')}: {reply.get('error')}")
        if reply.get("id") != req["id"]:
            raise SandboxError(f"sandbox reply out of order or forged: {str(reply)[:200]}")
        return reply

    def shell(self, script: str, timeout: float, cap: int = 1 << 20, stdin_pipe: bool = False) -> dict[str, Any]:
        """``{output, bytes, status, timed_out, restarted}``; the command ends after ``timeout`` seconds.
        ``stdin_pipe``: the script may read the shell's input (``su - user`` then switches the shell)."""
        req = {"op": "shell", "script": script, "timeout": timeout, "cap": cap}
        if stdin_pipe:
            req["stdin_pipe"] = True
        return self._request(req, timeout + 10)

    def exec(self, argv: list[str], timeout: float, cap: int = 1 << 20, cwd: str = "/root",
             env: dict[str, str] | None = None) -> dict[str, Any]:
        """``{code, stdout, stderr, timed_out}`` of a fresh process, like ``docker exec`` (``env``: extra
        variables)."""
        req: dict[str, Any] = {"op": "exec", "argv": argv, "timeout": timeout, "cap": cap, "cwd": cwd}
        if env:
            req["env"] = env
        return self._request(req, timeout + 10)

    def stop_shell(self) -> None:
        """End the agent's persistent shell (and a ``su`` session in it); its background processes go on. The
        next ``shell`` call starts a new one."""
        self._request({"op": "stop_shell"}, 10)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PipeSandbox(Sandbox):
    """sandboxd behind a child process's stdin/stdout."""

    def _attach(self, proc: subprocess.Popen[bytes], start_timeout: float) -> None:
        self.proc = proc
        self._buf = b""
        hello = json.loads(self._recv(start_timeout))
        if hello.get("op") != "ready":
            raise SandboxError(f"sandbox did not start: {hello}")

    def _send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def _recv(self, timeout: float) -> bytes:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SandboxError(f"sandbox did not answer within {timeout:g}s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    err = self.proc.stderr.read().decode(errors="replace")[-2000:] if self.proc.stderr else ""
                    raise SandboxError(f"sandbox exited ({self.proc.poll()}): {err.strip()}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line


class BwrapSandbox(PipeSandbox):
    def __init__(self, rootfs: Path, limits: Limits, run_dir: Path, hostname: str = "sandbox",
                 start_timeout: float = 20.0) -> None:
        if shutil.which("bwrap") is None:
            raise SandboxError("bubblewrap is not installed (apt-get install bubblewrap); run `make setup-os`")
        if os.geteuid() != 0:  # the overlay is mounted in a private mount namespace: CAP_SYS_ADMIN
            raise SandboxError("the bwrap backend runs as root (it mounts an overlay per episode); "
                               "use env.os.backend=docker otherwise")
        self.hostname = hostname
        self.name = f"ep-{uuid.uuid4().hex[:12]}"
        run_dir.mkdir(parents=True, exist_ok=True)
        self.ep_dir = Path(tempfile.mkdtemp(prefix=self.name, dir=run_dir))
        self.cgroup = Cgroup(self.name, limits)
        self.closed = False
        config = {"hostname": hostname, "nofile": limits.nofile, "fsize": limits.file_mb << 20, "pids": limits.pids}
        if not self.cgroup.dirs:  # no memory cgroup: fall back to a per-process address-space cap
            config["address_space"] = limits.memory_mb << 20
        bwrap = ["bwrap", "--bind", str(self.ep_dir / "root"), "/", "--proc", "/proc", "--dev", "/dev",
                 "--ro-bind", "/proc/sys", "/proc/sys",
                 "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-ipc", "--unshare-cgroup-try",
                 "--hostname", hostname, "--as-pid-1", "--die-with-parent", "--new-session",
                 "--ro-bind", str(SANDBOXD), "/run/jetrl/sandboxd.py", "--chdir", "/root", "--clearenv",
                 "--setenv", "PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                 "--setenv", "HOME", "/root", "--setenv", "JETRL_SANDBOX", json.dumps(config),
                 "--cap-drop", "ALL"]
        for cap in CAPS:
            bwrap += ["--cap-add", cap]
        for path in PROC_MASKED:
            if os.path.exists(path):
                bwrap += ["--ro-bind", "/dev/null", path]
        for path in SANDBOXD_HIDDEN:
            bwrap += ["--tmpfs", path, "--remount-ro", path]
        pass_fds: tuple[int, ...] = ()
        program = seccomp_program()
        if program is not None:
            fd = os.memfd_create("jetrl-seccomp", 0)  # not CLOEXEC: bwrap reads it after two execs
            os.write(fd, program)
            os.lseek(fd, 0, os.SEEK_SET)
            pass_fds = (fd,)
            bwrap += ["--seccomp", str(fd)]
        bwrap += ["python3", "-I", "/run/jetrl/sandboxd.py"]
        # Stage 1 joins the cgroups, stage 2 (in a private mount namespace) mounts tmpfs + overlay.
        attach = 'while [ "$1" != -- ]; do echo $$ > "$1"; shift; done; shift; exec "$@"'
        # /etc/hosts names the sandbox's hostname, as Docker's does (sudo looks it up; written to the upper layer)
        mount = ('set -e; ep=$1; lower=$2; size=$3; host=$4; shift 4; '
                 'mount -t tmpfs -o "size=$size,mode=0755" jetrl-os "$ep"; '
                 'mkdir "$ep/upper" "$ep/work" "$ep/root"; '
                 'mount -t overlay overlay -o "lowerdir=$lower,upperdir=$ep/upper,workdir=$ep/work" "$ep/root"; '
                 'printf "127.0.0.1\\tlocalhost\\n::1\\tlocalhost ip6-localhost ip6-loopback\\n127.0.1.1\\t%s\\n" '
                 '"$host" > "$ep/root/etc/hosts"; '
                 'exec "$@"')
        # the open-file limit the sandbox inherits; prlimit (util-linux) sets it as root
        n = sandbox_nofile(limits)
        nofile = ["prlimit", f"--nofile={n}:{n}", "--"] if shutil.which("prlimit") else []
        argv = [*nofile, "sh", "-c", attach, "jetrl-attach", *self.cgroup.procs_files, "--",
                "unshare", "--mount", "--propagation", "private", "--fork", "--kill-child=SIGKILL", "--",
                "sh", "-c", mount, "jetrl-mount", str(self.ep_dir), str(rootfs), f"{limits.disk_mb}m", hostname, *bwrap]
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True, pass_fds=pass_fds)
        finally:
            for fd in pass_fds:
                os.close(fd)
        try:
            self._attach(proc, start_timeout)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        proc = self.proc if hasattr(self, "proc") else None
        if proc is not None:
            try:  # EOF: sandboxd (pid 1) exits and the kernel ends the whole pid namespace
                if proc.stdin:
                    proc.stdin.close()
                proc.wait(timeout=2)
            except (OSError, subprocess.TimeoutExpired):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                proc.wait()
            for stream in (proc.stdout, proc.stderr):
                if stream:
                    stream.close()
        self.cgroup.kill_all()
        self.cgroup.remove()
        shutil.rmtree(self.ep_dir, ignore_errors=True)  # the upper dir lived on the namespace's tmpfs
