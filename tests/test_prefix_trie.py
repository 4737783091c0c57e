"""Prefix trie + block pool + scheduler on plain lists, with a fake runner that records what each
KV slot holds: sharing must never hand a sequence KV computed for other tokens, positions or
tenants, a shared block must never be written, and nothing may leak."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyserve.core import prefix_trie
from tinyserve.core.block_pool import BlockPool
from tinyserve.core.scheduler import Scheduler
from tinyserve.core.sequence import Sequence, SequenceStatus
from tinyserve.sampling_params import SamplingParams

_ids = iter(range(10**9))


def make_seq(tokens, max_tokens=4, salt=None, spans=()) -> Sequence:
    i = next(_ids)
    return Sequence(
        i,
        str(i),
        0,
        list(tokens),
        len(tokens),
        SamplingParams(),
        0,
        max_tokens,
        cache_salt=salt,
        mm_spans=tuple(spans),
    )


class FakeRunner:
    """Writes (token, position, salt) into each KV slot and checks every slot a row reads."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.kv: dict[tuple[int, int], tuple] = {}

    def run(self, batch) -> None:
        bs = self.pool.block_size
        trie = self.pool.trie
        for seq, num in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_kv_computed, seq.num_kv_computed + num
            for p in range(start, end):
                block = seq.block_table[p // bs]
                assert not (trie and block in trie), "wrote into a cached (shared) block"
                assert self.pool.ref_counts[block] == 1, "wrote into a block another seq holds"
                self.kv[block, p % bs] = (seq.token_ids[p], p, seq.cache_salt)
            for p in range(end):  # attention reads the whole context
                slot = (seq.block_table[p // bs], p % bs)
                assert self.kv.get(slot) == (seq.token_ids[p], p, seq.cache_salt), "wrong KV"


def step(sched: Scheduler, runner: FakeRunner, next_token: int = 5) -> None:
    batch = sched.schedule()
    if batch is None:
        return
    sampled = [batch.samples(i) for i in range(len(batch.seqs))]
    runner.run(batch)
    for seq, num, s in zip(batch.seqs, batch.num_new_tokens, sampled):
        seq.num_kv_computed += num
        sched.pool.commit(seq)
        if s:
            seq.token_ids.append(next_token)
            if seq.num_output_tokens >= seq.max_tokens:
                sched.finish(seq, "length")
    sched.check_invariants()


def drain(sched, runner):
    for _ in range(10_000):
        if not sched.has_work:
            return
        step(sched, runner)
    raise AssertionError("no progress")


def setup(num_blocks=64, block_size=4, budget=1000, caching=True):
    pool = BlockPool(num_blocks, block_size, caching)
    return pool, Scheduler(pool, 16, budget), FakeRunner(pool)


def test_second_request_hits_prompt_and_answer_blocks():
    pool, sched, runner = setup()
    a = make_seq(range(10), max_tokens=7)
    sched.add(a)
    drain(sched, runner)
    # the first turn's 17 tokens: 16 of them have KV (the last sampled token never ran)
    b = make_seq(a.token_ids + [9, 9, 9])
    sched.add(b)
    step(sched, runner)
    assert b.num_cached_tokens == 16
    assert pool.trie.num_hit_tokens == 16 and pool.trie.num_query_tokens == 10 + 20
    drain(sched, runner)
    assert pool.num_free_blocks == pool.num_blocks


def test_full_prompt_hit_recomputes_the_last_token():
    pool, sched, runner = setup()
    for _ in range(2):
        s = make_seq(range(8), max_tokens=1)
        sched.add(s)
        drain(sched, runner)
    assert s.num_cached_tokens == 4  # 8 tokens = 2 full blocks, but the last token reruns


def test_cache_salt_isolates_tenants():
    pool, sched, runner = setup()
    for salt, expect in [("a", 0), ("b", 0), ("a", 8), (None, 0), (None, 8)]:
        s = make_seq(range(12), max_tokens=1, salt=salt)
        sched.add(s)
        drain(sched, runner)
        assert s.num_cached_tokens == expect, salt


def test_hash_collisions_never_share_kv(monkeypatch):
    monkeypatch.setattr(prefix_trie, "hash_key", lambda tokens, extra: 0)
    pool, sched, runner = setup()
    for tokens in ([1, 2, 3, 4, 5, 6, 7, 8, 9], [8, 7, 6, 5, 4, 3, 2, 1, 9], [1, 2, 3, 4, 0, 0]):
        s = make_seq(tokens, max_tokens=2)
        sched.add(s)
        drain(sched, runner)  # FakeRunner asserts every slot read holds this seq's tokens
    assert s.num_cached_tokens == 4  # only the truly equal first block is shared


def cache(pool: BlockPool, tokens) -> Sequence:
    """Match, compute and commit a prompt, then release it (its blocks stay cached)."""
    seq = make_seq(tokens)
    pool.match_prefix(seq)
    pool.may_append(seq, seq.num_tokens - seq.num_kv_computed)
    seq.num_kv_computed = seq.num_tokens
    pool.commit(seq)
    pool.free_seq(seq)
    return seq


def cached_tokens_of(pool: BlockPool, path: list[int]) -> list[int]:
    return [t for b in path for t in pool.trie.nodes[b][2]]


@pytest.mark.parametrize("collide", [False, True])
def test_recalled_chains_are_verified(monkeypatch, collide):
    """A match remembers its chain for the next prompt with the same first block; the chain is
    used only while every block still holds those tokens: after its blocks are evicted and
    reused for other prompts, a match walks the trie again (and with every hash equal, a
    recalled chain of other tokens is never taken)."""
    if collide:
        monkeypatch.setattr(prefix_trie, "hash_key", lambda tokens, extra: 0)
    pool = BlockPool(12, 4)
    head = list(range(100, 132))  # 8 blocks
    cache(pool, head + [1])
    seq = make_seq(head + [2, 3])
    assert pool.match_prefix(seq) == 32 and pool.trie.recent  # walked, then remembered
    pool.free_seq(seq)
    seq = make_seq(head + [4])
    assert pool.match_prefix(seq) == 32  # recalled
    assert cached_tokens_of(pool, seq.block_table) == head
    pool.free_seq(seq)
    other = list(range(500, 532))
    cache(pool, other + [1])  # 9 blocks: evicts most of the head's chain, reusing its ids
    seq = make_seq(head + [5])
    matched = pool.match_prefix(seq)
    assert cached_tokens_of(pool, seq.block_table) == head[:matched]
    pool.free_seq(seq)
    seq = make_seq(other[:4] + head[4:])  # the other prompt's first block, then the head's
    matched = pool.match_prefix(seq)
    assert cached_tokens_of(pool, seq.block_table) == seq.token_ids[:matched] and matched == 4
    pool.free_seq(seq)
    pool.check_invariants()


def test_recalled_chains_are_capped(monkeypatch):
    """A remembered chain keeps RECALL_BLOCKS blocks (memory); a match past them walks on."""
    monkeypatch.setattr(prefix_trie, "RECALL_BLOCKS", 2)
    pool = BlockPool(32, 4)
    head = list(range(100, 124))  # 6 blocks
    cache(pool, head + [1])
    for tail in ([2], [3]):  # the first walks and remembers, the second recalls, then walks
        seq = make_seq(head + tail)
        assert pool.match_prefix(seq) == 24
        assert cached_tokens_of(pool, seq.block_table) == head
        assert [len(path) for path, _, _ in pool.trie.recent.values()] == [2]
        pool.free_seq(seq)


def test_match_never_ends_inside_a_media_span():
    pool, sched, runner = setup()
    spans = [(2, 7, "img-1")]
    for _ in range(2):
        s = make_seq(range(12), max_tokens=1, spans=spans)
        sched.add(s)
        drain(sched, runner)
    s = make_seq(range(12), max_tokens=1, spans=spans)
    sched.add(s)
    step(sched, runner)
    assert s.num_cached_tokens == 8  # blocks [0,4) [4,8): the span ends at 7 < 8
    other = make_seq(range(12), max_tokens=1, spans=[(2, 7, "img-2")])
    sched.add(other)
    step(sched, runner)
    assert other.num_cached_tokens == 0  # a different image in block 0: no match
    drain(sched, runner)


def test_failed_admission_rolls_back_refs_and_stats():
    pool, sched, runner = setup(num_blocks=6, block_size=4)
    a = make_seq(range(9), max_tokens=1)
    sched.add(a)
    drain(sched, runner)  # 2 blocks cached, evictable
    blocker = make_seq(range(100, 112), max_tokens=8)
    sched.add(blocker)
    step(sched, runner)  # holds 3 blocks (+1 soon): 3 left, 2 of them cached
    stats = (pool.trie.num_query_tokens, pool.trie.num_hit_tokens)
    b = make_seq(list(range(9)) + list(range(50, 61)), max_tokens=1)  # 20 tokens: 5 blocks
    sched.add(b)
    step(sched, runner)
    assert b.status is SequenceStatus.WAITING and not b.block_table and b.num_kv_computed == 0
    assert (pool.trie.num_query_tokens, pool.trie.num_hit_tokens) == stats
    sched.check_invariants()
    drain(sched, runner)


def test_long_prompt_does_not_starve_decodes_or_short_prompts():
    pool, sched, runner = setup(num_blocks=512, block_size=4, budget=64)
    decoders = [make_seq(range(i, i + 5), max_tokens=200) for i in range(4)]
    for s in decoders:
        sched.add(s)
    step(sched, runner)
    long = make_seq(range(1000, 2000), max_tokens=1)
    sched.add(long)
    step(sched, runner)
    short = make_seq(range(3000, 3010), max_tokens=1)
    sched.add(short)
    for _ in range(30):
        batch = sched.schedule()
        assert all(d in batch.seqs for d in decoders)  # decodes run every step
        runner.run(batch)
        for seq, num in zip(batch.seqs, batch.num_new_tokens):
            seq.num_kv_computed += num
            pool.commit(seq)
        for seq in batch.seqs:
            if seq.num_kv_computed == seq.num_tokens:
                seq.token_ids.append(1)
        if short.num_output_tokens:
            break
    assert short.num_output_tokens == 1 and long.num_output_tokens == 0


def test_long_prompt_yields_kv_before_decodes_are_preempted():
    pool, sched, runner = setup(num_blocks=12, block_size=4, budget=8)
    dec = make_seq(range(4), max_tokens=20)
    sched.add(dec)
    step(sched, runner)
    long = make_seq(range(100, 140), max_tokens=1)  # 10 blocks: cannot fit beside dec
    sched.add(long)
    for _ in range(8):
        step(sched, runner)
    assert dec.num_preemptions == 0 and long.num_preemptions >= 1
    drain(sched, runner)
    assert long.is_finished and dec.is_finished


@settings(max_examples=80, deadline=None)
@given(
    num_blocks=st.integers(6, 40),
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 40),
    caching=st.booleans(),
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "step", "step", "abort"]), st.integers(0, 10**6)),
        max_size=50,
    ),
)
def test_random_ops_never_share_wrong_kv_or_leak(num_blocks, block_size, budget, caching, ops):
    pool, sched, runner = setup(num_blocks, block_size, budget, caching)
    live = []
    capacity = num_blocks * block_size
    prefixes = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [7] * 12]
    for op, arg in ops:
        if op == "add":
            tokens = prefixes[arg % 3][: 1 + arg % 12] + [arg % 5] * (arg % 7)
            tokens = tokens[: capacity - 4] or [1]
            salt = [None, "t1"][arg % 2] if arg % 11 == 0 else None
            seq = make_seq(tokens, max_tokens=1 + arg % 3, salt=salt)
            live.append(seq)
            sched.add(seq)
        elif op == "step":
            step(sched, runner, next_token=arg % 4)
        elif live:
            seq = live[arg % len(live)]
            if not seq.is_finished:
                sched.finish(seq, "abort")
        sched.check_invariants()
    drain(sched, runner)
    assert pool.num_free_blocks == num_blocks  # free + cached-unreferenced == total
    assert all(s.is_finished for s in live)


