"""One command for a CUDA machine: every GPU test, then the decode-step and speculative-decoding benchmarks
on CUDA, recorded as one markdown page with a JSON file beside it.

    python scripts/gpu_suite.py                  # -> benchmarks/results/gpu_suite_<device>.md and .json
    python scripts/gpu_suite.py --out runs/gpu/h100.md
    python scripts/gpu_suite.py --allow-cpu      # dry run of this script's own plumbing on CPU, tiny sizes

Steps, each under its own time limit and all within ``--budget-s`` (default 7.8 minutes); a step that fails
is recorded and the others still run; the exit status is 1 when any step failed:

1. environment: ``nvidia-smi``, the devices torch sees, torch / CUDA / NCCL / flash-attn versions;
2. tests: ``python -m pytest -m gpu -q -rs`` over the test modules holding GPU tests (counts, failures, skip reasons, the output's tail);
3. ``benchmarks/decode_step.py`` on CUDA: the torch and Triton backends, Triton steps captured as CUDA graphs
   (``--compile``), and flash-attn when installed (block size 256 then, else 16);
4. ``benchmarks/spec_decode.py`` on CUDA: the Triton and torch backends, and flash-attn when installed;
5. ``benchmarks/tier_load_overlap.py`` on CUDA: a tier hit's TTFT with the load written layer by layer beside
   the pass or before it, random weights in Llama-3.1-8B's shapes.

The benchmarks write under a scratch folder (``runs/gpu/`` by default, git-ignored) so the CPU records in
``benchmarks/results/`` stay as they are; the record copies their tables. Without a CUDA device the script
refuses unless ``--allow-cpu`` is given; a dry run's record goes to the scratch folder by default. The dry
run is a CI test (``tests/test_gpu_suite.py``), so the suite's plumbing is checked on every commit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import asdict, dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
DEFAULT_SCRATCH = os.path.join(REPO, "runs", "gpu")
TAIL_LINES = 60

# Runs in a child interpreter so that a broken torch or flash-attn install is recorded, not fatal here.
PROBE = r"""
import json, os, platform
info = {"python": platform.python_version(), "cpus": os.cpu_count(), "devices": []}
try:
    import torch
    info.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if info["cuda_available"]:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["devices"].append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                                    "memory_gib": round(p.total_memory / 2**30, 1),
                                    "multiprocessors": p.multi_processor_count})
        try:
            v = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as err:
            info["nccl"] = None
except Exception as err:
    info.update(torch=None, torch_error=f"{type(err).__name__}: {err}", cuda_available=False)
try:
    import flash_attn
    info["flash_attn"] = getattr(flash_attn, "__version__", "unknown")
except Exception as err:
    info.update(flash_attn=None, flash_attn_error=f"{type(err).__name__}: {err}"[:300])
for name in ("transformers", "triton"):
    try:
        info[name] = __import__(name).__version__
    except Exception:
        info[name] = None
