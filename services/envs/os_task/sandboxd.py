"""In-sandbox agent of an OS episode: a stdlib-only script run by the sandbox's own python3.

It speaks JSON lines with the host on stdin/stdout. It keeps the agent's one persistent login bash
(``shell``: cwd and variables persist between actions) and runs independent commands as fresh
processes (``exec``: init and check scripts, like ``docker exec``). It is pid 1 of the bwrap sandbox,
so the agent cannot kill it (the kernel ignores SIGKILL sent to a namespace's init from inside); it
reaps orphans, and it ends a command's processes when its time is up: every process started since the
command began is stopped (SIGSTOP, sweep until none is left running, so a fork bomb cannot outrun it)
and then killed; processes started earlier (a task's background programs) are left alone.

Runs under Debian's or Ubuntu's python3 (3.8+), inside the sandbox: nothing here may import the
project. Config comes in the JETRL_SANDBOX environment variable (JSON), so ``ps`` stays short.
"""

import json
import os
import re
import resource
import select
import signal
import sys
import time

CONFIG = json.loads(os.environ.pop("JETRL_SANDBOX", "{}") or "{}")
ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "HOSTNAME": CONFIG.get("hostname", "sandbox"),
    "TERM": "dumb",
    "LANG": "C.UTF-8",
}
TOKEN = os.urandom(8).hex()
MARK = (f"__jetrl_done_{TOKEN}__").encode()
MARK_RE = re.compile(rb"\n" + MARK + rb" (-?\d+)\n")
WINDOW = len(MARK) + 32
SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 _-./,:=")
CLK = os.sysconf("SC_CLK_TCK")
exited = {}  # pid -> wait status, for children reaped by reap()


def reap():
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        exited[pid] = status


def exit_code(status):
    """os.waitstatus_to_exitcode, which python 3.8 (Ubuntu 20.04) lacks."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def ticks_now():
    with open("/proc/uptime") as f:
        return int(float(f.read().split()[0]) * CLK)


def start_ticks(pid):
    """Start time of a process in clock ticks since boot, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def pids():
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def end_processes_since(t0, keep):
    """Stop, then kill, every process started at or after tick t0 except ``keep``. Returns how many."""
    victims = set()
    for _ in range(500):  # sweep until no new process appears: stopped processes cannot fork
        new = False
        for pid in pids():
            if pid in keep or pid in victims:
                continue
            started = start_ticks(pid)
            if started is None or started < t0:
                continue
            try:
                os.kill(pid, signal.SIGSTOP)
            except OSError:
                continue
            victims.add(pid)
            new = True
        if not new:
            break
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    time.sleep(0.02)
    reap()
    return len(victims)


def crowded():
    """True when the sandbox nears its process cap: a fork bomb left running in the background."""
    limit = CONFIG.get("pids")
    return bool(limit) and len(pids()) >= 0.8 * limit


def child_setup(cwd):
    """In the forked child, before exec: own session, default signals, limits, cwd."""
    os.setsid()
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    for name, value in (("RLIMIT_NOFILE", CONFIG.get("nofile")), ("RLIMIT_FSIZE", CONFIG.get("fsize")),
                        ("RLIMIT_AS", CONFIG.get("address_space")), ("RLIMIT_CORE", 0)):
        if value is not None:
            hard = resource.getrlimit(getattr(resource, name))[1]
            if hard != resource.RLIM_INFINITY:
                value = min(value, hard)  # no CAP_SYS_RESOURCE in here: a hard limit can only go down
            resource.setrlimit(getattr(resource, name), (value, value))
    try:  # the OOM killer should pick the agent's processes before this one
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("500")
    except OSError:
        pass
    os.chdir(cwd if os.path.isdir(cwd) else "/")


def spawn(argv, stdin_fd, stdout_fd, stderr_fd, cwd="/root", env=None):
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(stdin_fd, 0)
            os.dup2(stdout_fd, 1)
            os.dup2(stderr_fd, 2)
            os.closerange(3, 4096)
            child_setup(cwd)
            os.execvpe(argv[0], argv, dict(ENV, **env) if env else ENV)
        except BaseException as exc:  # exec failed: say why on the child's stderr
            try:
                os.write(2, (f"jetrl-sandbox: cannot run {argv[0]}: {exc}\n").encode())
            finally:
                os._exit(127)
    return pid


def kill_session(pid):
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
        except OSError:
            pass


