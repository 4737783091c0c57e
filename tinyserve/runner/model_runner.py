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

Beside it: the graph sets and which one runs a step (graph_sets.py), a step's device inputs
(stage.py), its logits on the way to the sampler (step_logits.py), the state rows (states.py).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable

import torch

from tinyserve.config import EngineConfig
from tinyserve.core.scheduler import ScheduledBatch
from tinyserve.model.config import ModelConfig
from tinyserve.model.layers.attention import Attention, forward_context
from tinyserve.model.loader import load_model
from tinyserve.runner.graph_sets import (
    capture_graphs,
    capture_prefill_graphs,
    graphs_for,
    max_graph_chunk,
)
from tinyserve.runner.kv_cache import allocate_kv_cache, kv_bytes_per_block, num_kv_blocks
from tinyserve.runner.mtp_drafter import MtpDrafter
from tinyserve.runner.pending import PendingStep, to_host
from tinyserve.runner.prefill_lane import build_lane
from tinyserve.runner.stage import stage
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
from tinyserve.runner.step_inputs import HostInputs, build_host_inputs
from tinyserve.runner.step_logits import mask_stop_tokens, prompt_scores, sampled_logits, step_shift
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
            capture_graphs(self)  # runner/graph_sets.py
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
        """The longest prompt chunk with graphs (0: none): `graph_sets.max_graph_chunk`."""
        return max_graph_chunk(self)

    def capture_prefill_graphs(self, capture: bool) -> None:
        """The prompt-chunk graph sets: `graph_sets.capture_prefill_graphs`."""
        capture_prefill_graphs(self, capture)

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
        graphs = graphs_for(self, h)
        if batch.state_restores:  # prefix hits: their checkpoints into their slots, first
            self._copy_states([(self.checkpoint_base + c, s) for c, s in batch.state_restores])
        s = stage(self, h, graphs, prev)
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
        prompt = None
        if h.prompt_idx:
            prompt = prompt_scores(self.model, h, x, hidden, self.config.max_num_seqs, self.device)
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
            logits = sampled_logits(self.model, h, x, hidden, all_logits, graph_rows, self.device)
            mask_stop_tokens(logits, rows, self.eos_ids, self.device)
            steps = None
            if s.shift is not None:
                steps = step_shift(prev, s.shift, len(rows), self.device)
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

    @property
    def eos_ids(self) -> list[int]:
        return self.model_config.eos_token_ids
