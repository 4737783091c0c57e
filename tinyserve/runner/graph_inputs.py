"""The static inputs of a graph set (`graphs.DecodeGraphs`): one int64 buffer that a step's host
inputs reach in a single host-to-device copy, its layout per padded size, the block tables, and
the host-side staging of a step into them. A graph reads its inputs only from these tensors, so
every replay finds them at the addresses it was captured with."""

from __future__ import annotations

import numpy as np
import torch

from tinyserve.runner.graph_shapes import round_up
from tinyserve.sample.transfer import host_array


class GraphInputs:
    """Mixed into DecodeGraphs, which sets sizes, query_len, prefill, mixed and scratch_slot
    before calling `_init_inputs`."""

    def _init_inputs(
        self, max_blocks_per_seq: int, scratch_block: int, max_chunk: int, share, dev
    ) -> None:
        n, q = self.sizes[-1], self.query_len
        # One int64 buffer: the last step's sampled ids (n * q), then a replay's inputs, laid
        # out per padded size bs (m tokens, s sequences; `_layout`): ids (m), gather index (m),
        # positions (m), slots (m), logits rows (s; prefill and mixed), context lengths (s
        # int32s), query starts (s + 1 int32s; mixed). The graph's input ids are
        # buffer[gather]: a host-known id points at its own entry, a token still on the device
        # at the previous step's sampled row. A decode set that mixed graphs share (max_chunk:
        # their longest chunk) holds their layouts too.
        # A verify set's step also brings its speculative bookkeeping in the same copy, right
        # after the size's inputs (`run`'s `extra`: the drafts, KV limits and the overlapped
        # loop's shift entries, up to 7 q + 1 words a row, each array 16-byte aligned).
        self.extra_words = 0 if self.prefill or self.mixed or q == 1 else (7 * q + 1) * n + 2 * 9
        if share is not None:
            self.base, self.buffer = share.base, share.buffer
            self.block_tables = share.block_tables
        else:
            self.base = n * q
            size = max(self._layout(n)[2], self._layout(n, max_chunk)[2] if max_chunk else 0)
            size += self.extra_words
            self.buffer = torch.zeros(self.base + size, dtype=torch.long, device=dev)
            self.block_tables = torch.full(
                (n + 1, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=dev
            )
        self.last_sampled = self.buffer[: self.base]

    def _layout(self, bs: int, chunk: int | None = None) -> tuple[int, int, int]:
        """(tokens, sequences, int64 entries) of padded size bs; `chunk`: a mixed layout's."""
        if chunk is None:
            chunk = self.query_len if self.mixed else 0
        m, seqs = (bs + chunk, bs + 1) if chunk else (bs * self.query_len, bs)
        return m, seqs, 4 * m + seqs + -(-seqs // 2) + (-(-(seqs + 1) // 2) if chunk else 0)

    def _extra_offsets(self, bs: int, sizes: list[int]) -> tuple[list[int], int]:
        """Buffer offsets of `extra` arrays of these sizes after size bs's inputs, and the end."""
        start = self.base + self._layout(bs)[2]
        offsets, end = [], start + (start % 2 if sizes else 0)
        for n in sizes:
            offsets.append(end)
            end += -(-n // 2) * 2  # 16-byte aligned, as a fresh allocation (Triton specializes)
        assert end - start <= self.extra_words, "extra too large"
        return offsets, end

    def extra_views(self, num_seqs: int, sizes: list[int]) -> list[torch.Tensor]:
        """Device views of the `extra` arrays a `run` of num_seqs rows copies (sizes as given)."""
        offsets, _ = self._extra_offsets(round_up(self.sizes, num_seqs), sizes)
        return [self.buffer[o : o + n] for o, n in zip(offsets, sizes)]

    def fields(self, bs: int) -> list[torch.Tensor]:
        """Views of the buffer for padded size bs: ids, gather, positions, slots, logits rows
        (int64), then the context lengths and (mixed) the query starts as int32 (the kernels'
        dtype: no conversion)."""
        m, seqs, size = self._layout(bs)
        start = self.base
        fields = list(self.buffer[start : start + 4 * m + seqs].split([m, m, m, m, seqs]))
        start += 4 * m + seqs
        ctx = self.buffer[start : start + -(-seqs // 2)].view(torch.int32)[:seqs]
        cu = self.buffer[start + -(-seqs // 2) : self.base + size].view(torch.int32)[: seqs + 1]
        return fields + [ctx, cu]

    def _stage(
        self,
        bs: int,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        host_ctx: list[int],
        tables: np.ndarray,
        pending: tuple[list[int], list[int]],
        extra,
        pin: bool,
    ) -> np.ndarray:
        """Copy a decode, verify or prefill step (B rows, `host_ctx` their context lengths) into
        size bs's inputs, `extra` after them, and the block tables. Returns the context lengths
        as copied (int32; padded rows: query_len)."""
        b, q = len(host_ctx), self.query_len
        m, n = bs * q, len(input_ids)
        size = self._layout(bs)[2]
        offsets, end = self._extra_offsets(bs, [len(e) for e in extra])
        host = torch.empty(end - self.base, dtype=torch.long, pin_memory=pin)
        a = host.numpy()
        for e, o in zip(extra, offsets):
            a[o - self.base : o - self.base + len(e)] = e
        a[:n], a[n:m] = input_ids, 0
        a[m : 2 * m] = np.arange(self.base, self.base + m)
        a[m + np.asarray(pending[0], dtype=np.int64)] = pending[1]
        a[2 * m : 2 * m + n], a[2 * m + n : 3 * m] = positions, 0
        a[3 * m : 3 * m + n], a[3 * m + n : 4 * m] = slots, self.scratch_slot
        a[4 * m : 4 * m + bs] = n - 1  # the logits row of a prefill graph
        ctx = a[4 * m + bs : size].view(np.int32)
        ctx[:b], ctx[b:] = host_ctx, q
        self.buffer[self.base : end].copy_(host, non_blocking=True)
        # Columns past the width and padded rows may hold stale ids: only read (never written)
        # and only up to context_lens, so they are harmless.
        host_tables = host_array(tables, torch.int32, pin)
        self.block_tables[:b, : tables.shape[1]].copy_(host_tables, non_blocking=True)
        return ctx

    def _stage_mixed(
        self,
        bs: int,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        context_lens: list[int],
        tables: np.ndarray,
        pending: tuple[list[int], list[int]],
        pin: bool,
    ) -> np.ndarray:
        """Copy a mixed step (d decode rows, then one chunk of c tokens: the batch's last row)
        into size bs's inputs and the block tables. Returns the context lengths as copied
        (int32, bs + 1: the decode rows padded, then the chunk's)."""
        d, q = len(context_lens) - 1, self.query_len
        m, seqs, size = self._layout(bs)
        c = len(input_ids) - d
        at = np.r_[np.arange(d), np.arange(bs, bs + c)]  # host token i -> its buffer slot
        host = torch.zeros(size, dtype=torch.long, pin_memory=pin)
        a = host.numpy()
        ids, gather, pos, slot = (a[i * m : (i + 1) * m] for i in range(4))
        ids[at] = input_ids
        gather[:] = np.arange(self.base, self.base + m)
        gather[at[np.asarray(pending[0], dtype=np.int64)]] = pending[1]
        pos[at] = positions
        slot[:] = self.scratch_slot
        slot[at] = slots
        rows = a[4 * m : 4 * m + seqs]
        rows[:d], rows[d] = np.arange(d), bs + c - 1  # the sampled rows first; then token 0
        ctx = a[4 * m + seqs :].view(np.int32)
        ctx[:d], ctx[d:bs] = context_lens[:d], 1
        ctx[bs] = context_lens[d] + q - c  # padding goes after the chunk
        cu = ctx[-(-seqs // 2) * 2 :][: seqs + 1]
        cu[: bs + 1], cu[bs + 1] = np.arange(bs + 1), bs + q
        self.buffer[self.base : self.base + len(a)].copy_(host, non_blocking=True)
        host_tables = host_array(tables, torch.int32, pin)
        w = tables.shape[1]
        self.block_tables[:d, :w].copy_(host_tables[:d], non_blocking=True)
        self.block_tables[bs, :w].copy_(host_tables[d], non_blocking=True)
        return ctx[:seqs]
