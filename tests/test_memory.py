"""Memory: the CPU KV cache is sized from max_model_len and max_num_seqs (runner/kv_cache.py's
rule), takes memory as its blocks are used, and the default server idles under 1 GiB."""

from __future__ import annotations

import asyncio
import os
import re
from types import SimpleNamespace

import aiohttp
import pytest
import torch
from process_helpers import Server

from tinyserve.config import EngineConfig
from tinyserve.runner.kv_cache import (
    CPU_KV_CONTEXTS,
    allocate_kv_cache,
    cpu_num_kv_blocks,
    no_kv_memory,
)

IDLE_RSS_MB = 1024


def test_cpu_kv_cache_rule():
    mc = SimpleNamespace(max_position_embeddings=8192)
    config = EngineConfig(device="cpu", max_num_seqs=10, block_size=16)
    per_block = 46080 * 16  # SmolLM2-135M in fp32
    blocks = CPU_KV_CONTEXTS * 8192 // 16 + 10
    assert cpu_num_kv_blocks(config, mc, per_block) == blocks
    config = EngineConfig(device="cpu", max_model_len=1000, max_num_seqs=3, block_size=16)
    assert cpu_num_kv_blocks(config, mc, per_block) == -(-CPU_KV_CONTEXTS * 1000 // 16) + 3
    # never more than half the machine's memory (a model with a huge context)
    huge = SimpleNamespace(max_position_embeddings=1 << 40)
    blocks = cpu_num_kv_blocks(EngineConfig(device="cpu"), huge, per_block)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert blocks >= 1 and blocks * per_block <= ram // 2


def test_no_kv_memory_names_what_to_lower():
    """A dense model: the forward's budget. A hybrid one: its recurrent-state rows too (Qwen3.5-9B
    with MTP at max_num_seqs 512: 1,665 rows of 49 MiB, more than an H100 holds)."""
    config = EngineConfig(device="cpu", max_num_seqs=512)
    dense = str(no_kv_memory(config, 0, 0))
    assert "gpu_memory_utilization=0.9" in dense and "max_num_batched_tokens" in dense
    assert "max_num_seqs" not in dense
    hybrid = str(no_kv_memory(config, 1665, 1665 * 49 * 2**20))
    assert "1665 recurrent-state rows take 79.7 GiB (max_num_seqs=512" in hybrid
    assert hybrid.endswith("lower max_num_seqs")


def test_cpu_kv_cache_takes_memory_as_blocks_are_used():
    layers = [SimpleNamespace() for _ in range(4)]
    mc = SimpleNamespace(num_key_value_heads=2, head_dim=64)
    cache = allocate_kv_cache(layers, mc, 4096, 16, torch.float32, torch.device("cpu"))
    assert cache.shape == (2, 4, 4097, 16, 2, 64) and layers[3].v_cache.shape == (4097, 16, 2, 64)
    before = _rss_kb()
    assert not layers[0].k_cache[:8].any()  # zeros, like torch.zeros
    layers[0].k_cache[:8] = 1.0
    assert _rss_kb() - before < 8 * 1024  # 128 MiB mapped, a few pages touched


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1))


@pytest.mark.slow
def test_default_server_idles_under_1_gib(tmp_path, smollm2_path):
    server = Server(tmp_path)  # every flag at its default
    try:
        # 2 contexts of SmolLM2's 8192 tokens + a block for each of 256 sequences
        assert "KV cache: 20480 tokens in 1280 blocks of 16" in server.ready_line
        sizing = r"KV cache: 1280 blocks of 16 tokens = 20480 tokens, \d+\.\d MiB"
        assert re.search(sizing, server.log())

        async def requests():
            async with aiohttp.ClientSession(server.url) as session:
                for _ in range(3):
                    body = {"prompt": "The capital of France is", "max_tokens": 8}
                    r = await session.post("/v1/completions", json=body)
                    assert r.status == 200

        asyncio.run(requests())
        rss = server.rss_mb()
        assert rss < IDLE_RSS_MB, (rss, server.log()[-2000:])
        code, _ = server.terminate(30)
        assert code == 0
    finally:
        server.kill()
