"""KV-aware routing on plain objects: the router's index follows the instances' cache events (a real block pool's,
through ``PrefixCache.take_events``, and their tiers'), finds each instance's cached prefix of a prompt in its pool
and its tiers, and the placement weighs it against load."""

from __future__ import annotations

import pytest

from controller.config import ConfigError, parse_config
from controller.kv_index import Cached, PrefixIndex, PrefixRouting, by_cost
from controller.migration_policy import PolicyConfig
from controller.placement import decode_order, record_report
from controller.routing import Instance
from decode_worker.messages import PoolLoad
from modeling.block_pool import BlockPool, BlockTable
from modeling.prefix_cache import PrefixCache, PrefixCacheEvents
from modeling.prefix_hash import block_hashes, kv_salt
from modeling.sequence import Sequence

BS = 4
SALT = kv_salt("model", "float32", BS)


def _seq(rid, tokens):
    return Sequence(request_id=rid, prompt_ids=list(tokens), sampler=None, eos_token_ids=frozenset(),
                    block_table=BlockTable(BS), max_model_len=10_000)


def _finish(cache, pool, seq):
    """Compute the whole sequence, cache it, and end it (its blocks stay cached, unreferenced)."""
    seq.block_table.ensure_capacity(pool, len(seq.tokens))
    seq.num_computed = len(seq.tokens)
    cache.commit(seq, seq.num_computed)
    seq.block_table.release(pool)
    cache.forget(seq.request_id)


def test_the_index_follows_a_real_pool_through_caching_and_eviction():
    pool = BlockPool(6, BS)
    cache = PrefixCache(pool, SALT)
    index = PrefixIndex()
    doc = list(range(100, 117))  # 4 full blocks and a token
    _finish(cache, pool, _seq("a", doc))
    first = cache.take_events()
    assert first.reset and len(first.events) == 4  # the first report lists everything held
    index.apply("decode-0", first)
    assert cache.take_events() is None  # nothing changed since
    memo = {}
    assert index.cached("decode-0", doc + [7, 8, 9], memo).pool == 16
    assert index.cached("decode-0", doc[:9], memo={}).pool == 8  # the last token is never counted cached
    assert index.cached("decode-1", doc, memo).pool == 0  # an instance that reported nothing
    # another sequence needs 5 of the 6 blocks: 2 never-cached ones first, then the oldest cached ones go,
    # the prefix's end before its start
    _finish(cache, pool, _seq("b", list(range(500, 520))))
    events = cache.take_events()
    assert [stored for _, stored in events.events].count(False) == pool.num_evictions == 3
    index.apply("decode-0", events)
    assert index.num_blocks("decode-0") == pool.num_cached
    assert index.cached("decode-0", doc + [7], {}).pool == 4  # only the first block survived
    index.drop("decode-0")
    assert index.cached("decode-0", doc + [7], {}).pool == 0 and index.block_size("decode-0") is None


def test_a_reset_replaces_what_the_index_knew():
    index = PrefixIndex()
    hashes = block_hashes(list(range(12)), BS, SALT)
    index.apply("p", PrefixCacheEvents(SALT, BS, tuple((h, True) for h in hashes)))
    index.apply("p", PrefixCacheEvents(SALT, BS, ((hashes[0], True),), reset=True))  # a restarted instance
    assert index.num_blocks("p") == 1 and index.cached("p", list(range(13)), {}).pool == 4


def test_cost_weighs_blocks_to_compute_against_blocks_in_use():
    cached = {"hot": 64, "cold": 0}
    used = {"hot": 3, "cold": 0}
    # 80 tokens = 5 blocks of 16: hot computes 1 and has 3 in use (cost 4), cold computes 5 (cost 5)
    assert by_cost(["cold", "hot"], 80, 16, cached.get, used.get, 1.0) == ["hot", "cold"]
    used["hot"] = 10  # now the load outweighs the 4 cached blocks
    assert by_cost(["cold", "hot"], 80, 16, cached.get, used.get, 1.0) == ["cold", "hot"]
    assert by_cost(["cold", "hot"], 80, 16, cached.get, used.get, 4.0) == ["hot", "cold"]


def _decode(name, total_blocks, running=None):
    inst = Instance(name, "decode", handle=None)
    record_report(inst, PoolLoad(total_blocks, 16, dict(running or {}), 0, 0, frozenset()))
    return inst


def test_decode_order_goes_where_the_prefix_is_cached_when_it_has_room():
    a, b = _decode("decode-0", 100), _decode("decode-1", 100, {"r1": 10})
    policy = PolicyConfig()
    assert decode_order([a, b], 200, 0, policy, {})[0] == [a, b]  # load alone: the freer one
    order, room = decode_order([a, b], 200, 0, policy, {}, {"decode-1": 192})
    assert order == [b, a] and room  # 12 cached blocks outweigh its 10 in use
    assert decode_order([a, b], 200, 0, policy, {}, {"decode-1": 192}, overlap_weight=0.5)[0] == [a, b]
    full = _decode("decode-1", 100, {"r1": 95})  # holds the prefix but has no room for the request
    assert decode_order([a, full], 200, 0, policy, {}, {"decode-1": 192})[0] == [a, full]
    # before every instance has reported, the one holding the prefix goes first
    fresh = Instance("decode-2", "decode", handle=None)
    assert decode_order([a, fresh], 200, 0, policy, {}, {"decode-2": 16})[0] == [fresh, a]


