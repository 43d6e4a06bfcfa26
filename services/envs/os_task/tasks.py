"""OS tasks: AgentBench's format (loader and grader) and a seeded generator in the same format.

A task is a description, init scripts (run as fresh processes, like AgentBench's ``exec_run``), an
optional ``start`` script (run in the agent's shell, for background programs), and an evaluation:

* ``match``: the answer equals ``answer`` (after strip) or ``regex`` is found in it;
* ``check``: a chain of scripts. Values start as [answer]; each script runs in the episode's sandbox
  with all values so far as arguments; a non-zero exit fails, else its stdout is appended. ``None``
  stands for the ``example`` gold script. The named comparisons (``check/integer-match.py`` ...) are
  pure functions of the first two values, so they run here rather than in the sandbox.

Generated tasks differ in one way, on purpose: their gold answer comes from running the reference
script in a fresh sandbox right after init, before the agent acts, and stands in for the ``None``
entry. Grading with a gold computed after the agent's actions (AgentBench's rule, kept for its own
tasks) would pay an agent that deletes the data and answers 0.
"""

from __future__ import annotations

import glob
import hashlib
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------------------------- #
# Task format
# --------------------------------------------------------------------------------------------- #
LANGUAGES = ("bash", "python", "builtin")


@dataclass(frozen=True)
class Script:
    language: str  # bash | python | builtin (a named comparison)
    code: str


@dataclass
class OSTask:
    task_id: str
    description: str
    init: list[Script] = field(default_factory=list)
    start: Script | None = None
    match: dict[str, Any] | None = None
    check: list[Script | None] | None = None
    example: Script | None = None
    image: str = "default"
    fresh_gold: bool = False  # generated: gold = example's output in the fresh sandbox
    family: str = "agentbench"
    level: int = 0

    @property
    def wants_answer(self) -> bool:
        """Graded on an answer (match, or a chain comparing against the gold), not on the final state."""
        return self.match is not None or bool(self.check and any(s is None for s in self.check))


    @property
    def reads_answer(self) -> bool:
        """A check script takes the answer as its argument (AgentBench's Q47: the path asked for, then the
        state): the oracle must answer rather than finish."""
        return any(s is not None and s.language != "builtin" and re.search(r"argv\[1\]|\$\{?[1@*]", s.code)
                   for s in self.check or [])


class Unavailable(ValueError):
    """A task that cannot run here (a script file that is not shipped), with the reason."""


# --------------------------------------------------------------------------------------------- #
# Named comparisons (AgentBench's check/*.py), applied to values[0] (answer) and values[1] (gold)
# --------------------------------------------------------------------------------------------- #
SIZE_UNITS = {"B": 0, "K": 1, "KB": 1, "M": 2, "MB": 2, "G": 3, "GB": 3, "T": 4, "TB": 4, "P": 5, "PB": 5}


