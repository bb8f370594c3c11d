"""Embedded defaults: the bundled model and the demo prompts."""

from __future__ import annotations

import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL_NAME = "stdlib-llama-15m"
DEFAULT_MODEL_DIR = os.path.join(REPO_ROOT, "models", DEFAULT_MODEL_NAME)

DEMO_PROMPTS = (
    "import os\nimport sys\n\n\ndef main(argv):\n",
    'class LRUCache:\n    """A least-recently-used cache of fixed size."""\n\n    def __init__(self, capacity):\n',
    "def fibonacci(n):\n    if n < 2:\n",
)
