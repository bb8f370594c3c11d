"""Import every runtime module of the installed packages (those setup.py lists), so that a dependency the
code imports but setup.py does not declare fails here rather than on a user's machine.

    python scripts/check_runtime_imports.py

Run by .ci/run in a fresh virtualenv holding only the README's first install command (no test extras).
"""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Optional dependencies a module may import at its top: CUDA builds of torch ship triton, and the backend
# that needs it reports its absence when chosen; such a module is counted as skipped.
OPTIONAL = {"triton"}


def runtime_packages() -> list[str]:
    """The top-level packages setup.py installs (its ``PACKAGES`` list, read without running setup())."""
    with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "PACKAGES" for t in node.targets):
            return sorted({name.split(".")[0] for name in ast.literal_eval(node.value)})
    raise SystemExit("setup.py: no PACKAGES list")


def main() -> int:
    failed = []
    skipped = []
    count = 0
    for top in runtime_packages():
        package = importlib.import_module(top)
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{top}."):
            try:
                importlib.import_module(info.name)
                count += 1
            except ImportError as err:
                if (err.name or "").split(".")[0] in OPTIONAL:
                    skipped.append(info.name)
                else:
                    failed.append(f"{info.name}: {err}")
    for line in failed:
        print(f"import failed: {line}", file=sys.stderr)
    print(f"{count} runtime modules imported, {len(failed)} failed, {len(skipped)} skipped for lack of an optional "
          f"dependency ({', '.join(skipped) or 'none'})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