def parse_size(text: str) -> float:
    """Bytes in "4.0K", "1536 KB", "12": the suffixes as AgentBench lists them, in upper case."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Z]*)\s*", text)
    if not m or m.group(2) not in {"", *SIZE_UNITS}:
        raise ValueError(f"not a size: {text!r}")
    return float(m.group(1)) * 1024 ** SIZE_UNITS.get(m.group(2), 0)


def _integer_match(a: str, b: str) -> bool:
    try:
        return int(a.strip()) == int(b.strip())
    except ValueError:
        return False


def _norm(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n").strip()


def _size_match(a: str, b: str) -> bool:
    try:
        return parse_size(a) == parse_size(b)
    except ValueError:
        return False


COMPARISONS: dict[str, Callable[[str, str], bool]] = {
    "integer-match": _integer_match,
    "string-match": lambda a, b: _norm(a) == _norm(b),
    "size-match": _size_match,
    "containing": lambda a, b: _norm(b) in _norm(a),
    "in": lambda a, b: _norm(a) in _norm(b),
}


# --------------------------------------------------------------------------------------------- #
# AgentBench loader
# --------------------------------------------------------------------------------------------- #
def load_script(obj: Any, script_dir: Path | None) -> Script | None:
    if obj is None:
        return None
    if isinstance(obj, str):
        return Script("bash", obj)
    if not isinstance(obj, dict):
        raise Unavailable(f"invalid script object {obj!r}")
    language = obj.get("language", "bash")
    if "file" in obj:
        name = Path(obj["file"]).stem
        if name in COMPARISONS and Path(obj["file"]).parent.name == "check":
            return Script("builtin", name)
        path = script_dir / obj["file"] if script_dir else None
        if path is None or not path.is_file():
            raise Unavailable(f"script file {obj['file']} is not available")
        code = path.read_text()
    elif "code" in obj:
        code = obj["code"]
    else:
        raise Unavailable(f"script object without file or code: {obj!r}")
    if language not in LANGUAGES[:2]:
        raise Unavailable(f"unsupported script language {language!r}")
    return Script(language, code)


def parse_agentbench(item: dict[str, Any], task_id: str, script_dir: Path | None = None) -> OSTask:
    """One AgentBench OS item -> OSTask, following AgentBench's own loader (``_load_configs``)."""
    task = OSTask(task_id=task_id, description=item["description"])
    create = item.get("create")
    if isinstance(create, dict):
        task.image = str(create.get("image", create.get("local", "default"))).rsplit("/", 1)[-1]
        init = create.get("init")
        if init is not None:
            task.init = [s for s in (load_script(o, script_dir) for o in (init if isinstance(init, list) else [init]))
                         if s is not None]
    if "start" in item:
        task.start = load_script(item["start"], script_dir)
    evaluation = item["evaluation"]
    if "match" in evaluation:
        match = evaluation["match"]
        task.match = {"answer": match, "strip": True} if isinstance(match, str) else dict(match)
    elif "check" in evaluation:
        check = evaluation["check"]
        task.check = [load_script(s, script_dir) for s in (check if isinstance(check, list) else [check])]
        if "example" in evaluation:
            task.example = load_script(evaluation["example"], script_dir)
        if any(s is None for s in task.check) and task.example is None:
            raise Unavailable("check chain refers to the example script, which is missing")
    else:
        raise Unavailable("evaluation has neither match nor check")
    if task.image not in ("default", "packages"):
        raise Unavailable(f"image {task.image!r} is not built here")
    return task


def agentbench_script_dir(path: Path) -> Path:
    """Where the scripts of an AgentBench task file are, in AgentBench's layout: ``data/<N>/x.json`` ->
    ``scripts/<N>/``, ``data/dev.json`` -> ``scripts/dev/`` (as its configs/tasks/os.yaml pairs them);
    else the file's own folder."""
    if path.parent.parent.name == "data":
        candidate = path.parent.parent.parent / "scripts" / path.parent.name
    elif path.parent.name == "data":
        candidate = path.parent.parent / "scripts" / path.stem
    else:
        return path.parent
    return candidate if candidate.is_dir() else path.parent


def agentbench_prefix(path: Path) -> str:
    """``ab-<stem>``, or ``ab-<N>-<stem>`` for ``data/<N>/<stem>.json`` (AgentBench has several ``new.json``)."""
    if path.parent.parent.name == "data":
        return f"ab-{path.parent.name}-{path.stem}"
    return f"ab-{path.stem}"


@dataclass(frozen=True)
class TaskFile:
    path: Path
    script_dir: Path


def expand_task_files(entry: str) -> list[TaskFile]:
    """One ``env.os.agentbench_*`` entry: ``FILE``, a glob (``data/4/*.json``), either with ``=SCRIPTS_DIR``
    (AgentBench's ``script_dir``); without it the scripts folder is found by ``agentbench_script_dir``."""
    pattern, sep, scripts = entry.rpartition("=") if "=" in entry else (entry, "", "")
    pattern = str(Path(pattern).expanduser())
    if any(ch in pattern for ch in "*?["):
        paths = sorted(p for p in (Path(x) for x in glob.glob(pattern)) if p.suffix in (".json", ".jsonl"))
        if not paths:
            raise FileNotFoundError(f"no AgentBench task file matches {pattern!r}")
    else:
        paths = [Path(pattern)]
        if not paths[0].is_file():
            raise FileNotFoundError(f"AgentBench task file {pattern!r} does not exist")
    script_dir = Path(scripts).expanduser() if sep else None
    if script_dir is not None and not script_dir.is_dir():
        raise FileNotFoundError(f"scripts folder {str(script_dir)!r} (after '=' in {entry!r}) does not exist")
    return [TaskFile(p, script_dir or agentbench_script_dir(p)) for p in paths]


