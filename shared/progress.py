"""Progress with an ETA for long commands: a bar on a terminal, periodic log lines otherwise.

    with Progress("eval", total=40, unit="episodes") as bar:
        for ...:
            bar.update()          # or bar.set(done)

    results = list(track(pool.map(run, ids), "tasks", total=len(ids), unit="tasks"))

On a TTY one line is redrawn in place (at most 10 times a second); anywhere else (a log file, CI,
a pipe) a plain line is written every ``every_s`` seconds and at the end, so a 14-minute command
never looks dead. The ETA is the remaining count at the average rate so far.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sized
from contextlib import contextmanager
from types import TracebackType
from typing import TextIO, TypeVar

T = TypeVar("T")

# (label, done, total) of every Progress as it moves: an env replica puts its data build on its heartbeat
# ("building, questions 43 %"), so the controller waits for it instead of giving up (services/envs)
ProgressListener = Callable[[str, int, "int | None"], None]
_listeners: list[ProgressListener] = []


def listen(listener: ProgressListener) -> Callable[[], None]:
    """Call ``listener`` on every progress update in this process (any thread); returns the un-listen."""
    _listeners.append(listener)
    return lambda: _listeners.remove(listener) if listener in _listeners else None


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    def __init__(self, label: str, total: int | None, unit: str = "items", *, stream: TextIO | None = None,
                 every_s: float | None = None, width: int = 24, tty: bool | None = None) -> None:
        self.label, self.total, self.unit, self.width = label, total, unit, width
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        if os.environ.get("JETRL_PROGRESS") == "lines":  # force log lines (e.g. a terminal recorded to a file)
            self.tty = False
        self.every_s = every_s if every_s is not None else float(os.environ.get("JETRL_PROGRESS_EVERY_S", "10"))
        self.done = 0
        self.started = time.monotonic()
        self._last_draw = -1e9
        self._closed = False
        self._drawn: tuple[int, str] | None = None  # (count, note) of the last line written
        self._note = ""
        self._tell()

    # ------------------------------------------------------------------ counting
    def update(self, n: int = 1, note: str = "") -> None:
        self.set(self.done + n, note)

    def set(self, done: int, note: str = "") -> None:
        self.done = done
        self._note = note or self._note
        self._tell()
        now = time.monotonic()
        finished = self.total is not None and done >= self.total
        if finished or now - self._last_draw >= (0.1 if self.tty else self.every_s):
            self._last_draw = now
            self._draw(self._note)

    def close(self, note: str = "") -> None:
        if self._closed:
            return
        self._closed = True
        if not self.tty and not note and self._drawn == (self.done, self._note):
            return  # the last line already says it all
        self._draw(note or self._note, final=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close("failed" if kind is not None else "")

    def _tell(self) -> None:
        for listener in list(_listeners):
            listener(self.label, self.done, self.total)

    # ------------------------------------------------------------------ text
    @property
    def eta_s(self) -> float | None:
        elapsed = time.monotonic() - self.started
        if self.total is None or self.done <= 0 or elapsed <= 0:
            return None
        return (self.total - self.done) * elapsed / self.done

    def line(self, note: str = "") -> str:
        elapsed = time.monotonic() - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        if self.total:
            filled = int(self.width * min(self.done, self.total) / self.total)
            bar = "[" + "#" * filled + "." * (self.width - filled) + "]"
            pct = f"{100 * self.done / self.total:3.0f}%"
            eta = self.eta_s
            head = f"{self.label} {bar} {self.done}/{self.total} {self.unit} {pct}"
            tail = f"elapsed {format_duration(elapsed)} eta {format_duration(eta) if eta is not None else '?'}"
        else:
            head, tail = f"{self.label} {self.done} {self.unit}", f"elapsed {format_duration(elapsed)}"
        if not self.unit:  # a timer only (``ticking``): nothing counted
            return f"{self.label}  {tail}" + (f"  {note}" if note else "")
        rate_text = f"{rate:.2f} {self.unit}/s" if rate < 10 else f"{rate:.0f} {self.unit}/s"
        return f"{head}  {rate_text}  {tail}" + (f"  {note}" if note else "")

    def _draw(self, note: str, final: bool = False) -> None:
        self._drawn = (self.done, note)
        text = self.line(note)
        if self.tty:
            self.stream.write("\r\x1b[2K" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def track(items: Iterable[T], label: str, total: int | None = None, unit: str = "items") -> Iterator[T]:
    """Yield ``items`` while showing progress over them (``total`` defaults to ``len(items)``)."""
    if total is None and isinstance(items, Sized):
        total = len(items)
    with Progress(label, total=total, unit=unit) as bar:
        for item in items:
            yield item
            bar.update()


@contextmanager
def ticking(label: str, every_s: float | None = None, stream: TextIO | None = None) -> Iterator[Progress]:
    """For a step with no count to report (a data build inside a library call): a line with the elapsed
    time every ``every_s`` (on a terminal, a redrawn line each second) until the block ends."""
    bar = Progress(label, total=None, unit="", stream=stream, every_s=every_s)
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(1.0 if bar.tty else bar.every_s):
            bar._draw("still working")

    thread = threading.Thread(target=tick, name=f"progress-{label}", daemon=True)
    thread.start()
    try:
        yield bar
    finally:
        stop.set()
        thread.join()
        bar.close("done")
