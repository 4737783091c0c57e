"""Model runner: owns the weights and the KV cache, turns a ScheduledBatch into tensors, runs the
forward and the sampler. No policy lives here (that is the scheduler's job).

`launch` enqueues a step and returns; the only host sync is `PendingStep.result()` waiting on
the event after the copy of the sampled ids (and logprobs, prompt logprobs, accepted counts,
MTP drafts) to pinned host memory. The engine calls it while the next step already runs (the
overlapped loop).

Hybrid models also get the DeltaNet layers' state rows (runner/states.py): one slot per
sequence, a scratch slot, a speculative engine's per-token slots and the prefix cache's
checkpoints (copied to a hit's slot before the forward, saved after it); eager steps, decode and
verify graphs (no prefill, mixed or cascade graphs, no prefill lane yet). Their MTP layer (Qwen3.5)
is a full-attention layer with paged KV like MiMo's: it drafts after every step as MiMo's does.
"""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tinyserve.config import EngineConfig
from tinyserve.core.scheduler import ScheduledBatch
from tinyserve.kernels.prefill_attention import prefill_num_splits
from tinyserve.kernels.spec_shift import shift_inputs
from tinyserve.model.config import ModelConfig
from tinyserve.model.layers.attention import Attention, forward_context
from tinyserve.model.loader import load_model
from tinyserve.runner.kv_cache import allocate_kv_cache, kv_bytes_per_block, num_kv_blocks
from tinyserve.runner.mtp_drafter import MtpDrafter
from tinyserve.runner.pending import PendingStep, PromptScores, to_host
from tinyserve.runner.prefill_lane import build_lane
from tinyserve.runner.states import (
    allocate_state_rows,
    checkpoint_budget,
    commit_graphed_states,
    commit_token_states,
    copy_states,
    host_states,
    num_state_slots,
    save_token_states,
    state_pool_size,
)
from tinyserve.runner.step_inputs import HostInputs, StepInputs, build_host_inputs, device_inputs
from tinyserve.runner.warmup import compile_start_up
from tinyserve.sample.grammar import TokenBitmask
from tinyserve.sample.sampler import (
    SampleResult,
    SamplingRow,
    SamplingTensors,
    plain_greedy,
    sample,
)
from tinyserve.sample.transfer import to_device
from tinyserve.spec.speculator import Speculator
from tinyserve.spec.token_map import load_token_map

log = logging.getLogger("tinyserve.runner")


