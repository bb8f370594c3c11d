"""Helpers for tests that run real processes talking over torch.distributed (gloo).

``run_procs`` starts one process per (target, kwargs), gives each a result queue, and returns their
results by name; it fails the test (and kills every process) if any raises or the deadline passes.
Processes come from a forkserver that has imported torch and our packages once, so each start costs
a fork, not a fresh interpreter importing torch (seconds on a loaded 2-core CI machine).
"""

from __future__ import annotations

import os
import queue
import time
import traceback

import torch
import torch.multiprocessing as mp


def _entry(target, name, kwargs, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        value = target(**kwargs)
        results.put((name, "ok", value))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((name, "error", traceback.format_exc()))
    results.close()
    results.join_thread()
    # Skip interpreter teardown: gloo groups with closed pairs may abort in their destructors.
    os._exit(0)


_PRELOAD = ["torch", "torch.distributed", "tests.kv_procs", "kv_transfer", "prefill_worker", "modeling.engine"]
_ctx = None


def context():
    """The multiprocessing context every process (and queue) of these tests uses."""
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(_PRELOAD)
    return _ctx


def run_procs(specs: dict[str, tuple], timeout_s: float = 60.0, expect_death: tuple[str, ...] = ()) -> dict:
    """specs: name -> (target, kwargs). Returns name -> target's return value. Processes named in
    ``expect_death`` may die without reporting (they kill themselves on purpose)."""
    ctx = context()
    results = ctx.Queue()
    procs = {name: ctx.Process(target=_entry, args=(fn, name, kw, results), daemon=True)
             for name, (fn, kw) in specs.items()}
    for p in procs.values():
        p.start()
    out, errors = {}, {}
    deadline = time.monotonic() + timeout_s
    try:
        required = set(procs) - set(expect_death)
        while not required <= set(out) | set(errors):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"processes did not finish within {timeout_s}s: "
                                   f"{sorted(required - set(out) - set(errors))}")
            try:
                name, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [n for n in required - set(out) - set(errors) if not procs[n].is_alive()]
                if dead:
                    raise RuntimeError(f"processes died without a result: {dead}")
                continue
            (out if status == "ok" else errors)[name] = value
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    if errors:
        raise AssertionError("\n".join(f"--- {n}:\n{tb}" for n, tb in errors.items()))
    return out
