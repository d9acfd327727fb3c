"""A time bound the test harness enforces on one hostile case (pytest-timeout is not a test
dependency): `with within(30): ...` raises `Hang` in the main thread when the block runs past
its bound (SIGALRM, which interrupts Python code, the usual shape of a hang: a backtracking
regex in Python, a template loop, a parser recursing), and a watchdog thread ends the process,
with every thread's stack dumped, when the block is stuck in C code that never returns to Python
(twice the bound). A hang is then a counted failure or a failed run, never a stalled suite."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading


class Hang(Exception):
    """The block ran past its bound."""


@contextlib.contextmanager
def within(seconds: float, what: str = "the case"):
    if threading.current_thread() is not threading.main_thread():  # SIGALRM reaches the main thread only
        yield
        return

    def alarm(signum, frame):
        raise Hang(f"{what} ran past {seconds} s")

    done = threading.Event()

    def watchdog():
        if not done.wait(2 * seconds + 5):
            sys.stderr.write(
                f"\n{what} is stuck past {2 * seconds + 5} s in code SIGALRM cannot interrupt; every thread's stack:\n"
            )
            faulthandler.dump_traceback(all_threads=True)
            os._exit(3)

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    threading.Thread(target=watchdog, daemon=True, name="hang-watchdog").start()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        done.set()