@pytest.mark.parametrize("caching", [True, False])
def test_preempted_sequence_rehits_its_own_blocks(caching):
    pool, sched, runner = setup(num_blocks=8, block_size=4, budget=100, caching=caching)
    a = make_seq(range(12), max_tokens=12)
    b = make_seq(range(50, 62), max_tokens=12)
    sched.add(a)
    sched.add(b)
    resumed_from = []
    for _ in range(100):
        if not sched.has_work:
            break
        was_preempted = b.status is SequenceStatus.WAITING and b.num_preemptions
        step(sched, runner)
        if was_preempted and b.status is SequenceStatus.RUNNING:
            # KV computed after the admission step = matched tokens + that step's chunk
            resumed_from.append(b.num_kv_computed - sched._nums[sched._batch.index(b)])
    assert b.num_preemptions >= 1 and a.is_finished and b.is_finished
    assert resumed_from and (min(resumed_from) > 0) == caching


def test_same_prefix_admitted_together_is_computed_once():
    pool, sched, runner = setup(num_blocks=64, block_size=4, budget=1000)
    seqs = [make_seq(list(range(20)) + [100 + i], max_tokens=1) for i in range(4)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert batch.seqs == [seqs[0]]  # the others wait one step for its blocks
    runner.run(batch)
    seqs[0].num_kv_computed += batch.num_new_tokens[0]
    pool.commit(seqs[0])
    seqs[0].token_ids.append(1)
    sched.finish(seqs[0], "length")  # max_tokens=1: done, as the engine would say
    drain(sched, runner)
    assert [s.num_cached_tokens for s in seqs] == [0, 20, 20, 20]
    assert pool.trie.num_hit_tokens == 60


def test_multi_token_append_crosses_blocks_and_trim_releases_lookahead():
    pool, sched, runner = setup(num_blocks=16, block_size=4)
    seq = make_seq(range(6), max_tokens=20)
    seq.status = SequenceStatus.RUNNING
    pool.may_append(seq, 6)
    seq.num_kv_computed = 6  # blocks 0-1 hold 6 tokens
    assert pool.can_append(seq, 9) and pool.num_new_blocks(seq, 9) == 2  # 15 tokens: 4 blocks
    pool.may_append(seq, 9)  # k + 1 = 9 speculative slots across two block boundaries
    assert len(seq.block_table) == 4 and seq.kv_token_limit == 15
    seq.num_kv_computed = 8  # only 2 of the 9 were accepted
    pool.trim(seq)
    assert len(seq.block_table) == 2 and pool.num_free_blocks == 14
    pool.check_invariants([seq])
    assert not pool.can_append(seq, 16 * 4)
    pool.free_seq(seq)
    assert pool.num_free_blocks == 16


def test_cached_blocks_add_nothing_for_the_cyclic_gc():
    """A large cache must not be a large heap for Python's cyclic GC to walk on every full
    collection (one object per node cost 123 ms of GC per no-sharing set; see BENCHMARKS)."""
    import gc

    pool = BlockPool(4096, 4)
    seqs = [make_seq(range(1000 * i, 1000 * i + 64)) for i in range(64)]  # 16 blocks each
    gc.collect()
    gc.collect()
    before = len(gc.get_objects())
    for seq in seqs:
        pool.match_prefix(seq)
        pool.may_append(seq, seq.num_tokens)
        seq.num_kv_computed = seq.num_tokens
        pool.commit(seq)
        pool.free_seq(seq)
    assert len(pool.trie.nodes) == 64 * 16
    seqs = seq = None
    gc.collect()
    gc.collect()  # a tuple is untracked once the tuples inside it are
    assert len(gc.get_objects()) - before < 50  # not one (or three) per cached block
