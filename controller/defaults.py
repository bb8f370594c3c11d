"""Embedded defaults: the bundled model and the demo prompts."""

from __future__ import annotations

import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL_NAME = "stdlib-llama-15m"
DEFAULT_MODEL_DIR = os.path.join(REPO_ROOT, "models", DEFAULT_MODEL_NAME)

# Prompts end mid-line: the tokenizer merges a newline with the next line's indentation, so a prompt
# ending in a bare newline is an unusual token boundary for the model.
DEMO_PROMPTS = (
    "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser(",
    'class LRUCache:\n    """A least-recently-used cache of fixed size."""\n\n    def __init__(self, capacity):\n        self.',
    "def fibonacci(n):\n    if n < 2:\n        return",
)
# Light sampling keeps the small model from looping; the seed keeps the demo reproducible.
DEMO_SAMPLING = {"temperature": 0.7, "top_p": 0.95, "seed": 0}
