"""The dtypes a model, its KV cache and the KV transfer protocol run in, and their names (``model.dtype`` in
the cluster config, the dtype field of a KV fingerprint and of a transfer's extra tensor)."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' (or a torch dtype) -> torch dtype."""
    if isinstance(name, torch.dtype):
        if name in DTYPES.values():
            return name
        raise ValueError(f"dtype: unsupported {name}; allowed: {', '.join(DTYPES)}")
    if name not in DTYPES:
        raise ValueError(f"dtype: unsupported {name!r}; allowed: {', '.join(DTYPES)}")
    return DTYPES[name]
