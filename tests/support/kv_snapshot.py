"""The whole observable state of a KVCacheManager, for "nothing changed" assertions."""


def snapshot(kv):
    """Free-queue order, tables, hash chains, block states, cache index, usage and pending copies."""
    return (
        kv.pool.free_queue.ids(),
        {s: list(t) for s, t in kv._tables.items()},
        {s: list(h) for s, h in kv._hashes.items()},
        [(b.ref_count, b.block_hash, b.token_ids) for b in kv.pool.blocks],
        dict(kv.pool.cached),
        kv.usage(),
        list(kv._copy_pairs),
    )
