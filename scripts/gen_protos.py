"""Regenerate the gRPC stubs under protos/ from protos/magicserve/v1/*.proto.

    python scripts/gen_protos.py           # write the stubs
    python scripts/gen_protos.py --check   # exit 1 if the committed stubs are stale
"""

from __future__ import annotations

import argparse
import filecmp
import glob
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTO_ROOT = os.path.join(ROOT, "protos")
OUT_DIR = os.path.join(PROTO_ROOT, "magicserve", "v1")
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def generate(out_root: str) -> list[str]:
    """Run protoc into out_root; returns the generated files relative to it."""
    from grpc_tools import protoc

    protos = sorted(glob.glob(os.path.join(OUT_DIR, "*.proto")))
    args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={out_root}", f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}"] + protos
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    files = []
    for dirpath, _, names in os.walk(out_root):
        for n in names:
            if n.endswith(GENERATED_SUFFIXES):
                files.append(os.path.relpath(os.path.join(dirpath, n), out_root))
    for rel in files:  # stubs import each other as top-level 'magicserve.v1'; make it package-relative
        path = os.path.join(out_root, rel)
        with open(path) as f:
            text = f.read()
        text = text.replace("from magicserve.v1 import", "from protos.magicserve.v1 import")
        with open(path, "w") as f:
            f.write(text)
    return sorted(files)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only compare with the committed stubs")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(tmp)
        stale = [f for f in files if not os.path.exists(os.path.join(PROTO_ROOT, f))
                 or not filecmp.cmp(os.path.join(tmp, f), os.path.join(PROTO_ROOT, f), shallow=False)]
        if args.check:
            if stale:
                print("stale gRPC stubs (run python scripts/gen_protos.py):", ", ".join(stale))
                return 1
            print("gRPC stubs are up to date")
            return 0
        for f in files:
            shutil.copyfile(os.path.join(tmp, f), os.path.join(PROTO_ROOT, f))
        print("wrote", ", ".join(files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
