# The two commands of the README: `make demo` and `make test`.
# Both create .venv and install every distribution of the repo in editable mode.
# `make test` also builds a second environment (Python 3.12, the newest jax
# there) and runs the flash_pallas, flash_triton and cudnn tests in it: the
# Pallas adapters are checked on both jax lines they claim.
# `make test-gpu` (on a GPU machine only) certifies the gpu backends there.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Every distribution in the repo: core, each plugin folder, the conformance suite.
PACKAGES := core $(patsubst %/pyproject.toml,%,$(wildcard plugins/*/pyproject.toml)) contracts \
	examples/dense_jax_backend
STAMP := $(VENV)/.installed

# The newer jax line: needs Python 3.12 (pyenv provides it on these machines).
PYTHON_NEXT ?= env PYENV_VERSION=3.12.1 python3.12
JAX_NEXT ?= jax>=0.12,<0.13
VENV_NEXT := .venv-jax-next
PY_NEXT := $(VENV_NEXT)/bin/python
PACKAGES_NEXT := core plugins/reference plugins/xla_native plugins/flash_pallas plugins/flash_triton \
	plugins/cudnn contracts
STAMP_NEXT := $(VENV_NEXT)/.installed

# Conformance certificates written by `make test`, and a repo-local cache so
# test runs never read or write the user's ~/.cache.
CERTS := .certificates
test-main test-jax-next test-gpu: export ATTN_BACKENDS_CACHE_DIR = $(CURDIR)/.attn-cache
CHECK = $(VENV)/bin/attn-backends check
CHECK_NEXT = $(VENV_NEXT)/bin/attn-backends check

# Wheels as users get them: `make dist` builds every distribution into dist/
# (regular wheels, not editable); test-wheels installs them into fresh venvs.
DIST := dist

.PHONY: install install-next demo dist test test-main test-jax-next test-wheels test-gpu clean

$(STAMP): $(addsuffix /pyproject.toml,$(PACKAGES)) requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=77" wheel
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-build-isolation $(addprefix -e ,$(PACKAGES))
	touch $@

$(STAMP_NEXT): $(addsuffix /pyproject.toml,$(PACKAGES_NEXT)) requirements-dev.txt
	$(PYTHON_NEXT) -m venv $(VENV_NEXT)
	$(PY_NEXT) -m pip install -q --upgrade pip "setuptools>=77" wheel
	$(PY_NEXT) -m pip install -q -r requirements-dev.txt "$(JAX_NEXT)"
	$(PY_NEXT) -m pip install -q --no-build-isolation $(addprefix -e ,$(PACKAGES_NEXT))
	touch $@

install: $(STAMP)

install-next: $(STAMP_NEXT)

demo: install
	$(VENV)/bin/attn-backends list
	$(VENV)/bin/attn-backends explain --device cpu --q 2,256,8,64 --kv 2,256,2,64 --causal
	$(PY) examples/demo.py
	$(PY) examples/transformer/train.py --steps 20

test: test-main test-jax-next test-wheels

# Folder paths start with ./ so pip never mistakes one for a PyPI name
# (`pip wheel contracts` builds an unrelated PyPI project).
dist: install
	rm -rf $(DIST) $(addsuffix /build,$(PACKAGES))  # stale build/lib files would ship
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w $(DIST) $(addprefix ./,$(PACKAGES))

# tests/wheels/run.sh: a fresh venv per variant, wheels from dist/, third-party
# dependencies from PyPI; `--wheel` and `--run` add a wheel and a check script.
test-wheels: dist
	PYTHON=$(PYTHON) tests/wheels/run.sh --variant full
	rm -rf $(DIST)/third-party tests/wheels/broken_backend/build
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w $(DIST)/third-party ./tests/wheels/broken_backend
	PYTHON=$(PYTHON) tests/wheels/run.sh --variant xla \
		--wheel $(DIST)/third-party/attn_backend_broken-1.0-py3-none-any.whl \
		--run tests/wheels/broken_not_served.py

test-main: install
	$(PY) -m pytest --durations=25
	$(PY) -m pytest tests/multidevice
	mkdir -p $(CERTS)
	$(CHECK) reference --json $(CERTS)/reference.json
	$(CHECK) xla_native --json $(CERTS)/xla_native.json
	$(CHECK) example_dense --json $(CERTS)/example_dense.json
	ATTN_BACKENDS_PALLAS_INTERPRET=1 $(CHECK) flash_pallas --json $(CERTS)/flash_pallas.json
	ATTN_BACKENDS_TRITON_INTERPRET=1 $(CHECK) flash_triton --json $(CERTS)/flash_triton.json

test-jax-next: install-next
	$(PY_NEXT) -c "import jax; print('jax', jax.__version__, 'on Python 3.12')"
	$(PY_NEXT) -m pytest plugins/flash_pallas plugins/flash_triton plugins/cudnn
	$(PY_NEXT) -m pytest tests/test_flax.py tests/test_flax_nnx.py
	# xla_native's decode path runs only on jaxlib >= 0.12 (its _plan.py says why).
	$(PY_NEXT) -m pytest plugins/xla_native/tests/test_xla_native_decode.py \
		plugins/xla_native/tests/test_xla_native_forward_only.py
	mkdir -p $(CERTS)
	ATTN_BACKENDS_PALLAS_INTERPRET=1 $(CHECK_NEXT) flash_pallas --json $(CERTS)/flash_pallas-jax-next.json
	ATTN_BACKENDS_TRITON_INTERPRET=1 $(CHECK_NEXT) flash_triton \
		--json $(CERTS)/flash_triton-jax-next.json

# On a GPU machine (never in CI): installs JAX's CUDA plugin for the installed
# jax, runs the gpu-only tests, certifies every gpu backend on the local GPU and
# times the GPU backends against bare cuDNN (benchmarks/bench_gpu.py).
GPU_BACKENDS := cudnn flash_triton xla_native reference
test-gpu: install
	@command -v nvidia-smi >/dev/null || \
		{ echo "make test-gpu: no NVIDIA GPU here (nvidia-smi not found); run it on a GPU machine"; exit 1; }
	$(PY) -m pip install -q "jax[cuda12]==$$($(PY) -c 'import jax; print(jax.__version__)')"
	$(PY) -c "import jax; print('jax', jax.__version__, jax.devices('gpu'))"
	$(PY) -m pytest plugins/cudnn plugins/flash_triton
	mkdir -p $(CERTS)
	for name in $(GPU_BACKENDS); do \
		$(CHECK) $$name --json $(CERTS)/$$name-gpu.json || exit 1; done
	$(VENV)/bin/attn-backends bench --device gpu --backends cudnn,flash_triton,xla_native \
		--dtype bfloat16
	$(PY) benchmarks/bench_gpu.py

clean:
	rm -rf $(VENV) $(VENV_NEXT) $(CERTS) .attn-cache $(DIST)
