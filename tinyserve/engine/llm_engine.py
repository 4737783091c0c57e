"""The engine: request lifecycle (add / step / abort) around the scheduler and the runner.

`LLMEngine.step()` runs one iteration of the step loop and returns the deltas of the requests
that moved. `add_request` and `abort` may be called from another thread than `step` (the async
engine runs steps in a worker thread): they only validate and push onto inboxes that `step`
drains in phase 1, so scheduler state is touched by one thread only.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass

import torch

from tinyserve.config import EngineConfig
from tinyserve.core.block_pool import BlockPool
from tinyserve.core.scheduler import ScheduledBatch, Scheduler
from tinyserve.core.sequence import PLACEHOLDER, Sequence, SequenceStatus
from tinyserve.core.state_pool import StatePool
from tinyserve.engine.constraints import Constraints
from tinyserve.engine.requests import Request, RequestIntake
from tinyserve.model.config import ModelConfig, resolve_dtype
from tinyserve.model.tokenizer import Tokenizer
from tinyserve.outputs import CompletionOutput, RequestOutput
from tinyserve.runner.model_runner import ModelRunner
from tinyserve.runner.pending import PendingStep
from tinyserve.sample.grammar import Grammar, GrammarCompiler
from tinyserve.sample.sampler import SamplingRow
from tinyserve.sampling_params import InvalidParameter, SamplingParams, StructuredOutputsParams
from tinyserve.spec.speculator import Speculator

log = logging.getLogger("tinyserve.engine")


LANE_IDLE_S = 0.001  # a step with nothing to run but prefill-lane chunks in flight sleeps this


@dataclass(slots=True)
class InFlight:
    """A launched step awaiting post-processing."""

    batch: ScheduledBatch
    sampled: list[int]  # batch rows that sample
    drafted: list[int]  # drafts each batch row carried
    pending: PendingStep
    # Overlapped loop: batch row -> index of its PLACEHOLDER in token_ids (None: synchronous).
    positions: dict[int, int] | None


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.model is None:
            from tinyserve.model.gguf import default_model_path

            config.model = default_model_path()
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        # Hybrid models: state slots beside paged KV.
        self.is_hybrid = "linear_attention" in self.model_config.layer_types
        # A checkpoint without tokenizer.json (dummy benchmark shapes) takes and gives token ids.
        has_tokenizer = os.path.exists(os.path.join(config.model, "tokenizer.json"))
        self.tokenizer = Tokenizer.from_pretrained(config.model) if has_tokenizer else None
        device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.model_config, device)
        # Speculative decoding, whatever the method (None: off); the runner verifies through it.
        self.spec = Speculator(config) if config.speculative_method is not None else None
        self.runner = ModelRunner(self.model_config, config, self.dtype, self.spec)
        self.pool = BlockPool(
            self.runner.num_kv_blocks,
            config.block_size,
            config.enable_prefix_caching,
            key_next_token=self.spec is not None and self.spec.keys_next_token,
        )
        # Hybrid models: runtime state slots, and the checkpoints prefix hits resume from.
        states = (
            StatePool(
                config.max_num_seqs,
                self.runner.num_checkpoints,
                decode_interval=config.prefix_cache_decode_state_interval,
                checkpoint_base=self.runner.checkpoint_base,
            )
            if self.is_hybrid
            else None
        )
        self.pool.states = states if config.enable_prefix_caching else None
        capacity = self.pool.num_blocks * config.block_size
        limit = config.max_model_len or self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > capacity:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the KV cache capacity of "
                f"{capacity} tokens: lower max_model_len or give the KV cache more memory"
            )
        # NOTE: a sequence of max_model_len tokens always fits the whole pool, so any admitted
        # request can run to completion once the others finish (no hang, only waiting).
        self.max_model_len = min(limit, capacity)
        self.scheduler = Scheduler(
            self.pool,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            spec_lookahead=self.spec.lookahead if self.spec is not None else 0,
            max_model_len=self.max_model_len,
            lane_chunk=self.runner.lane.chunk if self.runner.lane is not None else 0,
            lane_depth=self.runner.lane.depth if self.runner.lane is not None else 0,
            lane_limit=self.runner.max_blocks_per_seq * config.block_size,
            state_pool=states,
        )
        self._in_flight: InFlight | None = None  # the overlapped loop's launched step
        self.requests: dict[str, Request] = {}
        self._new: deque[Request] = deque()
        self._aborted: deque[str] = deque()
        vocab, eos = self.model_config.vocab_size, self.model_config.eos_token_ids
        self.intake = RequestIntake(self.tokenizer, vocab, self.max_model_len, config.seed)
        self.grammar_compiler = (
            GrammarCompiler(self.tokenizer, vocab, eos) if has_tokenizer else None
        )
        k = config.num_speculative_tokens if self.spec is not None else 0
        pin = device.type == "cuda"
        self.constraints = Constraints(self.requests, vocab, pin, self.spec is not None, k)

    def compile_grammar(self, spec: StructuredOutputsParams) -> Grammar:
        """The compiled grammar of a structured-outputs spec (cached by spec), for `add_request`.
        Thread-safe and GIL-free while compiling: the server calls it in an executor. Raises
        InvalidParameter for a schema, regex or grammar xgrammar rejects."""
        if self.grammar_compiler is None:
            raise InvalidParameter("structured_outputs", "this model has no tokenizer")
        return self.grammar_compiler.compile(spec)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.pool.block_size

    def has_unfinished(self) -> bool:
        return bool(self.requests or self._new or self._aborted)

    # -- request lifecycle ----------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        mm_spans: list[tuple[int, int, str]] = (),
        grammar: Grammar | None = None,
    ) -> None:
        """Validate and queue a request; raises InvalidParameter for bad input (nothing queued).

        `cache_salt` isolates the request's prefix-cache entries from other salts (tenants);
        `mm_spans` are (start, end, content hash) of media placeholder ranges in the prompt.
        `grammar`: `compile_grammar(params.structured_outputs)`, compiled off the caller's
        thread; without it a spec is compiled here.
        """
        params = params or SamplingParams()
        if request_id in self.requests or any(r.request_id == request_id for r in self._new):
            raise InvalidParameter("request_id", f"request id {request_id!r} is already in use")
        req = self.intake.build(
            request_id, prompt, params, grammar, self.compile_grammar, cache_salt, mm_spans
        )
        self._new.append(req)

    def abort(self, request_id: str) -> None:
        self._aborted.append(request_id)

    # -- the step loop ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        deltas: dict[str, RequestOutput] = {}
        # 1) take new and aborted requests
        while self._new:
            req = self._new.popleft()
            self.requests[req.request_id] = req
            self.constraints.admit(req)
            for seq in req.seqs:
                self.scheduler.add(seq)
        while self._aborted:
            req = self.requests.get(self._aborted.popleft())
            if req is not None:
                for seq in req.seqs:
                    if not seq.is_finished:
                        self.scheduler.finish(seq, "abort")
                        self._delta(deltas, req, seq, [], "")
        lane = self.runner.lane
        if lane is not None:  # prefill-lane chunks done since the last step
            self.scheduler.lane_finished(lane.poll())
        if self._can_overlap():
            # 2) schedule N+1 and 3) launch it before N's tokens are on the host (its inputs
            # come from N's sampled ids on the device); 4) post-process N meanwhile.
            batch = self.scheduler.schedule()
            launched = self._launch(batch, overlap=True) if batch is not None else None
            self._launch_lane()
            if self._in_flight is not None:
                self._post_process(self._in_flight, deltas)
            self._in_flight = launched
        else:
            if self._in_flight is not None:  # leaving the overlapped loop: drain it first
                self._post_process(self._in_flight, deltas)
                self._in_flight = None
            batch = self.scheduler.schedule()
            self._launch_lane()
            if batch is not None:
                self._post_process(self._launch(batch, overlap=False), deltas)
        if batch is None and self._in_flight is None and self.scheduler.lane:
            # Only the prefill lane works (its streams finished meanwhile): wait a little
            # instead of spinning the host, which would also take the GIL from the server.
            time.sleep(LANE_IDLE_S)
        for rid in [rid for rid, d in deltas.items() if d.finished]:
            req = self.requests.pop(rid)
            self.constraints.release(req)
        return list(deltas.values())

    def _launch_lane(self) -> None:
        """This step's prefill-lane chunks: after the overlapped loop's step (the decode rows
        go first), before a step the loop then waits for."""
        for seq, start, num in self.scheduler.lane_launches:
            self.runner.lane.launch(seq.token_ids[start : start + num], start, seq.block_table)

    def _can_overlap(self) -> bool:
        """The overlapped loop needs every next input computable on the device: not with
        penalties (they count token values), nor with host-side drafters (n-gram drafts read
        the accepted tokens). MTP drafts, the accepted counts and the positions they move stay
        on the device, for rows whose sampling does not depend on their output count."""
        if not self.config.async_scheduling or (
            self.spec is not None and not self.spec.drafts_on_device
        ):
            return False
        return self.constraints.allow_overlap  # O(1): every step

    def _launch(self, batch: ScheduledBatch, overlap: bool) -> InFlight:
        sampled = [i for i in range(len(batch.seqs)) if batch.samples(i)]
        rows = [row for i in sampled for row in self._sampling_rows(batch.seqs[i])]
        drafted = [len(seq.draft_ids) for seq in batch.seqs]
        prev = self._in_flight.pending if overlap and self._in_flight else None
        seqs = [batch.seqs[i] for i in sampled]
        # Grammar masks and forced end ids: the runner fills them once the forward is enqueued,
        # so the host works while the device runs it.
        bitmask = self.constraints.masks(seqs, prev)
        pending = self.runner.launch(batch, rows, prev, bitmask)
        positions = None
        if overlap:  # advance now: the next schedule must see this step's tokens as computed
            positions = {}
            for seq, num, d in zip(batch.seqs, batch.num_new_tokens, drafted):
                seq.num_kv_computed += num - d  # drafts count once verified (post-process)
            for j, i in enumerate(sampled):
                seq = batch.seqs[i]
                positions[i] = len(seq.token_ids)
                seq.token_ids.append(PLACEHOLDER)
                seq.pending_row = j
                if self.spec is not None:  # the next step drafts from the device
                    in_flight = seq.num_unverified + drafted[i]  # this step's and the last's
                    num = self.spec.num_drafts(seq, self.max_model_len, in_flight)
                    seq.draft_ids = [PLACEHOLDER] * num
                    seq.num_unverified = drafted[i]
        return InFlight(batch, sampled, drafted, pending, positions)

    def _post_process(self, step: InFlight, deltas: dict) -> None:
        """Verified tokens in, stop checks, detokenize, commit full blocks, free; drafts."""
        outs = iter(step.pending.result())
        sampled = set(step.sampled)
        token_saves: dict[int, list[tuple[int, int]]] = {}  # row -> [(position, checkpoint)]
        for row, position, ck in (step.batch.token_saves or []) + (step.batch.unsure_saves or []):
            token_saves.setdefault(row, []).append((position, ck))
        scored = step.pending.prompt_logprobs()  # batch row -> (position, entries)
        for i, (seq, num) in enumerate(zip(step.batch.seqs, step.batch.num_new_tokens)):
            out = next(outs) if i in sampled else None
            if seq.is_finished:
                continue  # aborted, or stopped one step earlier (overlap): drop its results
            if i in scored and (acc := self.requests[seq.request_id].prompt_logprobs):
                # Position p's logits score prompt token p + 1 (a recompute after preemption
                # writes the same entries again).
                position, entries = scored[i]
                acc[position + 1 : position + 1 + len(entries)] = entries
            if out is None:
                if step.positions is None:
                    seq.num_kv_computed += num
                self.pool.commit(seq)  # full blocks of final tokens enter the trie
                continue
            later: list[int] = []
            if step.positions is not None:  # overlap: the placeholder, and any after it
                # Accepted drafts of an earlier step may have moved it right since the launch.
                pos = seq.token_ids.index(PLACEHOLDER, step.positions[i])
                later = seq.token_ids[pos + 1 :]
                del seq.token_ids[pos:]
            num_drafts = step.drafted[i]
            if num_drafts:
                self.spec.record(seq, num_drafts, len(out.tokens) - 1)
            if i in token_saves:  # kept if a token of this step's accepted ones ends there
                start = len(seq.token_ids) - 1  # the row's first token's position
                states = self.scheduler.state_pool
                for position, ck in token_saves[i]:
                    kept = start < position <= start + len(out.tokens)
                    states.settle_speculative_save(seq.seq_id, position, ck, kept)
            reason, delta = self._append_tokens(seq, out.tokens)
            running = seq.status is SequenceStatus.RUNNING  # not preempted meanwhile
            if step.positions is None:
                # Every token but the last now has KV (rejected drafts' slots are garbage).
                seq.num_kv_computed = seq.num_tokens - 1
            else:
                if running:
                    seq.num_kv_computed += len(out.tokens) - 1  # the accepted drafts' KV
                if reason is None:
                    seq.token_ids += later  # the next step's placeholder goes back after it
            self.pool.commit(seq)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            elif self.spec is not None and not later:
                # No step of this row in flight: release the lookahead slots past the verified
                # tokens, and the next step drafts on the host's copy. (With one in flight, its
                # drafts are on the device and it may still write those slots.)
                seq.num_unverified = 0
                self.pool.trim(seq)
                seq.draft_ids = (
                    self.spec.next_drafts(seq, out.draft_ids, self.max_model_len) if running else []
                )
                req = self.requests[seq.request_id]
                r = req.reasoning[seq.index] if req.reasoning else None
                if seq.draft_ids and r is not None:
                    seq.draft_ids = r.trim_drafts(seq.draft_ids)
                if seq.draft_ids and req.grammars and (r is None or r.is_ended):
                    seq.draft_ids = req.grammars[seq.index].valid_drafts(seq.draft_ids)
            self._delta(deltas, self.requests[seq.request_id], seq, *delta)

    def _sampling_rows(self, seq: Sequence) -> list[SamplingRow]:
        """One row per position sampled: the last token's, then one after each draft (the RNG
        counter and the penalties see the drafts before it as already generated)."""
        p = seq.params
        drafts = seq.draft_ids
        # Copying token lists every step costs O(context) per row: only penalties need them.
        if p.needs_token_values:
            out = seq.output_ids
            return [
                SamplingRow(p, seq.seed, seq.prompt_ids, out + drafts[:j])
                for j in range(len(drafts) + 1)
            ]
        # Empty tuples, not lists: no objects for the collector to track, which at 64 MTP rows
        # a step (two rows each) ran a gen-0 collection every step (docs/benchmark-log.md).
        n = seq.num_output_tokens
        return [SamplingRow(p, seq.seed, (), (), step=n + j) for j in range(len(drafts) + 1)]

    def _append_tokens(self, seq: Sequence, outs) -> tuple[str | None, tuple]:
        """Append a step's verified tokens up to the first stop; returns the finish reason and
        the delta's (token ids, text, logprobs)."""
        req = self.requests[seq.request_id]
        p = seq.params
        detok = req.detoks[seq.index]
        ids, text, logprobs, reason, stop_reason = [], "", None, None, None
        r = req.reasoning[seq.index] if req.reasoning else None
        for out in outs:
            token = out.token_id
            grammar = req.grammars and (r is None or r.is_ended)  # before this token: answer
            if r is not None:
                r.advance(token)
            seq.token_ids.append(token)
            ids.append(token)
            text += detok.add([token]) if detok else ""
            if p.logprobs is not None:
                logprobs = (logprobs or []) + [{token: out.logprob, **dict(out.top_logprobs or [])}]
            if token in p.stop_token_ids:
                reason, stop_reason = "stop", token
            elif not p.ignore_eos and token in self.model_config.eos_token_ids:
                reason = "stop"
            elif detok and detok.stopped:
                reason, stop_reason = "stop", detok.stop_reason
                if p.include_stop_str_in_output:
                    text += detok.stop_reason
            elif grammar and req.grammars[seq.index].finishes_on(token):
                reason = "stop"  # the grammar ended (its EOS taken, even with ignore_eos)
            elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = "length"
            if reason is not None:
                break  # drafts accepted past a stop are dropped
        if r is not None:
            self.constraints.may_sync(r)
        if reason is not None and detok and not detok.stopped:
            text += detok.flush()
        seq.stop_reason = stop_reason
        return reason, (ids, text, logprobs)

    def _delta(self, deltas, req: Request, seq: Sequence, ids, text, logprobs=None) -> None:
        d = deltas.get(req.request_id)
        if d is None:
            d = deltas[req.request_id] = RequestOutput(
                req.request_id, req.prompt, req.prompt_ids, [], num_cached_tokens=0
            )
        if ids and seq.index == 0 and req.prompt_logprobs is not None:  # complete: hand over
            d.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None
        d.outputs.append(
            CompletionOutput(seq.index, text, ids, seq.finish_reason, seq.stop_reason, logprobs)
        )
        seqs = req.seqs
        if len(seqs) == 1:  # the common case, without generator overhead (called per token)
            d.finished = seq.is_finished
            d.num_cached_tokens = seq.num_cached_tokens
            d.num_draft_tokens, d.num_accepted_tokens = (
                seq.num_draft_tokens,
                seq.num_accepted_tokens,
            )
            return
        d.finished = req.is_finished
        d.num_cached_tokens = min(s.num_cached_tokens for s in seqs)
        d.num_draft_tokens = sum(s.num_draft_tokens for s in seqs)
        d.num_accepted_tokens = sum(s.num_accepted_tokens for s in seqs)

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
        self.constraints.check_invariants()
        if not self.scheduler.has_work:
            assert self.pool.num_free_blocks == self.pool.num_blocks, "KV blocks leaked"
