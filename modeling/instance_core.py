"""What every serving instance is built on, built in one place.

The reference engine, the prefill worker and the decode worker each run one :class:`InstanceCore`: the model
(this rank's shard under tensor parallelism), the block pool, the runner over its paged KV cache, the prefix
cache keyed to the model, dtype and block size with the KV tiers below it (``modeling/kv_tiers``, as the config's
``kv_tiers`` asks), and the checkpoint's tokenizer. Each puts its own scheduler,
connector and request state around it. A tensor-parallel instance's other ranks hold only a runner over their
shard and their part of the same blocks (:func:`follower_runner`).
"""

from __future__ import annotations

from dataclasses import dataclass

from modeling.block_pool import BlockPool
from modeling.checkpoint import LoadedModel
from modeling.instance_config import InstanceConfig
from modeling.kv_cache import PagedKVCache
from modeling.kv_tiers.host import HostTier
from modeling.kv_tiers.tiers import KVTiers
from modeling.prefix_cache import PrefixCache
from modeling.prefix_hash import kv_salt
from modeling.runner import ModelRunner
from modeling.tokenizer import TextTokenizer, load_tokenizer_if_present
from modeling.tp_group import TPGroup
from modeling.tp_runner import ShardedBlocks, TPDriverRunner, build_runner, load_for_rank


@dataclass(frozen=True)
class InstanceCore:
    """One instance's model, block pool, runner (and its KV cache), prefix cache, tokenizer (None when the
    checkpoint has no ``tokenizer.json``) and KV tiers (None: none)."""

    loaded: LoadedModel
    pool: BlockPool
    runner: ModelRunner
    prefix_cache: PrefixCache
    tokenizer: TextTokenizer | None
    tiers: KVTiers | None = None

    @property
    def cache(self) -> PagedKVCache:
        """The paged KV cache the runner reads and writes (this rank's KV heads)."""
        return self.runner.cache

    @classmethod
    def build(cls, model: LoadedModel | str, config: InstanceConfig, tp: TPGroup | None = None, *,
              compile_steps: bool, prefix_caching: bool, num_blocks: int | None = None,
              instance_id: str = "instance") -> "InstanceCore":
        """The core of an instance run as ``config`` says (dtype, device, block size, attention backend).

        ``model``: a loaded model, or a checkpoint path loaded here as this rank runs it (its shard with the
        all-reduces installed under a sharded ``tp``). ``tp``: build rank 0 of a tensor-parallel instance, whose
        runner broadcasts every forward to the other ranks (they build theirs with :func:`follower_runner`).
        ``compile_steps``: compile the small steps where supported (``build_runner``); ``prefix_caching``: keep
        full blocks' KV for later prompts (the prefix cache is built either way, off when false);
        ``num_blocks``: the KV cache's blocks (None: ``kv_cache_tokens // block_size``); ``instance_id`` names
        the disk tier's directory. The tiers run with prefix caching on; they keep whole blocks (every KV head),
        which rank 0 of a sharded tensor-parallel instance gathers from and scatters to its ranks
        (:class:`~modeling.tp_runner.ShardedBlocks`)."""
        loaded = model if isinstance(model, LoadedModel) else load_for_rank(model, config.dtype, config.device, tp)
        tokenizer = load_tokenizer_if_present(loaded.path)
        pool = BlockPool(_num_blocks(config, num_blocks), config.block_size)
        runner = build_runner(loaded, pool.num_blocks, config.block_size, config.attention_backend, tp,
                              compile_steps=compile_steps)
        salt = kv_salt(loaded.path, loaded.dtype, config.block_size)
        tiers = None
        if prefix_caching:
            blocks = runner.cache
            if isinstance(runner, TPDriverRunner):
                blocks = ShardedBlocks(runner, loaded.config.num_key_value_heads)
            tiers = KVTiers.build(config.kv_tiers, blocks, salt, loaded.path, instance_id,
                                  layout=f"tp{loaded.shard.size}")
        prefix_cache = PrefixCache(pool, salt, prefix_caching, tiers)
        return cls(loaded, pool, runner, prefix_cache, tokenizer, tiers)

    def adopt_host_tier(self, previous: HostTier | None, salt: bytes) -> int:
        """Keep the blocks of a previous worker's host tier on this instance (a role change), when its blocks
        were keyed with the same ``salt`` (model, dtype, block size) and this core has a host tier; how many
        were kept."""
        if previous is None or self.tiers is None or salt != self.prefix_cache.salt:
            return 0
        return self.tiers.adopt_host(previous)

    def close(self) -> None:
        """Release a tensor-parallel instance's followers; finish the tiers' queued writes and release their
        directory."""
        if isinstance(self.runner, TPDriverRunner):
            self.runner.stop()
        if self.tiers is not None:
            self.tiers.close()


def follower_runner(model: LoadedModel | str, config: InstanceConfig, tp: TPGroup,
                    num_blocks: int | None = None) -> ModelRunner:
    """A non-driver rank of a tensor-parallel instance: its shard of the model (``model``: loaded already, or a
    checkpoint path loaded here) and a runner over a cache of the driver's blocks for its KV heads (``num_blocks``
    as :meth:`InstanceCore.build` takes it; steps run eagerly, as every rank of a sharded model does)."""
    loaded = model if isinstance(model, LoadedModel) else load_for_rank(model, config.dtype, config.device, tp)
    return build_runner(loaded, _num_blocks(config, num_blocks), config.block_size, config.attention_backend, tp)


def _num_blocks(config: InstanceConfig, num_blocks: int | None) -> int:
    return config.kv_cache_tokens // config.block_size if num_blocks is None else num_blocks
