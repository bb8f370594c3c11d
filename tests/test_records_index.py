"""The benchmark records' index (``benchmarks/results/README.md``) matches the tree: every row names files
that exist and a command whose script is in the tree, and every file there is in some row; the docs name
only scripts and records that exist."""

from __future__ import annotations

import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
SCRIPT = re.compile(r"(?:benchmarks|scripts)/[\w/]+\.py")


def index_rows() -> list[tuple[str, str]]:
    """(first cell, last cell) of each record row of the index's table."""
    with open(os.path.join(RESULTS, "README.md"), encoding="utf-8") as f:
        lines = [ln for ln in f if ln.startswith("| `")]
    rows = []
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        rows.append((cells[0], cells[-1]))
    return rows


def files_of(cell: str) -> list[str]:
    """The files a row's first cell names: ``NAME`` with the extensions in its parentheses, and any whole
    file names there; a cell without parentheses names one file."""
    name = re.match(r"`([^`]+)`", cell).group(1)
    inside = re.search(r"\((.*)\)", cell)
    if inside is None:
        return [name]
    parts = re.findall(r"`([^`]+)`", inside.group(1))
    return [name + p if p.startswith(".") else p for p in parts]


def test_every_record_in_the_index_exists_and_every_file_is_indexed():
    rows = index_rows()
    assert len(rows) > 10
    named = set()
    for cell, _ in rows:
        for name in files_of(cell):
            assert os.path.isfile(os.path.join(RESULTS, name)), f"the index names {name}, which is not in the tree"
            named.add(name)
    present = {n for n in os.listdir(RESULTS) if os.path.isfile(os.path.join(RESULTS, n))} - {"README.md"}
    assert present - named == set(), f"records not in the index: {sorted(present - named)}"


@pytest.mark.parametrize("cell,command", index_rows(), ids=[c.split("`")[1] for c, _ in index_rows()])
def test_each_records_command_names_a_script_in_the_tree(cell, command):
    if command == "-":  # FINDINGS: each paragraph names its own commands (checked below)
        return
    scripts = SCRIPT.findall(command)
    assert scripts or "magicserve " in command, f"{cell}: no command found in {command!r}"
    for path in scripts:
        assert os.path.isfile(os.path.join(REPO, path)), f"{cell}: {path} is not in the tree"


def test_findings_and_the_benchmarks_doc_cite_only_what_exists():
    for doc in (os.path.join(RESULTS, "FINDINGS.md"), os.path.join(REPO, "docs", "benchmarks.md")):
        with open(doc, encoding="utf-8") as f:
            text = f.read()
        for path in set(SCRIPT.findall(text)):
            if os.path.basename(path)[:-3].isupper():  # a placeholder (benchmarks/SCRIPT.py)
                continue
            assert os.path.isfile(os.path.join(REPO, path)), f"{os.path.basename(doc)} cites {path}, not in the tree"
    with open(os.path.join(REPO, "docs", "benchmarks.md"), encoding="utf-8") as f:
        text = f.read()
    for script in set(re.findall(r"^\| `(\w+\.py)` \|", text, flags=re.M)):
        assert os.path.isfile(os.path.join(REPO, "benchmarks", script)), f"docs/benchmarks.md lists {script}"
    for stem, exts in set(re.findall(r"`(\w+)\.\{([\w,]+)\}`", text)):
        for ext in exts.split(","):
            name = f"{stem}.{ext}"
            # names the docs give as a script's output pattern (OUT.json) are not records
            if stem.isupper():
                continue
            assert os.path.isfile(os.path.join(RESULTS, name)), f"docs/benchmarks.md names {name}, not in the tree"
