"""Model runner: owns the weights and the KV cache, turns a ScheduledBatch into tensors, runs the
forward and the sampler. No policy lives here (that is the scheduler's job).

The only host sync is `execute`'s final copy of the sampled ids (and logprobs) to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tinyserve.config import EngineConfig, ModelConfig
from tinyserve.layers.attention import Attention, AttentionMetadata, forward_context
from tinyserve.loader import load_model
from tinyserve.sampling import SamplingRow, SamplingTensors, sample
from tinyserve.scheduler import ScheduledBatch

CPU_KV_CACHE_BYTES = 4 << 30  # default KV budget on CPU, where there is no memory to profile


@dataclass(slots=True)
class RowOutput:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class ModelRunner:
    def __init__(self, model_config: ModelConfig, config: EngineConfig, dtype: torch.dtype) -> None:
        self.model_config = model_config
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = dtype
        self.block_size = config.block_size
        self.model = load_model(model_config, dtype, self.device, config.load_format, config.seed)
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
        self.graphs = None
        if self.device.type == "cuda" and not config.enforce_eager:
            from tinyserve.graphs import DecodeGraphs

            self.graphs = DecodeGraphs(
                self.model, config.max_num_seqs, self.max_blocks_per_seq, self.num_kv_blocks,
                self.block_size,
            )  # fmt: skip

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
        budget = total * self.config.gpu_memory_utilization - peak - used_by_others
        torch.cuda.empty_cache()
        if budget < self.kv_bytes_per_block:
            raise RuntimeError(
                f"no memory left for the KV cache at gpu_memory_utilization="
                f"{self.config.gpu_memory_utilization}: raise it or lower max_num_batched_tokens"
            )
        return int(budget // self.kv_bytes_per_block)

    def _prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_q = [0]
        ctx_lens: list[int] = []
        logits_idx: list[int] = []
        for seq, num in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_kv_computed, seq.num_kv_computed + num
            input_ids += seq.token_ids[start:end]
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
            if end == seq.num_tokens:
                logits_idx.append(cu_q[-1] - 1)
        width = max(len(s.block_table) for s in batch.seqs)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in batch.seqs]
        dev = self.device

        def t(x: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype, pin_memory=dev.type == "cuda").to(
                dev, non_blocking=True
            )

        q_lens = batch.num_new_tokens
        self._metadata = AttentionMetadata(
            slot_mapping=t(slots, torch.long),
            block_tables=t(tables, torch.int32),
            cu_seqlens_q=t(cu_q, torch.int32),
            context_lens=t(ctx_lens, torch.int32),
            query_lens_cpu=list(q_lens),
            context_lens_cpu=ctx_lens,
            max_context_len=max(ctx_lens),
            is_decode_only=all(n == 1 for n in q_lens),
        )
        if self._metadata.is_decode_only and dev.type == "cuda":
            from tinyserve.graphs import decode_num_splits

            mc = self.model_config
            self._metadata.num_splits = decode_num_splits(
                len(q_lens), self.config.max_num_seqs, mc.num_key_value_heads,
                self.max_blocks_per_seq * self.block_size, dev,
            )  # fmt: skip
        return t(input_ids, torch.long), t(positions, torch.long), logits_idx

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, rows: list[SamplingRow]) -> list[RowOutput]:
        """Forward the batch; sample one token for each row that reached its last known token.

        `rows` holds the sampling state of those rows, in batch order.
        """
        input_ids, positions, logits_idx = self._prepare(batch)
        md = self._metadata
        if md.is_decode_only and self.graphs is not None and self.graphs.can_run(len(rows)):
            logits = self.graphs.run(input_ids, positions, md.slot_mapping, md.context_lens,
                                     md.block_tables)  # fmt: skip
        else:
            with forward_context(md):
                hidden = self.model(input_ids, positions)
            if not logits_idx:
                return []  # only non-final prefill chunks: no logits, nothing sampled
            idx = torch.tensor(logits_idx, device=self.device)
            logits = self.model.compute_logits(hidden[idx])  # (N, V) float32
        assert len(rows) == len(logits_idx)
        self._mask_stop_tokens(logits, rows)
        result = sample(logits, SamplingTensors.build(rows, logits.shape[-1], self.device))
        # NOTE: the one host sync of a step.
        token_ids = result.token_ids.tolist()
        logprobs = result.logprobs.tolist() if result.logprobs is not None else None
        tops = None
        if result.top_ids is not None:
            tops = list(zip(result.top_ids.tolist(), result.top_logprobs.tolist()))
        outs = []
        for i, (tok, row) in enumerate(zip(token_ids, rows)):
            out = RowOutput(tok)
            if row.params.logprobs is not None and logprobs is not None:
                out.logprob = logprobs[i]
                k = row.params.logprobs
                out.top_logprobs = list(zip(tops[i][0][:k], tops[i][1][:k])) if tops else []
            outs.append(out)
        return outs

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
            logits[torch.tensor(r), torch.tensor(c)] = float("-inf")

    @property
    def eos_ids(self) -> list[int]:
        return self.model_config.eos_token_ids
