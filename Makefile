# solattn: `make test` (set up + full test suite), `make bench` (verify + TFLOP/s table).
# With a CUDA GPU, `make test` runs the GPU suite and the AOT check in this python. Without one it
# runs scripts/ci_cpu.sh: the suite's CPU selection in Triton's interpreter (TRITON_INTERPRET=1)
# and the AOT check on the pinned stack (constraints.txt), then a subset and the AOT check on the
# newest stack (constraints-latest.txt), each stack in a venv cached under $SOLATTN_CI_CACHE,
# and prints each stage's time.
PY ?= python3
HAS_GPU := $(shell $(PY) -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
ifeq ($(HAS_GPU),1)
  RUN :=
else
  RUN := TRITON_INTERPRET=1
endif

.PHONY: setup test test-cpu test-gpu test-latest aot bench lint

# Install only what is missing: the GPU machine already has torch/triton and no network (hence no
# build isolation, which would download setuptools; the fallback is for a setuptools < 64).
setup:
	@$(PY) -c "import torch, triton, pytest" 2>/dev/null || \
	  $(PY) -m pip install -q -c constraints.txt torch triton pytest "numpy<2.3"
	@$(PY) -c "import numpy, sys; sys.exit(int(tuple(map(int, numpy.__version__.split('.')[:2])) >= (2, 3)))" \
	  || [ "$(HAS_GPU)" = "1" ] || $(PY) -m pip install -q -c constraints.txt "numpy<2.3"
	@$(PY) -c "import transformers" 2>/dev/null || [ "$(HAS_GPU)" = "1" ] \
	  || $(PY) -m pip install -q -c constraints.txt transformers
	@$(PY) -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null \
	  || $(PY) -m pip install -q --no-deps -e .

ifeq ($(HAS_GPU),1)
test: test-gpu
else
test: test-cpu
endif

# The GPU suite (bf16 + fp16, the full grid, `-m gpu` tests included) and the AOT check.
test-gpu: setup
	$(PY) -m pytest tests -q -p no:cacheprovider
	$(PY) -m solattn.cli aot --arch 90 --arch 80

# CPU: needs only python3 (with venv) and the network to PyPI the first time (scripts/ci_cpu.sh).
test-cpu:
	@PY=$(PY) bash scripts/ci_cpu.sh

# The newest stack's stages only (CPU).
test-latest:
	@PY=$(PY) bash scripts/ci_cpu.sh latest

bench: setup
	$(RUN) $(PY) -m solattn.cli bench

aot: setup
	$(PY) -m solattn.cli aot --arch 90 --arch 80

lint:
	$(PY) -m ruff check solattn tests scripts
