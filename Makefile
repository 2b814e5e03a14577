# Each target installs what it needs into a local virtual environment first.
# CPU machines get torch and triton pinned by constraints.txt; a user with their own torch can
# `pip install -e .[test]` into their environment instead.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-gemm test test-slow bench plots report-tightness clean

$(STAMP): setup.py constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt torch triton
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

# the detection-coverage campaign on its embedded default (a few minutes on 2 cores)
demo: $(STAMP)
	rm -rf runs/demo
	$(BIN)/abft eval --out runs/demo

# one checked product with one injected bit flip, located
demo-gemm: $(STAMP)
	$(BIN)/abft demo

# both suites in JOBS pytest-xdist workers: most tests are one thread (the Triton interpreter,
# small products), so one worker per core
JOBS ?= 2
PYTEST := TRITON_INTERPRET=1 $(BIN)/python -m pytest -q tests --benchmark-disable -n $(JOBS) --dist worksteal

# the suite CI runs (under 20 minutes on 2 cores); the slow tests are the next target
test: $(STAMP)
	$(PYTEST) -m "not slow"

# the tests marked slow (the fused kernel under a whole Llama, the second stress seed, an
# evaluation trial on the triton backend): run them before calling work on the kernel, the
# threshold or the evaluation's triton path done
test-slow: $(STAMP)
	$(PYTEST) -m slow

bench: $(STAMP)
	$(BIN)/abft bench

# benchmarks/plots/*.png from benchmarks/data/*.json (what the scripts wrote with --json)
plots: $(STAMP)
	$(BIN)/python benchmarks/plot.py

report-tightness: $(STAMP)
	$(BIN)/python tests/stress.py --report

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .benchmarks
