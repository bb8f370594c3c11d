"""The GPU suite's own plumbing, on CPU: which test modules it collects."""

from __future__ import annotations

import importlib.util
import os
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
