"""Host -> device copies of a step's inputs. Every copy is staged in pinned host memory, so it is
asynchronous: the host never waits for the GPU to take it."""

from __future__ import annotations

import numpy as np
import torch

_TORCH = {
    np.dtype(np.int64): torch.long,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
}


def host_array(x: np.ndarray, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host tensor holding `x`, pinned if asked (an async copy's source; `torch.tensor`
    cannot pin an array)."""
    host = torch.empty(x.shape, dtype=dtype, pin_memory=pin)
    host.numpy()[:] = x
    return host


def to_device(
    x: list | np.ndarray, device: torch.device, dtype: torch.dtype = torch.long
) -> torch.Tensor:
    if not isinstance(x, np.ndarray):
        # Through numpy: 5x faster than torch.tensor(list).
        x = np.array(x, dtype=np.int32 if dtype == torch.int32 else np.int64)
    return host_array(x, dtype, device.type == "cuda").to(device, non_blocking=True)


def packed_to_device(arrays: list[list | np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Copy arrays (lists: int64; numpy: int64, int32 or float32, any shape) to the device in
    one copy; returns a device view of each. A step's ~20 small inputs as separate copies cost a
    launch each, on the host and in the GPU's queue. Every view starts 16-byte aligned, as a
    fresh allocation does (Triton specializes kernels on it)."""
    arrays = [a if isinstance(a, np.ndarray) else np.asarray(a, dtype=np.int64) for a in arrays]
    dtypes = [_TORCH[a.dtype] for a in arrays]  # KeyError: a dtype the kernels do not read
    words = [-(-a.nbytes // 16) * 2 for a in arrays]  # int64 words, rounded up to 16 bytes
    host = torch.empty(sum(words), dtype=torch.long, pin_memory=device.type == "cuda")
    flat = host.numpy()
    offsets = np.cumsum([0] + words[:-1]).tolist()
    for a, off, w in zip(arrays, offsets, words):
        flat[off : off + w].view(a.dtype)[: a.size] = a.ravel()
    dev = host.to(device, non_blocking=True)
    return [
        dev[off : off + w].view(dt)[: a.size].view(a.shape)
        for a, dt, off, w in zip(arrays, dtypes, offsets, words)
    ]
