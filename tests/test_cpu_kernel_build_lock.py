"""The CPU kernel's build lock: a builder killed mid-build never makes later loads wait forever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

cpu_kernel = pytest.importorskip("modeling.attention.cpu_kernel")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _holder(build_dir: str, marker: str) -> subprocess.Popen:
    """A process that takes the build lock, says so through ``marker`` and then sleeps until killed."""
    code = textwrap.dedent(f"""
        import time
        from modeling.attention.cpu_kernel import exclusive_build
        with exclusive_build({build_dir!r}):
            open({marker!r}, "w").close()
            time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    deadline = time.monotonic() + 60
    while not os.path.exists(marker):
        assert proc.poll() is None, "the lock holder exited early"
        assert time.monotonic() < deadline, "the lock holder never took the lock"
        time.sleep(0.05)
    return proc


def test_stale_torch_lock_is_removed_under_the_build_lock(tmp_path):
    (tmp_path / "lock").write_text("")  # what a builder killed mid-build leaves behind
    with cpu_kernel.exclusive_build(str(tmp_path)):
        assert not (tmp_path / "lock").exists()


def test_build_lock_serialises_and_is_released_when_its_holder_is_killed(tmp_path):
    proc = _holder(str(tmp_path), str(tmp_path / "held"))
    try:
        # while the holder lives, a second builder waits (probe from another process, non-blocking)
        probe = textwrap.dedent(f"""
            import fcntl, sys
            with open({str(tmp_path / 'magicserve.build.lock')!r}, "a+") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    sys.exit(3)
        """)
        assert subprocess.run([sys.executable, "-c", probe], timeout=60).returncode == 3
        (tmp_path / "lock").write_text("")  # the holder "was building" when it died
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        t0 = time.monotonic()
        with cpu_kernel.exclusive_build(str(tmp_path)):
            assert not (tmp_path / "lock").exists()
        assert time.monotonic() - t0 < 5
    finally:
        if proc.poll() is None:
            proc.kill()


def test_kernel_loads_despite_a_stale_lock_in_its_build_directory():
    """End to end, in a fresh process: torch alone would wait forever on this lock file."""
    if not cpu_kernel.cpu_kernel_available():
        pytest.skip(f"cpu attention kernel unavailable: {cpu_kernel.cpu_kernel_error()}")
    from torch.utils import cpp_extension

    name = f"{cpu_kernel._EXT_BASE_NAME}_{cpu_kernel._cpu_fingerprint()}"
    build_dir = cpp_extension._get_build_directory(name, verbose=False)
    stale = os.path.join(build_dir, "lock")
    with cpu_kernel.exclusive_build(build_dir):  # never plant it while a real build runs
        open(stale, "w").close()
    code = "from modeling.attention.cpu_kernel import load_cpu_kernel; load_cpu_kernel(); print('loaded')"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "loaded" in out.stdout, out.stderr[-2000:]
    assert not os.path.exists(stale)
