"""CUDA graphs for decode batches: one graph per padded batch size, captured once at start-up.

A decode step of a small model is a few hundred tiny kernel launches; replaying them as one graph
removes the launch gaps. Inputs live in static buffers that each step overwrites; padded rows
write their KV into a scratch block (the last block of the cache, never handed out by the pool)
and attend to it only, so they cannot disturb real sequences. `query_len` > 1 captures the
speculative verify step: every row runs its last token plus k drafts (k + 1 queries).
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
                 block_size: int, query_len: int = 1, pool=None) -> None:  # fmt: skip
        dev = next(model.parameters()).device
        self.model = model
        self.query_len = q = query_len
        self.sizes = graph_batch_sizes(max_num_seqs)
        n = self.sizes[-1]
        self.scratch_slot = scratch_block * block_size
        self.input_ids = torch.zeros(n * q, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n * q, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n * q,), self.scratch_slot, dtype=torch.long, device=dev)
        self.context_lens = torch.full((n,), q, dtype=torch.int32, device=dev)
        # Every tensor a graph reads must outlive it: a per-capture arange would be freed and
        # its memory handed to other tensors while the graph still reads that address.
        self.cu_seqlens_q = torch.arange(0, n * q + 1, q, dtype=torch.int32, device=dev)
        self.block_tables = torch.full(
            (n, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=dev
        )
        self.max_num_seqs = max_num_seqs
        self.num_kv_heads = next(
            m.num_kv_heads for m in model.modules() if hasattr(m, "num_kv_heads")
        )
        self.max_len = max_blocks_per_seq * block_size
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_replays = 0
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bs -> (hidden, logits)
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
            md = self._metadata(bs)
            with forward_context(md):
                self._run(bs)  # warm-up: Triton compiles and autotunes outside the capture
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bs] = self._run(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
        self.pool = pool  # shared with the next capture (verify graphs reuse this memory)

    def _metadata(self, bs: int) -> AttentionMetadata:
        q, dev = self.query_len, self.input_ids.device
        decode = q == 1
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[: bs * q],
            block_tables=self.block_tables[:bs],
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            context_lens=self.context_lens[:bs],
            query_lens_cpu=[q] * bs,
            context_lens_cpu=[],  # unknown at capture: the kernels read the device copy
            max_context_len=0,  # unknown at capture: kernels size splits by the table width
            is_decode_only=decode,
            num_splits=decode_num_splits(bs, self.max_num_seqs, self.num_kv_heads, self.max_len,
                                         dev) if decode else None,
        )  # fmt: skip

    def _run(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = bs * self.query_len
        hidden = self.model(self.input_ids[:n], self.positions[:n])
        return hidden, self.model.compute_logits(hidden)

    def capture_drafts(self, draft_tokens) -> None:
        """Capture `draft_tokens` (the runner's MTP drafting) per padded batch size, reading this
        graph set's static inputs and outputs, so a verify step drafts without eager launches.
        Padded rows own no KV slots (limit 0): their chained drafts write the scratch slot."""
        n, q, dev = self.sizes[-1], self.query_len, self.input_ids.device
        self.next_ids = torch.zeros(n * q, dtype=torch.long, device=dev)
        self.accepted = torch.zeros(n, dtype=torch.long, device=dev)
        self.limits = torch.zeros(n, dtype=torch.long, device=dev)
        self.seg_starts = torch.arange(0, n * q, q, device=dev)
        self.draft_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = self.pool
        for bs in reversed(self.sizes):
            md = self._metadata(bs)

            def run(bs=bs, md=md) -> torch.Tensor:
                chosen = self.seg_starts[:bs] + self.accepted[:bs]
                return draft_tokens(md, self.positions[: bs * q], self.outputs[bs][0],
                                    self.next_ids[: bs * q], chosen, self.block_tables[:bs],
                                    self.limits[:bs], None)  # fmt: skip

            run()  # warm-up outside the capture
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = run()
            pool = graph.pool()
            self.draft_graphs[bs] = (graph, out)
        self.pool = pool

    def draft(self, next_ids, accepted, limits) -> torch.Tensor:
        """Replay the drafting graph of the last `run`'s batch: (B, k) drafts."""
        b, q = accepted.shape[0], self.query_len
        bs = next(s for s in self.sizes if s >= b)
        self.next_ids[: b * q].copy_(next_ids)
        self.next_ids[b * q : bs * q].zero_()
        self.accepted[:b].copy_(accepted)
        self.accepted[b:bs].zero_()
        self.limits[:b].copy_(limits)
        self.limits[b:bs].zero_()
        graph, out = self.draft_graphs[bs]
        graph.replay()
        return out[:b]

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def run(self, input_ids, positions, slot_mapping, context_lens, block_tables
            ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Inputs are device tensors of the real batch (B rows of query_len tokens); returns
        hidden (B * query_len, H) and logits (B * query_len, V)."""
        b, q = context_lens.shape[0], self.query_len
        bs = next(s for s in self.sizes if s >= b)
        self.input_ids[: b * q].copy_(input_ids)
        self.positions[: b * q].copy_(positions)
        self.slot_mapping[: b * q].copy_(slot_mapping)
        self.slot_mapping[b * q : bs * q].fill_(self.scratch_slot)
        self.context_lens[:b].copy_(context_lens)
        self.context_lens[b:bs].fill_(q)
        # Columns past `width` and padded rows may hold stale ids: only read (never written)
        # and only up to context_lens, so they are harmless.
        self.block_tables[:b, : block_tables.shape[1]].copy_(block_tables)
        self.graphs[bs].replay()
        self.num_replays += 1
        hidden, logits = self.outputs[bs]
        return hidden[: b * q], logits[: b * q]
