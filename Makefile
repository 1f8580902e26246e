# pdserve: `make serve` runs the main job on the default model; `make test` passes the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdserve-installed

.PHONY: install serve test bench download clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[test]'
	touch $(STAMP)

download: install
	$(VENV)/bin/pdserve download

serve: install
	$(VENV)/bin/pdserve serve

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m bench.offline

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
