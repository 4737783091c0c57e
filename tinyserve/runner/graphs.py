"""CUDA graphs for decode batches: one graph per padded batch size and decode split count (a
short context takes fewer splits: `graph_shapes`), captured once at start-up.

A decode step of a small model is a few hundred tiny kernel launches; replaying them as one graph
removes the launch gaps. The step's host work around the replay is kept to two host-to-device
copies and the read-back: every per-token input lives in one static int64 buffer written by a
single copy (`graph_inputs`), the previous step's sampled ids are gathered from that buffer
inside the graph (the overlapped loop's inputs), and the graph ends with the greedy argmax into
the same buffer.

Padded rows write their KV into a scratch block (the last block of the cache, never handed out by
the pool) and attend to it only, so they cannot disturb real sequences. `query_len` > 1 captures
the speculative verify step: every row runs its last token plus k drafts (k + 1 queries, which
the decode kernel attends split-K like a decode row).

With `shared_prefix`, decode batches of 16 or more rows also get a second graph per size whose
attention reads KV blocks that several rows share (prefix-cache hits) once per group of rows
(cascade attention, kernels/decode_attention.py); a step replays it when `plan_shared_prefixes`
finds enough sharing. Its sums run in another order than the plain graph's, so outputs may
differ from it by rounding, as with a different split count.

Hybrid models (`state_scratch`: the scratch state slot, runner/states.py) have decode and verify
graphs: each row's state slot and whether it holds a state are graph inputs (`state_inputs`,
copied per replay); padded rows read zeros and write the scratch slot only. A verify graph's
rows keep the state after each token in the slot `token_state_inputs` names (runner/states.py;
padded rows: -1, not kept), which the runner commits after the replay.
"""

from __future__ import annotations

import numpy as np
import torch

from tinyserve.kernels.prefill_attention import prefill_num_splits
from tinyserve.model.layers.attention import AttentionMetadata, forward_context
from tinyserve.model.layers.cascade import plan_shared_prefixes
from tinyserve.runner import graph_shapes  # split rules, read per call as eager steps read them
from tinyserve.runner.graph_inputs import GraphInputs
from tinyserve.runner.graph_shapes import (
    MIXED_SPLIT_FROM,
    MIXED_SPLITS,
    graph_batch_sizes,
    mixed_batch_sizes,
    round_up,
)
from tinyserve.sample.sampler import greedy

SHARED_MIN_BATCH = 16  # smaller batches keep one graph per size (half the captures)


