# zeroshard developer entry points. Needs only python3 and make: every target that runs Python first
# creates (or reuses) the virtualenv .venv and installs the project into it.
#
#   make demo     train the example GPT with ZeRO stage 2 on 2 CPU processes (gloo)
#   make test     run the test suite (make test-unit: without the integration tests)
#   make lint     ruff check, ruff format --check, mypy zeroshard, the size budget (tools/check_sizes.py)
#   make help     everything else

SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Pinned and installed before the project: an unpinned `torch` (or pyproject's `torch>=2.4` on its own)
# would fetch a multi-GB CUDA build, while this version is a local CPU wheel here.
TORCH_VERSION ?= 2.13.0
PIP := $(PY) -m pip --quiet --disable-pip-version-check --no-input
# Marks a finished install. Keyed on pyproject.toml's timestamp: editing the dependencies reinstalls, and
# an unchanged tree skips pip entirely.
STAMP := $(VENV)/.zeroshard-installed

# Demo knobs: `make demo NPROC=1`, `make demo-stage3 DEMO_ARGS="--steps 20"`.
NPROC ?= 2
DEMO_ARGS ?= --save-dir checkpoints/demo
DEMO_STAGES := demo-stage0 demo-stage1 demo-stage2 demo-stage3
DEMO_PRECISIONS := demo-bf16 demo-fp16
NVME_DIR ?= /tmp/zeroshard-nvme
PYTEST_ARGS ?=

.PHONY: help install demo demo-nvme $(DEMO_STAGES) $(DEMO_PRECISIONS) test lint format clean distclean

help:
	@echo "make demo          train examples/train_gpt.py, ZeRO stage 2, $(NPROC) processes (gloo on CPU)"
	@echo "make demo-stageN   the same with examples/configs/zeroN.json, N in 0..3"
	@echo "make demo-bf16     stage 2 in bf16 (examples/configs/zero2_bf16.json); demo-fp16 likewise"
	@echo "make demo-nvme     stage 3, optimizer state and parameters offloaded to files in $(NVME_DIR)"
	@echo "make test          pytest, with the 15 slowest tests' durations"
	@echo "make test-unit     the same without tests marked integration (external libraries, launchers, scripts)"
	@echo "make test-cuda     tests/test_cuda.py on a machine with a CUDA GPU (the CUDA paths)"
	@echo "make bench-gpu     on one GPU in under 8 minutes: tests/test_cuda.py, bench/gpu.py, bench/gpu_largest.py"
	@echo "make lint          ruff check + ruff format --check + mypy zeroshard + tools/check_sizes.py (size budget)"
	@echo "make deepspeed-inventory / deepspeed-surface   reread DeepSpeed's public names; rewrite docs/deepspeed-surface.md"
	@echo "make benchmarks-page   rewrite docs/benchmarks.md's tables from bench/results/*.json (runs no benchmark)"
	@echo "make elasticity-reference   rerun DeepSpeed 0.19.6's compute_elastic_config (pip-downloaded) into tests/data/"
	@echo "make format        ruff format + ruff check --fix"
	@echo "make install       create $(VENV) and install torch==$(TORCH_VERSION) and zeroshard[dev] into it"
	@echo "make bench         zeroshard vs DDP, ZeRO-1, FSDP2, DeepSpeed (bench/peers.py); bench-quick: smoke"
	@echo "make clean         remove caches;  make distclean  also removes $(VENV)"

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch is named again in the second install so that resolving '.[dev]' can never swap it for another build.
$(STAMP): pyproject.toml | $(PY)
	@echo "installing torch==$(TORCH_VERSION), then zeroshard[dev] (editable) into $(VENV)"
	$(PIP) install "torch==$(TORCH_VERSION)"
	DS_BUILD_OPS=0 $(PIP) install -e ".[dev]" "torch==$(TORCH_VERSION)"
	@touch $@

install: $(STAMP)

demo: demo-stage2

# Two processes on two cores: one intra-op thread each, or they fight over the cores.
$(DEMO_STAGES): demo-stage%: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) \
		examples/train_gpt.py --deepspeed_config examples/configs/zero$*.json $(DEMO_ARGS)

# 16-bit matmuls run about 10x slower than fp32 on CPUs without bf16/fp16 units: fewer steps by default.
$(DEMO_PRECISIONS): demo-%: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) \
		examples/train_gpt.py --deepspeed_config examples/configs/zero2_$*.json --steps 12 $(DEMO_ARGS)

# ZeRO-Infinity: examples/configs/zero3_nvme.json names $(NVME_DIR) as nvme_path (it must exist).
demo-nvme: $(STAMP)
	mkdir -p $(NVME_DIR)
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) \
		examples/train_gpt.py --deepspeed_config examples/configs/zero3_nvme.json --steps 20 $(DEMO_ARGS)