def load_agentbench(path: Path, prefix: str = "", script_dir: Path | None = None
                    ) -> tuple[list[OSTask], dict[str, str]]:
    """Tasks of an AgentBench .json/.jsonl file, ids ``<prefix>-<index>`` (default prefix:
    ``agentbench_prefix``), and the ids skipped with their reason (e.g. a script file that is missing)."""
    prefix = prefix or agentbench_prefix(path)
    text = path.read_text()
    items = [json.loads(line) for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl" \
        else json.loads(text)
    if isinstance(items, dict):
        items = [items]
    tasks, skipped = [], {}
    for idx, item in enumerate(items):
        task_id = f"{prefix}-{idx:05d}"
        try:
            tasks.append(parse_agentbench(item, task_id, script_dir or agentbench_script_dir(path)))
        except (Unavailable, KeyError, TypeError) as exc:
            skipped[task_id] = str(exc)
    return tasks, skipped


# --------------------------------------------------------------------------------------------- #
# Generator: six families x three levels, seeded by the task id
# --------------------------------------------------------------------------------------------- #
WORDS = ["alpha", "bravo", "cedar", "delta", "ember", "fjord", "gamma", "harbor", "indigo", "jasper", "kernel",
         "lumen", "maple", "nectar", "onyx", "pixel", "quartz", "raven", "sierra", "tundra", "umber", "vortex",
         "willow", "xenon", "yonder", "zephyr"]
EXTS = ["txt", "log", "csv", "md", "py", "conf", "json", "sh"]
DIRS = ["/root/data", "/root/workspace", "/srv/files", "/opt/archive", "/var/tmp/job", "/home/share"]
NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy", "mallory", "oscar"]
INT, STR = Script("builtin", "integer-match"), Script("builtin", "string-match")


def q(s: str) -> str:
    """Single-quote for bash."""
    return "'" + s.replace("'", "'\\''") + "'"


def _answer(desc: str, init: str, ref: str, cmp: Script = INT, start: str | None = None) -> dict[str, Any]:
    return {"description": desc, "init": init, "reference": ref, "check": [None, cmp], "start": start}


def _action(desc: str, init: str, ref: str, check: str, start: str | None = None) -> dict[str, Any]:
    return {"description": desc, "init": init, "reference": ref, "check": [Script("bash", check)], "start": start}


def gen_files(rng: random.Random, level: int) -> dict[str, Any]:
    d, ext = rng.choice(DIRS), rng.choice(EXTS)
    others = [e for e in EXTS if e != ext]
    lines = [f"mkdir -p {d}"]
    if level == 1:
        for i in range(rng.randint(3, 12)):
            lines.append(f"echo {rng.choice(WORDS)} > {d}/{rng.choice(WORDS)}{i}.{ext}")
        for i in range(rng.randint(2, 8)):
            lines.append(f"echo {rng.choice(WORDS)} > {d}/{rng.choice(WORDS)}{i}.{rng.choice(others)}")
        lines.append(f"mkdir -p {d}/sub.{ext} && touch {d}/sub.{ext}/inner.{ext}")
        return _answer(f"How many regular files with the extension .{ext} are directly in {d} "
                       "(not in its subdirectories)?", "\n".join(lines),
                       f"find {d} -maxdepth 1 -type f -name '*.{ext}' | wc -l")
    if level == 2:
        subs = [f"{d}/{rng.choice(WORDS)}{i}" for i in range(rng.randint(2, 4))]
        lines += [f"mkdir -p {s}" for s in subs]
        for i in range(rng.randint(6, 20)):
            base = rng.choice([d, *subs])
            hidden = "." if rng.random() < 0.25 else ""
            e = ext if rng.random() < 0.6 else rng.choice(others)
            lines.append(f"echo {i} > {base}/{hidden}{rng.choice(WORDS)}{i}.{e}")
        return _answer(f"How many .{ext} files are there in {d} and all its subdirectories, not counting hidden "
                       "files (names starting with a dot)?", "\n".join(lines),
                       f"find {d} -type f -name '*.{ext}' ! -name '.*' | wc -l")
    big_kb = rng.choice([8, 16, 32])
    for i in range(rng.randint(5, 14)):
        size = rng.choice([rng.randint(10, 2000), rng.randint(big_kb * 1024 + 4096, big_kb * 1024 * 3)])
        sub = rng.choice(["", f"{rng.choice(WORDS)}/"])
        lines.append(f"mkdir -p {d}/{sub} && head -c {size} /dev/zero > {d}/{sub}f{i}.{rng.choice(EXTS)}")
    return _answer(f"How many files under {d} (recursively) are larger than {big_kb} KiB?", "\n".join(lines),
                   f"find {d} -type f -size +{big_kb}k | wc -l")


def gen_search(rng: random.Random, level: int) -> dict[str, Any]:
    d, word = rng.choice(DIRS), rng.choice(WORDS)
    path = f"{d}/{rng.choice(WORDS)}.txt"
    body = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(5, 40))]
    init = f"mkdir -p {d}\nprintf '%s\\n' " + " ".join(q(line) for line in body) + f" > {path}"
    if level == 1:
        return _answer(f"How many lines does the file {path} have?", init, f"wc -l < {path}")
    if level == 2:
        return _answer(f"How many lines of {path} contain the word \"{word}\" (as a whole word)?", init,
                       f"grep -cw {word} {path} || true")
    lines = [f"mkdir -p {d}/logs"]
    for i in range(rng.randint(4, 12)):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))
        lines.append(f"echo {q(text)} > {d}/logs/part{i}.log")
    return _answer(f"How many files under {d}/logs contain the string \"{word}\"?", "\n".join(lines),
                   f"grep -rl {word} {d}/logs | wc -l")


