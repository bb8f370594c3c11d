"""The committed gRPC stubs match protos/magicserve/v1/*.proto."""

import subprocess
import sys


def test_stubs_are_fresh():
    result = subprocess.run([sys.executable, "scripts/gen_protos.py", "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
