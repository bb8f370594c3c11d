"""How long ``magicserve serve`` takes to answer, and where the time goes.

Each repeat starts ``python -m frontend.cli serve --config CONFIG`` (free ports), reads its start-up line
(``controller/startup.py``: Ray, placement, the workers' start, KV channels, the fronts), sends one request of
one token over gRPC, and stops the server with SIGINT. Recorded per repeat: seconds from the command's start to
the ready line, to the first token, and each phase; "before the cluster" is the ready time less the phases
(interpreter start, imports, config). With ``--tree`` given more than once (checkouts of two commits, e.g. a
``git worktree``), the trees are measured in alternation on the same machine.

    python benchmarks/startup.py --out benchmarks/results/startup
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # ahead of this folder, whose kv_transfer.py would shadow the package

from controller.startup import parse_line  # noqa: E402

READY_TIMEOUT_S = 600.0


def start_once(tree: str, config: str) -> dict:
    """One start of the server in ``tree``: ready and first-token seconds, and the start-up phases."""
    env = {**os.environ, "PYTHONPATH": tree, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "frontend.cli", "serve", "--config", config, "--port", "0", "--http-port", "0"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        address, phases, ready_s, lines = None, {}, None, []
        for line in proc.stdout:  # the start-up line (where the tree prints one), then the ready line
            lines.append(line)
            phases = parse_line(line) or phases
            if m := re.search(r"gRPC on ([\w.]+:\d+)", line):
                address, ready_s = m.group(1), time.perf_counter() - t0
                break
            if time.perf_counter() - t0 > READY_TIMEOUT_S:
                break
        if address is None:
            raise SystemExit(f"startup: {tree} did not become ready:\n{''.join(lines[-30:])}")
        first_token_s = _first_token(tree, address) - t0
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {"ready_s": ready_s, "first_token_s": first_token_s, "phases": phases,
            "before_cluster_s": ready_s - sum(phases.values()) if phases else None}


def _first_token(tree: str, address: str) -> float:
    """perf_counter time when one token came back (a client in this process, the tree's own client code)."""
    from frontend.client import Client

    with Client(address) as client:
        for chunk in client.generate_stream("def add(a, b):", max_tokens=1):
            if chunk.text or chunk.final:
                return time.perf_counter()
    return time.perf_counter()


def summarize(runs: list[dict]) -> dict:
    names = list(dict.fromkeys(n for r in runs for n in r["phases"]))
    return {"ready_s": statistics.median(r["ready_s"] for r in runs),
            "first_token_s": statistics.median(r["first_token_s"] for r in runs),
            "before_cluster_s": (statistics.median(r["before_cluster_s"] for r in runs)
                                 if all(r["before_cluster_s"] is not None for r in runs) else None),
            "phases": {n: statistics.median(r["phases"].get(n, 0.0) for r in runs) for n in names},
            "ready_runs_s": [r["ready_s"] for r in runs]}


def git_label(tree: str) -> str:
    """The tree's commit, and whether its files differ from it."""
    out = subprocess.run(["git", "-C", tree, "log", "-1", "--format=%h %s"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    label = out.stdout.strip()[:70] or tree
    return label + (" (with uncommitted changes)" if dirty else "")


def write_markdown(result: dict, path: str) -> None:
    m = result["meta"]
    lines = ["# Server start-up: time to answer, and where it goes", "", f"`{m['command']}`  ",
             f"{m['cpu']}, {m['cpus']} cores; config `{m['config']}`; median of {m['repeats']} starts"
             + (" per tree, the trees in alternation" if len(result["trees"]) > 1 else "") + ". Ready: from the "
             "command's start to its ready line; first token: to the first token of a one-token request over "
             "gRPC. Before the cluster: the interpreter, imports and config, before Ray starts. A tree that prints "
             "no start-up line has its ready and first-token times only (-).", "",
             "| tree | ready s | first token s | before the cluster s | "
             + " | ".join(f"{n} s" for n in result["phase_names"]) + " | ready runs s |",
             "|---|---:|---:|---:|" + "---:|" * len(result["phase_names"]) + "---|"]
    for t in result["trees"]:
        s = t["summary"]
        before = "-" if s["before_cluster_s"] is None else f"{s['before_cluster_s']:.1f}"
        lines.append(f"| {t['label']} | {s['ready_s']:.1f} | {s['first_token_s']:.1f} | {before} | "
                     + " | ".join(f"{s['phases'][n]:.1f}" if n in s["phases"] else "-" for n in result["phase_names"])
                     + f" | {', '.join(f'{x:.1f}' for x in s['ready_runs_s'])} |")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = ["before the cluster", *result["phase_names"]]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.7 * len(result["trees"])))
    labelled = [False] * len(parts)
    for y, t in enumerate(result["trees"]):
        s, left = t["summary"], 0.0
        if s["before_cluster_s"] is None:  # no phases printed: the ready time as one bar
            ax.barh(y, s["ready_s"], color="lightgray")
            left = s["ready_s"]
        else:
            for i, part in enumerate(parts):
                width = s["before_cluster_s"] if i == 0 else s["phases"].get(part, 0.0)
                ax.barh(y, width, left=left, color=plt.cm.tab10(i), label=part if not labelled[i] else None)
                labelled[i] = True
                left += width
        ax.text(left, y, f" {s['ready_s']:.1f} s", va="center", fontsize=8)
    ax.set_xlim(0, 1.12 * max(t["summary"]["ready_s"] for t in result["trees"]))
    ax.set_yticks(range(len(result["trees"])), [t["label"][:40] for t in result["trees"]], fontsize=8)
    ax.set_xlabel("seconds from the command to the ready line (medians)")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.35 - 0.1 * len(result["trees"])))
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="cluster_configs/local.yaml", help="relative to each tree")
    ap.add_argument("--tree", action="append", default=[], help="a checkout to measure (repeatable; default: this)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "startup"))
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats: must be >= 1, got {args.repeats}")
    trees = [os.path.abspath(t) for t in (args.tree or [REPO])]
    for tree in trees:
        if not os.path.isfile(os.path.join(tree, args.config)):
            ap.error(f"--config: {args.config} not found in {tree}")
    from tqdm import tqdm

    runs: dict[str, list[dict]] = {t: [] for t in trees}
    with tqdm(total=args.repeats * len(trees), desc="server starts", unit="start") as bar:
        for _ in range(args.repeats):
            for tree in trees:
                runs[tree].append(start_once(tree, args.config))
                bar.update()
    from benchmarks._record import record
    from planner.profiler import cpu_model_name

    names = list(dict.fromkeys(n for rs in runs.values() for r in rs for n in r["phases"]))
    result = {"meta": {"command": "python benchmarks/startup.py " + " ".join(sys.argv[1:]), "cpu": cpu_model_name(),
                       "cpus": os.cpu_count(), "config": args.config, "repeats": args.repeats},
              "phase_names": names,
              "trees": [{"tree": t, "label": git_label(t), "runs": runs[t], "summary": summarize(runs[t])}
                        for t in trees]}
    record(result, args.out, write_markdown)
    plot(result, args.out + ".png")


if __name__ == "__main__":
    main()
