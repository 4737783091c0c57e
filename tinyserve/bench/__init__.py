"""The workloads of `python bench.py` (the entry point at the repository root), one module per
concern: cpu, kernels (+ kernels_attention, kernels_ops), prefix (+ long_context), e2e, spec,
serve, pool; common.py (ceilings, timing, `SHAPES`), drive.py (stepping an engine), plot.py,
and cli.py (flags, the table, the JSON). Every figure is measured in the run that reports it."""

from tinyserve.bench.common import SHAPES

__all__ = ["SHAPES"]