@dataclass(slots=True)
class Staged:
    """`ModelRunner._stage`'s result: what a step's forward and bookkeeping read on the device."""

    x: StepInputs | None  # None: a plain graph step, or a verify-graph step (`extra`)
    graphed: bool  # a verify-graph step: it accepts and drafts in `draft_graphs`
    extra: list | tuple = ()  # the verify replay's `extra` arrays
    fix: Callable | None = None  # edits a replay's copied inputs (the MTP step in flight)
    shift: tuple[torch.Tensor, ...] | None = None  # HostInputs.shift_* on the device
    seg_dev: torch.Tensor | None = None  # (S,) each sampled sequence's first logits row


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        config: EngineConfig,
        dtype: torch.dtype,
        spec: Speculator | None = None,
    ) -> None:
        self.model_config = model_config
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = dtype
        self.spec = spec  # verifies speculative rows (None: no speculation)
        self.block_size = config.block_size
        if self.device.type == "cuda":
            # Engines dropped earlier in this process (notebooks, tests) may still hold memory
            # through reference cycles, or leave it cached: free and return it before loading,
            # or the weights land inside a dead KV cache's segment, which then cannot be
            # returned, and the new KV cache does not fit.
            gc.collect()
            torch.cuda.empty_cache()
        token_map = None
        if config.speculative_token_map is not None:  # read and checked before the weights load
            token_map = load_token_map(config.speculative_token_map, model_config.vocab_size)
        self.model = load_model(
            model_config,
            dtype,
            self.device,
            config.load_format,
            config.seed,
            with_mtp=config.speculative_method == "mtp",
        )
        self.mtp = self.model.mtp
        if token_map is not None:  # before the KV pool is sized: its rows take memory
            self.mtp.restrict_drafts(token_map)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        # Hybrid models: state rows for the DeltaNet layers, sized before the KV cache takes
        # the rest (allocated after it: the sizing forward runs without them).
        self.is_hybrid = "linear_attention" in model_config.layer_types
        self.state_scratch = config.max_num_seqs  # the scratch slot (runner/states.py)
        self.num_state_slots, self.state_bytes = state_pool_size(model_config, config, dtype)
        # Prefix-cache checkpoints: the last rows (runner/states.py)
        self.num_checkpoints = checkpoint_budget(config) if self.is_hybrid else 0
        self.checkpoint_base = self.num_state_slots - self.num_checkpoints
        if self.is_hybrid and config.speculative_method is not None:
            # A verify step keeps each token's state in the rows after the scratch slot: they
            # must all sit before the checkpoints (`host_states` writes them unchecked).
            k, budget = config.num_speculative_tokens, config.max_num_batched_tokens
            assert self.checkpoint_base >= num_state_slots(config.max_num_seqs, k, budget)
        self.states: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv_bytes_per_block = kv_bytes_per_block(
            model_config, self.attn_layers, dtype, self.block_size
        )
        self.num_kv_blocks = config.num_kv_blocks or num_kv_blocks(self)
        self.kv_cache = allocate_kv_cache(
            self.attn_layers, model_config, self.num_kv_blocks, self.block_size, dtype, self.device
        )
        if self.is_hybrid:
            self.states = allocate_state_rows(self.model, model_config, self.num_state_slots)
        self.drafter = (
            None
            if self.mtp is None
            else MtpDrafter(
                self.mtp,
                config.num_speculative_tokens,
                self.block_size,
                self.num_kv_blocks,
                model_config.max_position_embeddings - 1,
            )
        )
        limit = min(config.max_model_len or 1 << 30, model_config.max_position_embeddings)
        self.max_blocks_per_seq = -(-limit // self.block_size)
        self.graphs = self.verify_graphs = self.draft_graphs = None
        self.prefill_graphs: dict[int, object] = {}  # padded length -> one-sequence graphs
        self.mixed_graphs: dict[int, object] = {}  # padded chunk -> decode rows + that chunk
        if self.device.type == "cuda" and not config.enforce_eager:
            from tinyserve.runner.draft_graphs import DraftGraphs
            from tinyserve.runner.graphs import DecodeGraphs

            args = (
                self.model,
                config.max_num_seqs,
                self.max_blocks_per_seq,
                self.num_kv_blocks,
                self.block_size,
            )
            self.graphs = DecodeGraphs(
                *args,
                # (cascade decode graphs with state inputs are not tried on a GPU yet)
                shared_prefix=config.enable_prefix_caching and not self.is_hybrid,
                max_chunk=self.max_graph_chunk,
                state_scratch=self.state_scratch if self.is_hybrid else None,
            )
            self.capture_prefill_graphs(capture=True)
            # The verify step: last token + k drafts (hybrid models: with per-token states)
            if config.speculative_method is not None:
                q = config.num_speculative_tokens + 1
                self.verify_graphs = DecodeGraphs(
                    *args,
                    query_len=q,
                    pool=self.graphs.pool,
                    state_scratch=self.state_scratch if self.is_hybrid else None,
                )
                if self.drafter is not None:  # the MTP head's drafts after a verify replay, too
                    self.draft_graphs = DraftGraphs(
                        self.verify_graphs, self.drafter.draft_tokens, self.graphs.last_sampled
                    )
        self.lane = None
        if not self.is_hybrid:
            self.lane = build_lane(self.model, config, self.max_blocks_per_seq, self.num_kv_blocks)
        elif config.prefill_lane_tokens or (
            config.prefill_lane_tokens is None and self.graphs is not None
        ):
            log.info("prefill lane off: not supported for hybrid models yet")
        if self.device.type == "cuda":
            compile_start_up(self)
            for g in (
                self.graphs,
                self.verify_graphs,
                *self.prefill_graphs.values(),
                *self.mixed_graphs.values(),
            ):
                if g is not None:  # the replay counters count served steps (tests read them)
                    g.num_replays = g.num_shared_replays = 0

    @property
    def max_graph_chunk(self) -> int:
        """The longest prompt chunk with graphs (0: none; not with MTP, whose drafting reads
        every row's inputs, nor for hybrid models yet)."""
        from tinyserve.runner.graph_shapes import prefill_graph_lengths

        lengths = prefill_graph_lengths(self.config.max_num_batched_tokens)
        return 0 if self.mtp is not None or self.is_hybrid or not lengths else lengths[-1]

    def capture_prefill_graphs(self, capture: bool) -> None:
        """Prompt-chunk graphs: one sequence's chunk, and a chunk beside decode rows (a long
        prompt chunked while others decode). Launched kernel by kernel such a forward is
        host-bound: a 32-token prompt of a 0.6B model waits 15-21 ms for ~1.2 ms of GPU work."""
        from tinyserve.runner.graph_shapes import prefill_graph_lengths
        from tinyserve.runner.graphs import DecodeGraphs

        if not self.max_graph_chunk:
            return
        pool = self.graphs.pool if capture else None
        args = (self.model, 1, self.max_blocks_per_seq, self.num_kv_blocks, self.block_size)
        for q in reversed(prefill_graph_lengths(self.config.max_num_batched_tokens)):
            g = DecodeGraphs(*args, query_len=q, pool=pool, capture=capture, prefill=True)
            pool = g.pool if capture else None
            self.prefill_graphs[q] = g
            if self.config.max_num_seqs > 1:
                g = DecodeGraphs(
                    self.model,
                    self.config.max_num_seqs,
                    *args[2:],
                    query_len=q,
                    pool=pool,
                    capture=capture,
                    mixed=True,
                    share=self.graphs,
                )
                pool = g.pool if capture else None
                self.mixed_graphs[q] = g
        self.prefill_graphs = dict(sorted(self.prefill_graphs.items()))  # shortest first
        self.mixed_graphs = dict(sorted(self.mixed_graphs.items()))
        if capture:
            self.graphs.pool = pool

    def _device_inputs(self, h: HostInputs) -> StepInputs:
        x = device_inputs(h, self.device, self.mtp is not None)
        md = x.metadata
        if (md.is_decode_only or md.verify_query_len) and self.device.type == "cuda":
            from tinyserve.runner.graph_shapes import decode_num_splits, decode_tiling

            shape = (
                len(h.q_lens),
                self.config.max_num_seqs,
                self.model_config.num_key_value_heads,
                self.max_blocks_per_seq * self.block_size,
                self.device,
            )
            md.num_splits = decode_num_splits(*shape, max(h.ctx_lens))
            md.decode_block_n, md.decode_min_split = decode_tiling(*shape, md.num_splits)
        elif self.device.type == "cuda":
            mc = self.model_config
            heads = (mc.num_attention_heads, mc.num_key_value_heads)
            md.prefill_num_splits = prefill_num_splits(
                h.q_lens, h.ctx_lens, *heads, self.device, self.dtype, mc.head_dim
            )
        return x

    def _graphs_for(self, h: HostInputs):
        """The graph set that runs this step, or None (eager): decode-only batches, and verify
        steps where every row runs k drafts."""
        # Prompt logprobs read the hidden state of every scored position: eager.
        if self.graphs is None or h.prompt_idx or not self.graphs.can_run(len(h.q_lens)):
            return None
        if all(n == 1 for n in h.q_lens):
            return self.graphs
        # Padding tokens sit after a prompt chunk: their positions must stay inside the table.
        limit = self.max_blocks_per_seq * self.block_size
        if len(h.q_lens) == 1 and not h.dst and not h.spec:  # one prompt chunk
            q = next((q for q in self.prefill_graphs if q >= h.q_lens[0]), None)
            if q is not None and h.ctx_lens[0] + q - h.q_lens[0] <= limit:
                return self.prefill_graphs[q]
        d = len(h.q_lens) - 1  # decode rows, then one chunk that is the last row
        if self.mixed_graphs and d and h.q_lens[d] > 1 and not h.spec and d == h.q_lens.count(1):
            q = next((q for q in self.mixed_graphs if q >= h.q_lens[d]), None)
            # The decode rows all sample (logits rows 0..d-1: the first d of an ascending list).
            samples = len(h.logits_idx) >= d and h.logits_idx[d - 1] == d - 1
            if q is not None and samples and h.ctx_lens[d] + q - h.q_lens[d] <= limit:
                return self.mixed_graphs[q]
        v = self.verify_graphs
        if v is not None and len(set(h.q_lens)) == 1 and h.q_lens[0] == v.query_len:
            if len(h.logits_idx) == len(h.input_ids) and not h.dst:
                return v
        return None

    @torch.inference_mode()
    def launch(
        self,
        batch: ScheduledBatch,
        rows: list[SamplingRow],
        prev: PendingStep | None = None,
        bitmask: Callable[[], TokenBitmask | None] | None = None,
    ) -> PendingStep:
        """Forward the batch and sample every logits row (`rows`: one per sampling sequence,
        plus one per draft of a speculative row), enqueued on the device; returns at once and
        `result()` waits for it. `bitmask` returns the grammar masks of some rows: it is called
        once the forward is enqueued, so the host fills them while the device computes.

        Token ids still PLACEHOLDER on the host (sampled by `prev`, not read back yet) are
        taken from `prev`'s sampled ids on the device (`seq.pending_row`), so this step can be
        launched before the previous one finished. A graph step gathers them from
        `graphs.last_sampled`, which therefore receives every step's sampled ids.
        """
        # 1. Inputs: host lists, the graph set that runs them (or None), their device copies.
        h = build_host_inputs(batch, self.block_size, self.mtp is not None)
        if self.is_hybrid:
            h.states = host_states(batch, self.state_scratch, h.spec)
        graphs = self._graphs_for(h)
        if batch.state_restores:  # prefix hits: their checkpoints into their slots, first
            self._copy_states([(self.checkpoint_base + c, s) for c, s in batch.state_restores])
        s = self._stage(h, graphs, prev)
        x = s.x
        # 2. The forward: a graph replay (it copies its own inputs), or eager.
        if graphs is not None:
            hidden, all_logits = graphs.run(
                h.input_ids,
                h.positions,
                h.slots,
                h.ctx_lens,
                h.tables,
                (h.dst, h.src),
                s.fix,
                s.extra,
                h.states,
            )
        else:
            if x.pending is not None:  # the overlapped loop: inputs sampled by `prev`
                dst, src = x.pending
                x.input_ids[dst] = prev.sampled[src]
            with forward_context(x.metadata):
                hidden, all_logits = self.model(x.input_ids, x.positions), None
        spec_states = h.states is not None and h.states.token_slots is not None
        if batch.state_saves and not spec_states:  # (a verify step's slots: after commit)
            self._save_states(batch)
        prompt = self._prompt_scores(h, x, hidden) if h.prompt_idx else None
        if not h.logits_idx:  # only non-final prefill chunks: no logits, nothing sampled
            if self.mtp is not None:
                self.drafter.first_pass(x.metadata, x.positions, hidden, x.next_ids)  # KV only
            step = PendingStep([], rows)
            step.prompt = prompt
            if prompt is not None and self.device.type == "cuda":
                step.event = torch.cuda.Event()
                step.event.record()
            return step
        assert len(rows) == len(h.logits_idx)
        # 3. Sampling. The graph's logits rows are the sampled rows: every token sampled, or a
        # prefill graph's one row (the chunk's last token's).
        graph_rows = all_logits is not None and (
            len(h.logits_idx) == len(h.input_ids) or graphs.prefill or graphs.mixed
        )
        if graph_rows and bitmask is None and plain_greedy(rows):
            # The graph's own argmax is exactly what `sample` would compute (verify graphs too:
            # the next step reads it, on the device, before the next replay rewrites it).
            result = SampleResult(graphs.last_sampled[: len(rows)], None, None, None)
        else:
            logits = self._logits(h, x, hidden, all_logits, graph_rows)
            self._mask_stop_tokens(logits, rows)
            steps = self._step_shift(prev, s.shift, len(rows)) if s.shift is not None else None
            masks = bitmask() if bitmask is not None else None
            st = SamplingTensors.build(rows, logits.shape[-1], self.device, steps, masks)
            result = sample(logits, st)
        # 4. Speculative steps: accepted counts and the next drafts, all on the device.
        sampled = result.token_ids
        # spec_force_accept (benchmarks): the first f drafts become the emitted tokens, written
        # into `sampled` by the accept kernel.
        accepted = drafts = None
        if s.graphed:  # the accept-and-draft graph reads the tokens where the replay left them
            own = graphs.last_sampled[: len(rows)]
            if sampled.data_ptr() != own.data_ptr():
                own.copy_(sampled)
            sampled = own
            # It also copies them to where the next decode graph step gathers its inputs.
            accepted, drafts, results = self.draft_graphs.draft(len(h.seg_starts))
            if h.states is not None:  # each row's state after its last accepted token
                slots = graphs.state_inputs[0, : len(h.q_lens)]
                commit_graphed_states(self.states, h.states, slots, accepted, self.device)
                if batch.state_saves:
                    self._save_states(batch)
                if batch.token_saves:
                    self._save_token_states(batch, h, graphs.positions(len(h.q_lens)))
        elif x is not None and x.draft_next is not None:
            accepted = self.spec.accept(sampled, x.draft_next, x.seg_starts)
            if x.keep_states is not None:  # each row's state after its last accepted token
                commit_token_states(self.states, x.metadata.state_slots, *x.keep_states, accepted)
                if batch.state_saves:
                    self._save_states(batch)
                if batch.token_saves:
                    self._save_token_states(batch, h, x.positions)
        last = self.graphs.last_sampled if self.graphs is not None else None
        if (
            not s.graphed
            and last is not None
            and sampled.data_ptr() != last.data_ptr()
            and len(rows) <= len(last)
        ):
            last[: len(rows)].copy_(sampled)  # where the next graph step gathers its inputs
        if self.mtp is not None and not s.graphed:
            drafts = self.drafter.drafts(x, hidden, sampled, accepted)
        step = PendingStep(h.seg_starts, rows, sampled)
        if self.mtp is not None:  # the next step may start from these on the device
            step.seg_dev, step.accepted, step.drafts = s.seg_dev, accepted, drafts
        # 5. Device -> pinned host copies, then an event: `result()` waits on that event only.
        logprobs = [to_host(t) for t in (result.logprobs, result.top_ids, result.top_logprobs)]
        if s.graphed:  # tokens, accepted counts and drafts in one copy
            step.host = self.draft_graphs.split(to_host(results), len(h.seg_starts)) + logprobs
        else:
            step.host = [to_host(t) for t in (sampled, accepted, drafts)] + logprobs
        step.prompt = prompt
        if self.device.type == "cuda":
            step.event = torch.cuda.Event()
            step.event.record()
        return step

    def _copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """(source row, destination row) copies of every DeltaNet layer's state, enqueued on
        the device (the index lists travel through pinned memory: no host sync)."""
        src, dst = zip(*pairs)
        copy_states(self.states, to_device(src, self.device), to_device(dst, self.device))

    def _save_token_states(self, batch: ScheduledBatch, h: HostInputs, positions) -> None:
        dst = [self.checkpoint_base + c for _, _, c in batch.token_saves]
        save_token_states(self.states, batch, h.states.keep, positions, dst, self.device)

    def _save_states(self, batch: ScheduledBatch) -> None:
        """Checkpoints of the states this step computed (rows whose chunk ends a block)."""
        self._copy_states([(s, self.checkpoint_base + c) for s, c in batch.state_saves])

    def _stage(self, h: HostInputs, graphs, prev: PendingStep | None) -> Staged:
        """The step's device inputs: StepInputs (eager forward, speculative bookkeeping) or a
        verify graph's `extra` arrays, and the `fix` past the MTP step in flight (`shift`)."""
        # A verify-graph step of an MTP model accepts and drafts in a graph of its own, right
        # after the verify replay; its drafts, KV limits and shift entries go to the device with
        # the replay's inputs (`extra`), so it needs no StepInputs. Plain graph steps copy
        # nothing else either: the graph reads its own buffer.
        graphed = self.mtp is not None and graphs is not None and graphs is self.verify_graphs
        plain = graphs is not None and not h.spec and self.mtp is None
        x = None if graphed or plain else self._device_inputs(h)
        s = Staged(x, graphed)
        if graphed:
            extra = self.draft_graphs.extras(h.draft_next, h.limits, self.config.spec_force_accept)
            if h.shift_tok:
                extra += [
                    h.shift_tok,
                    h.shift_seq,
                    h.shift_j,
                    h.shift_row,
                    h.shift_num,
                    h.shift_logit,
                ]
            views = graphs.extra_views(len(h.q_lens), [len(e) for e in extra])
            draft_next, s.shift = views[0][: len(h.draft_next)], tuple(views[2:]) or None
            s.extra = extra
            s.seg_dev = self.draft_graphs.seg_starts[: len(h.seg_starts)]  # every row q rows
        elif x is not None:
            draft_next, s.shift, s.seg_dev = x.draft_next, x.shift, x.seg_starts
        if (shift := s.shift) is None:  # else: tokens of the MTP step in flight
            return s

        def fix(*inputs, draft_next=draft_next):  # ids, positions, slots, ctx, tables
            outs = (prev.accepted, prev.sampled, prev.seg_dev, prev.drafts)
            shift_inputs(shift, outs, inputs, self.block_size, draft_next)

        # A verify-graph step fixes its own buffers (`graphs.run`) and drafts from them;
        # otherwise the eager forward or the eager MTP drafting reads these.
        s.fix = fix
        if not graphed:
            md = x.metadata
            fix(x.input_ids, x.positions, md.slot_mapping, md.context_lens, md.block_tables)
            # A decode graph (eager MTP drafting) still fixes its own input buffers; the
            # drafts to verify are fixed already.
            s.fix = functools.partial(fix, draft_next=None) if graphs is not None else None
            if self.device.type == "cpu":  # the CPU attention reads host lengths (no sync)
                md.context_lens_cpu = md.context_lens.tolist()
                md.max_context_len = max(md.context_lens_cpu)
            else:
                md.max_context_len += self.config.num_speculative_tokens
        return s

    def _logits(
        self,
        h: HostInputs,
        x: StepInputs | None,
        hidden: torch.Tensor,
        all_logits: torch.Tensor | None,
        graph_rows: bool,
    ) -> torch.Tensor:
        """(R, V) float32 logits of the sampled rows: the graph's, or the LM head's (eager)."""
        if graph_rows:
            return all_logits[: len(h.logits_idx)]  # a mixed graph's chunk may not sample
        idx = x.idx if x is not None else to_device(h.logits_idx, self.device)
        if all_logits is not None:
            return all_logits[idx]
        return self.model.compute_logits(hidden[idx])

    def _prompt_scores(self, h: HostInputs, x: StepInputs, hidden: torch.Tensor) -> PromptScores:
        """Logprobs of the prompt tokens this step scores: float32 log_softmax of the logits of
        the positions before them, the scored token's gathered and the top-k, copied to pinned
        host memory with the step's results. The logits go through in slices of max_num_seqs
        rows (what num_kv_blocks' profile left room for): never (P, V) floats at once."""
        idx, next_ids = x.prompt  # (P,) token index in this step, (P,) the token it scores
        num, k, dev = len(h.prompt_idx), h.prompt_top_k, self.device
        logprobs = torch.empty(num, dtype=torch.float32, device=dev)
        top_ids = torch.empty(num, k, dtype=torch.long, device=dev) if k else None
        top_lps = torch.empty(num, k, dtype=torch.float32, device=dev) if k else None
        for a in range(0, num, self.config.max_num_seqs):
            b = min(num, a + self.config.max_num_seqs)
            lp = torch.log_softmax(self.model.compute_logits(hidden[idx[a:b]]), dim=-1)  # (b-a, V)
            logprobs[a:b] = lp.gather(1, next_ids[a:b, None]).squeeze(1)
            if k:
                top_lps[a:b], top_ids[a:b] = lp.topk(k, dim=-1)
        host = [to_host(t) for t in (logprobs, top_ids, top_lps)]
        return PromptScores(h.prompt_rows, h.prompt_next, host)

    def _step_shift(
        self, prev: PendingStep, shift: tuple[torch.Tensor, ...], num_rows: int
    ) -> torch.Tensor:
        """(R,) RNG counter steps each logits row still lacks: a row's counter is its emitted
        count, which the step in flight raises by the drafts it accepts (so seeded sampling
        draws what the synchronous loop draws)."""
        _, seq, _, _, _, logit = shift
        steps = torch.zeros(num_rows, dtype=torch.long, device=self.device)
        return steps.index_add_(0, logit, prev.num_accepted()[seq])  # each shifted row, once

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