class DecodeGraphs(GraphInputs):
    """`prefill=True` captures one sequence of up to query_len prompt tokens instead (padded at
    the end; the logits are its last real token's only).

    `mixed=True` captures decode rows beside one prompt chunk of up to query_len tokens (the
    chunk last: a long prompt being chunked while other sequences decode; `share` is the decode
    graph set, whose input buffer, sampled ids and block tables these graphs use, so that the
    steps before and after gather each other's tokens). Tokens: the decode rows padded to the
    size, then the chunk padded at its end; the decode kernel attends the decode rows and the
    prefill kernel the chunk, so neither grid depends on the other. Its logits rows are the
    sampled rows (the decode rows, then the chunk's last token where it samples). Each size has
    graphs for both chunk key-split counts, each at the decode rows' GPU-filling count and, where
    the table allows a long row, at a long row's count (`decode_num_splits`).

    `capture=False` replays by running the same static-buffer forward eagerly: the CPU tests
    drive the runner's graph path with it (there are no CUDA graphs on the CPU)."""

    def __init__(
        self,
        model,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        block_size: int,
        query_len: int = 1,
        pool=None,
        capture: bool = True,
        prefill: bool = False,
        shared_prefix: bool = False,
        mixed: bool = False,
        share: DecodeGraphs | None = None,
        max_chunk: int = 0,
        state_scratch: int | None = None,
    ) -> None:
        dev = next(model.parameters()).device
        self.model = model
        self.query_len = q = query_len
        self.prefill = prefill
        self.mixed = mixed
        if prefill:
            self.sizes = [1]
        else:
            self.sizes = (mixed_batch_sizes if mixed else graph_batch_sizes)(max_num_seqs)
        n = self.sizes[-1]
        self.scratch_slot = scratch_block * block_size
        self._init_inputs(max_blocks_per_seq, scratch_block, max_chunk, share, dev)
        # Hybrid models: (2, n) int32, each row's state slot, then 1 where it holds a state;
        # a verify set's (n q,) slots of each token's state.
        self.state_scratch = state_scratch
        self.state_inputs = self.token_state_inputs = None
        if state_scratch is not None:
            assert not prefill and not mixed, "hybrid models: decode and verify graphs only"
            self.state_inputs = torch.zeros(2, n, dtype=torch.int32, device=dev)
            self.state_inputs[0] = state_scratch
            if q > 1:
                self.token_state_inputs = torch.full((n * q,), -1, dtype=torch.int32, device=dev)
        # Every tensor a graph reads must outlive it: a per-capture arange would be freed and
        # its memory handed to other tensors while the graph still reads that address.
        if mixed:  # the chunk's query starts (the step's are an input of each replay)
            self.chunk_cu = torch.tensor([0, q], dtype=torch.int32, device=dev)
        else:
            self.cu_seqlens_q = torch.arange(0, n * q + 1, q, dtype=torch.int32, device=dev)
        # One logits buffer for every graph of the set (and the mixed sets: up to max_num_seqs
        # rows): each size's own output would keep bs x V float32 alive per graph (~5 GB for
        # sizes up to 512 with a 152k vocabulary).
        if share is not None:
            self.logits = share.logits
        else:
            self.logits = torch.empty(
                1 if prefill else n * q,
                model.lm_head.weight.shape[0],
                dtype=torch.float32,
                device=dev,
            )
        # Verify graphs of one size (one per split count) leave their hidden states here, where
        # the size's one drafting graph (`draft_graphs.py`) reads them.
        w = model.lm_head.weight
        self.hidden = (
            None
            if prefill or mixed or q == 1
            else torch.empty(n * q, w.shape[1], dtype=w.dtype, device=dev)
        )
        self.max_num_seqs = max_num_seqs
        attn = next(m for m in model.modules() if hasattr(m, "num_kv_heads"))
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.dtype = w.dtype
        self.max_len = max_blocks_per_seq * block_size
        self.block_size = block_size
        self.capture = capture
        # Shared-prefix (cascade) graphs: keyed (bs, True) beside the plain (bs, False) ones.
        # Their inputs: one int32 buffer of the shared lengths (n), then the chunks (n / 2 rows
        # of 1 + R; a plan needing more chunks leaves groups out), unused ones all -1.
        from tinyserve.kernels.shared_prefix_attention import shared_prefix_rows

        self.shared_rows = shared_prefix_rows(attn.num_heads, attn.num_kv_heads)
        self.shared_sizes = (
            [s for s in self.sizes if s >= SHARED_MIN_BATCH]
            if (shared_prefix and q == 1 and not prefill and not mixed and self.shared_rows)
            else []
        )
        if self.shared_sizes:
            self.shared_buffer = torch.zeros(
                n + n // 2 * (1 + self.shared_rows), dtype=torch.int32, device=dev
            )
            self.shared_buffer[n:] = -1
        # Keys (bs, shared, splits): decode and verify graphs come in every split count a step
        # of bs rows may pick (`decode_num_splits`, short contexts take fewer), cascade graphs
        # in the full one; prefill graphs have splits None.
        self.graphs: dict[tuple[int, bool, int | None], torch.cuda.CUDAGraph] = {}
        self.num_replays = self.num_shared_replays = 0
        # key -> (hidden, logits) and what the captured graph reads
        self.outputs: dict[tuple[int, bool, int | None], tuple[torch.Tensor, torch.Tensor]] = {}
        self.metadata: dict[tuple[int, bool, int | None], AttentionMetadata] = {}
        self.pool = pool  # shared with the next capture (verify graphs reuse this memory)
        if not capture:
            return
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
            for key in self.keys(bs):
                self._run(*key)  # warm-up: Triton compiles outside the capture
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.outputs[key] = self._run(*key)
                self.pool = graph.pool()
                self.graphs[key] = graph

    def _num_splits(self, bs: int, max_context_len: int | None = None) -> int | None:
        if self.prefill:
            return None
        shape = (bs, self.max_num_seqs, self.num_kv_heads, self.max_len, self.buffer.device)
        return graph_shapes.decode_num_splits(*shape, max_context_len)

    def _tiling(self, bs: int, splits: int | None) -> tuple[int | None, int]:
        if splits is None:  # prefill graphs
            return None, 0
        shape = (bs, self.max_num_seqs, self.num_kv_heads, self.max_len, self.buffer.device)
        return graph_shapes.decode_tiling(*shape, splits)

    def keys(self, bs: int) -> list[tuple[int, bool, int | tuple[int, int] | None]]:
        full, longest = self._num_splits(bs), self._num_splits(bs, self.max_len)
        long = [longest] if full is not None and longest > full else []  # a long row's count
        if self.mixed:  # the third entry: (the decode rows' splits, the chunk's key splits)
            return [(bs, False, (d, c)) for d in [full, *long] for c in (1, MIXED_SPLITS)]
        keys = [(bs, False, full)]
        if full is not None:
            keys += [(bs, False, 1 << i) for i in range(full.bit_length() - 1)]
        keys += [(bs, False, s) for s in long]
        return keys + [(bs, True, full)] * (bs in self.shared_sizes)

    def _run(
        self,
        bs: int,
        shared: bool,
        splits: int | tuple[int, int] | None,
        host_ctx: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured forward; `host_ctx`: the context lengths on the host, which only an
        eager replay (capture=False) can use (the CPU attention needs them)."""
        _, gather, positions, slots, rows, ctx, cu = self.fields(bs)
        if self.mixed:
            md = self._mixed_metadata(bs, splits, slots, ctx, cu, host_ctx or [])
        else:
            md = self._metadata(bs, shared, splits, slots, ctx, host_ctx or [])
        self.metadata[bs, shared, splits] = md
        # A verify set's hidden states go where its drafting graph reads them (no copy).
        out = None if self.hidden is None else self.hidden[: len(gather)]
        with forward_context(md):
            hidden = self.model(self.buffer[gather], positions, out)
        last = hidden.index_select(0, rows) if self.prefill or self.mixed else hidden
        logits = self.model.compute_logits(last, out=self.logits[: last.shape[0]])
        # The greedy tokens, where the next step's gather finds them (it reads them before
        # this write: the gather is the replay's first kernel).
        greedy(logits, out=self.last_sampled[: logits.shape[0]])
        return hidden, logits

    def _metadata(
        self,
        bs: int,
        shared: bool,
        splits: int | None,
        slots: torch.Tensor,
        ctx: torch.Tensor,
        host_ctx: list[int],
    ) -> AttentionMetadata:
        decode = self.query_len == 1
        if shared:
            n = self.sizes[-1]
            lens = self.shared_buffer[:bs]
            chunks = self.shared_buffer[n:].view(n // 2, 1 + self.shared_rows)[: bs // 2]
        block_n, min_split = self._tiling(bs, splits)
        return AttentionMetadata(
            slot_mapping=slots,
            block_tables=self.block_tables[:bs],
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            context_lens=ctx,
            query_lens_cpu=[self.query_len] * bs,
            context_lens_cpu=host_ctx,  # [] at capture: kernels read the device copy
            max_context_len=0,  # unknown at capture: kernels size splits by the table width
            is_decode_only=decode,
            verify_query_len=0 if decode or self.prefill else self.query_len,
            num_splits=splits,
            decode_block_n=block_n,
            decode_min_split=min_split,
            shared_prefix=(chunks, lens) if shared else None,
            state_slots=None if self.state_inputs is None else self.state_inputs[0, :bs],
            has_initial_state=None if self.state_inputs is None else self.state_inputs[1, :bs],
            token_state_slots=(
                None
                if self.token_state_inputs is None
                else self.token_state_inputs[: bs * self.query_len]
            ),
        )

    def _mixed_metadata(
        self,
        bs: int,
        splits: tuple[int, int],
        slots: torch.Tensor,
        ctx: torch.Tensor,
        cu: torch.Tensor,
        host_ctx: list[int],
    ) -> AttentionMetadata:
        """bs decode rows, then the chunk's row (its query starts are the buffer's `cu`)."""
        decode_splits, chunk_splits = splits
        block_n, min_split = self._tiling(bs, decode_splits)
        return AttentionMetadata(
            slot_mapping=slots,
            block_tables=self.block_tables[: bs + 1],
            cu_seqlens_q=cu,
            context_lens=ctx,
            query_lens_cpu=[1] * bs + [self.query_len],
            context_lens_cpu=host_ctx,
            max_context_len=0,
            is_decode_only=False,
            num_splits=decode_splits,
            decode_block_n=block_n,
            decode_min_split=min_split,
            prefill_num_splits=chunk_splits,
            chunk=(bs, self.chunk_cu),
        )

    def _copy_shared_plan(self, tables: np.ndarray, ctx: np.ndarray, bs: int, pin: bool) -> bool:
        """Plan this step's shared prefixes; if worth it, copy the plan to the shared graph's
        inputs (padded rows and unused chunks: none) and say so."""
        plan = plan_shared_prefixes(tables, ctx, self.block_size, self.shared_rows, bs // 2)
        if plan is None:
            return False
        chunks, lens = plan
        n = self.sizes[-1]
        host = torch.empty(n + bs // 2 * (1 + self.shared_rows), dtype=torch.int32, pin_memory=pin)
        a = host.numpy()
        a[: len(lens)], a[len(lens) : n] = lens, 0
        c = a[n:].reshape(bs // 2, 1 + self.shared_rows)
        c[: len(chunks)], c[len(chunks) :] = chunks, -1
        self.shared_buffer[: len(a)].copy_(host, non_blocking=True)
        return True

    def positions(self, num_seqs: int) -> torch.Tensor:
        """The positions the last replay of `num_seqs` rows read (after any `fix`)."""
        return self.fields(round_up(self.sizes, num_seqs))[2]

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        context_lens: list[int],
        tables: np.ndarray,
        pending: tuple[list[int], list[int]] = ((), ()),
        fix=None,
        extra=(),
        states=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Host inputs of the real batch (B rows of query_len tokens, or one prompt chunk of up
        to query_len tokens; `tables` (B, W) int32); `pending` (dst, src): input dst is the
        previous step's sampled row src, which `last_sampled` holds. Returns hidden (one row
        per token) and logits (one row per token, or the chunk's last token's); `last_sampled`
        then holds their greedy tokens. `fix(ids, positions, slots, context_lens, tables)`
        edits the copied inputs on the device before the replay. `extra` (a verify set's):
        int64 arrays copied with the inputs, to where `extra_views` points. `states`: a hybrid
        model's runner/states.HostStates."""
        if self.mixed:
            return self._replay_mixed(input_ids, positions, slots, context_lens, tables, pending)
        b, q = len(context_lens), self.query_len
        bs = round_up(self.sizes, b)
        n = len(input_ids)
        host_ctx = list(context_lens)
        if self.prefill:  # queries are a row's last q positions: padding goes after the chunk
            host_ctx[0] += q - n
        pin = self.buffer.is_cuda  # pinned host memory: the copies are async
        ctx = self._stage(bs, input_ids, positions, slots, host_ctx, tables, pending, extra, pin)
        if self.state_inputs is not None:
            self._stage_states(states, pin)
        if fix is not None:
            ids, _, dev_positions, dev_slots, _, dev_ctx, _ = self.fields(bs)
            fix(ids, dev_positions, dev_slots, dev_ctx, self.block_tables[:bs])
            if not self.capture:  # the CPU attention reads host lengths
                host_ctx = dev_ctx[:b].tolist()
        # A fix only lengthens contexts: a plan on the host's lengths shares no written block.
        shared = bs in self.shared_sizes and self._copy_shared_plan(tables, ctx[:b], bs, pin)
        # Sized by the host's lengths (a fix may lengthen them: any count gives the same result
        # up to rounding), as the eager step's (runner/stage.py step_device_inputs).
        key = (bs, shared, self._num_splits(bs, None if shared else max(context_lens)))
        if self.capture:
            self.graphs[key].replay()
        else:
            self.outputs[key] = self._run(*key, host_ctx + [q] * (bs - b))
        self.num_replays += 1
        self.num_shared_replays += shared
        hidden, logits = self.outputs[key]
        return hidden[:n], logits if self.prefill else logits[:n]

    def _stage_states(self, states, pin: bool) -> None:
        """Each row's state slot and has-state flag; padded rows: the scratch slot, no state.
        A verify set also stages each token's state slot (padded rows': -1, not kept)."""
        b = len(states.slots)
        host = torch.zeros(self.state_inputs.shape, dtype=torch.int32, pin_memory=pin)
        a = host.numpy()
        a[0, :b], a[0, b:] = states.slots, self.state_scratch
        a[1, :b] = states.has_init
        self.state_inputs.copy_(host, non_blocking=True)
        if self.token_state_inputs is not None:
            t = len(states.token_slots)
            tokens = torch.empty(self.token_state_inputs.shape, dtype=torch.int32, pin_memory=pin)
            tokens[:t], tokens[t:] = torch.from_numpy(states.token_slots), -1
            self.token_state_inputs.copy_(tokens, non_blocking=True)

    def _replay_mixed(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        context_lens: list[int],
        tables: np.ndarray,
        pending: tuple[list[int], list[int]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`run` for d decode rows then one chunk of c tokens (the batch's last row): returns
        the chunk's hidden states and the logits of the sampled rows (all d, then the chunk's
        last token's: the caller keeps the rows it samples)."""
        d, q = len(context_lens) - 1, self.query_len
        bs = next(s for s in self.sizes if s >= d)
        c = len(input_ids) - d
        pin = self.buffer.is_cuda  # pinned host memory: the copies are async
        ctx = self._stage_mixed(bs, input_ids, positions, slots, context_lens, tables, pending, pin)
        # The decode rows' count follows their longest context, as a decode step's does: a long
        # row among them is read by all of a long count's splits, not one program a kv head.
        full, longest = self._num_splits(bs), self._num_splits(bs, max(context_lens[:d]))
        decode_splits = max(full, longest)  # shorter contexts keep the GPU-filling count
        key = (bs, False, (decode_splits, self._mixed_splits(q, int(ctx[bs]))))
        if self.capture:
            self.graphs[key].replay()
        else:
            self.outputs[key] = self._run(*key, ctx.tolist())
        self.num_replays += 1
        hidden, logits = self.outputs[key]
        return hidden[bs : bs + c], logits[: d + 1]

    def _mixed_splits(self, chunk: int, context_len: int) -> int:
        """The captured split count nearest to what the padded chunk alone would take: the
        decode rows run their own kernel, so counting them (as an eager mixed step's single
        kernel does) kept a 128-token chunk at 24-32k keys on 1 split."""
        s = prefill_num_splits(
            [chunk],
            [context_len],
            self.num_heads,
            self.num_kv_heads,
            self.buffer.device,
            self.dtype,
        )
        return MIXED_SPLITS if s >= MIXED_SPLIT_FROM else 1
