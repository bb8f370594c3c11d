"""Setting a worker process's niceness, every thread of it.

Ray starts the workers of a local cluster at niceness 15, below the gRPC server, the load generator and Ray's
own daemons at 0 (CFS weights 36 against 1024: a busy process at 0 takes nearly all of a core a worker
wants). ``ray.worker_niceness`` sets the workers' niceness once they are up. On Linux (NPTL) niceness is a
property of each thread, and a new thread takes its creator's: so every thread the process has is set (from
``/proc/self/task``), and threads made later by those threads (the step loop's torch pool, Ray's call
threads) inherit it.
"""

from __future__ import annotations

import os

TASKS = "/proc/self/task"


def thread_ids() -> list[int]:
    """The ids of this process's threads (Linux), else only the calling process's id."""
    try:
        return sorted(int(t) for t in os.listdir(TASKS))
    except FileNotFoundError:
        return [os.getpid()]


def set_process_niceness(niceness: int) -> dict:
    """Set every thread of this process to ``niceness``. Returns ``{"pid": ..., "niceness": [per thread]}``
    as read back. Lowering niceness needs CAP_SYS_NICE: a PermissionError then names the config field."""
    for tid in thread_ids():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except PermissionError as err:
            raise PermissionError(f"ray.worker_niceness: cannot set niceness {niceness} (now "
                                  f"{os.getpriority(os.PRIO_PROCESS, tid)}): lowering it needs CAP_SYS_NICE; "
                                  f"leave the field unset or raise it") from err
    return {"pid": os.getpid(), "niceness": thread_niceness()}


def thread_niceness() -> list[int]:
    """The niceness of each of this process's threads, as read back."""
    out = []
    for tid in thread_ids():
        try:
            out.append(os.getpriority(os.PRIO_PROCESS, tid))
        except ProcessLookupError:
            continue
    return out
