# The documented commands. Each installs what it needs into .venv first.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
NPROC   ?= 2
export OMP_NUM_THREADS ?= 1

.PHONY: install test test-torch demo docs examples-smoke bench bench-quick lint clean

install: $(STAMP)

# torch is pinned exactly: 2.13.0 resolves to the local CPU wheel; a range would pull CUDA packages.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,docs]'
	touch $(STAMP)

# Two phases: the single-process tests on $(NPROC) pytest-xdist workers (one thread each), then the
# multi-process tests (tests/dist: each already runs its ranks on every core) one at a time.
test: install
	$(BIN)/python -m pytest -q -n $(NPROC) tests --ignore=tests/dist
	$(BIN)/python -m pytest -q tests/dist

# The suite on another torch of the supported range (pyproject.toml), in a venv of its own that is kept
# (.venv-torch-$(TORCH)), e.g. `make test-torch TORCH=2.15.0`. Cost: on Linux the registry's torch wheels are
# CUDA builds that pull the nvidia-* packages, several GB the first time (the 2.13.0 CPU wheel of `make
# install` is local to this project's machines). The pip constraint file is lifted for this venv only: a
# machine-wide one may cap torch below the version asked for. The subset below (the unit tests, then
# TORCH_DIST_TESTS one file at a time) takes about 15-20 minutes on 2 cores; `make test` stays on 2.13.0.
TORCH   ?= 2.15.0
TVENV   := .venv-torch-$(TORCH)
TORCH_DIST_TESTS ?= tests/dist/test_data_parallel.py tests/dist/test_tensor_parallel.py \
	tests/dist/test_grads.py tests/dist/test_inductor.py
$(TVENV)/.installed: pyproject.toml
	test -x $(TVENV)/bin/python || $(PY) -m venv $(TVENV)
	PIP_CONSTRAINT=/dev/null $(TVENV)/bin/pip install -q torch==$(TORCH)
	PIP_CONSTRAINT=/dev/null $(TVENV)/bin/pip install -q -e '.[test]' torch==$(TORCH)
	touch $@

test-torch: $(TVENV)/.installed
	$(TVENV)/bin/python -c 'import torch; print("torch", torch.__version__)'
	$(TVENV)/bin/python -m pytest -q -n $(NPROC) tests/unit; unit=$$?; \
	$(TVENV)/bin/python -m pytest -q $(TORCH_DIST_TESTS) && exit $$unit

demo: install
	$(BIN)/torchrun --standalone --nproc_per_node=$(NPROC) examples/train_gpt.py

# The documentation site (docs/*.md, the API reference from the docstrings) into site/; warnings are errors.
docs: install
	$(BIN)/mkdocs build --strict

# Every example in smoke mode (seconds each): world size 1 under python, then 2 ranks under torchrun.
# Deliberately not a prerequisite of `test` (the suite gets its own smoke test of the examples).
examples-smoke: install
	$(BIN)/python examples/train_gpt.py --smoke
	$(BIN)/torchrun --standalone --nproc_per_node=$(NPROC) examples/train_gpt.py --smoke
	$(BIN)/python examples/sample.py --ckpt checkpoints/smoke --chars 80
	$(BIN)/python examples/inspect_graphs.py --smoke
	$(BIN)/python examples/override_moe.py --smoke

# spmd vs DDP and FSDP2 on 2 gloo ranks (1 thread each): prints tables, writes bench.json. ~20-25 min on 2 cores (the plan check and a 6-minute crash hunt included; --no-plan-check, --hunt-minutes 0 skip them).
bench: install
	$(BIN)/python benchmarks/bench/run.py

# The same harness on small models with a few steps: a smoke run (a few minutes).
bench-quick: install
	$(BIN)/python benchmarks/bench/run.py --quick

lint: install
	$(BIN)/ruff check spmd passes tests examples benchmarks
	$(BIN)/ruff format --check spmd passes
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .venv-torch-* site spmd_dump checkpoints bench.json .pytest_cache .mypy_cache .ruff_cache *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
