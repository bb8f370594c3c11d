"""KV tiers in the simulator: what each instance keeps below its pool (host memory and disk together, or the
cluster's store), as content hashes only, and what loading them back costs.

:class:`SimTiers` is a ``LowerTiers`` (``modeling/prefix_cache.py``) over hashes: the simulated instances' real
prefix caches hand it every block they cache and ask it for the blocks after their pool's cached run, exactly
as a serving instance's ``KVTiers`` is asked. It keeps up to ``capacity_tokens`` of blocks, least recently used
evicted first, and counts what it loads, at ``load_gb_per_s``. Who pays a load, as serving instances do:

* a prefill instance's next step: the whole load (``layered`` off: written before the pass), or only what its
  pass does not hide (``layered``, ``kv_tiers.layered_loads`` on GPUs: written layer by layer beside the pass);
* nobody's step, on a decode instance (``start_load``, beside its steps): for a prompt whose KV a prefill
  instance sends, taken to be done by the time the KV lands; for a prompt it prefills itself, its first chunk
  waits ``background_seconds`` for it while the batch decodes on;
* a decode instance's next step, for a preempted sequence it recomputes.

Reading ahead for a waiting prompt is not modelled: each of its loads is paid whole by the step that takes it.
With ``SimTierConfig.shared`` every instance's ``SimTiers`` reads and writes one set of hashes (the cluster's
store), each paying its own loads. Pure Python.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


class SimTierConfigError(ValueError):
    pass


@dataclass(frozen=True)
class SimTierConfig:
    """``capacity_tokens`` of KV below each instance's pool, loaded back at ``load_gb_per_s``; a token's KV is
    ``kv_bytes_per_token`` bytes. ``shared``: one store for the whole cluster (``capacity_tokens`` in all),
    which every instance writes to and loads from, each at ``load_gb_per_s``. ``layered``: a prefill instance's
    loads are written layer by layer beside its pass (``kv_tiers.layered_loads``, on by default on GPUs), so a
    step pays only what its pass does not hide."""

    capacity_tokens: int
    load_gb_per_s: float
    kv_bytes_per_token: int
    shared: bool = False
    layered: bool = True

    def __post_init__(self) -> None:
        for name in ("capacity_tokens", "kv_bytes_per_token"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SimTierConfigError(f"tiers.{name}: must be an integer >= 1, got {value!r}")
        if not self.load_gb_per_s > 0:
            raise SimTierConfigError(f"tiers.load_gb_per_s: must be > 0, got {self.load_gb_per_s!r}")

    def load_seconds(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / (self.load_gb_per_s * 1e9)


class SimTiers:
    """One instance's tiers: block hashes, least recently used first (``held``: the cluster's store, shared
    with the other instances; default: the instance's own)."""

    def __init__(self, config: SimTierConfig, block_size: int, held: OrderedDict[int, None] | None = None):
        self.config = config
        self.block_size = block_size
        self.capacity_blocks = max(1, config.capacity_tokens // block_size)
        self._held: OrderedDict[int, None] = OrderedDict() if held is None else held
        self.loaded_tokens = 0  # since the start
        self.evicted_blocks = 0
        self._pending_tokens = 0  # loaded since the last step took their time
        self._started: dict[str, int] = {}  # request id -> blocks its background load brings

    def __len__(self) -> int:
        return len(self._held)

    def find(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self._held:
                break
            n += 1
        return n

    def read_ahead(self, request_id: str, hashes: Sequence[int]) -> bool:
        """Not modelled: every load's time is paid by the step that takes it (an upper bound)."""
        return False

    def cancel_read_ahead(self, request_id: str) -> None:
        self._started.pop(request_id, None)

    def start_load(self, request_id: str, hashes: Sequence[int], blocks: Sequence[int]) -> bool:
        """A load beside the instance's steps: counted, and paid by no step."""
        n = self.find(hashes[:len(blocks)])
        for h in hashes[:n]:
            self._held.move_to_end(h)
        self.loaded_tokens += n * self.block_size
        self._started[request_id] = n
        return True

    def background_seconds(self, request_id: str) -> float:
        """How long the request's load beside the steps (``start_load``) takes."""
        return self.config.load_seconds(self._started.get(request_id, 0) * self.block_size)

    def copies_from_memory(self, hashes: Sequence[int]) -> bool:
        """Never: the simulated instances run on GPUs, where every load crosses to the device."""
        return False

    def load_done(self, request_id: str) -> bool:
        """The simulation waits ``background_seconds`` before it finishes a load: done by then."""
        return True

    def finish_load(self, request_id: str) -> int:
        return self._started.pop(request_id, 0)

    def load(self, hashes: Sequence[int], blocks: Sequence[int], request_id: str = "") -> int:
        n = self.find(hashes[:len(blocks)])
        for h in hashes[:n]:
            self._held.move_to_end(h)
        self.loaded_tokens += n * self.block_size
        self._pending_tokens += n * self.block_size
        return n

    def save(self, blocks: Sequence[int], hashes: Sequence[int]) -> None:
        for h in hashes:
            if h in self._held:
                self._held.move_to_end(h)
                continue
            self._held[h] = None
            if len(self._held) > self.capacity_blocks:
                self._held.popitem(last=False)
                self.evicted_blocks += 1

    def take_load_seconds(self) -> float:
        """The time to load what was loaded since the last call (the instance's next step pays it, or the part of
        it its pass does not hide)."""
        tokens, self._pending_tokens = self._pending_tokens, 0
        return self.config.load_seconds(tokens) if tokens else 0.0
