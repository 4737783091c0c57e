"""tinyserve benchmarks: `python bench.py WORKLOAD [options]` prints a table and writes JSON;
`python bench.py --help` lists the workloads, which live in tinyserve/bench/ (one module each).
`python bench.py plot RESULT.json` draws a saved result's plots."""

from tinyserve.bench import SHAPES  # noqa: F401 - the GPU tests: `from bench import SHAPES`
from tinyserve.bench.cli import main

if __name__ == "__main__":
    main()
