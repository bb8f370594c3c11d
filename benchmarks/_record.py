"""Writing a benchmark's result: OUT.json (the figures) and OUT.md (the table a person reads)."""

from __future__ import annotations

import json
import os
from typing import Callable


def record(result: dict, out: str, write_markdown: Callable[[dict, str], None]) -> None:
    """Write ``result`` to OUT.json and, through ``write_markdown``, OUT.md; print the markdown."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    write_markdown(result, out + ".md")
    with open(out + ".md", encoding="utf-8") as f:
        print(f.read())


def write_lines(path: str, lines: list[str]) -> None:
    """A markdown file from its lines."""
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
