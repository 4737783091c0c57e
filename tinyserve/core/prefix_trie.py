"""Block-granular prefix trie: which KV blocks hold which committed token prefixes.

A node is one full block, named by its block id (ROOT = -1 is the empty prefix). Its key is the
block's token ids plus extra keys (the request's `cache_salt`, content hashes of media spans
overlapping the block), so tenants and images never share KV by accident. Children are found
through a hash of the key, but a hit is always verified on the key itself (token ids compared),
so a hash collision can never share KV. The trie holds no references: a node whose block no
sequence references is evictable, and only leaves are evicted, least recently used first.

A match walks the chain block by block, except where a recent match had the same first block:
its chain is taken after one comparison of the token lists and a check that each of its nodes
is still the one recorded (an evicted or reused block fails it). Requests sharing a system
prompt are admitted at a fraction of the walk's host time.

The trie is flat maps from ints to ints and tuples, not one object per node: a cache of
hundreds of thousands of blocks would otherwise be that many container objects for Python's
cyclic GC to walk (10x the GC time of a cache-off run). No tensors here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

ROOT = -1
RECALL_CHAINS, RECALL_BLOCKS = 64, 512  # remembered chains, and blocks of each (see _remember)


def hash_key(token_ids: tuple[int, ...], extra: tuple) -> int:
    """Narrows the search only; tests monkeypatch it to force collisions."""
    return hash((token_ids, extra))


class PrefixTrie:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # block id -> (parent block id, key hash, token ids, extra): the cached blocks.
        self.nodes: dict[int, tuple[int, int, tuple[int, ...], tuple]] = {}
        # (parent block id, key hash) -> child block id, or a list of them on a hash collision.
        self.children: dict[tuple[int, int], int | list[int]] = {}
        self.num_children: dict[int, int] = {}  # block id -> cached children (0: a leaf)
        # Unreferenced cached blocks, least recently used first (the eviction order).
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        # Recent matched chains by their first block's key hash: (block ids, their node
        # entries, the token ids they hold).
        self.recent: OrderedDict[int, tuple[list[int], list[tuple], list[int]]] = OrderedDict()

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.nodes

    @property
    def num_evictable(self) -> int:
        return len(self.evictable)

    def _find(self, parent: int, key_hash: int, token_ids: tuple, extra: tuple) -> int | None:
        found = self.children.get((parent, key_hash))
        for child in (found,) if isinstance(found, int) else found or ():
            _, _, ids, ext = self.nodes[child]
            if ids == token_ids and ext == extra:  # verify, never trust a hash
                return child
        return None

    def match(self, token_ids: list[int], extra_of: Callable[[int], tuple] | None) -> list[int]:
        """Block ids of the longest chain of cached full blocks that prefixes `token_ids`;
        `extra_of(i)` is block i's extra key (asked only up to the first miss; None: no block
        has one). An admission matches a whole prompt (128 blocks for 2k tokens), so the
        common case (one child under the hash, no extra key) is inlined."""
        bs, node, path = self.block_size, ROOT, []
        children, nodes = self.children, self.nodes
        if extra_of is None and len(token_ids) >= 2 * bs:
            path = self._recall(token_ids)
            node = path[-1] if path else ROOT
        recalled = len(path)
        for i in range(recalled, len(token_ids) // bs):
            key = tuple(token_ids[i * bs : (i + 1) * bs])
            extra = extra_of(i) if extra_of is not None else ()
            key_hash = hash_key(key, extra)
            child = children.get((node, key_hash))
            if type(child) is int:
                _, _, ids, ext = nodes[child]
                if ids != key or ext != extra:  # verify, never trust a hash
                    break
            else:  # none, or a list after a hash collision
                child = self._find(node, key_hash, key, extra)
                if child is None:
                    break
            path.append(child)
            node = child
        if extra_of is None and len(path) > max(recalled, 1):  # a longer chain than recalled
            self._remember(token_ids, path)
        return path

    def _recall(self, token_ids: list[int]) -> list[int]:
        """The chain of a recent match that prefixes `token_ids`, if all of it is still cached
        as it was (a block evicted, or reused for other tokens, fails the node comparison)."""
        key_hash = hash_key(tuple(token_ids[: self.block_size]), ())
        entry = self.recent.get(key_hash)
        if entry is None:
            return []
        path, entries, tokens = entry
        nodes = self.nodes
        if token_ids[: len(tokens)] != tokens or [nodes.get(b) for b in path] != entries:
            return []
        self.recent.move_to_end(key_hash)
        return path.copy()

    def _remember(self, token_ids: list[int], path: list[int]) -> None:
        """Keep the chain's first RECALL_BLOCKS blocks (a 100k-token prompt's whole chain would
        hold its token list here), for the RECALL_CHAINS most recent first blocks."""
        path = path[:RECALL_BLOCKS]
        key_hash = self.nodes[path[0]][1]
        self.recent[key_hash] = (
            path,
            [self.nodes[b] for b in path],
            token_ids[: len(path) * self.block_size],
        )
        self.recent.move_to_end(key_hash)
        if len(self.recent) > RECALL_CHAINS:
            self.recent.popitem(last=False)

    def insert(self, parent: int | None, token_ids: list[int], extra: tuple, block_id: int) -> int:
        """Add a committed block under `parent` (None = root); returns the block id that now
        holds this prefix. If an equal block is cached already (another sequence computed the
        same prefix), that one is returned: the caller's block stays private and is freed
        normally."""
        parent = ROOT if parent is None else parent
        key = tuple(token_ids)
        key_hash = hash_key(key, extra)
        slot = (parent, key_hash)
        other = self.children.get(slot)
        if other is not None and (found := self._find(parent, key_hash, key, extra)) is not None:
            return found
        assert block_id not in self.nodes, f"block {block_id} cached twice"
        self.nodes[block_id] = (parent, key_hash, key, extra)
        if other is None:
            self.children[slot] = block_id
        elif isinstance(other, int):
            self.children[slot] = [other, block_id]
        else:
            other.append(block_id)
        self.num_children[parent] = self.num_children.get(parent, 0) + 1
        return block_id

    def on_unreferenced(self, block_id: int) -> bool:
        """The pool dropped the last reference: keep a cached block as evictable (True)."""
        if block_id not in self.nodes:
            return False
        self.evictable[block_id] = None  # most recently used: evicted last
        return True

    def on_referenced(self, block_id: int) -> None:
        self.evictable.pop(block_id, None)

    def evict(self) -> int:
        """Drop the least recently used unreferenced leaf; return its block id."""
        # Least recently used first. A freed sequence's tail goes in first, so the first entry
        # is almost always a leaf (a parent has an entry in num_children).
        for block_id in self.evictable:
            if block_id not in self.num_children:
                break
        else:
            raise AssertionError("no evictable leaf")  # an unreferenced subtree has leaves
        del self.evictable[block_id]
        parent, key_hash, _, _ = self.nodes.pop(block_id)
        slot = (parent, key_hash)
        siblings = self.children[slot]
        if isinstance(siblings, int):
            del self.children[slot]
        else:
            siblings.remove(block_id)
            if len(siblings) == 1:
                self.children[slot] = siblings[0]
        left = self.num_children[parent] - 1
        if left:
            self.num_children[parent] = left
        else:
            del self.num_children[parent]
        return block_id

    def check_invariants(self, ref_counts: list[int]) -> None:
        counts: dict[int, int] = {}
        for block_id, (parent, key_hash, ids, extra) in self.nodes.items():
            assert parent == ROOT or parent in self.nodes, f"block {block_id}: parent evicted"
            assert len(ids) == self.block_size and hash_key(ids, extra) == key_hash
            found = self.children[(parent, key_hash)]
            assert block_id == found or (isinstance(found, list) and block_id in found)
            counts[parent] = counts.get(parent, 0) + 1
        assert counts == self.num_children, "child counts disagree with the nodes"
        listed = [c for v in self.children.values() for c in ([v] if isinstance(v, int) else v)]
        assert sorted(listed) == sorted(self.nodes), "children map and nodes disagree"
        for block_id in self.nodes:
            unreferenced = ref_counts[block_id] == 0
            assert unreferenced == (block_id in self.evictable), f"block {block_id} misfiled"
