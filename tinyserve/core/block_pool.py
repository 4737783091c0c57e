"""Paged KV blocks: a free list, reference counts, per-sequence block tables, and the prefix trie.

A block is in exactly one state: free (refcount 0, in `free_ids`), cached (refcount 0, in the
trie, evictable) or used (refcount >= 1, possibly also cached). Allocation takes free blocks
first, then evicts cached leaves. Refcounts count sequences only; the trie holds no references.
A block enters the trie only when committed: full, every token id final and its KV written.
The pool never touches tensors, and nothing here assumes that every model layer stores paged KV.

Hybrid models (`states`, core/state_pool.py): a match keeps only the blocks up to the deepest one
with a ready state checkpoint, a committed block becomes the node of the checkpoints saved at
its end, and an evicted node drops its checkpoint.
"""

from __future__ import annotations

from collections import deque

from tinyserve.core.prefix_trie import PrefixTrie
from tinyserve.core.sequence import PLACEHOLDER, Sequence
from tinyserve.core.state_pool import StatePool


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        key_next_token: bool = False,
    ):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.trie = PrefixTrie(block_size) if enable_prefix_caching else None
        # With an MTP head, a block's MTP-layer KV at its last position was computed from the
        # token after the block: that token joins the key, so a hit reuses exactly that KV.
        self.key_next_token = key_next_token
        self.states: StatePool | None = None  # hybrid models: checkpoints hang off trie nodes
        # The last match_prefix's restore: the checkpoint to copy (None: none), the matched
        # tokens before clamping to it (the branch point the sequence recomputes up to) and the
        # block they end (None: no block matched).
        self.match_checkpoint: int | None = None
        self.match_branch_tokens = 0
        self.match_branch_block: int | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones plus evictable cached ones."""
        return len(self.free_ids) + (self.trie.num_evictable if self.trie else 0)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, num: int) -> list[int]:
        assert num <= self.num_free_blocks, "caller must check can_append first"
        ids = [self.free_ids.popleft() if self.free_ids else self._evict() for _ in range(num)]
        for i in ids:
            self.ref_counts[i] = 1
        return ids

    def _evict(self) -> int:
        block_id = self.trie.evict()
        if self.states is not None:
            self.states.drop_block(block_id)
        return block_id

    def _ref(self, block_ids: list[int]) -> None:
        refs = self.ref_counts
        for i in block_ids:  # a prefix hit's whole chain: 128 blocks for 2k tokens
            if refs[i] == 0:
                self.trie.on_referenced(i)
            refs[i] += 1

    def free(self, block_ids: list[int]) -> None:
        # Tail blocks first: the deepest (least shareable) cached blocks are evicted first.
        for i in reversed(block_ids):
            assert self.ref_counts[i] > 0, f"double free of block {i}"
            self.ref_counts[i] -= 1
            if self.ref_counts[i] == 0 and not (self.trie and self.trie.on_unreferenced(i)):
                self.free_ids.append(i)

    # -- per-sequence operations --------------------------------------------------------------

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` still needs so that KV for `num_new_tokens` more tokens has slots."""
        needed = self.num_blocks_for(seq.num_kv_computed + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def may_append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Allocate every block that `num_new_tokens` more tokens cross (n = k + 1 for spec)."""
        num = self.num_new_blocks(seq, num_new_tokens)
        if num:
            seq.block_table.extend(self.allocate(num))
        # Never lower: the overlapped speculative loop may still write slots a step in flight
        # reserved (its own `trim` waits until no step is in flight).
        seq.kv_token_limit = max(seq.kv_token_limit, seq.num_kv_computed + num_new_tokens)

    def trim(self, seq: Sequence) -> None:
        """Release lookahead blocks beyond the computed KV (e.g. rejected speculative slots)."""
        keep = self.num_blocks_for(seq.num_kv_computed)
        if len(seq.block_table) > keep:
            self.free(seq.block_table[keep:])
            del seq.block_table[keep:]
        seq.kv_token_limit = seq.num_kv_computed

    def free_seq(self, seq: Sequence) -> None:
        self.free(seq.block_table)
        seq.block_table = []
        seq.kv_token_limit = 0
        seq.num_committed_blocks = 0
        seq.trie_node = None

    # -- prefix caching -----------------------------------------------------------------------

    def has_extra_keys(self, seq: Sequence) -> bool:
        """False in the common case (no cache salt, no media, no MTP head): every block's extra
        key is (), and commits and matches skip `block_extra` per block."""
        return bool(seq.mm_spans or self.key_next_token or seq.cache_salt)

    def block_extra(self, seq: Sequence, i: int) -> tuple:
        """Extra key of block i: the cache salt (first block only: it isolates the whole
        subtree) and the content hashes of media spans overlapping the block."""
        lo, hi = i * self.block_size, (i + 1) * self.block_size
        media = tuple(h for start, end, h in seq.mm_spans if start < hi and end > lo)
        nxt = (seq.token_ids[hi],) if self.key_next_token else ()
        return ((seq.cache_salt,) if i == 0 and seq.cache_salt else ()) + media + nxt

    def match_prefix(self, seq: Sequence) -> int:
        """Tentatively reuse cached blocks for a sequence with no KV; returns matched tokens.

        The last token is never matched (its logits are needed), and a match never ends inside
        a media span. Undo with `free_seq` if admission then fails: refs and cursor go back.
        """
        assert not seq.block_table and seq.num_kv_computed == 0
        if self.trie is None:
            return 0
        bs = self.block_size
        tokens = seq.token_ids[: seq.num_tokens - 1]
        extra_of = (lambda i: self.block_extra(seq, i)) if self.has_extra_keys(seq) else None
        path = self.trie.match(tokens, extra_of)
        num = len(path)
        while num and any(s < num * bs < e for s, e, _ in seq.mm_spans):
            num -= 1
        self.match_checkpoint, self.match_branch_tokens = None, num * bs
        self.match_branch_block = path[num - 1] if num else None
        if self.states is not None:  # resume only where an exact state is kept
            num = self.states.restore_point(path[:num])
            if num:
                self.match_checkpoint = self.states.checkpoint_of[path[num - 1]]
        seq.block_table = path[:num]
        self._ref(seq.block_table)
        seq.num_kv_computed = seq.kv_token_limit = num * bs
        seq.num_committed_blocks = num
        seq.trie_node = path[num - 1] if num else None
        return num * bs

    def commit(self, seq: Sequence) -> None:
        """Insert the sequence's newly completed blocks (KV written, token ids final)."""
        if self.trie is None:
            return
        bs = self.block_size
        end = seq.num_kv_computed
        if self.key_next_token:  # keys hold the token after the block: known ones only
            end = min(end, len(seq.token_ids) - 1 - (seq.token_ids[-1] == PLACEHOLDER))
        keyed = self.has_extra_keys(seq)
        for i in range(seq.num_committed_blocks, end // bs):
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            own = seq.block_table[i]
            extra = self.block_extra(seq, i) if keyed else ()
            node = self.trie.insert(seq.trie_node, tokens, extra, own)
            if node != own:
                # An equal block was committed first (same prefix computed concurrently): share
                # it and drop our copy, so this sequence's cursor always stays referenced.
                self._ref([node])
                self.free([own])
                seq.block_table[i] = node
            seq.trie_node = node
        seq.num_committed_blocks = max(seq.num_committed_blocks, end // bs)
        if self.states is not None and seq.seq_id in self.states.pending:
            done = seq.num_committed_blocks * bs
            for position, ck in list(self.states.pending_of(seq.seq_id)):
                if position <= done:  # its last block is a trie node now
                    self.states.attach(seq.seq_id, ck, seq.block_table[position // bs - 1])

    def check_invariants(self, seqs: list[Sequence] = ()) -> None:
        """Refcounts equal the live block tables holding each block; every block in one state."""
        expected = [0] * self.num_blocks
        for seq in seqs:
            assert len(set(seq.block_table)) == len(seq.block_table), "block listed twice"
            assert len(seq.block_table) == self.num_blocks_for(seq.kv_token_limit)
            assert seq.num_kv_computed <= seq.kv_token_limit
            for i in seq.block_table:
                expected[i] += 1
        assert expected == self.ref_counts, "refcounts disagree with block tables"
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), "block freed twice"
        cached = set(self.trie.nodes) if self.trie else set()
        assert not free & cached, "a cached block is also free"
        unreferenced = {i for i, r in enumerate(self.ref_counts) if r == 0}
        assert free | (cached & unreferenced) == unreferenced, "a block leaked"
        if self.trie:
            self.trie.check_invariants(self.ref_counts)
