"""Model runner: owns the weights and the KV cache, turns a ScheduledBatch into tensors, runs the
forward and the sampler. No policy lives here (that is the scheduler's job).

`launch` enqueues a step and returns; the only host sync is `PendingStep.result()` waiting on
the event after the copy of the sampled ids (and logprobs, accepted counts, MTP drafts) to
pinned host memory. The engine calls it while the next step already runs (the overlapped loop).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import numpy as np
import torch

from tinyserve.config import EngineConfig, ModelConfig
from tinyserve.graphs import host_array
from tinyserve.layers.attention import Attention, AttentionMetadata, forward_context
from tinyserve.loader import load_model
from tinyserve.sampling import SampleResult, SamplingRow, SamplingTensors, sample
from tinyserve.scheduler import ScheduledBatch
from tinyserve.sequence import PLACEHOLDER
from tinyserve.spec_decode import accepted_counts

CPU_KV_CACHE_BYTES = 4 << 30  # default KV budget on CPU, where there is no memory to profile


@dataclass(slots=True)
class RowOutput:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(slots=True)
class SeqOutput:
    """What one sampling sequence got from a step."""

    tokens: list[RowOutput]  # accepted drafts, then the target's own token
    draft_ids: list[int]  # the MTP head's drafts for the next step ([] without MTP)


@dataclass(slots=True)
class HostInputs:
    """One step's inputs as host lists, before any copy to the device."""

    input_ids: list[int]  # (T,) 0 where the token is still on the device (`dst`)
    positions: list[int]  # (T,)
    slots: list[int]  # (T,) KV cache slot of each token
    cu_q: list[int]  # (B + 1,) query offsets
    ctx_lens: list[int]  # (B,) KV length of each row including this step
    tables: np.ndarray  # (B, W) int32 block tables padded with 0 to one width
    q_lens: list[int]  # (B,)
    logits_idx: list[int]  # token index of each logits row (R,)
    seg_starts: list[int]  # first logits row of each sampling sequence (S,)
    draft_next: list[int]  # (R,) draft for the position after each row, -1 if none
    next_ids: list[int]  # (T,) token after each position where known (MTP's input)
    limits: list[int]  # (S,) KV slots owned by each sampling sequence
    sample_rows: list[int]  # (S,) batch row of each sampling sequence
    dst: list[int]  # input positions whose token the previous step sampled ...
    src: list[int]  # ... and its sampled row there
    # The overlapped speculative loop: tokens whose value and position come from the step in
    # flight (the row's last token, then its MTP drafts), one entry per token ...
    shift_tok: list[int]  # token index in this step
    shift_seq: list[int]  # the in-flight step's sampling sequence it follows
    shift_j: list[int]  # 0 for the row's last token, j for its j-th draft
    shift_row: list[int]  # batch row
    shift_num: list[int]  # drafts the row carries
    shift_logit: list[int]  # its logits row

    @property
    def spec(self) -> bool:
        return len(self.draft_next) > len(self.seg_starts)  # some row carries drafts


@dataclass(slots=True)
class StepInputs:
    """Device inputs of one step (the eager forward, and the speculative / MTP bookkeeping)."""

    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    metadata: AttentionMetadata
    idx: torch.Tensor  # (R,) logits_idx
    next_ids: torch.Tensor | None  # (T,) MTP only
    draft_next: torch.Tensor | None  # (R,) speculative steps only
    seg_starts: torch.Tensor | None  # (S,) speculative or MTP steps
    seg_ids: torch.Tensor | None  # (R,) sampling sequence of each logits row; speculative
    kv_limits: torch.Tensor | None  # (S,) MTP only
    max_kv_limit: int
    sample_rows: torch.Tensor | None  # (S,) MTP only
    pending: tuple[torch.Tensor, torch.Tensor] | None  # (dst, src)
    shift: tuple[torch.Tensor, ...] | None  # HostInputs.shift_* on the device


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    if t.device.type == "cpu":  # a copy still: `t` may be a view the next step overwrites
        return t.clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