print("PROBE_JSON=" + json.dumps(info))
"""


# -- running steps ---------------------------------------------------------------------------------------

@dataclass
class Step:
    """One step of the suite and how it ended. ``status``: passed | failed | timed out | not run | skipped."""

    name: str
    title: str
    command: list[str] = field(default_factory=list)
    status: str = "not run"
    rc: int | None = None
    seconds: float = 0.0
    log: str | None = None
    tail: str = ""
    note: str = ""
    data: dict = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.status in ("failed", "timed out", "not run")

    def shell(self) -> str:
        """The command as a person would type it at the repository root."""
        return " ".join(shlex.quote(display_path(a)) for a in self.command)


def display_path(arg: str) -> str:
    """This interpreter as ``python``, paths inside the repository relative to its root."""
    if arg == sys.executable:
        return "python"
    return arg.replace(REPO + os.sep, "")


def run_command(cmd: list[str], timeout_s: float, log_path: str, env: dict | None = None) -> tuple[int | None, bool, float]:
    """Run ``cmd`` from the repository root, echoing its output and writing it to ``log_path``. Past
    ``timeout_s`` its whole process group is stopped (TERM, then KILL). Returns (rc, timed_out, seconds)."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    t0 = time.monotonic()
    with open(log_path, "w", encoding="utf-8", errors="replace") as log:
        log.write(f"$ {' '.join(shlex.quote(a) for a in cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, text=True, errors="replace", bufsize=1)
        pump = threading.Thread(target=_pump, args=(proc.stdout, log), daemon=True)
        pump.start()
        timed_out = False
        try:
            proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop_group(proc)
        pump.join(timeout=10)
        if timed_out:
            log.write(f"\n[gpu_suite] stopped after {timeout_s:.0f} s (time limit)\n")
    return proc.returncode, timed_out, time.monotonic() - t0


def _pump(stream, log) -> None:
    """Copy a child's output to the console and its log, line by line."""
    for line in stream:
        sys.stdout.write(line)
        sys.stdout.flush()
        log.write(line)
        log.flush()


def _stop_group(proc: subprocess.Popen) -> None:
    """Stop a child started in its own session, with everything it started."""
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def read_tail(path: str, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of a log, without progress-bar carriage-return noise."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    clean = [ln.rsplit("\r", 1)[-1] for ln in text.splitlines()]
    return "\n".join(clean[-lines:])


class Budget:
    """The suite's overall time budget: each step runs for its own limit or what is left, whichever is less."""

    def __init__(self, total_s: float):
        self.deadline = time.monotonic() + total_s

    def left(self) -> float:
        return self.deadline - time.monotonic()


def execute(step: Step, limit_s: float, budget: Budget, scratch: str, env: dict | None = None) -> Step:
    """Run a step's command within its limit and the budget, recording status, log and output tail."""
    if budget.left() < 20:
        step.status, step.note = "not run", "the suite's time budget was spent"
        return step
    allowed = min(limit_s, budget.left())
    clear_outputs(step)
    print(f"\n=== {step.title}: {step.shell()}  (limit {allowed:.0f} s)", flush=True)
    step.log = os.path.join(scratch, f"{step.name}.log")
    step.rc, timed_out, step.seconds = run_command(step.command, allowed, step.log, env)
    step.tail = read_tail(step.log)
    step.status = "timed out" if timed_out else ("passed" if step.rc == 0 else "failed")
    print(f"=== {step.title}: {step.status} in {step.seconds:.0f} s", flush=True)
    return step


def clear_outputs(step: Step) -> None:
    """Remove a benchmark's outputs from an earlier run, so that only this run's can be read back."""
    out = step.data.get("out")
    for ext in (".json", ".md", ".png") if out else ():
        if os.path.exists(out + ext):
            os.remove(out + ext)


# -- environment -----------------------------------------------------------------------------------------

def probe_environment() -> dict:
    """Versions and devices as a child interpreter sees them, plus nvidia-smi's view."""
    info: dict = {}
    try:
        out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=180)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("PROBE_JSON=")), None)
        info = json.loads(line.split("=", 1)[1]) if line else {"probe_error": (out.stderr or out.stdout)[-2000:]}
    except (subprocess.TimeoutExpired, OSError) as err:
        info = {"probe_error": f"{type(err).__name__}: {err}"}
    info.setdefault("cuda_available", False)
    info.setdefault("devices", [])
    info["nvidia_smi"] = nvidia_smi()
    return info


