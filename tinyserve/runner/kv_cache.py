"""The paged KV cache: bytes per block, how many blocks a device gets, and the one allocation
that every attention layer views."""

from __future__ import annotations

import torch

from tinyserve.model.config import ModelConfig

CPU_KV_CACHE_BYTES = 4 << 30  # default KV budget on CPU, where there is no memory to profile


def kv_bytes_per_block(
    mc: ModelConfig, attn_layers: list, dtype: torch.dtype, block_size: int
) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    per_token = 2 * len(attn_layers) * mc.num_key_value_heads * mc.head_dim * elem
    return per_token * block_size


def num_kv_blocks(runner) -> int:
    """Blocks for the KV cache when the user gave no `num_kv_blocks`: a fixed budget on the CPU;
    on a GPU, what is left of gpu_memory_utilization after the largest forward."""
    device, config, per_block = runner.device, runner.config, runner.kv_bytes_per_block
    if device.type != "cuda":
        return max(1, CPU_KV_CACHE_BYTES // per_block)
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
    budget = total * util - peak - used_by_others
    torch.cuda.empty_cache()
    # The KV cache is one allocation, and cached segments that a live tensor splits cannot hold
    # it (an earlier engine in the same process), so it must also fit the device's free memory.
    budget = min(budget, torch.cuda.mem_get_info(device)[0] - (1 - util) * total)
    if budget < per_block:
        raise RuntimeError(
            f"no memory left for the KV cache at gpu_memory_utilization="
            f"{config.gpu_memory_utilization}: raise it or lower max_num_batched_tokens"
        )
    return int(budget // per_block)


def allocate_kv_cache(
    attn_layers: list,
    mc: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """(2, layers, blocks + 1, block_size, kv_heads, head_dim): one allocation, per-layer views.
    The extra last block is scratch for CUDA-graph padding rows; the pool never hands it out."""
    cache = torch.zeros(
        2,
        len(attn_layers),
        num_blocks + 1,
        block_size,
        mc.num_key_value_heads,
        mc.head_dim,
        dtype=dtype,
        device=device,
    )
    for i, layer in enumerate(attn_layers):
        layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
    return cache
