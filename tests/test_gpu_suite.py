"""The GPU suite's own plumbing, on CPU: which test modules it collects, and its dry run end to end."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", os.path.join(REPO, "scripts", "gpu_suite.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_suite", module)  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_suite_collects_every_module_with_gpu_tests_and_no_serving_module():
    files = load_suite().gpu_test_files()
    assert {"tests/test_gpu.py", "tests/test_model_hf.py", "tests/test_tensor_parallel.py"} <= set(files)
    for path in files:  # a bare CUDA machine has no Ray, Starlette or gRPC health package
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            source = f.read()
        for module in ("import ray", "tests.serving", "controller.server", "starlette"):
            assert module not in source, f"{path} imports {module}"


def test_dry_run_on_cpu_runs_every_step_and_records_it(tmp_path):
    """``gpu_suite.py --allow-cpu``: the same steps as on a GPU at tiny sizes (the Triton benchmark in its
    interpreter), each passing, and a record whose counts come from the GPU tests' JUnit report."""
    out = tmp_path / "suite.md"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "gpu_suite.py"), "--allow-cpu",
                           "--scratch", str(tmp_path / "scratch"), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    record = json.loads((tmp_path / "suite.json").read_text())
    status = {s["name"]: s["status"] for s in record["steps"]}
    assert status == {"tests": "passed", "decode_step": "passed", "spec_decode_triton": "passed",
                      "spec_decode_torch": "passed", "spec_decode_flash": "skipped"}
    assert record["failed_steps"] == []
    tests = record["tests"]  # without CUDA every GPU test is collected and skips, naming why
    assert tests["passed"] == tests["failed"] == tests["errors"] == 0 and tests["skipped"] > 100
    assert any("CUDA" in reason for reason in tests["skip_reasons"])
    for step in record["steps"][1:4]:  # each benchmark's own figures were read back
        assert step["data"]["result"]["rows"], step["name"]
    markdown = out.read_text()
    assert markdown.startswith("# GPU suite: dry run on CPU") and "**every step passed**" in markdown
