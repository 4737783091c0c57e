"""Launcher helpers shared by the kernel files (no Triton ops here).

`check(cond, msg)` raises ValueError for a bad call; `is_interpreter()` says whether Triton runs
kernels on CPU tensors (TRITON_INTERPRET=1), where bf16 `tl.dot` is wrong in triton 3.9, so the
kernels upcast dot operands to float32 there; `num_sms(device)` sizes grids.
"""

from __future__ import annotations

import functools
import os

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def is_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=16)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 for the CPU interpreter (keeps grids tiny)."""
    if device.type != "cuda":
        return 4
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 models get exact fp32 products (tf32 would cost ~3e-4 relative error); 16-bit
    operands ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"