class PendingStep:
    """A launched step: its sampled ids on the device (the next step's inputs) and pinned host
    copies of its results, readable once `event` has passed."""

    def __init__(self, seg_starts: list[int], rows: list[SamplingRow],
                 sampled: torch.Tensor | None = None) -> None:  # fmt: skip
        self.seg_starts, self.rows, self.sampled = seg_starts, rows, sampled
        # MTP steps, for the next step's inputs: (S,) first logits row and accepted drafts of
        # each sampling sequence (None: none accepted), (S, k) its drafts; all on the device.
        self.seg_dev: torch.Tensor | None = None
        self.accepted: torch.Tensor | None = None
        self.drafts: torch.Tensor | None = None
        self.host: list[torch.Tensor | None] = []
        self.event: torch.cuda.Event | None = None

    def result(self) -> list[SeqOutput]:
        """Per sampling sequence: its accepted drafts and token, and the MTP drafts."""
        if not self.seg_starts:
            return []
        if self.event is not None:
            # NOTE: the one host sync of a step, in the engine's worker thread (never the loop).
            self.event.synchronize()
        tokens, accepted, drafts, logprobs, top_ids, top_lps = (
            t.tolist() if t is not None else None for t in self.host
        )
        num = len(self.seg_starts)
        accepted = accepted or [0] * num
        drafts = drafts or [[]] * num
        outs = []
        for first, n, drafted in zip(self.seg_starts, accepted, drafts):
            row_outs = []
            for r in range(first, first + n + 1):
                out = RowOutput(tokens[r])
                k = self.rows[r].params.logprobs
                if k is not None and logprobs is not None:
                    out.logprob = logprobs[r]
                    out.top_logprobs = list(zip(top_ids[r][:k], top_lps[r][:k])) if top_ids else []
                row_outs.append(out)
            outs.append(SeqOutput(row_outs, drafted))
        return outs


def _plain_greedy(rows: list[SamplingRow]) -> bool:
    """Rows whose token is the plain argmax of the logits: greedy, nothing that changes the
    logits (bias, penalties, the min_tokens stop mask) and no logprobs."""
    for row in rows:
        p = row.params
        if not p.is_greedy or p.logprobs is not None or p.logit_bias:
            return False
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
            return False
        if row.num_output_tokens < p.min_tokens:
            return False
    return True


def _lengths(starts: list[int], total: int) -> list[int]:
    return [b - a for a, b in zip(starts, starts[1:] + [total])]


