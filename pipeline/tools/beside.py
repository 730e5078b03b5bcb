"""A process busy a share of one core, to run beside a benchmark (`bench throughput
--busy-beside`): what a client, a proxy or another service on the same host takes from the
forward. It spins `fraction` of every `period` (10 ms) and sleeps the rest, as a process that
wakes for work in bursts does; the scheduler gives it its share from whichever core it lands
on, as it would a neighbour's."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

PERIOD_S = 0.01


def spin(fraction: float, period: float = PERIOD_S) -> None:
    """Busy `fraction` of every `period` seconds, until killed. The bursts keep to the clock:
    time lost waiting for a core is not made up."""
    due = time.perf_counter()
    while True:
        busy_until = due + fraction * period
        while time.perf_counter() < busy_until:
            pass
        due += period
        rest = due - time.perf_counter()
        if rest > 0:
            time.sleep(rest)
        else:
            due = time.perf_counter()


@contextmanager
def busy_beside(fraction: float) -> Iterator[None]:
    """A process busy `fraction` of one core while the block runs (None or 0: nothing)."""
    if not fraction:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.tools.beside", str(fraction)])
    try:
        time.sleep(0.2)  # (started and spinning before the row's clock starts)
        if proc.poll() is not None:
            raise RuntimeError(f"the busy process beside the benchmark exited with code "
                               f"{proc.returncode}")
        yield
    finally:
        proc.kill()
        proc.wait()


def parse_fraction(text: str) -> float:
    """--busy-beside's value: a share of one core, in (0, 1]."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: a share of one core, above 0 and at most 1")
    return value


if __name__ == "__main__":
    spin(float(sys.argv[1]))
