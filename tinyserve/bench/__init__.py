"""The workloads of `python bench.py` (the entry point at the repository root), one module per
concern: cpu, kernels (+ kernels_attention, kernels_ops, kernels_hybrid), prefix (+
long_context), hybrid_prefix, e2e, spec, serve, pool, structured (+ qwen_vocab), memory;
common.py (ceilings, timing, `SHAPES`), drive.py (stepping an engine), plot.py, and cli.py
(flags, the table, the JSON). Every figure is measured in the run that reports it."""

from tinyserve.bench.common import SHAPES

__all__ = ["SHAPES"]