def nvidia_smi() -> str | None:
    """nvidia-smi's summary of the GPUs (None when the tool is absent)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    query = "index,name,driver_version,memory.total,memory.used,utilization.gpu,temperature.gpu,power.draw"
    try:
        out = subprocess.run([exe, f"--query-gpu={query}", "--format=csv"], capture_output=True, text=True, timeout=60)
        return (out.stdout or out.stderr).strip()
    except (subprocess.TimeoutExpired, OSError) as err:
        return f"nvidia-smi failed: {err}"


def device_name(env: dict) -> str:
    if env.get("cuda_available") and env["devices"]:
        return env["devices"][0]["name"]
    return "cpu"


def slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia_h100_80gb_hbm3'."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "device"


# -- the steps -------------------------------------------------------------------------------------------

def gpu_test_files() -> list[str]:
    """The test modules that hold tests marked ``gpu``. Only these are collected: the others import the
    serving stack (Ray, Starlette, gRPC health), which a bare GPU machine does not have."""
    tests_dir = os.path.join(REPO, "tests")
    found = []
    for name in sorted(os.listdir(tests_dir)):
        if name.startswith("test_") and name.endswith(".py"):
            with open(os.path.join(tests_dir, name), encoding="utf-8") as f:
                if GPU_MARK.search(f.read()):
                    found.append(os.path.join("tests", name))
    return found


GPU_MARK = re.compile(r"pytest\.mark\.gpu\b")


def tests_step(args, scratch: str) -> tuple[Step, dict]:
    """pytest -m gpu over the modules holding GPU tests, with a JUnit report to count from, and each test's
    outcome written as it finishes (``scripts/pytest_outcomes.py``) to count from when pytest is stopped at
    the step's limit before writing the report. The C++ CPU attention kernel is not built (no GPU test uses
    it; its tests would JIT-compile it at collection)."""
    junit = os.path.join(scratch, "pytest_gpu.xml")
    outcomes = os.path.join(scratch, "pytest_gpu_outcomes.jsonl")
    for stale in (junit, outcomes):  # an earlier run's must not be read as this one's
        if os.path.exists(stale):
            os.remove(stale)
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "--durations=10", f"--junitxml={junit}",
           "-p", "pytest_outcomes"]
    cmd += gpu_test_files()
    cmd += shlex.split(args.pytest_args)
    scripts = os.path.join(REPO, "scripts")
    env = dict(os.environ, MAGICSERVE_DISABLE_CPU_KERNEL="1", PYTHONUNBUFFERED="1", MAGICSERVE_TEST_OUTCOMES=outcomes,
               PYTHONPATH=os.pathsep.join(p for p in (scripts, os.environ.get("PYTHONPATH")) if p))
    return Step("tests", "GPU tests", cmd), {"env": env, "junit": junit, "outcomes": outcomes}


def summarize_tests(junit: str, outcomes: str) -> dict:
    """The JUnit report's summary, or, when pytest left none (stopped at its limit), the outcomes it wrote
    test by test (marked ``partial``)."""
    summary = summarize_junit(junit)
    if not summary.get("missing") or not os.path.exists(outcomes):
        return summary
    return summarize_outcomes(outcomes) | {"partial": True}


def summarize(results) -> dict:
    """Counts, failing test ids with their first message line, and skip reasons from (test id, outcome,
    message) triples, outcome one of passed | failed | error | skipped."""
    summary = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "skip_reasons": {}}
    reasons: Counter = Counter()
    for test_id, outcome, message in results:
        summary["errors" if outcome == "error" else outcome] += 1
        if outcome in ("failed", "error"):
            summary["failures"].append({"test": test_id, "message": message[:300]})
        elif outcome == "skipped":
            reasons[message[:200]] += 1
    summary["skip_reasons"] = dict(reasons.most_common())
    return summary


def summarize_outcomes(path: str) -> dict:
    """:func:`summarize` over ``scripts/pytest_outcomes.py``'s JSON lines."""
    with open(path, encoding="utf-8") as f:
        entries = [json.loads(line) for line in f]
    return summarize((e["test"], e["outcome"], e["message"]) for e in entries)


