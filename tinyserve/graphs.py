"""CUDA graphs for decode batches: one graph per padded batch size, captured once at start-up.

A decode step of a small model is a few hundred tiny kernel launches; replaying them as one graph
removes the launch gaps. Inputs live in static buffers that each step overwrites; padded rows
write their KV into a scratch block (the last block of the cache, never handed out by the pool)
and attend to that one slot, so they cannot disturb real sequences.
"""

from __future__ import annotations

import torch

from tinyserve.layers.attention import AttentionMetadata, forward_context


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    return sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})


def padded_size(num_seqs: int, max_num_seqs: int) -> int:
    return next((s for s in graph_batch_sizes(max_num_seqs) if s >= num_seqs), num_seqs)


def decode_num_splits(num_seqs: int, max_num_seqs: int, num_kv_heads: int, max_len: int,
                      device: torch.device) -> int:  # fmt: skip
    """Split count of a decode step, a function of the padded batch size only."""
    from tinyserve.kernels.decode_attention import default_num_splits

    return default_num_splits(padded_size(num_seqs, max_num_seqs), num_kv_heads, max_len, device)


class DecodeGraphs:
    def __init__(self, model, max_num_seqs: int, max_blocks_per_seq: int, scratch_block: int,
                 block_size: int) -> None:  # fmt: skip
        dev = next(model.parameters()).device
        self.model = model
        self.sizes = graph_batch_sizes(max_num_seqs)
        n = self.sizes[-1]
        self.scratch_slot = scratch_block * block_size
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.long, device=dev)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.full(
            (n, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=dev
        )
        self.max_num_seqs = max_num_seqs
        self.num_kv_heads = next(
            m.num_kv_heads for m in model.modules() if hasattr(m, "num_kv_heads")
        )
        self.max_len = max_blocks_per_seq * block_size
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        pool = None
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
            md = self._metadata(bs)
            with forward_context(md):
                self._run(bs)  # warm-up: Triton compiles and autotunes outside the capture
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[bs] = self._run(bs)
            pool = graph.pool()
            self.graphs[bs] = graph

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs],
            cu_seqlens_q=torch.arange(bs + 1, dtype=torch.int32, device=self.input_ids.device),
            context_lens=self.context_lens[:bs],
            query_lens_cpu=[1] * bs,
            context_lens_cpu=[],  # unknown at capture: the decode kernel reads the device copy
            max_context_len=0,  # unknown at capture: kernels size splits by the table width
            is_decode_only=True,
            num_splits=decode_num_splits(bs, self.max_num_seqs, self.num_kv_heads, self.max_len,
                                         self.input_ids.device),
        )  # fmt: skip

    def _run(self, bs: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs])
        return self.model.compute_logits(hidden)

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def run(self, input_ids, positions, slot_mapping, context_lens, block_tables) -> torch.Tensor:
        """Inputs are device tensors of the real batch (B rows); returns logits (B, V)."""
        b = input_ids.shape[0]
        bs = next(s for s in self.sizes if s >= b)
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(slot_mapping)
        self.slot_mapping[b:bs].fill_(self.scratch_slot)
        self.context_lens[:b].copy_(context_lens)
        self.context_lens[b:bs].fill_(1)
        # Columns past `width` and padded rows may hold stale ids: only read (never written)
        # and only up to context_lens, so they are harmless.
        self.block_tables[:b, : block_tables.shape[1]].copy_(block_tables)
        self.graphs[bs].replay()
        return self.logits[bs][:b]
