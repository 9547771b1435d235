"""Where a one-shot command's time goes (`mkport speak --verbose`): named steps in order, each timed from the
end of the one before, the first from the start of the process."""

from __future__ import annotations

import os
import time


def process_age_s() -> float | None:
    """Seconds since this process started (from Linux's /proc, 10 ms resolution), or None where unknown."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class Steps:
    """mark(name) ends a step; detail(name, seconds) records a part of the step marked last, timed elsewhere.
    The first step runs from the process's start, when known."""

    def __init__(self, first: str):
        now = time.perf_counter()
        age = process_age_s()
        self.start = now - (age or 0.0)
        self.known_start = age is not None
        self.last = now
        self.rows: list[tuple[str, float, float | None]] = []  # (name, seconds, seconds since start)
        if self.known_start:
            self.rows.append((first, now - self.start, now - self.start))

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.rows.append((name, now - self.last, now - self.start if self.known_start else None))
        self.last = now

    def detail(self, name: str, seconds: float) -> None:
        self.rows.append(("  " + name, seconds, None))

    def since_start(self) -> float:
        return time.perf_counter() - self.start

    def lines(self, title: str) -> list[str]:
        width = max(len(name) for name, _, _ in self.rows) if self.rows else 0
        out = [title, f"  {'step':{width}s}  {'seconds':>8s}  {'since start':>11s}"]
        for name, seconds, at in self.rows:
            out.append(f"  {name:{width}s}  {seconds:8.3f}  {'' if at is None else f'{at:11.3f}'}")
        if not self.known_start:
            out.append("  (the process's start time is not known here: times count from mkport's start)")
        return out