def summarize_junit(path: str) -> dict:
    """:func:`summarize` over a JUnit report (``missing`` when there is none)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return summarize(()) | {"missing": True}
    return summarize(_junit_case(case) for case in root.iter("testcase"))


def _junit_case(case) -> tuple[str, str, str]:
    test_id = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
    for tag, outcome in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
        node = case.find(tag)
        if node is None:
            continue
        if tag == "skipped":
            return test_id, outcome, (node.get("message") or "").strip()
        lines = (node.get("message") or node.text or "").strip().splitlines()
        return test_id, outcome, lines[0] if lines else ""
    return test_id, "passed", ""


def pytest_summary_line(tail: str) -> str:
    """pytest's closing line ('3 failed, 60 passed, 10 skipped in 95.1s'), if present."""
    for line in reversed(tail.splitlines()):
        if re.search(r"\d+ (passed|failed|skipped|error|errors|deselected)\b", line):
            return line.strip("= ").strip()
    return ""


def decode_step_step(args, scratch: str, tag: str, flash: bool, cpu: bool) -> Step:
    out = os.path.join(scratch, f"decode_step_{tag}")
    cmd = [sys.executable, "benchmarks/decode_step.py", "--out", out]
    if cpu:  # dry run: one tiny cell
        cmd += ["--device", "cpu", "--backends", "torch", "--batches", "1", "--contexts", "64", "--repeats", "1",
                "--block-size", "16", "--threads", "1"]
    else:
        # flash-attn's paged KV needs blocks of 256; without it, the serving default of 16
        cmd += ["--device", "cuda", "--block-size", "256" if flash else "16", "--compile", "--backends", "torch", "triton"]
        cmd += ["flash"] if flash else []
        cmd += ["--batches", "1", "8", "32", "--contexts", "1024", "4096", "16384", "--repeats", "5"]
    return Step("decode_step", "Decode step", cmd, data={"out": out})


def spec_decode_step(args, scratch: str, tag: str, backend: str, cpu: bool) -> Step:
    out = os.path.join(scratch, f"spec_decode_{backend}_{tag}")
    cmd = [sys.executable, "benchmarks/spec_decode.py", "--out", out, "--attention-backend", backend]
    if cpu:  # dry run: one tiny cell, two configurations (Triton's kernel in its interpreter)
        cmd = (["env", "TRITON_INTERPRET=1"] if backend == "triton" else []) + cmd
        cmd += ["--device", "cpu", "--batches", "1", "--prefixes", "64", "--ks", "0", "1", "--budgets", "32",
                "--steps", "2", "--repeats", "1", "--adaptive-warmup", "0", "--min-run-ms", "0", "--threads", "1",
                "--no-rope"]
    else:
        block = "256" if backend == "flash" else "16"
        # batches 1 and 8: the torch backend's per-sequence loop makes batch 32 cells take minutes each; the
        # torch backend gets batch 1 only, the GPU backends both
        batches = ["1"] if backend == "torch" else ["1", "8"]
        cmd += ["--device", "cuda", "--block-size", block, "--dtype", "bfloat16", "--batches", *batches,
                "--prefixes", "1024", "4096", "--ks", "0", "1", "2", "3", "--budgets", "256", "--steps", "16",
                "--repeats", "2", "--adaptive-warmup", "32"]
    title = f"Speculative decoding ({backend} backend)"
    return Step(f"spec_decode_{backend}", title, cmd, data={"out": out})


def tier_load_overlap_step(args, scratch: str, tag: str, cpu: bool) -> Step:
    out = os.path.join(scratch, f"tier_load_overlap_{tag}")
    cmd = [sys.executable, "benchmarks/tier_load_overlap.py", "--out", out]
    if cpu:  # dry run: one short document, the bundled model
        cmd += ["--docs", "64", "--question", "8", "--repeats", "1", "--threads", "1"]
    else:  # random weights in Llama-3.1-8B's shapes: 128 KiB of KV per token, as in serving
        cmd += ["--device", "cuda", "--model", "llama-3.1-8b", "--docs", "2048", "8192", "32768", "--repeats", "3",
                "--token-budget", "8192"]
    return Step("tier_load_overlap", "Tier hits loaded layer by layer", cmd, data={"out": out})


