"""The workers' pass logs of an SLO sweep: drained through the server's ``DrainPassLog`` RPC around every
rate, kept beside the sweep, and read back as the passes of one rate.

The sweep drains once with the server idle just before a rate (dropping the warm-up's and the speed probes'
passes) and once after the rate has drained, so a rate's log holds exactly the passes that served it and
nothing is fetched while it is measured. Each worker keeps its last 65536 passes (``modeling/pass_log.py``);
what it had to drop is counted and recorded.

Storage: ``PREFIX.passes.json.gz`` beside ``PREFIX.json`` (named in its ``pass_log_file``): a list with one
entry per rate, ``{"rate": r, "instances": [{"name", "role", "dropped", "records": [...]}]}``, in sweep order.
``controller/planner/load_speed.py`` reads a rate's passes as the machine's speed under that load
(``benchmarks/sim_validate.py --speed load``).
"""

from __future__ import annotations

import gzip
import json
import os
import sys

from controller.planner.interference import pass_row

SUFFIX = ".passes.json.gz"


class PassLogCollector:
    """Drains a gRPC target's pass logs; after the server refuses (``DrainPassLog`` off) or a drain fails,
    says why once and returns None from then on (a sweep without pass logs is still a sweep)."""

    def __init__(self, target):
        self.target = target
        self.enabled = hasattr(target, "drain_pass_log")

    async def drain(self) -> list[dict] | None:
        if not self.enabled:
            return None
        try:
            return await self.target.drain_pass_log()
        except Exception as err:  # noqa: BLE001 - reported, and collection stops
            self.enabled = False
            print(f"pass logs: not collected ({err}); the sweep goes on without them", file=sys.stderr, flush=True)
            return None


def summary(instances: list[dict]) -> dict:
    """What a sweep's JSON keeps of a rate's log: passes and dropped passes per instance."""
    return {"instances": [{"name": i["name"], "role": i["role"], "passes": len(i["records"]), "dropped": i["dropped"]}
                          for i in instances],
            "passes": sum(len(i["records"]) for i in instances), "dropped": sum(i["dropped"] for i in instances)}


def write(path: str, rates: list[dict]) -> None:
    """Write the per-rate logs (see the module docstring) to ``path`` (gzip'd JSON), atomically."""
    tmp = path + ".tmp"
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        json.dump(rates, f, separators=(",", ":"))
    os.replace(tmp, path)


def load(sweep_path: str, sweep: dict) -> list[dict] | None:
    """The per-rate logs of the sweep stored at ``sweep_path`` (None when it recorded none)."""
    name = sweep.get("pass_log_file")
    if not name:
        return None
    path = os.path.join(os.path.dirname(os.path.abspath(sweep_path)), name)
    if not os.path.isfile(path):
        raise ValueError(f"{sweep_path}: its pass logs {name!r} are not beside it ({path})")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rates = json.load(f)
    if [r["rate"] for r in rates] != [r["rate"] for r in sweep["rates"]]:
        raise ValueError(f"{path}: its rates do not match the sweep's")
    return rates


def rows_of(instances: list[dict]) -> list[dict]:
    """A rate's logs as ``interference.pass_row`` rows, ``worker`` = the instance's index in the drain."""
    return [pass_row(r, worker) for worker, inst in enumerate(instances) for r in inst["records"]]


def complete(instances: list[dict]) -> bool:
    """Whether every worker kept every pass of the window (none dropped off its log)."""
    return all(i["dropped"] == 0 for i in instances)
