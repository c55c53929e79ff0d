# The two commands of the README: `make demo` and `make test`.
# Both create .venv and install every distribution of the repo in editable mode.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Every distribution in the repo: core, each plugin folder, the conformance suite.
PACKAGES := core $(patsubst %/pyproject.toml,%,$(wildcard plugins/*/pyproject.toml)) contracts
STAMP := $(VENV)/.installed

.PHONY: install demo test clean

$(STAMP): $(addsuffix /pyproject.toml,$(PACKAGES)) requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=77" wheel
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-build-isolation $(addprefix -e ,$(PACKAGES))
	touch $@

install: $(STAMP)

demo: install
	$(VENV)/bin/attn-backends list
	$(VENV)/bin/attn-backends explain --device cpu --q 2,256,8,64 --kv 2,256,2,64 --causal
	$(PY) examples/demo.py

test: install
	$(PY) -m pytest

clean:
	rm -rf $(VENV)
