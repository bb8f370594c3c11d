"""Where a server's start-up goes: named phases, timed in order, reported as one line and as a dict.

``magicserve serve`` prints the line when it is ready to answer (Ray, placement, the workers' start, KV
channels, the fronts); ``benchmarks/startup.py`` reads the dict back from that line. No torch, no Ray.
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass, field

# What the printed line starts with, so a reader can find it among the logs.
PREFIX = "start-up:"


@dataclass
class StartupTimeline:
    """Phases of a start-up in the order they ran, each with its wall time in seconds."""

    phases: list[tuple[str, float]] = field(default_factory=list)
    clock: object = time.perf_counter

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time the block as phase ``name`` (recorded even when it raises)."""
        t0 = self.clock()
        try:
            yield
        finally:
            self.phases.append((name, self.clock() - t0))

    def add(self, name: str, seconds: float) -> None:
        """Record phase ``name`` timed elsewhere."""
        self.phases.append((name, seconds))

    def total(self) -> float:
        return sum(s for _, s in self.phases)

    def as_dict(self) -> dict[str, float]:
        """Phase -> seconds (a phase run twice sums)."""
        out: dict[str, float] = {}
        for name, seconds in self.phases:
            out[name] = out.get(name, 0.0) + seconds
        return out

    def describe(self) -> str:
        """E.g. ``start-up: 21.4 s = ray 4.1 s + placement 0.2 s + workers 14.9 s + ...``."""
        parts = " + ".join(f"{name} {seconds:.1f} s" for name, seconds in self.as_dict().items())
        return f"{PREFIX} {self.total():.1f} s = {parts}"


_PART = re.compile(r"([a-z_ ]+?) (\d+(?:\.\d+)?) s")


def parse_line(line: str) -> dict[str, float] | None:
    """The phases of a line :meth:`StartupTimeline.describe` wrote (None when the line is not one)."""
    at = line.find(PREFIX)
    if at < 0 or " = " not in line[at:]:
        return None
    parts = line[at:].split(" = ", 1)[1]
    return {m.group(1).strip(): float(m.group(2)) for m in _PART.finditer(parts)}
