"""A pytest plugin that writes each test's outcome as one JSON line the moment it is known, so that a run
stopped at a time limit (the GPU suite's test step) still says which tests passed, failed or were skipped
and why; a JUnit report is written only at the end. Load it with ``-p pytest_outcomes`` (``scripts/`` on
``sys.path``) and name the file in ``MAGICSERVE_TEST_OUTCOMES``; without that variable it does nothing.

Each line: ``{"test": node id, "outcome": "passed" | "failed" | "error" | "skipped", "message": first line}``,
one per test (an error in setup or teardown counts as an error).
"""

from __future__ import annotations

import json
import os

ENV = "MAGICSERVE_TEST_OUTCOMES"


def _message(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):  # (file, line, "Skipped: reason")
        return str(report.longrepr[2]).removeprefix("Skipped: ")[:300]
    text = getattr(report, "longreprtext", "") or ""
    lines = [ln for ln in text.splitlines() if ln.startswith("E ")]  # the assertion or exception line
    return (lines[0][1:].strip() if lines else (text.strip().splitlines() or [""])[-1])[:300]


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    if report.when == "call":
        outcome = report.outcome
    elif report.failed:  # setup or teardown raised
        outcome = "error"
    elif report.when == "setup" and report.skipped:  # skipped before running (marks, fixtures)
        outcome = "skipped"
    else:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"test": report.nodeid, "outcome": outcome, "message": _message(report)}) + "\n")
