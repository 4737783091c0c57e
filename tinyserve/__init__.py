"""tinyserve: a compact LLM inference server (paged KV, continuous batching, Triton kernels).

The public names load lazily so that `import tinyserve.core.scheduler` (or the CLI's --help)
does not pull in torch and the model code.
"""

from __future__ import annotations

_EXPORTS = {
    "LLM": "tinyserve.llm",
    "SamplingParams": "tinyserve.sampling_params",
    "InvalidParameter": "tinyserve.sampling_params",
    "RequestOutput": "tinyserve.outputs",
    "CompletionOutput": "tinyserve.outputs",
    "AsyncEngine": "tinyserve.engine.async_engine",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tinyserve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