def load_benchmark(step: Step) -> None:
    """Attach a finished benchmark's JSON figures and markdown body (its title line dropped) to the step."""
    out = step.data.get("out")
    if not out:
        return
    try:
        with open(out + ".json", encoding="utf-8") as f:
            step.data["result"] = json.load(f)
        with open(out + ".md", encoding="utf-8") as f:
            body = f.read().splitlines()
        step.data["markdown"] = "\n".join(ln for ln in body if not ln.startswith("# ")).strip()
    except (OSError, json.JSONDecodeError) as err:
        if step.status == "passed":
            step.status, step.note = "failed", f"no readable output at {out}.json/.md ({err})"


# -- the record ------------------------------------------------------------------------------------------

def render(env: dict, steps: list[Step], tests: dict, argv: list[str], started: str, total_s: float, cpu: bool) -> str:
    """The markdown record of one suite run."""
    name = device_name(env)
    verdict = suite_verdict(steps, tests)
    lines = [f"# GPU suite on {name}" if not cpu else "# GPU suite: dry run on CPU (no CUDA device; plumbing only)", "",
             f"`python scripts/gpu_suite.py {' '.join(shlex.quote(a) for a in argv)}`  ",
             f"started {started}, {total_s / 60:.1f} min in all; **{verdict}**.", ""]
    lines += render_environment(env)
    lines += ["## Steps", "", "| step | status | seconds | command |", "|---|---|---:|---|"]
    for s in steps:
        status = s.status + (f" ({s.note})" if s.note else "")
        lines.append(f"| {s.title} | {status} | {s.seconds:.0f} | `{s.shell()}` |")
    lines.append("")
    lines += render_tests(next(s for s in steps if s.name == "tests"), tests)
    for s in steps:
        if s.name != "tests":
            lines += render_benchmark(s)
    return "\n".join(lines).rstrip() + "\n"


def suite_verdict(steps: list[Step], tests: dict) -> str:
    """One line: the steps that failed or did not run, and the GPU tests that passed, failed or were skipped."""
    failed = [s for s in steps if s.failed]
    idle = [s for s in steps if not s.failed and s.status in ("skipped", "not run")]
    passed = [s for s in steps if s.status == "passed"]
    parts = [f"{len(failed)} of {len(steps)} steps failed: " + ", ".join(s.name for s in failed) if failed
             else f"{len(passed)} of {len(steps)} steps passed"]
    if idle:
        parts.append("not run: " + ", ".join(s.name for s in idle))
    counted = tests.get("passed", 0) + tests.get("failed", 0) + tests.get("errors", 0) + tests.get("skipped", 0)
    if counted:
        parts.append(f"GPU tests: {tests.get('passed', 0)} passed, {tests.get('failed', 0) + tests.get('errors', 0)} "
                     f"failed, {tests.get('skipped', 0)} skipped of {counted}")
    return "; ".join(parts)


def render_environment(env: dict) -> list[str]:
    lines = ["## Environment", ""]
    for d in env.get("devices", []):
        lines.append(f"- GPU {d['index']}: {d['name']}, compute capability {d['capability']}, "
                     f"{d['memory_gib']} GiB, {d['multiprocessors']} SMs")
    if not env.get("devices"):
        lines.append("- no CUDA device visible to torch")
    torch_line = f"- torch {env.get('torch')}" + (f" (CUDA {env['torch_cuda']})" if env.get("torch_cuda") else " (no CUDA build)")
    if env.get("nccl"):
        torch_line += f", NCCL {env['nccl']}"
    lines.append(torch_line)
    if env.get("torch_error"):
        lines.append(f"- torch failed to import: `{env['torch_error']}`")
    if env.get("flash_attn"):
        lines.append(f"- flash-attn {env['flash_attn']}")
    else:
        lines.append(f"- flash-attn not importable (`{env.get('flash_attn_error', 'absent')}`): its tests skip and "
                     "the flash benchmarks do not run")
    lines.append(f"- python {env.get('python')}, {env.get('cpus')} CPUs, transformers {env.get('transformers')}, "
                 f"triton {env.get('triton')}")
    if env.get("probe_error"):
        lines.append(f"- environment probe failed: `{env['probe_error'][-300:]}`")
    lines += ["", "nvidia-smi:", "", "```text", env.get("nvidia_smi") or "(nvidia-smi not found)", "```", ""]
    return lines


