"""The paged KV cache: bytes per block, how many blocks a device gets, and the one allocation
that every attention layer views.

Sizing without `num_kv_blocks`: on a GPU, what `gpu_memory_utilization` leaves after the weights
and the largest forward. On the CPU there is no memory to profile, so the cache is sized from
the limits the user set: `max_num_seqs` sequences sharing CPU_KV_CONTEXTS contexts of
`max_model_len` tokens, plus a partly filled last block for each of them (one block a
sequence), and never more than half the machine's memory. SmolLM2-135M (fp32, 8192 tokens, 256
sequences): 1280 blocks, 20480 tokens, 900 MiB. The CPU cache is an anonymous mapping whose
pages the kernel backs as they are first touched: an idle server holds none of it, a busy one
the blocks it has used. A hybrid model's KV is its attention layers' only (`attn_layers`), and
on a GPU its state rows (`runner.state_bytes`, allocated after the cache) come off the budget.
"""

from __future__ import annotations

import logging
import math
import mmap
import os

import torch

from tinyserve.config import EngineConfig
from tinyserve.model.config import ModelConfig

log = logging.getLogger("tinyserve.runner.kv_cache")

CPU_KV_CONTEXTS = 2  # full-length contexts the default CPU cache holds at once


def kv_bytes_per_block(
    mc: ModelConfig, attn_layers: list, dtype: torch.dtype, block_size: int
) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    per_token = 2 * len(attn_layers) * mc.num_key_value_heads * mc.head_dim * elem
    return per_token * block_size


def num_kv_blocks(runner) -> int:
    """Blocks for the KV cache when the user gave no `num_kv_blocks` (the module's rule)."""
    device, config, per_block = runner.device, runner.config, runner.kv_bytes_per_block
    if device.type != "cuda":
        return cpu_num_kv_blocks(config, runner.model_config, per_block)
    torch.cuda.reset_peak_memory_stats(device)
    num = min(config.max_num_batched_tokens, runner.model_config.max_position_embeddings)
    ids = torch.zeros(num, dtype=torch.long, device=device)
    with torch.inference_mode():
        hidden = runner.model(ids, torch.arange(num, device=device))
        runner.model.compute_logits(hidden[-config.max_num_seqs :])
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_allocated(device)
    used_by_others = total - free - torch.cuda.memory_reserved(device)
    util = config.gpu_memory_utilization
    budget = total * util - peak - used_by_others - runner.state_bytes
    torch.cuda.empty_cache()
    # The KV cache is one allocation, and cached segments that a live tensor splits cannot hold
    # it (an earlier engine in the same process), so it must also fit the device's free memory.
    budget = min(
        budget, torch.cuda.mem_get_info(device)[0] - (1 - util) * total - runner.state_bytes
    )
    if budget < per_block:
        raise no_kv_memory(config, runner.num_state_slots, runner.state_bytes)
    log.info(
        "KV cache budget: %.2f GiB of %.2f GiB (gpu_memory_utilization %.2f, peak forward "
        "%.2f GiB, other processes %.2f GiB, state slots %.2f GiB)",
        budget / 2**30,
        total / 2**30,
        util,
        peak / 2**30,
        used_by_others / 2**30,
        runner.state_bytes / 2**30,
    )
    return int(budget // per_block)


def no_kv_memory(config: EngineConfig, num_state_rows: int, state_bytes: int) -> RuntimeError:
    """The error when nothing is left for the KV cache, naming what to lower: on a hybrid
    model the recurrent-state rows (one per sequence, per draft token with speculation, per
    checkpoint) can take most of the device at a large max_num_seqs."""
    fix = "raise it or lower max_num_batched_tokens"
    if state_bytes:
        fix += (
            f"; the {num_state_rows} recurrent-state rows take {state_bytes / 2**30:.1f} GiB "
            f"(max_num_seqs={config.max_num_seqs}, x (num_speculative_tokens + 1) with "
            "speculation, plus prefix_cache_state_budget checkpoints): lower max_num_seqs"
        )
    return RuntimeError(
        f"no memory left for the KV cache at gpu_memory_utilization="
        f"{config.gpu_memory_utilization}: {fix}"
    )


def cpu_num_kv_blocks(config: EngineConfig, mc: ModelConfig, per_block: int) -> int:
    """CPU_KV_CONTEXTS x max_model_len tokens plus a block per sequence, at most half the RAM."""
    max_len = min(config.max_model_len or 1 << 62, mc.max_position_embeddings)
    num = -(-CPU_KV_CONTEXTS * max_len // config.block_size) + config.max_num_seqs
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if num * per_block > ram // 2:
        num = max(1, ram // 2 // per_block)
        log.warning(
            "KV cache: %d x max_model_len %d tokens exceed half this machine's memory; %d "
            "blocks (lower max_model_len, or set num_kv_blocks)",
            CPU_KV_CONTEXTS,
            max_len,
            num,
        )
    else:
        log.info(
            "KV cache sized for the CPU: %d x max_model_len %d tokens + a block for each of "
            "max_num_seqs %d",
            CPU_KV_CONTEXTS,
            max_len,
            config.max_num_seqs,
        )
    return num


def allocate_kv_cache(
    attn_layers: list,
    mc: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """(2, layers, blocks + 1, block_size, kv_heads, head_dim): one allocation, per-layer views.
    The extra last block is scratch for CUDA-graph padding rows; the pool never hands it out.
    Zeros either way (keys never written must not be NaN: a masked score times NaN is NaN)."""
    shape = (2, len(attn_layers), num_blocks + 1, block_size, mc.num_key_value_heads, mc.head_dim)
    if device.type == "cpu":
        # torch.zeros would write every page now; an anonymous mapping reads as zeros and takes
        # memory as blocks are first touched (the mapping lives as long as the tensor).
        numel = math.prod(shape)
        nbytes = numel * torch.tensor([], dtype=dtype).element_size()
        cache = torch.frombuffer(mmap.mmap(-1, max(1, nbytes)), dtype=dtype, count=numel)
        cache = cache.view(shape)
    else:
        cache = torch.zeros(shape, dtype=dtype, device=device)
    log.info(
        "KV cache: %d blocks of %d tokens = %d tokens, %.1f MiB (%s, %s)",
        num_blocks,
        block_size,
        num_blocks * block_size,
        cache.numel() * cache.element_size() / 2**20,
        device,
        str(dtype).removeprefix("torch."),
    )
    for i, layer in enumerate(attn_layers):
        layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
    return cache
