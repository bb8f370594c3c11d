"""The committed gRPC stubs match protos/magicserve/v1/*.proto."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_stubs_are_fresh():
    script = os.path.join(ROOT, "scripts", "gen_protos.py")
    result = subprocess.run([sys.executable, script, "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
