"""The start-up timeline (controller/startup.py): phases timed in order, one line a reader parses back."""

from __future__ import annotations

import itertools

import pytest

from controller.startup import StartupTimeline, parse_line


def test_phases_are_timed_in_order_and_read_back_from_the_line():
    ticks = itertools.count()
    timeline = StartupTimeline(clock=lambda: float(next(ticks)) * 0.5)
    with timeline.phase("ray"):
        pass
    with pytest.raises(RuntimeError), timeline.phase("workers"):  # a phase that raises is still recorded
        raise RuntimeError("boom")
    timeline.add("kv channels", 2.25)
    assert timeline.phases == [("ray", 0.5), ("workers", 0.5), ("kv channels", 2.25)]
    line = "magicserve: " + timeline.describe()
    assert line == "magicserve: start-up: 3.2 s = ray 0.5 s + workers 0.5 s + kv channels 2.2 s"
    assert parse_line(line) == {"ray": 0.5, "workers": 0.5, "kv channels": 2.2}
    assert parse_line("magicserve: serving on 127.0.0.1:1") is None


def test_a_phase_run_twice_sums():
    timeline = StartupTimeline()
    timeline.add("workers", 1.0)
    timeline.add("workers", 2.0)
    assert timeline.as_dict() == {"workers": 3.0} and timeline.total() == 3.0