# pytest exits 5 when it collects no test; that is reported loudly but is not a failure of the run.
# The suite is a CPU suite: on a GPU machine the engine would move its models to the GPU, so the GPU is hidden
# (tests/test_cuda.py skips); `make test-cuda` runs the CUDA paths on a GPU machine.
test: $(STAMP)
	@rc=0; CUDA_VISIBLE_DEVICES= $(PY) -m pytest --durations=15 $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests"; rc=0; fi; \
	exit $$rc

# The unit suite: no test that drives transformers, accelerate, Lightning, DeepSpeed, torchrun or a bench/ script
# end to end (marked `integration`, pyproject.toml); `make test` runs those too.
.PHONY: test-unit
test-unit: $(STAMP)
	@rc=0; CUDA_VISIBLE_DEVICES= $(PY) -m pytest -m "not integration" --durations=15 $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-unit: pytest collected no tests"; rc=0; fi; \
	exit $$rc

# On a machine with a CUDA GPU: NCCL, pinned CPU offload, 16-bit kernels (docs/benchmarks.md, "One GPU").
.PHONY: test-cuda
test-cuda: $(STAMP)
	$(PY) -m pytest -s tests/test_cuda.py

# One GPU, one go, in under 8 minutes: tests/test_cuda.py, bench/gpu.py's rows, bench/gpu_largest.py (what each
# stage does and how long it may take: bench/gpu_check.sh). Installs nothing (a GPU machine has no network: carry
# the wheels tools/gpu_wheels.sh makes), hence no $(STAMP).
BENCH_GPU_OUT ?= bench/results
.PHONY: bench-gpu
bench-gpu:
	bash bench/gpu_check.sh $(BENCH_GPU_OUT)

# DeepSpeed's public surface ([Note: generated surface] in zeroshard/deepspeed/surface.py). For a new DeepSpeed
# release: pin it in pyproject.toml's dev extra, `make install`, then `make deepspeed-inventory
# deepspeed-surface` and commit zeroshard/deepspeed/inventory.json and docs/deepspeed-surface.md.
.PHONY: deepspeed-inventory deepspeed-surface
deepspeed-inventory: $(STAMP)
	env -u ZEROSHARD_AS_DEEPSPEED DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES= $(PY) tools/deepspeed_inventory.py

deepspeed-surface: $(STAMP)
	CUDA_VISIBLE_DEVICES= $(PY) tools/deepspeed_surface_report.py

# docs/benchmarks.md's tables, from the committed results (tools/benchmarks_page.py; tests/test_benchmarks_page.py
# fails when the page differs). A benchmark rewrites its JSON; this then rewrites the page.
.PHONY: benchmarks-page
benchmarks-page: $(STAMP)
	$(PY) tools/benchmarks_page.py

# tests/data/elasticity_reference.json: DeepSpeed 0.19.6's own elastic batch search over a table of inputs
# (tools/elasticity_reference.py downloads the 0.19.6 sdist; DeepSpeed 0.19.8 removed elasticity), which
# tests/test_elasticity.py compares zeroshard's with.
.PHONY: elasticity-reference
elasticity-reference: $(STAMP)
	$(PY) tools/elasticity_reference.py

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy zeroshard
	$(PY) tools/check_sizes.py

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf .pytest_cache .mypy_cache .ruff_cache build *.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)

# Benchmarks against the peers (issue 7). DeepSpeed lives in its own venv beside the same torch: pinned, since
# an unpinned torch would fetch a CUDA build; DS_BUILD_OPS=0 skips compiling its C++/CUDA ops at install.
PEERS_VENV := bench/.venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed
.PHONY: bench bench-quick

$(PEERS_STAMP):
	$(PYTHON) -m venv $(PEERS_VENV)
	DS_BUILD_OPS=0 $(PEERS_VENV)/bin/python -m pip --quiet --disable-pip-version-check --no-input install \
		"torch==$(TORCH_VERSION)" "deepspeed==0.19.*" psutil
	@touch $@

# Both model sizes, every system (DeepSpeed and the offload rows included; the offload rows at the small size
# only, BENCH_ARGS=--large-offload adds them at the large one for ~5 minutes more); rewrites
# bench/results/peers.json, docs/benchmarks.md's peers section and docs/bench_*.png. About 20 minutes with
# nothing else running, about 40 at load 5 (it prints its estimate, an ETA after every run and its total);
# the first run also JIT-builds DeepSpeed's CPU Adam (timed and reported; 49 s at load 3-4 here).
bench: $(STAMP) $(PEERS_STAMP)
	$(PY) bench/peers.py $(BENCH_ARGS)

# Tiny model, 3 steps, torch peers + zeroshard (NVMe offload rows included), one process pair: a smoke test
# (~10 s quiet, ~35 s under load), writes bench/results/peers_quick.json and no docs.
bench-quick: $(STAMP)
	$(PY) bench/peers.py --quick