class Shell:
    """The agent's persistent bash. Each script is eval'd in it, then a marker with a random token
    tells where the output ends; stdin is /dev/null so a script cannot eat the next command."""

    def __init__(self):
        self.pid = None
        self.last_t0 = 0
        self.dead = False
        self.start()

    def start(self):
        r_in, self.stdin = os.pipe()
        self.stdout, w_out = os.pipe()
        self.pid = spawn(["bash", "--login"], r_in, w_out, w_out)
        os.close(r_in)
        os.close(w_out)
        os.set_blocking(self.stdout, False)
        self.run("true", 10.0, 1024)

    def stop(self):
        kill_session(self.pid)
        for fd in (self.stdin, self.stdout):
            try:
                os.close(fd)
            except OSError:
                pass
        time.sleep(0.01)
        reap()

    def run(self, script, timeout, cap, stdin_pipe=False):
        """``stdin_pipe``: the script reads the shell's own input, so ``su - user`` in it goes on reading
        the next commands (as in AgentBench's interactive shell): the shell now runs as that user."""
        if self.dead:
            self.dead = False
            self.start()
        t0 = ticks_now()
        quoted = "$'" + "".join(chr(b) if chr(b) in SAFE else f"\\x{b:02x}" for b in script.encode()) + "'"
        redirect = "" if stdin_pipe else " < /dev/null"
        line = f"eval {quoted}{redirect}\nprintf '\\n%s %d\\n' {MARK.decode()} $?\n"
        kept, total, window = bytearray(), 0, b""
        result = {"timed_out": False, "restarted": False, "status": None, "background_bytes": self.drain()}
        try:
            os.write(self.stdin, line.encode())
        except OSError:  # the shell is gone; start a new one and try once more
            self.stop()
            self.start()
            os.write(self.stdin, line.encode())
            result["restarted"] = True
        deadline = time.monotonic() + timeout
        grace = None
        while True:
            now = time.monotonic()
            if grace is None and now >= deadline:
                result["timed_out"] = True
                result["killed"] = end_processes_since(t0, {os.getpid(), self.pid, 1})
                grace = now + 1.0
            if grace is not None and now >= grace:  # the shell itself hangs (exec, stdout redirected)
                self.stop()
                self.start()
                result["restarted"] = True
                break
            ready, _, _ = select.select([self.stdout], [], [], 0.2)
            reap()
            if not ready:
                if self.pid in exited:  # shell ended, its pipe may linger in a background child
                    self._restart_after_exit(result)
                    break
                continue
            try:
                chunk = os.read(self.stdout, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                self._restart_after_exit(result)
                break
            total += len(chunk)
            if len(kept) < cap:
                kept += chunk[: cap - len(kept)]
            window = (window + chunk[-WINDOW:])[-WINDOW:]
            match = MARK_RE.search(window)
            if match:
                total -= len(window) - match.start()
                del kept[total:]
                result["status"] = int(match.group(1))
                break
        if not crowded() and any((start_ticks(p) or 0) >= t0 for p in pids()):
            time.sleep(0.1)  # the command left processes running: give a fork bomb the time to show itself
        if crowded():
            result["killed"] = result.get("killed", 0) + end_processes_since(t0, {os.getpid(), self.pid, 1})
            result["crowded"] = True
        self.last_t0 = t0
        result.update(output=bytes(kept).decode("utf-8", "replace"), bytes=total)
        return result

    def stop_chain(self):
        """Kill the shell and the user-switching chain under it (``su`` -> the user's shell), nothing else:
        background programs live on, as when an interactive session ends. ``run`` starts a new shell."""
        chain, frontier = [self.pid], [self.pid]
        while frontier:
            parent, frontier = frontier, []
            for pid in pids():
                try:
                    with open(f"/proc/{pid}/stat", "rb") as f:
                        data = f.read()
                    comm = data[data.index(b"(") + 1:data.rindex(b")")]
                    ppid = int(data[data.rindex(b")") + 2:].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                if ppid in parent and comm in (b"su", b"sudo", b"login", b"bash", b"sh", b"dash") \
                        and (ppid != self.pid or comm in (b"su", b"sudo", b"login")):
                    chain.append(pid)
                    frontier.append(pid)
        for pid in reversed(chain):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        deadline = time.monotonic() + 2.0  # gone from /proc before the next command counts processes
        while time.monotonic() < deadline:
            reap()
            if all(start_ticks(pid) is None for pid in chain):
                break
            time.sleep(0.005)
        for fd in (self.stdin, self.stdout):
            try:
                os.close(fd)
            except OSError:
                pass
        self.stdin = self.stdout = -1  # never write to a closed descriptor number: another pipe may reuse it
        self.dead = True

    def drain(self):
        """Throw away what background processes wrote since the last command; return how much."""
        total = 0
        while True:
            try:
                chunk = os.read(self.stdout, 1 << 16)
            except (BlockingIOError, OSError):
                return total
            if not chunk:
                return total
            total += len(chunk)

    def _restart_after_exit(self, result):
        time.sleep(0.05)
        reap()
        status = exited.pop(self.pid, None)
        result["exited"] = exit_code(status) if status is not None else None
        self.stop()
        self.start()
        result["restarted"] = True


def run_exec(argv, timeout, cap, cwd="/root", env=None):
    """A fresh process, like ``docker exec``: stdout and stderr kept apart, exit code returned."""
    t0 = time.monotonic()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    with open(os.devnull, "rb") as devnull:
        pid = spawn(argv, devnull.fileno(), out_w, err_w, cwd, env)
    os.close(out_w)
    os.close(err_w)
    streams = {out_r: bytearray(), err_r: bytearray()}
    open_fds = [out_r, err_r]
    timed_out, done_at = False, None
    while open_fds:
        now = time.monotonic()
        if now - t0 > timeout and not timed_out:
            timed_out = True
            kill_session(pid)
        reap()
        if pid in exited and done_at is None:
            done_at = now
        if done_at is not None and now - done_at > 0.2:
            break  # a background child keeps the pipe open; do not wait for it (docker exec does not)
        if timed_out and now - t0 > timeout + 2:
            break
        ready, _, _ = select.select(open_fds, [], [], 0.05)
        for fd in ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                open_fds.remove(fd)
            elif len(streams[fd]) < cap:
                streams[fd] += chunk[: cap - len(streams[fd])]
    for fd in (out_r, err_r):
        os.close(fd)
    deadline = time.monotonic() + 2
    while pid not in exited and time.monotonic() < deadline:
        time.sleep(0.005)
        reap()
    status = exited.pop(pid, None)
    code = exit_code(status) if status is not None else -9
    return {"code": code, "stdout": streams[out_r].decode("utf-8", "replace"),
            "stderr": streams[err_r].decode("utf-8", "replace"), "timed_out": timed_out}


def not_dumpable():
    """PR_SET_DUMPABLE 0: without CAP_SYS_PTRACE nobody in the sandbox may open /proc/<us>/fd (our pipe
    to the host: a forged reply there could pass a check), /proc/<us>/mem or /proc/<us>/environ."""
    try:
        import ctypes

        if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE)")
    except (ImportError, OSError, AttributeError) as exc:
        os.write(2, f"jetrl-sandbox: cannot make sandboxd non-dumpable: {exc}\n".encode())


def main():
    not_dumpable()
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only the host ends us, by closing stdin
    shell = Shell()
    reply = {"ok": True, "op": "ready", "token_len": len(TOKEN)}
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
    buf = b""
    stdin = sys.stdin.fileno()
    while True:
        ready, _, _ = select.select([stdin], [], [], 1.0)
        reap()
        if crowded():  # between actions too: a background fork bomb must not starve the sandbox
            end_processes_since(shell.last_t0, {os.getpid(), shell.pid, 1})
        if not ready:
            continue
        chunk = os.read(stdin, 1 << 16)
        if not chunk:
            break
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                req = json.loads(line)
                op = req["op"]
                if op == "shell":
                    reply = shell.run(req["script"], float(req["timeout"]), int(req["cap"]),
                                      bool(req.get("stdin_pipe")))
                elif op == "exec":
                    reply = run_exec(req["argv"], float(req["timeout"]), int(req["cap"]), req.get("cwd", "/root"),
                                     {str(k): str(v) for k, v in (req.get("env") or {}).items()})
                elif op == "stop_shell":
                    shell.stop_chain()
                    reply = {}
                elif op == "ping":
                    reply = {"pid": os.getpid(), "shell": shell.pid}
                else:
                    raise ValueError(f"unknown op {op!r}")
                reply["ok"] = True
                reply["id"] = req.get("id")
            except Exception as exc:  # a bad request must not end the sandbox
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()
    shell.stop()


if __name__ == "__main__":
    main()
