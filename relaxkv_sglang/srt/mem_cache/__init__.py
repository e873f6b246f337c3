"""The ``relaxkv`` tree cache: SGLang's radix tree plus the position-independent chunk store.

Runs in SGLang's scheduler process (one cache per TP worker). The cache class
(:mod:`.tree_cache_class`, SGLang's ``RadixCache`` subclassed) and its parts, one concept each:
chunk reuse and publication, every KV copy in the pool (:mod:`.pool_kv`), admission pins,
eviction order, the lower tiers (host, disk, a HiCache storage backend) and the movement between
them, the model identity stored values carry, the counters. What the rest of the plugin calls on
it is :class:`~.chunk_cache.ChunkCache`.

SGLang files used: ``mem_cache/radix_cache.py`` (subclassed), ``mem_cache/memory_pool.py`` (the
KV pool, read and written), ``mem_cache/storage/`` (HiCache storage backends, through their
factory). Imports nothing of :mod:`relaxkv_sglang.srt.forward`, ``entrypoints`` or ``scheduler``.
"""
