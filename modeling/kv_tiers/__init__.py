"""KV tiers below an instance's block pool: host memory and a local disk directory.

A full block whose KV is final (the prefix cache caches it: never a draft position, never a half-written
block) is copied out when it is cached and kept in the tiers under its content hash, each tier with its own
capacity and least-recently-used eviction; the disk write runs on a background thread, off the step. When a
prompt's prefix is not in the pool, the blocks the tiers hold after the pool's cached run are loaded back into
freshly allocated blocks instead of being computed. ``tiers.py`` is the entry point (:class:`KVTiers`),
``modeling/instance_config.py`` ``KVTiersConfig`` the YAML section, ``host.py`` and ``disk.py`` the two tiers.

What each tier buys: on a GPU the pool lives in device memory, so the host tier adds capacity at PCIe
bandwidth and the disk tier adds more at the disk's; on CPU the pool already lives in host memory, so the host
tier is more of the same memory outside the pool's fixed size, and the disk tier is the one that adds capacity
beyond RAM (and outlives the process: a restarted instance finds its blocks again).
"""
