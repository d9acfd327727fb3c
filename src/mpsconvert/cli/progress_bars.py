"""Progress on stderr: bars on a terminal (one per phase), and a plain line per phase every few
seconds when stderr is a log file or a pipe (a long run is never silent)."""

from __future__ import annotations

import contextlib
import threading
import time

from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from ..infra.units import human
from .render import console

# Phases whose `done` / `total` count bytes (drawn with sizes and a speed); the others count items.
BYTE_PHASES = ("quantize", "verify")
# Without a terminal: seconds between two lines of the phase under way.
LINE_EVERY = 10.0


class ProgressLines:
    """`progress(phase, done, total, detail)` as plain lines on stderr, for logs and pipes: a
    phase that runs longer than `every` seconds gets a line every `every` seconds (`tick`, called
    by each update and by a timer, so that a phase with no update for minutes still shows it is
    alive) and one when it completes; a quick one prints nothing (a short command's output stays
    its result, or its one-line error). `clock` is injectable (tests)."""

    def __init__(self, every: float = LINE_EVERY, clock=time.monotonic, write=None):
        self.every, self.clock = every, clock
        self.write = write or (lambda line: console.print(line, highlight=False, soft_wrap=True, markup=False))
        self.state: dict[str, list] = {}  # phase -> [done, total, detail, started, last line (or start), lines printed]
        self.current: str | None = None
        self.lock = threading.Lock()

    def _line(self, phase: str, now: float, finished: bool = False) -> None:
        done, total, detail, started = self.state[phase][:4]
        if phase in BYTE_PHASES:
            amount = f"{human(done)}" + (f" of {human(total)}" if total else "")
        else:
            amount = f"{done}" + (f"/{total}" if total else "")
        left = remaining(done, total, now - started)
        when = ", done" if finished else f", about {left:.0f} s left" if left is not None else ""
        self.write(f"{phase}: {amount}" + (f" {detail}" if detail else "") + f" ({now - started:.0f} s{when})")
        self.state[phase][4] = now
        self.state[phase][5] += 1

    def __call__(self, phase: str, done: int, total: int | None, detail: str = "") -> None:
        with self.lock:
            now = self.clock()
            if phase not in self.state:
                self.state[phase] = [done, total, detail, now, now, 0]
            else:
                self.state[phase][:3] = [done, total, detail]
            self.current = phase
            if total and done >= total:
                if self.state[phase][5] and self.state[phase][4] != float(
                    "inf"
                ):  # it said it was running: say it ended
                    self._line(phase, now, finished=True)
                self.state[phase][4] = float("inf")  # complete: no more lines for it
            else:
                self._tick(now)

    def tick(self) -> None:
        """A line for the phase under way if `every` seconds passed since its last one."""
        with self.lock:
            self._tick(self.clock())

    def _tick(self, now: float) -> None:
        if self.current is not None and now - self.state[self.current][4] >= self.every:
            self._line(self.current, now)


def remaining(done: float, total: float | None, elapsed: float) -> float | None:
    """Seconds a phase has left at the rate it went so far, or None before anything is done
    (or without a total). A phase of a few equal steps (validate's samples and rounds) is
    estimated from its first."""
    if not total or done <= 0 or done >= total:
        return None
    return elapsed * (total - done) / done


@contextlib.contextmanager
def progress_bars(every: float = LINE_EVERY):
    """Yield a `progress(phase, done, total, detail)` callback: one bar per phase on stderr, or,
    when stderr is not a terminal, `ProgressLines` with a timer thread ticking it."""
    if not console.is_terminal:
        lines, stop = ProgressLines(every), threading.Event()

        def beat() -> None:
            while not stop.wait(every):
                lines.tick()

        threading.Thread(target=beat, name="mpsconvert-progress", daemon=True).start()
        try:
            yield lines
        finally:
            stop.set()
        return
    with contextlib.ExitStack() as stack:
        bars: dict[bool, Progress] = {}
        tasks: dict[str, tuple[Progress, int]] = {}

        def bar(is_bytes: bool) -> Progress:
            if is_bytes not in bars:
                cols = (DownloadColumn(), TransferSpeedColumn()) if is_bytes else (MofNCompleteColumn(),)
                bars[is_bytes] = stack.enter_context(
                    Progress(
                        TextColumn("[bold]{task.fields[phase]}[/]"),
                        BarColumn(),
                        *cols,
                        TimeElapsedColumn(),
                        TextColumn("eta"),
                        TimeRemainingColumn(),
                        TextColumn("{task.description}"),
                        console=console,
                        speed_estimate_period=30.0 if is_bytes else 3600.0,
                    )
                )  # a phase of few slow steps: its ETA from all of them
            return bars[is_bytes]

        def update(phase: str, done: int, total: int | None, detail: str = "") -> None:
            if phase not in tasks:
                p = bar(phase in BYTE_PHASES)
                tasks[phase] = (p, p.add_task("", total=total, phase=phase))
            p, task = tasks[phase]
            p.update(task, completed=done, total=total, description=detail[-48:])

        yield update