def render_tests(step: Step, tests: dict) -> list[str]:
    lines = ["## GPU tests", ""]
    if step.status in ("not run", "skipped"):
        return lines + [f"{step.status.capitalize()}: {step.note}.", ""]
    counts = (f"{tests['passed']} passed, {tests['failed']} failed, {tests['errors']} errors, "
              f"{tests['skipped']} skipped")
    lines.append(f"{counts} (pytest: `{tests.get('summary_line') or 'no summary line'}`; rc {step.rc}, "
                 f"{step.status}).")
    if tests.get("partial"):
        lines.append("No JUnit report was written (pytest was stopped or crashed): the counts above are the "
                     "tests that finished, as they finished; see the output tail and the log.")
    elif tests.get("missing"):
        lines.append("No JUnit report was written (pytest was stopped or crashed): the counts above are not "
                     "complete; see the output tail and the log.")
    lines.append("")
    if tests.get("failures"):
        lines += ["Failures:", ""] + [f"- `{f['test']}`: {f['message']}" for f in tests["failures"]] + [""]
    if tests.get("skip_reasons"):
        lines += ["Skipped, by reason:", ""] + [f"- {n} x {reason or '(no reason given)'}"
                                                for reason, n in tests["skip_reasons"].items()] + [""]
    lines += ["Output tail:", "", "```text", step.tail, "```", ""]
    return lines


def render_benchmark(step: Step) -> list[str]:
    lines = [f"## {step.title}", ""]
    if step.status == "skipped":
        return lines + [f"Skipped: {step.note}.", ""]
    if step.status == "not run":
        return lines + [f"Not run: {step.note}.", ""]
    note = f" ({step.note})" if step.note else ""
    lines += [f"{step.status.capitalize()} in {step.seconds:.0f} s{note}; log `{display_path(step.log or '')}`.", ""]
    if step.data.get("markdown"):
        lines += [step.data["markdown"], ""]
    if step.status != "passed":
        lines += ["Output tail:", "", "```text", step.tail, "```", ""]
    return lines


def record_json(env: dict, steps: list[Step], tests: dict, argv: list[str], started: str, total_s: float) -> dict:
    out_steps = []
    for s in steps:
        d = asdict(s)
        d["data"] = {k: v for k, v in s.data.items() if k != "markdown"}
        out_steps.append(d)
    return {"device": device_name(env), "started": started, "total_s": total_s, "argv": argv, "environment": env,
            "tests": tests, "steps": out_steps, "failed_steps": [s.name for s in steps if s.failed]}


# -- main ------------------------------------------------------------------------------------------------

def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="markdown record path (JSON beside it); default "
                                  "benchmarks/results/gpu_suite_<device>.md, or under --scratch for a CPU dry run")
    ap.add_argument("--scratch", default=DEFAULT_SCRATCH, help="folder for logs and benchmark outputs (default runs/gpu)")
    ap.add_argument("--allow-cpu", action="store_true", help="without CUDA, dry-run every step on CPU with tiny sizes")
    ap.add_argument("--budget-s", type=float, default=470.0, help="time for all steps together (default 7.8 min)")
    ap.add_argument("--tests-timeout-s", type=float, default=270.0, help="GPU tests (Triton compiles each kernel "
                                                                         "variant on first use)")
    ap.add_argument("--decode-timeout-s", type=float, default=60.0)
    ap.add_argument("--spec-triton-timeout-s", type=float, default=80.0, help="speculative decoding, Triton backend")
    ap.add_argument("--spec-timeout-s", type=float, default=60.0, help="speculative decoding, torch backend")
    ap.add_argument("--spec-flash-timeout-s", type=float, default=80.0, help="speculative decoding, flash backend")
    ap.add_argument("--tier-load-timeout-s", type=float, default=90.0, help="tier hits loaded layer by layer")
    ap.add_argument("--pytest-args", default="", help="extra pytest arguments, e.g. \"-k flash -x\"")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-benchmarks", action="store_true")
    return ap.parse_args(argv)