def gen_permissions(rng: random.Random, level: int) -> dict[str, Any]:
    d = rng.choice(DIRS)
    path = f"{d}/{rng.choice(WORDS)}.{rng.choice(EXTS)}"
    mode = rng.choice(["644", "600", "755", "700", "640", "444", "750", "664"])
    if level == 1:
        return _answer(f"What are the permission bits of {path}, in octal (for example 644)?",
                       f"mkdir -p {d} && echo data > {path} && chmod {mode} {path}", f"stat -c %a {path}", STR)
    if level == 2:
        target = rng.choice(["600", "700", "640", "755", "444"])
        words = {"600": "readable and writable by its owner only, with no permissions for anyone else",
                 "700": "readable, writable and executable by its owner only, with no permissions for anyone else",
                 "640": "readable and writable by its owner, readable by its group, and not accessible to others",
                 "755": "writable by its owner only, and readable and executable by everyone",
                 "444": "read-only for everyone (owner, group and others may read; nobody may write or execute)"}
        return _action(f"Change the permissions of {path} so that it is {words[target]}.",
                       f"mkdir -p {d} && echo data > {path} && chmod {mode} {path}", f"chmod {target} {path}",
                       f'[ "$(stat -c %a {path})" = {target} ] && [ "$(cat {path})" = data ]')
    lines = [f"mkdir -p {d}"]
    for i in range(rng.randint(4, 12)):
        lines.append(f"echo x > {d}/f{i} && chmod {rng.choice(['644', '755', '700', '600', '744', '655'])} {d}/f{i}")
    return _answer(f"How many regular files directly in {d} are executable by their owner?", "\n".join(lines),
                   f"find {d} -maxdepth 1 -type f -perm -u+x | wc -l")


def gen_users(rng: random.Random, level: int) -> dict[str, Any]:
    names = rng.sample(NAMES, rng.randint(2, 6))
    group = rng.choice(["devs", "ops", "audit", "staff2", "builders"])
    if level == 1:
        init = "\n".join(f"useradd -m -s /bin/bash {n}" if rng.random() < 0.7 else f"useradd -M -s /bin/sh {n}"
                         for n in names)
        return _answer("How many user accounts on this system have a home directory under /home/?", init,
                       "getent passwd | awk -F: '$6 ~ \"^/home/\" {n++} END {print n+0}'")
    if level == 2:
        new = rng.choice([n for n in NAMES if n not in names])
        init = f"groupadd {group}\n" + "\n".join(f"useradd -m {n}" for n in names)
        return _action(f"Create a user named {new} with the home directory /home/{new} (created), the login shell "
                       f"/bin/bash, and membership in the existing group {group}.", init,
                       f"useradd -m -s /bin/bash -G {group} {new}",
                       f'id -nG {new} | tr " " "\\n" | grep -qx {group} && [ -d /home/{new} ] && '
                       f'[ "$(getent passwd {new} | cut -d: -f6,7)" = /home/{new}:/bin/bash ]')
    members = [n for n in names if rng.random() < 0.6]
    init = f"groupadd {group}\n" + "\n".join(
        f"useradd -m {'-G ' + group + ' ' if n in members else ''}{n}" for n in names)
    return _answer(f"How many users are members of the group {group} (as listed in /etc/group)?", init,
                   f"getent group {group} | cut -d: -f4 | tr ',' '\\n' | grep -c . || true")


