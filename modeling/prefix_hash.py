"""Content hashes of full KV blocks, for prefix caching (``modeling/block_pool.py``).

A block's KV depends on every token before it and in it, and on what else shapes the KV (the model, its
dtype, the block size): block i's hash covers block i-1's hash, block i's token ids and that *salt*. Hashes
are SHA-256 based, so they are the same in every process (instances report them to the router, which
matches them across the cluster) and collisions are out of reach (64 bits kept).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Container, Sequence


def kv_salt(*parts: object) -> bytes:
    """What besides the tokens determines a block's KV (e.g. model path, dtype, block size), as bytes."""
    return "\x1f".join(str(p) for p in parts).encode()


def block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes = b"", parent: int = 0,
                 start_block: int = 0) -> list[int]:
    """Hashes of the full blocks of ``token_ids`` from block ``start_block`` on (``parent``: the hash of the
    block before it, 0 for the first block). A partly filled last block has none."""
    out = []
    h = parent
    for b in range(start_block, len(token_ids) // block_size):
        tokens = array("q", token_ids[b * block_size:(b + 1) * block_size]).tobytes()
        h = int.from_bytes(hashlib.sha256(h.to_bytes(8, "little") + salt + tokens).digest()[:8], "little")
        out.append(h)
    return out


def leading_run(hashes: Sequence[int], held: Container[int]) -> int:
    """How many of ``hashes``, from the first, ``held`` contains: the blocks of the longest cached prefix."""
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n