def plan_steps(args, scratch: str, tag: str, flash: bool, cpu: bool) -> tuple[list[tuple[Step, float]], dict]:
    """Every step with its time limit (skipped ones marked), and the test step's extras (env, junit path)."""
    test_step, extras = tests_step(args, scratch)
    plan = [(test_step, args.tests_timeout_s)]
    plan.append((decode_step_step(args, scratch, tag, flash, cpu), args.decode_timeout_s))
    plan.append((spec_decode_step(args, scratch, tag, "triton", cpu), args.spec_triton_timeout_s))
    plan.append((spec_decode_step(args, scratch, tag, "torch", cpu), args.spec_timeout_s))
    flash_spec = spec_decode_step(args, scratch, tag, "flash", cpu)
    if not flash:
        flash_spec.status = "skipped"
        flash_spec.note = "flash-attn not installed" if not cpu else "flash-attn needs CUDA"
    plan.append((flash_spec, args.spec_flash_timeout_s))
    plan.append((tier_load_overlap_step(args, scratch, tag, cpu), args.tier_load_timeout_s))
    for step, _ in plan:
        if args.skip_tests and step.name == "tests" or args.skip_benchmarks and step.name != "tests":
            step.status, step.note = "skipped", "skipped on the command line"
    return plan, extras


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    t0 = time.monotonic()
    env = probe_environment()
    cpu = not env.get("cuda_available")
    if cpu and not args.allow_cpu:
        why = env.get("torch_error") or "torch.cuda.is_available() is False"
        print(f"gpu_suite: no CUDA device ({why}); pass --allow-cpu for a dry run of this script on CPU",
              file=sys.stderr)
        return 2
    name = device_name(env)
    tag = slug(name)
    scratch = os.path.join(os.path.abspath(args.scratch), tag)
    os.makedirs(scratch, exist_ok=True)
    out = args.out or (os.path.join(args.scratch, f"gpu_suite_{tag}.md") if cpu
                       else os.path.join(RESULTS, f"gpu_suite_{tag}.md"))
    print(f"gpu_suite: {name}; torch {env.get('torch')}; flash-attn {env.get('flash_attn') or 'not installed'}; "
          f"logs in {scratch}", flush=True)
    if env.get("nvidia_smi"):
        print(env["nvidia_smi"], flush=True)

    flash = bool(env.get("flash_attn")) and not cpu
    plan, extras = plan_steps(args, scratch, tag, flash, cpu)
    budget = Budget(args.budget_s)
    steps = []
    for step, limit in plan:
        if step.status != "skipped":
            execute(step, limit, budget, scratch, extras["env"] if step.name == "tests" else None)
            if step.name != "tests":
                load_benchmark(step)
        steps.append(step)

    test_step = steps[0]
    ran = test_step.status not in ("skipped", "not run")
    tests = (summarize_tests(extras["junit"], extras["outcomes"]) if ran
             else {"passed": 0, "failed": 0, "errors": 0, "skipped": 0})
    tests["summary_line"] = pytest_summary_line(test_step.tail)
    total_s = time.monotonic() - t0
    write_record(out, render(env, steps, tests, argv, started, total_s, cpu),
                 record_json(env, steps, tests, argv, started, total_s))
    failed = [s.name for s in steps if s.failed]
    print(f"\ngpu_suite: {'all steps passed' if not failed else 'failed: ' + ', '.join(failed)}; record {out}")
    return 1 if failed else 0


def write_record(md_path: str, markdown: str, data: dict) -> None:
    """OUT.md and OUT.json (the same stem)."""
    os.makedirs(os.path.dirname(os.path.abspath(md_path)), exist_ok=True)
    with open(md_path, "w", encoding="utf-8") as f:
        f.write(markdown)
    stem = md_path[:-3] if md_path.endswith(".md") else md_path
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