def gen_processes(rng: random.Random, level: int) -> dict[str, Any]:
    secs = rng.sample(range(3000, 9000), rng.randint(2, 6))
    start = "\n".join(f"sleep {s} &" for s in secs)
    if level == 1:
        return _answer("Some programs are running in the background. How many processes named sleep are running?",
                       "true", "pgrep -c -x sleep", start=start)
    if level == 2:
        pick = rng.choice(secs)
        return _answer(f"A background process was started with the command `sleep {pick}`. What is its PID?",
                       "true", f"pgrep -f '^sleep {pick}$'", start=start)
    lo = [s for s in secs if s < 6000] or [secs[0]]
    hi = [s for s in secs if s not in lo]
    start = "\n".join(f"sleep {s} &" for s in [*lo, *hi])
    pattern = "|".join(str(s) for s in lo)
    return _action("Several sleep processes are running in the background. Kill every sleep process whose "
                   f"argument is below 6000 seconds ({', '.join(map(str, lo))}) and leave the others running.",
                   "true", f"pkill -f '^sleep ({pattern})$'",
                   f"! pgrep -f '^sleep ({pattern})$' > /dev/null && [ \"$(pgrep -c -x sleep)\" = {len(hi)} ]",
                   start=start)


def gen_text(rng: random.Random, level: int) -> dict[str, Any]:
    d = rng.choice(DIRS)
    path = f"{d}/{rng.choice(['sales', 'orders', 'inventory', 'events'])}.csv"
    cities = rng.sample(WORDS, rng.randint(3, 6))
    rows = [(rng.choice(cities), rng.randint(1, 500)) for _ in range(rng.randint(5, 30))]
    init = f"mkdir -p {d}\nprintf '%s\\n' city,amount " + " ".join(f"{c},{n}" for c, n in rows) + f" > {path}"
    if level == 1:
        return _answer(f"{path} is a CSV file with a header line. What is the sum of its amount column?", init,
                       f"tail -n +2 {path} | cut -d, -f2 | awk '{{s+=$1}} END {{print s+0}}'")
    if level == 2:
        counts: dict[str, int] = {}
        for c, _ in rows:
            counts[c] = counts.get(c, 0) + 1
        top = max(counts.values())
        if sum(1 for v in counts.values() if v == top) > 1:  # make the most frequent value unique
            winner = rng.choice([c for c, v in counts.items() if v == top])
            rows.append((winner, rng.randint(1, 500)))
            init = f"mkdir -p {d}\nprintf '%s\\n' city,amount " + " ".join(f"{c},{n}" for c, n in rows) + f" > {path}"
        return _answer(f"{path} is a CSV file with a header line. Which city appears in the most rows?", init,
                       f"tail -n +2 {path} | cut -d, -f1 | sort | uniq -c | sort -rn | head -1 | awk '{{print $2}}'",
                       STR)
    out = f"{d}/cities.txt"
    expected = sorted({c for c, _ in rows})
    return _action(f"{path} is a CSV file with a header line. Write the distinct values of its city column, sorted "
                   f"alphabetically, one per line, to {out}.", init,
                   f"tail -n +2 {path} | cut -d, -f1 | sort -u > {out}",
                   f"printf '%s\\n' {' '.join(expected)} | diff -q - {out} > /dev/null")


FAMILIES: dict[str, Callable[[random.Random, int], dict[str, Any]]] = {
    "files": gen_files, "search": gen_search, "permissions": gen_permissions, "users": gen_users,
    "processes": gen_processes, "text": gen_text,
}


def generate(family: str, level: int, split: str, index: int) -> OSTask:
    """One generated task; the id alone determines it (stable across replicas and runs)."""
    task_id = f"gen-{family}-l{level}-{split}-{index:05d}"
    rng = random.Random(hashlib.sha256(task_id.encode()).digest())
    spec = FAMILIES[family](rng, level)
    return OSTask(task_id=task_id, description=spec["description"], init=[Script("bash", spec["init"])],
                  start=Script("bash", spec["start"]) if spec["start"] else None, check=spec["check"],
                  example=Script("bash", spec["reference"]), fresh_gold=True, family=family, level=level)


def content_key(task: OSTask) -> str:
    return hashlib.sha256(json.dumps([task.description, [s.code for s in task.init],
                                      task.start.code if task.start else ""]).encode()).hexdigest()


def generate_split(split: str, per_family: int, exclude: set[str] | None = None) -> list[OSTask]:
    """``per_family`` tasks of each family, levels 1-3 in turn; tasks whose content is in ``exclude``
    (the train split's, when making test) are skipped, so the splits never share a task."""
    tasks = []
    for family in FAMILIES:
        index = 0
        made = 0
        while made < per_family:
            task = generate(family, 1 + made % 3, split, index)
            index += 1
            if exclude and content_key(task) in exclude:
                continue
            tasks.append(task)
            made += 1
    return tasks
