# solattn: `make test` (set up + full test suite), `make bench` (verify + TFLOP/s table).
# On a machine without a CUDA GPU both run the kernels in Triton's interpreter (TRITON_INTERPRET=1).
PY ?= python3
HAS_GPU := $(shell $(PY) -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
ifeq ($(HAS_GPU),1)
  RUN :=
else
  RUN := TRITON_INTERPRET=1
endif

.PHONY: setup test test-cpu test-gpu aot bench lint

# Install only what is missing: the GPU machine already has torch/triton and no network (hence no
# build isolation, which would download setuptools; the fallback is for a setuptools < 64).
setup:
	@$(PY) -c "import torch, triton, pytest" 2>/dev/null || \
	  $(PY) -m pip install -q -c constraints.txt torch triton pytest "numpy<2.3"
	@$(PY) -c "import numpy, sys; sys.exit(int(tuple(map(int, numpy.__version__.split('.')[:2])) >= (2, 3)))" \
	  || [ "$(HAS_GPU)" = "1" ] || $(PY) -m pip install -q -c constraints.txt "numpy<2.3"
	@$(PY) -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null \
	  || $(PY) -m pip install -q --no-deps -e .

test: setup
	$(RUN) $(PY) -m pytest tests -q -p no:cacheprovider
	$(PY) -m solattn.cli aot --arch 90 --arch 80

bench: setup
	$(RUN) $(PY) -m solattn.cli bench

aot: setup
	$(PY) -m solattn.cli aot --arch 90 --arch 80

lint:
	$(PY) -m ruff check solattn tests scripts