class ModelRunner:
    def __init__(self, model_config: ModelConfig, config: EngineConfig, dtype: torch.dtype) -> None:
        self.model_config = model_config
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = dtype
        self.block_size = config.block_size
        if self.device.type == "cuda":
            # Engines dropped earlier in this process (notebooks, tests) may still hold memory
            # through reference cycles, or leave it cached: free and return it before loading,
            # or the weights land inside a dead KV cache's segment, which then cannot be
            # returned, and the new KV cache does not fit (seen on the H100).
            gc.collect()
            torch.cuda.empty_cache()
        self.model = load_model(model_config, dtype, self.device, config.load_format, config.seed,
                                with_mtp=config.speculative_method == "mtp")  # fmt: skip
        self.mtp = self.model.mtp
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.num_kv_blocks = config.num_kv_blocks or self._profile_num_blocks()
        mc = model_config
        # (2, layers, blocks + 1, block_size, kv_heads, head_dim): one allocation, per-layer
        # views. The extra last block is scratch for CUDA-graph padding rows; the pool never
        # hands it out.
        self.kv_cache = torch.zeros(
            2, len(self.attn_layers), self.num_kv_blocks + 1, self.block_size,
            mc.num_key_value_heads, mc.head_dim, dtype=dtype, device=self.device,
        )  # fmt: skip
        for i, layer in enumerate(self.attn_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        limit = min(config.max_model_len or 1 << 30, mc.max_position_embeddings)
        self.max_blocks_per_seq = -(-limit // self.block_size)
        self.graphs = self.verify_graphs = None
        self.prefill_graphs: dict[int, object] = {}  # padded length -> one-sequence graphs
        if self.device.type == "cuda" and not config.enforce_eager:
            from tinyserve.graphs import DecodeGraphs

            args = (self.model, config.max_num_seqs, self.max_blocks_per_seq, self.num_kv_blocks,
                    self.block_size)  # fmt: skip
            self.graphs = DecodeGraphs(*args, shared_prefix=config.enable_prefix_caching)
            self.capture_prefill_graphs(capture=True)
            if config.speculative_method is not None:  # the verify step: last token + k drafts
                q = config.num_speculative_tokens + 1
                self.verify_graphs = DecodeGraphs(*args, query_len=q, pool=self.graphs.pool)
                if self.mtp is not None:  # the MTP head's drafts after a verify replay, too
                    self.verify_graphs.capture_drafts(self.draft_tokens)

    def capture_prefill_graphs(self, capture: bool) -> None:
        """One-sequence prompt graphs (not with MTP, whose drafting reads every row's inputs):
        a short prompt's forward is host-bound when launched kernel by kernel (H100, 32 tokens:
        qwen3-0.6b 15-21 ms to the first token eagerly, for ~1.2 ms of GPU work)."""
        from tinyserve.graphs import DecodeGraphs, prefill_graph_lengths

        if self.mtp is not None:
            return
        pool = self.graphs.pool if capture else None
        for q in reversed(prefill_graph_lengths(self.config.max_num_batched_tokens)):
            g = DecodeGraphs(self.model, 1, self.max_blocks_per_seq, self.num_kv_blocks,
                             self.block_size, query_len=q, pool=pool, capture=capture,
                             prefill=True)  # fmt: skip
            pool = g.pool if capture else None
            self.prefill_graphs[q] = g
        self.prefill_graphs = dict(sorted(self.prefill_graphs.items()))  # shortest first
        if capture:
            self.graphs.pool = pool

    @property
    def kv_bytes_per_block(self) -> int:
        mc = self.model_config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        per_token = 2 * len(self.attn_layers) * mc.num_key_value_heads * mc.head_dim * elem
        return per_token * self.block_size

    def _profile_num_blocks(self) -> int:
        if self.device.type != "cuda":
            return max(1, CPU_KV_CACHE_BYTES // self.kv_bytes_per_block)
        # Run the largest forward the scheduler can ask for, then give the KV cache what is left
        # of gpu_memory_utilization.
        torch.cuda.reset_peak_memory_stats(self.device)
        num = min(self.config.max_num_batched_tokens, self.model_config.max_position_embeddings)
        ids = torch.zeros(num, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            hidden = self.model(ids, torch.arange(num, device=self.device))
            self.model.compute_logits(hidden[-self.config.max_num_seqs :])
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        util = self.config.gpu_memory_utilization
        budget = total * util - peak - used_by_others
        torch.cuda.empty_cache()
        # The KV cache is one allocation, and cached segments that a live tensor splits cannot
        # hold it (seen on the H100 after an earlier engine in the process: an OOM asking for
        # 67 GB with 68 GB cached), so it must also fit the device's own free memory.
        budget = min(budget, torch.cuda.mem_get_info(self.device)[0] - (1 - util) * total)
        if budget < self.kv_bytes_per_block:
            raise RuntimeError(
                f"no memory left for the KV cache at gpu_memory_utilization="
                f"{self.config.gpu_memory_utilization}: raise it or lower max_num_batched_tokens"
            )
        return int(budget // self.kv_bytes_per_block)

    def _prepare(self, batch: ScheduledBatch) -> HostInputs:
        bs = self.block_size
        input_ids: list[int] = []
        next_ids: list[int] = []  # the token after each position where known (MTP's input)
        positions: list[int] = []
        slots: list[int] = []
        cu_q = [0]
        ctx_lens: list[int] = []
        logits_idx: list[int] = []
        draft_next: list[int] = []  # per logits row: the draft for the position after it, or -1
        seg_starts: list[int] = []  # per sampled sequence: its first logits row
        dst: list[int] = []  # batch positions whose token is a placeholder ...
        src: list[int] = []  # ... and the previous step's sampled row holding it
        limits: list[int] = []  # per sampled sequence: KV slots it owns
        sample_rows: list[int] = []  # per sampled sequence: its batch row
        shift: tuple[list[int], ...] = ([], [], [], [], [], [])  # HostInputs.shift_*
        for row, (seq, num) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start, end = seq.num_kv_computed, seq.num_kv_computed + num
            drafts = seq.draft_ids
            if num == 1 and not drafts and self.mtp is None and end == seq.num_tokens:
                # The common decode row, without the general path's slicing (host time per
                # step grows with the batch: this loop runs for every running sequence).
                tok = seq.token_ids[start]
                if tok == PLACEHOLDER:
                    dst.append(len(input_ids))
                    src.append(seq.pending_row)
                    tok = 0
                input_ids.append(tok)
                positions.append(start)
                slots.append(seq.block_table[start // bs] * bs + start % bs)
                cu_q.append(cu_q[-1] + 1)
                ctx_lens.append(end)
                seg_starts.append(len(logits_idx))
                logits_idx.append(cu_q[-1] - 1)
                draft_next.append(-1)
                limits.append(seq.kv_token_limit)
                sample_rows.append(row)
                continue
            tokens = seq.token_ids + drafts if drafts else seq.token_ids
            chunk = tokens[start:end]
            if self.mtp is not None and chunk[0] == PLACEHOLDER:
                # The overlapped speculative loop: the last token and the drafts are the step
                # in flight's, and so is how far they move (`_shift`, on the device).
                assert end == seq.num_tokens + len(drafts), "a pending token in a prefill"
                first, logit = len(input_ids), len(logits_idx)
                for j in range(num):
                    entry = (first + j, seq.pending_row, j, row, len(drafts), logit + j)
                    for lst, v in zip(shift, entry):
                        lst.append(v)
                chunk = [0] * num
            elif seq.pending_row is not None and PLACEHOLDER in chunk:
                j = chunk.index(PLACEHOLDER)
                dst.append(len(input_ids) + j)
                src.append(seq.pending_row)
                chunk = chunk[:j] + [0] + chunk[j + 1 :]
            input_ids += chunk
            if self.mtp is not None:
                following = chunk[1:] + tokens[end : end + 1]
                next_ids += following + [0] * (num - len(following))  # sampled ones: on device
            positions += range(start, end)
            table = seq.block_table
            if num <= 16:
                slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            else:  # long chunks in numpy: a Python loop per token would hold the GIL for ms
                pos = np.arange(start, end)
                blocks = np.asarray(table[start // bs : (end - 1) // bs + 1])
                slots += (blocks[pos // bs - start // bs] * bs + pos % bs).tolist()
            cu_q.append(cu_q[-1] + num)
            ctx_lens.append(end)
            if end >= seq.num_tokens:  # samples: the last known token, then each draft
                limits.append(seq.kv_token_limit)
                sample_rows.append(row)
                seg_starts.append(len(logits_idx))
                n = end - seq.num_tokens + 1
                logits_idx += range(cu_q[-1] - n, cu_q[-1])
                draft_next += drafts[: n - 1] + [-1]
        width = max(len(s.block_table) for s in batch.seqs)
        tables = np.zeros((len(batch.seqs), width), dtype=np.int32)  # one array, no nested lists
        for i, seq in enumerate(batch.seqs):
            tables[i, : len(seq.block_table)] = seq.block_table
        return HostInputs(input_ids, positions, slots, cu_q, ctx_lens, tables,
                          list(batch.num_new_tokens), logits_idx, seg_starts, draft_next,
                          next_ids, limits, sample_rows, dst, src, *shift)  # fmt: skip

    def _tensor(self, x: list | np.ndarray, dtype: torch.dtype = torch.long) -> torch.Tensor:
        pin = self.device.type == "cuda"  # pinned, so the copy is async
        if isinstance(x, np.ndarray):
            host = host_array(x, dtype, pin)
        else:
            host = torch.tensor(x, dtype=dtype, pin_memory=pin)
        return host.to(self.device, non_blocking=True)

    def _device_inputs(self, h: HostInputs) -> StepInputs:
        t = self._tensor
        md = AttentionMetadata(
            slot_mapping=t(h.slots),
            block_tables=t(h.tables, torch.int32),
            cu_seqlens_q=t(h.cu_q, torch.int32),
            context_lens=t(h.ctx_lens, torch.int32),
            query_lens_cpu=h.q_lens,
            context_lens_cpu=h.ctx_lens,
            max_context_len=max(h.ctx_lens),
            is_decode_only=all(n == 1 for n in h.q_lens),
        )
        if md.is_decode_only and self.device.type == "cuda":
            from tinyserve.graphs import decode_num_splits

            mc = self.model_config
            md.num_splits = decode_num_splits(
                len(h.q_lens), self.config.max_num_seqs, mc.num_key_value_heads,
                self.max_blocks_per_seq * self.block_size, self.device,
            )  # fmt: skip
        spec, mtp = h.spec, self.mtp is not None
        lengths = _lengths(h.seg_starts, len(h.logits_idx))
        seg_ids = [s for s, n in enumerate(lengths) for _ in range(n)] if spec else []
        return StepInputs(
            input_ids=t(h.input_ids),
            positions=t(h.positions),
            metadata=md,
            idx=t(h.logits_idx),
            next_ids=t(h.next_ids) if mtp else None,
            draft_next=t(h.draft_next) if spec else None,
            seg_starts=t(h.seg_starts) if spec or mtp else None,
            seg_ids=t(seg_ids) if spec else None,
            kv_limits=t(h.limits) if mtp else None,
            max_kv_limit=max(h.limits, default=0),
            sample_rows=t(h.sample_rows) if mtp else None,
            pending=(t(h.dst), t(h.src)) if h.dst else None,
            shift=tuple(t(a) for a in (h.shift_tok, h.shift_seq, h.shift_j, h.shift_row,
                                       h.shift_num, h.shift_logit)) if h.shift_tok else None,
        )  # fmt: skip

    def _graphs_for(self, h: HostInputs):
        """The graph set that runs this step, or None (eager): decode-only batches, and verify
        steps where every row runs k drafts."""
        if self.graphs is None or not self.graphs.can_run(len(h.q_lens)):
            return None
        if all(n == 1 for n in h.q_lens):
            return self.graphs
        if len(h.q_lens) == 1 and not h.dst and not h.spec:  # one prompt chunk
            q = next((q for q in self.prefill_graphs if q >= h.q_lens[0]), None)
            # Padding tokens sit after the chunk: their positions must stay inside the table.
            limit = self.max_blocks_per_seq * self.block_size
            if q is not None and h.ctx_lens[0] + q - h.q_lens[0] <= limit:
                return self.prefill_graphs[q]
        v = self.verify_graphs
        if v is not None and len(set(h.q_lens)) == 1 and h.q_lens[0] == v.query_len:
            if len(h.logits_idx) == len(h.input_ids) and not h.dst:
                return v
        return None

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, rows: list[SamplingRow],
               prev: PendingStep | None = None) -> PendingStep:  # fmt: skip
        """Forward the batch and sample every logits row (`rows`: one per sampling sequence,
        plus one per draft of a speculative row), enqueued on the device; returns at once and
        `result()` waits for it.

        Token ids still PLACEHOLDER on the host (sampled by `prev`, not read back yet) are
        taken from `prev`'s sampled ids on the device (`seq.pending_row`), so this step can be
        launched before the previous one finished. A graph step gathers them from
        `graphs.last_sampled`, which therefore receives every step's sampled ids.
        """
        h = self._prepare(batch)
        graphs = self._graphs_for(h)
        # Plain graph steps copy nothing else to the device: the graph reads its own buffer.
        x = self._device_inputs(h) if graphs is None or h.spec or self.mtp is not None else None
        fix = None
        if x is not None and x.shift is not None:  # tokens of the MTP step in flight

            def fix(ids, positions, slots, ctx, tables, draft_next=None):
                self._shift(prev, x.shift, ids, positions, slots, ctx, tables, draft_next)

            md = x.metadata
            fix(x.input_ids, x.positions, md.slot_mapping, md.context_lens, md.block_tables,
                x.draft_next)  # fmt: skip
            if self.device.type == "cpu":  # the CPU attention reads host lengths (no sync here)
                md.context_lens_cpu = md.context_lens.tolist()
                md.max_context_len = max(md.context_lens_cpu)
            else:
                md.max_context_len += self.config.num_speculative_tokens
        if graphs is not None:
            hidden, all_logits = graphs.run(h.input_ids, h.positions, h.slots, h.ctx_lens,
                                            h.tables, (h.dst, h.src), fix)  # fmt: skip
        else:
            if x.pending is not None:  # the overlapped loop: inputs sampled by `prev`
                dst, src = x.pending
                x.input_ids[dst] = prev.sampled[src]
            with forward_context(x.metadata):
                hidden, all_logits = self.model(x.input_ids, x.positions), None
        if not h.logits_idx:  # only non-final prefill chunks: no logits, nothing sampled
            if self.mtp is not None:
                self._mtp_first_pass(x.metadata, x.positions, hidden, x.next_ids)  # KV only
            return PendingStep([], rows)
        assert len(rows) == len(h.logits_idx)
        # The graph's logits rows are the sampled rows: every token sampled, or a prefill
        # graph's one row (the chunk's last token's).
        graph_rows = all_logits is not None and (
            len(h.logits_idx) == len(h.input_ids) or graphs.prefill
        )
        if graph_rows:
            logits = all_logits
        else:
            idx = x.idx if x is not None else self._tensor(h.logits_idx)
            if all_logits is not None:
                logits = all_logits[idx]
            else:
                logits = self.model.compute_logits(hidden[idx])  # (R, V) float32
        if graph_rows and _plain_greedy(rows):
            # The graph's own argmax is exactly what `sample` would compute (verify graphs too:
            # the next step reads it, on the device, before the next replay rewrites it).
            result = SampleResult(graphs.last_sampled[: len(rows)], None, None, None)
        else:
            self._mask_stop_tokens(logits, rows)
            shift = None
            if x is not None and x.shift is not None:
                shift = self._step_shift(prev, x.shift, len(rows))
            st = SamplingTensors.build(rows, logits.shape[-1], self.device, shift)
            result = sample(logits, st)
        sampled = result.token_ids
        if x is not None and x.draft_next is not None:
            force = self.config.spec_force_accept
            accepted = accepted_counts(sampled, x.draft_next, x.seg_ids, x.seg_starts, force)
            if force is not None:  # benchmarks: the first f drafts become the emitted tokens
                row_in_seq = torch.arange(len(h.logits_idx), device=self.device)
                row_in_seq = row_in_seq - x.seg_starts[x.seg_ids]
                sampled = torch.where(row_in_seq < accepted[x.seg_ids], x.draft_next, sampled)
        else:
            accepted = None
        last = self.graphs.last_sampled if self.graphs is not None else None
        if last is not None and sampled.data_ptr() != last.data_ptr() and len(rows) <= len(last):
            last[: len(rows)].copy_(sampled)  # where the next graph step gathers its inputs
        drafts = None
        if self.mtp is not None:
            graphed = graphs is not None and graphs is self.verify_graphs
            drafts = self._mtp_drafts(x, hidden, sampled, accepted, graphed)
        step = PendingStep(h.seg_starts, rows, sampled)
        if self.mtp is not None:  # the next step may start from these on the device
            step.seg_dev, step.accepted, step.drafts = x.seg_starts, accepted, drafts
        # Device -> pinned host copies, then an event: `result()` waits on that event only.
        step.host = [_to_host(t) for t in (sampled, accepted, drafts, result.logprobs,
                                           result.top_ids, result.top_logprobs)]  # fmt: skip
        if self.device.type == "cuda":
            step.event = torch.cuda.Event()
            step.event.record()
        return step

    def _shift(self, prev: PendingStep, shift: tuple[torch.Tensor, ...], ids: torch.Tensor,
               positions: torch.Tensor, slots: torch.Tensor, ctx: torch.Tensor,
               tables: torch.Tensor, draft_next: torch.Tensor | None = None) -> None:  # fmt: skip
        """Complete, in place and on the device, the rows that continue an MTP step still in
        flight: their last token is its emitted one (the target's token after the accepted
        drafts), their drafts are its MTP drafts, and every position, slot and context length
        moves up by the drafts it accepted (the host built them as if it accepted none)."""
        tok, seq, j, row, num, logit = shift
        accepted = prev.accepted if prev.accepted is not None else torch.zeros_like(prev.seg_dev)
        a = accepted[seq]
        k = prev.drafts.shape[1]
        last = prev.sampled[prev.seg_dev[seq] + a]
        ids[tok] = torch.where(j == 0, last, prev.drafts[seq, (j - 1).clamp(min=0)])
        pos = positions[tok] + a
        positions[tok] = pos
        bs = self.block_size
        slots[tok] = tables[row, pos // bs].long() * bs + pos % bs
        ctx[row] = ctx[row] + a.to(ctx.dtype)  # every token of a row writes the same value
        if draft_next is not None:
            draft_next[logit] = torch.where(j < num, prev.drafts[seq, j.clamp(max=k - 1)], -1)

    def _step_shift(self, prev: PendingStep, shift: tuple[torch.Tensor, ...],
                    num_rows: int) -> torch.Tensor:  # fmt: skip
        """(R,) RNG counter steps each logits row still lacks: a row's counter is its emitted
        count, which the step in flight raises by the drafts it accepts (so seeded sampling
        draws what the synchronous loop draws)."""
        _, seq, _, _, _, logit = shift
        accepted = prev.accepted if prev.accepted is not None else torch.zeros_like(prev.seg_dev)
        steps = torch.zeros(num_rows, dtype=torch.long, device=self.device)
        return steps.index_add_(0, logit, accepted[seq])  # every shifted logits row, once

    def _mtp_first_pass(self, md: AttentionMetadata, positions: torch.Tensor,
                        hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """The MTP layer over every token of the step, at the target's positions and slots:
        writes its KV (entry i from target hidden h_i and token t_{i+1}), returns its output."""
        with forward_context(md):
            return self.mtp(next_ids, hidden, positions, target_hidden=True)

    def _mtp_drafts(self, x: StepInputs, hidden: torch.Tensor, sampled: torch.Tensor,
                    accepted: torch.Tensor | None, graphed: bool) -> torch.Tensor:  # fmt: skip
        """k drafts per sampling sequence (S, k), on the device; `graphed`: the verify graph ran
        this step, so its MTP graph (same static inputs) drafts."""
        next_ids = x.next_ids.index_put((x.idx,), sampled)  # sampled tokens follow logits rows
        if accepted is None:
            accepted = torch.zeros_like(x.seg_starts)
        if graphed:
            return self.verify_graphs.draft(next_ids, accepted, x.kv_limits)
        chosen = x.idx[x.seg_starts] + accepted  # token index of the last verified position
        tables = x.metadata.block_tables[x.sample_rows]  # (S, W)
        return self.draft_tokens(x.metadata, x.positions, hidden, next_ids, chosen, tables,
                                 x.kv_limits, x.max_kv_limit)  # fmt: skip

    def draft_tokens(self, md: AttentionMetadata, positions: torch.Tensor, hidden: torch.Tensor,
                     next_ids: torch.Tensor, chosen: torch.Tensor, tables: torch.Tensor,
                     limits: torch.Tensor, max_kv_limit: int | None) -> torch.Tensor:  # fmt: skip
        """The MTP head over the step's tokens (writing its KV), then k drafts per sequence: the
        first from the entry at the last verified position `chosen` (whose next token is the one
        just sampled), the others chaining the head on its own output one position further,
        writing KV into the row's lookahead slots (`limits`; rewritten once verified). Device
        tensors only, no host reads: the verify graph captures this too."""
        out = self._mtp_first_pass(md, positions, hidden, next_ids)
        h = out[chosen]
        token = self.mtp.compute_logits(h).argmax(-1)
        drafts = [token]
        bs, num = self.block_size, chosen.shape[0]
        pos = positions[chosen]
        max_pos = self.model_config.max_position_embeddings - 1
        scratch = self.num_kv_blocks * bs
        cu = torch.arange(num + 1, dtype=torch.int32, device=self.device)
        for _ in range(1, self.config.num_speculative_tokens):
            pos = pos + 1
            valid = pos < limits  # past the lookahead slots: write to the scratch slot
            p = torch.minimum(pos, limits - 1).clamp(min=0)
            col = (p // bs).clamp(max=tables.shape[1] - 1)[:, None]
            slots = tables.gather(1, col).squeeze(1).long() * bs + p % bs
            chain = AttentionMetadata(
                slot_mapping=torch.where(valid, slots, scratch),
                block_tables=tables,
                cu_seqlens_q=cu,
                context_lens=(p + 1).to(torch.int32),
                query_lens_cpu=[1] * num,
                context_lens_cpu=[],
                max_context_len=max_kv_limit or 0,
                is_decode_only=True,
            )
            with forward_context(chain):
                h = self.mtp(token, h, pos.clamp(max=max_pos), target_hidden=False)
            token = self.mtp.compute_logits(h).argmax(-1)
            drafts.append(token)
        return torch.stack(drafts, dim=1)

    def _mask_stop_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        """min_tokens: stop tokens cannot be sampled before a row has min_tokens outputs."""
        r, c = [], []
        for i, row in enumerate(rows):
            p = row.params
            if row.num_output_tokens < p.min_tokens:
                ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_ids))
                r += [i] * len(ids)
                c += sorted(ids)
        if r:
            idx = torch.tensor([r, c], pin_memory=self.device.type == "cuda")
            idx = idx.to(self.device, non_blocking=True)  # pageable -> device would sync
            logits[idx[0], idx[1]] = float("-inf")

    @property
    def eos_ids(self) -> list[int]:
        return self.model_config.eos_token_ids
