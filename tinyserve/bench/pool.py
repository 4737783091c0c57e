"""`bench.py pool`: the block pool's host cost per KV block with prefix caching on vs off, the
objects the cyclic GC tracks with the cache full, and the cost of a prefix hit per matched block.
No model: the scheduler's bookkeeping alone, on the CPU."""

from __future__ import annotations

import time


def bench_pool(args) -> dict:
    """Host cost of the block pool per KV block, prefix cache on vs off, for prompts that share
    nothing (the no-sharing workload's bookkeeping): 256 prompts of 1,024 tokens, each matched,
    allocated (evicting cached blocks once the pool is full), committed and freed."""
    import gc
    import random

    from tinyserve.core.block_pool import BlockPool
    from tinyserve.core.sequence import Sequence
    from tinyserve.sampling_params import SamplingParams

    rng, res = random.Random(0), {"rows": []}
    for cache in (True, False):
        pool, times = BlockPool(20000, 16, enable_prefix_caching=cache), []
        for _ in range(6):
            seqs = [
                Sequence(i, str(i), 0, ids, len(ids), SamplingParams(), 0, 16, 1 << 20)
                for i in range(256)
                for ids in [[rng.randrange(2000) for _ in range(1024)]]
            ]
            t = time.perf_counter()
            for seq in seqs:
                pool.match_prefix(seq)
                pool.may_append(seq, seq.num_tokens)
                seq.num_kv_computed = seq.num_tokens
                pool.commit(seq)
            for seq in seqs:
                pool.free_seq(seq)
            times.append(time.perf_counter() - t)
        us = min(times[1:]) / (256 * 64) * 1e6  # the first pass fills the pool, then it evicts
        # Objects the cyclic GC walks on every full collection, with 20k blocks cached (two
        # passes: a tuple is untracked once the tuples inside it are).
        gc.collect()
        gc.collect()
        res["rows"].append(
            {
                "prefix_caching": cache,
                "us_per_block": round(us, 3),
                "gc_tracked_objects": len(gc.get_objects()),
            }
        )
        print(res["rows"][-1], flush=True)
        pool = seqs = None
    # Prefix hits: 256 prompts on one cached 2,048-token head (the shared-prefix workload's
    # admissions), each matched and released; per matched block.
    pool = BlockPool(20000, 16, enable_prefix_caching=True)
    head = [rng.randrange(2000) for _ in range(2048)]
    seqs = [
        Sequence(i, str(i), 0, ids, len(ids), SamplingParams(), 0, 16, 1 << 20)
        for i in range(257)
        for ids in [head + [rng.randrange(2000) for _ in range(256)]]
    ]
    pool.may_append(seqs[0], seqs[0].num_tokens)
    seqs[0].num_kv_computed = seqs[0].num_tokens
    pool.commit(seqs[0])
    times = []
    for _ in range(6):
        t = time.perf_counter()
        for seq in seqs[1:]:
            assert pool.match_prefix(seq) == 2048  # the whole head
        times.append(time.perf_counter() - t)
        for seq in seqs[1:]:
            pool.free_seq(seq)
            seq.num_kv_computed = 0
    us = min(times) / (256 * 128) * 1e6
    res["rows"].append({"prefix_hit_us_per_matched_block": round(us, 3)})
    print(res["rows"][-1], flush=True)
    return res
