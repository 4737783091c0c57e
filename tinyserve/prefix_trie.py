"""Block-granular prefix trie: which KV blocks hold which committed token prefixes.

A node is one full block. Its key is the block's token ids plus extra keys (the request's
`cache_salt`, content hashes of media spans overlapping the block), so tenants and images never
share KV by accident. Children are found through a hash of the key, but a hit is always verified
on the key itself (token ids compared), so a hash collision can never share KV. The trie holds no
references: a node whose block no sequence references is evictable, and only leaves are evicted,
least recently used first. No tensors here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field


def hash_key(token_ids: tuple[int, ...], extra: tuple) -> int:
    """Narrows the search only; tests monkeypatch it to force collisions."""
    return hash((token_ids, extra))


@dataclass(slots=True, eq=False)
class Node:
    token_ids: tuple[int, ...]
    extra: tuple
    block_id: int
    parent: Node | None
    key_hash: int  # hash_key(token_ids, extra), kept so eviction need not hash again
    children: dict[int, list[Node]] = field(default_factory=dict)  # hash -> nodes (collisions)

    def find(self, key_hash: int, token_ids: tuple[int, ...], extra: tuple) -> Node | None:
        for node in self.children.get(key_hash, ()):
            if node.token_ids == token_ids and node.extra == extra:  # verify, never trust a hash
                return node
        return None


class PrefixTrie:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.root = Node((), (), -1, None, 0)
        self.nodes: dict[int, Node] = {}  # block id -> node, for every cached block
        # Unreferenced cached blocks, least recently used first (the eviction order).
        self.evictable: OrderedDict[int, Node] = OrderedDict()
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.nodes

    @property
    def num_evictable(self) -> int:
        return len(self.evictable)

    def match(self, token_ids: list[int], extra_of: Callable[[int], tuple]) -> list[Node]:
        """Longest chain of cached full blocks that prefixes `token_ids`; `extra_of(i)` is block
        i's extra key (asked only up to the first miss)."""
        bs, node, path = self.block_size, self.root, []
        for i in range(len(token_ids) // bs):
            key, extra = tuple(token_ids[i * bs : (i + 1) * bs]), extra_of(i)
            child = node.find(hash_key(key, extra), key, extra)
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def insert(
        self, parent: Node | None, token_ids: list[int], extra: tuple, block_id: int
    ) -> Node:
        """Add a committed block under `parent` (None = root). If an equal block is cached
        already (another sequence computed the same prefix), return that node instead: the
        caller's block stays private and is freed normally."""
        parent = parent or self.root
        key = tuple(token_ids)
        key_hash = hash_key(key, extra)
        node = parent.find(key_hash, key, extra)
        if node is not None:
            return node
        assert block_id not in self.nodes, f"block {block_id} cached twice"
        node = Node(key, extra, block_id, parent, key_hash)
        parent.children.setdefault(key_hash, []).append(node)
        self.nodes[block_id] = node
        return node

    def on_unreferenced(self, block_id: int) -> bool:
        """The pool dropped the last reference: keep a cached block as evictable (True)."""
        node = self.nodes.get(block_id)
        if node is None:
            return False
        self.evictable[block_id] = node  # most recently used: evicted last
        return True

    def on_referenced(self, block_id: int) -> None:
        self.evictable.pop(block_id, None)

    def evict(self) -> int:
        """Drop the least recently used unreferenced leaf; return its block id."""
        block_id, node = next((b, n) for b, n in self.evictable.items() if not n.children)
        del self.evictable[block_id]
        del self.nodes[block_id]
        siblings = node.parent.children[node.key_hash]
        siblings.remove(node)
        if not siblings:
            del node.parent.children[node.key_hash]
        return block_id

    def check_invariants(self, ref_counts: list[int]) -> None:
        seen = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for group in node.children.values():
                for child in group:
                    assert child.parent is node and self.nodes[child.block_id] is child
                    assert len(child.token_ids) == self.block_size
                    stack.append(child)
                    seen += 1
        assert seen == len(self.nodes), "trie map and tree disagree"
        for block_id in self.nodes:
            unreferenced = ref_counts[block_id] == 0
            assert unreferenced == (block_id in self.evictable), f"block {block_id} misfiled"
