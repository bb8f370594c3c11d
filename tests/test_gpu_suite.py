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
        for module in ("import ray", "tests.serving", "frontend.server", "starlette"):
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
                      "spec_decode_torch": "passed", "spec_decode_flash": "skipped", "tier_load_overlap": "passed"}
    assert record["failed_steps"] == []
    tests = record["tests"]  # without CUDA every GPU test is collected and skips, naming why
    assert tests["passed"] == tests["failed"] == tests["errors"] == 0 and tests["skipped"] > 100
    assert any("CUDA" in reason for reason in tests["skip_reasons"])
    outcomes = (tmp_path / "scratch" / "cpu" / "pytest_gpu_outcomes.jsonl").read_text().splitlines()
    assert len(outcomes) == tests["skipped"]  # the plugin wrote every test's outcome as it went
    for step in record["steps"][1:4] + record["steps"][5:]:  # each benchmark's own figures were read back
        assert step["data"]["result"]["rows"], step["name"]
    markdown = out.read_text()
    # the verdict counts what ran: the flash step skipped, every GPU test skipped
    verdict = (f"**5 of 6 steps passed; not run: spec_decode_flash; GPU tests: 0 passed, 0 failed, "
               f"{tests['skipped']} skipped of {tests['skipped']}**")
    assert markdown.startswith("# GPU suite: dry run on CPU") and verdict in markdown, markdown[:600]


SAMPLE_TESTS = '''
import time

import pytest


@pytest.fixture
def broken():
    raise RuntimeError("no device")


def test_ok():
    pass


def test_bad():
    assert 1 == 2, "wrong"


@pytest.mark.skip(reason="needs CUDA")
def test_skipped():
    pass


def test_setup_error(broken):
    pass


def test_hangs():
    time.sleep(600)
'''


def test_a_test_run_stopped_at_its_limit_is_still_counted_test_by_test(tmp_path):
    """The suite's test step stopped at its time limit leaves no JUnit report; the outcomes written as the
    tests finished still give the counts, the failures and the skip reasons."""
    import argparse

    suite = load_suite()
    (tmp_path / "test_sample.py").write_text(SAMPLE_TESTS)
    step, extras = suite.tests_step(argparse.Namespace(pytest_args=""), str(tmp_path))
    assert "pytest_outcomes" in step.command
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "pytest_outcomes", f"--junitxml={extras['junit']}",
           str(tmp_path / "test_sample.py")]
    rc, timed_out, _ = suite.run_command(cmd, 5.0, str(tmp_path / "pytest.log"), extras["env"])
    assert timed_out and not os.path.exists(extras["junit"])
    tests = suite.summarize_tests(extras["junit"], extras["outcomes"])
    assert tests["partial"] and (tests["passed"], tests["failed"], tests["errors"], tests["skipped"]) == (1, 1, 1, 1)
    assert {f["test"].split("::")[1]: f["message"] for f in tests["failures"]} == {
        "test_bad": "AssertionError: wrong", "test_setup_error": "RuntimeError: no device"}
    assert tests["skip_reasons"] == {"needs CUDA": 1}
