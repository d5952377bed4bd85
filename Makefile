# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
CORE_SOURCES := $(wildcard torch_tpu/csrc/*.cpp torch_tpu/csrc/*.h sparsecore/csrc/*.cpp sparsecore/csrc/*.h)
# The build must not try to load the (maybe stale) backend it is building.
BUILD_ENV := TORCH_DEVICE_BACKEND_AUTOLOAD=0 MAX_JOBS=2

.PHONY: setup demo test test-all bench clean

setup: torch_tpu/_core.so

# torchrec declares the CUDA fbgemm-gpu, which would replace the CPU build:
# install it without dependencies and list what it needs in requirements-recsys.txt.
$(VENV)/.deps: requirements-dev.txt requirements-recsys.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q -r requirements-dev.txt -r requirements-recsys.txt
	$(PIP) install -q --no-deps torchrec==1.8.0
	$(PY) -c "import torchrec, fbgemm_gpu"
	touch $@

# The editable install takes the metadata and entry points; the next rule builds the extensions.
$(VENV)/.installed: $(VENV)/.deps pyproject.toml setup.py
	TORCH_TPU_SKIP_EXTENSIONS=1 $(BUILD_ENV) $(PIP) install -q --no-build-isolation --no-deps -e .
	touch $@

torch_tpu/_core.so: $(VENV)/.installed $(CORE_SOURCES)
	$(BUILD_ENV) $(PY) setup.py -q build_ext --inplace
	touch $@

demo: setup
	$(PY) -m models.train

test: setup
	$(PY) -m pytest -q -m "not slow and not timing"

test-all: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) -m benchmarks.eager_overhead
	$(PY) -m benchmarks.eager_modes
	$(PY) -m benchmarks.compile
	$(PY) -m benchmarks.inductor_codegen
	$(PY) -m benchmarks.op_coverage
	$(PY) -m benchmarks.collectives
	$(PY) -m benchmarks.dlrm_distributed
	OMP_NUM_THREADS=1 $(PY) -m benchmarks.embedding --dims 32,64,128 --shapes 8192x1,8192x20,8192x100 \
		--dists uniform,zipf1.05 --phases forward,rowwise_adagrad,sgd --subset-shapes all --cell-budget 2 \
		--out benchmarks/results/one_thread
	$(PY) -m benchmarks.planner_calibration
	$(PY) -m benchmarks.planner

clean:
	rm -rf build torch_tpu/_core.so sparsecore/_kernels.so $(VENV)/.installed
