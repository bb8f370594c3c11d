"""The training corpus of the bundled default model: the Python standard library's own sources.

Shared by ``train_default_model.py`` and ``eval_default_model.py`` so that both see exactly the same
files and the same train / held-out split.

Corpus: every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (sorted by relative path), except
``site-packages`` (third-party code), ``__pycache__`` and the test-suite *data* directories (fixtures such
as deliberately broken or oddly encoded modules, not representative source). Files that are not valid
UTF-8 or are empty are skipped. Licence: PSF License (the interpreter's ``LICENSE.txt``).

Split: a file is held out when the first 8 bytes of SHA-256 of its relative path, modulo 1000, fall below
``holdout_permille`` (deterministic, independent of the interpreter's path and of file order).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass

EOS_TOKEN = "<|endoftext|>"

# Directories (relative to the stdlib root, or any path component) that hold no real library source.
_EXCLUDED_COMPONENTS = {"site-packages", "__pycache__", "encoded_modules"}


@dataclass(frozen=True)
class Document:
    """One source file of the corpus."""

    path: str  # relative to the stdlib root, '/'-separated
    text: str

    @property
    def heldout_key(self) -> int:
        """Deterministic hash of the relative path, used for the split."""
        return int.from_bytes(hashlib.sha256(self.path.encode("utf-8")).digest()[:8], "big")


def stdlib_dir() -> str:
    """The standard library directory of the running interpreter."""
    return sysconfig.get_paths()["stdlib"]


def _is_excluded_dir(rel_dir: str) -> bool:
    """True for site-packages, caches and test data directories (e.g. test/test_email/data)."""
    parts = [p for p in rel_dir.split("/") if p]
    if any(p in _EXCLUDED_COMPONENTS for p in parts):
        return True
    in_tests = any(p in ("test", "tests", "idle_test") for p in parts)
    return in_tests and any("data" in p for p in parts)


def list_source_files(root: str | None = None) -> list[str]:
    """Sorted relative paths of the corpus' ``*.py`` files under ``root`` (default: the stdlib)."""
    root = root or stdlib_dir()
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
        rel_dir = "" if rel_dir == "." else rel_dir
        if _is_excluded_dir(rel_dir):
            dirnames[:] = []
            continue
        dirnames.sort()
        for name in filenames:
            if name.endswith(".py"):
                found.append(f"{rel_dir}/{name}" if rel_dir else name)
    return sorted(found)


def load_documents(root: str | None = None) -> list[Document]:
    """Read the corpus (UTF-8 files only, non-empty), sorted by relative path."""
    root = root or stdlib_dir()
    docs: list[Document] = []
    for rel in list_source_files(root):
        try:
            with open(os.path.join(root, rel), encoding="utf-8", newline="") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip() and EOS_TOKEN not in text:
            docs.append(Document(rel, text))
    return docs


def split_documents(docs: list[Document], holdout_permille: int) -> tuple[list[Document], list[Document]]:
    """(train, held-out) by path hash; both keep the sorted order."""
    train, heldout = [], []
    for doc in docs:
        (heldout if doc.heldout_key % 1000 < holdout_permille else train).append(doc)
    return train, heldout


def corpus_stats(docs: list[Document]) -> dict[str, int]:
    """Number of files, characters and UTF-8 bytes."""
    return {
        "files": len(docs),
        "chars": sum(len(d.text) for d in docs),
        "bytes": sum(len(d.text.encode("utf-8")) for d in docs),
    }
