"""Launcher helpers shared by the kernel files, and the PDL prologue every decode kernel runs.

`check(cond, msg)` raises ValueError for a bad call; `is_interpreter()` says whether Triton runs
kernels on CPU tensors (TRITON_INTERPRET=1), where bf16 `tl.dot` is wrong in triton 3.9, so the
kernels upcast dot operands to float32 there; `num_sms(device)` sizes grids.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check(cond: bool, msg: str, *values) -> None:
    """Raise ValueError(msg) unless cond; `values` are appended to the message only then (a
    launcher runs a dozen checks per launch, and formatting costs host time)."""
    if not cond:
        raise ValueError(" ".join([msg, *map(str, values)]))


def is_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=16)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 for the CPU interpreter (keeps grids tiny)."""
    if device.type != "cuda":
        return 4
    return _cuda_sms(_index(device))


@functools.lru_cache(maxsize=16)
def _cuda_shared_memory(index: int) -> int:
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


def shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may opt into (227 KB on Hopper); the interpreter has
    no limit, so it gets Hopper's."""
    if device.type != "cuda":
        return 232448
    return _cuda_shared_memory(_index(device))


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 models get exact fp32 products (tf32 would cost ~3e-4 relative error); 16-bit
    operands ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_paged(q, k_cache, v_cache, block_tables, batch: int) -> None:
    """Checks shared by the paged attention launchers: q (*, Hq, D), caches (N, bs, Hkv, D)."""
    num_heads, head_dim = q.shape[1:]
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    check(v_cache.shape == k_cache.shape, "k_cache and v_cache shapes differ")
    check(q.dtype in FLOAT_DTYPES, f"unsupported dtype {q.dtype}")
    check(k_cache.dtype == q.dtype and v_cache.dtype == q.dtype, "q and caches dtypes differ")
    check(cache_dim == head_dim, "head_dim of q and cache differ")
    check(head_dim in (16, 32, 64, 128, 256), f"head_dim {head_dim} must be a power of 2 <= 256")
    check(num_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv")
    check(block_size & (block_size - 1) == 0, "block_size must be a power of two")
    check(q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1,
          "q and caches need a contiguous last dim")
    check(block_tables.dtype == torch.int32 and block_tables.dim() == 2, "block_tables int32 2-D")
    check(block_tables.shape[0] == batch and block_tables.stride(1) == 1, "block_tables (B, n)")


def pdl(device: torch.device) -> dict:
    """Launch options for programmatic dependent launch (Hopper and later, CUDA only): the
    kernel may be scheduled while the one before it still runs, so a decode step's ~10 small
    launches a layer stop paying a launch gap each. `TINYSERVE_PDL=0` turns it off."""
    on = (
        device.type == "cuda"
        and os.environ.get("TINYSERVE_PDL", "1") != "0"
        and _cuda_capability(device.index if device.index is not None else 0) >= 9
    )
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}


@functools.lru_cache(maxsize=16)
def _cuda_capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


@triton.jit
def pdl_sync(USE_PDL: tl.constexpr):
    """Let the next kernel be scheduled at once, then wait until the kernel before this one has
    finished and its writes are visible (the next kernel waits the same way, so each waits for
    every kernel before it). Before this a kernel may only read what no kernel of the current
    PDL chain writes: weights, step inputs (written by copies or plain torch ops, which break
    the chain) and the KV of earlier forwards; it writes nothing."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def silu_mul_rounded(gate, up, dtype: tl.constexpr):
    """silu(gate) * up from float32 gate_up accumulators, rounded to dtype as HF's separate
    projections and SiLU are: each output, silu(gate), then the product (still float32)."""
    gate = gate.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return act * up.to(dtype).to(tl.float32)