@pytest.mark.parametrize("raw,message", [
    ({"prefix_caching": {"overlap_weight": -1}}, "prefix_caching.overlap_weight: must be a number >= 0, got -1"),
    ({"prefix_caching": {"local_prefill_tokens": -5}}, "prefix_caching.local_prefill_tokens: must be >= 0, got -5"),
    ({"prefix_caching": {"enabled": "yes"}}, "prefix_caching.enabled: must be true or false, got 'yes'"),
    ({"prefix_caching": {"tier_load_cost": 1.5}}, "prefix_caching.tier_load_cost: must be a number in [0, 1], got 1.5"),
    ({"prefix_caching": {"prefill_ahead": "sometimes"}},
     "prefix_caching.prefill_ahead: must be true, false or auto, got 'sometimes'"),
    ({"prefix_caching": {"prefill_ahead": 1}}, "prefix_caching.prefill_ahead: must be true, false or auto, got 1"),
    ({"prefix_caching": {"hash": "md5"}}, "prefix_caching.hash: unknown field; allowed: enabled, overlap_weight,"),
    ({"decode": {"prefix_caching": False}}, "decode.prefix_caching: not set here; it follows prefix_caching.enabled"),
])
def test_prefix_caching_config_errors_name_the_field(raw, message):
    with pytest.raises(ConfigError) as info:
        parse_config({"model": {"path": "m"}, **raw})
    assert str(info.value).startswith(message), str(info.value)


def test_one_switch_turns_caching_off_in_every_pool_and_the_router():
    on = parse_config({"model": {"path": "m"}})
    assert on.prefill.prefix_caching and on.decode.prefix_caching and on.colocated.prefix_caching
    assert on.prefix_caching.routing() == PrefixRouting(True, 1.0, 256, 0.2, prefill_ahead=False)  # auto, on CPU
    assert on.prefix_caching.routing(prefill_on_gpus=True).prefill_ahead  # auto, with GPUs
    forced = parse_config({"model": {"path": "m"}, "prefix_caching": {"prefill_ahead": True}})
    assert forced.prefix_caching.routing().prefill_ahead
    off = parse_config({"model": {"path": "m"}, "prefix_caching": {"enabled": False}})
    assert not (off.prefill.prefix_caching or off.decode.prefix_caching or off.colocated.prefix_caching)
    assert not off.prefix_caching.routing().enabled and off.prefix_caching.routing().local_prefill_tokens == 0


def _report(hashes_by_tier=(), pool=(), tiers=("host", "disk"), reset=False):
    return PrefixCacheEvents(SALT, BS, tuple((h, True) for h in pool), reset=reset,
                             tier_events=tuple((t, h, True) for t, hs in hashes_by_tier for h in hs), tiers=tiers)


def test_the_tiers_extend_the_pools_run_and_count_part_of_a_computed_block():
    doc = list(range(200, 233))  # 8 full blocks and a token
    h = block_hashes(doc[:-1], BS, SALT)
    index = PrefixIndex()
    # the pool holds the first 2 blocks; host the next 3, disk the 3 after: one run of 8 blocks, 6 loaded
    index.apply("d", _report([("host", h[2:5]), ("disk", h[5:8])], pool=h[:2], reset=True))
    got = index.cached("d", doc, {}, tier_load_cost=0.25)
    assert got == Cached(pool=8, tiers=24, saved=8 + 24 * 0.75) and got.tokens == 32
    assert index.cached("d", doc, {}).pool == 8  # the pool's own run
    # the host tier drops a block in the middle: the run stops there (the instance's lookup would stop too)
    index.apply("d", PrefixCacheEvents(SALT, BS, (), tier_events=(("host", h[3], False),), tiers=("host", "disk")))
    assert index.cached("d", doc, {}).tokens == 12 and index.tier_blocks("d", "host") == 2
    # a restart's first report (reset) replaces the tiers' contents too
    index.apply("d", _report([("disk", h[:1])], reset=True))
    assert index.cached("d", doc, {}) == Cached(0, 4, 4.0)
    # without a pool run or a tier run, nothing
    assert index.cached("d", [9] * 33, {}) == Cached()


def test_the_store_is_shared_by_every_instance_that_reaches_it_and_outlives_its_writer():
    doc = list(range(300, 317))
    h = block_hashes(doc[:-1], BS, SALT)
    index = PrefixIndex()
    index.apply("prefill-0", _report([("store", h)], tiers=("store",), reset=True))
    index.apply("decode-0", _report(tiers=("store",), reset=True))
    index.apply("decode-1", _report(tiers=("host",), reset=True))  # no store configured there
    assert index.cached("decode-0", doc, {}).tiers == 16
    assert index.cached("decode-1", doc, {}).tiers == 0
    index.drop("prefill-0")  # its writes stay findable in the store
    assert index.cached("decode-0", doc, {}).tiers == 16
    assert index.tier_blocks("decode-0", "store") == 4 and index.tier_blocks("decode-1", "store") == 0


def test_cost_prefers_the_pool_to_a_tier_and_a_tier_to_computing():
    doc = list(range(400, 433))
    h = block_hashes(doc[:-1], BS, SALT)
    index = PrefixIndex()
    index.apply("pool", _report(pool=h, reset=True))
    index.apply("tier", _report([("disk", h)], reset=True))
    index.apply("cold", _report(reset=True))
    saved = {n: index.cached(n, doc, {}, tier_load_cost=0.2).saved for n in ("pool", "tier", "cold")}
    no_load = {"pool": 0, "tier": 0, "cold": 0}.get
    assert by_cost(["cold", "tier", "pool"], 33, BS, saved.get, no_load, 1.0) == ["pool", "tier", "cold"]
    # with 2 blocks in use where the pool holds it, loading 8 blocks (1.6 blocks' worth) is cheaper
    assert by_cost(["pool", "tier"], 33, BS, saved.get, {"pool": 2, "tier": 0}.get, 1.0) == ["tier", "pool"]
