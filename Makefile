# pdserve: `make serve` runs the main job on the default model; `make test` passes the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdserve-installed

.PHONY: install serve test test-fast test-stress bench download clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(MAKE) --no-print-directory libibverbs
	$(PY) -m pip install -e '.[test,mooncake]'
	touch $(STAMP)

# The mooncake KV transport's engine links libibverbs (no RDMA device needed). Installed with
# apt-get where it is missing on a Debian-like host, as root or through sudo; elsewhere a note.
.PHONY: libibverbs
libibverbs:
	@if [ "$$(uname -s)" != Linux ] || ! command -v dpkg >/dev/null; then exit 0; fi; \
	if dpkg -s libibverbs1 >/dev/null 2>&1; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then sudo=; elif command -v sudo >/dev/null; then sudo="sudo -n"; \
	else sudo=none; fi; \
	if [ "$$sudo" != none ] && command -v apt-get >/dev/null; then \
		$$sudo apt-get install -y -q libibverbs1 >/dev/null 2>&1 || \
		{ $$sudo apt-get update -q >/dev/null 2>&1 && $$sudo apt-get install -y -q libibverbs1; } \
		&& exit 0; fi; \
	echo "note: libibverbs1 is not installed; the mooncake KV transport (and its tests) need it"

download: install
	$(VENV)/bin/pdserve download

serve: install
	$(VENV)/bin/pdserve serve

test: install
	$(PY) -P -m pytest -q --durations=20

# In-process tests only (no server, node or peer process; nothing that takes seconds): < 1 min.
test-fast: install
	$(PY) -P -m pytest -q -m "not processes and not slow and not default_model"

# The fault and end-to-end tests while a busy-looping process occupies every core (started
# before pytest, stopped after it whatever the outcome): they must hold on a loaded machine.
test-stress: install
	$(PY) -P tests/cpu_hog.py -- $(PY) -P -m pytest -q tests/faults tests/e2e

bench: install
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m pdserve.bench.offline

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache

# The GPU check (README, "GPU check"; docs/operations.md): `make gpu-wheels` where pip reaches an index, then
# `make gpu-check` on the GPU machine, offline. The wheels are what that machine (Python 3.12,
# x86_64) lacks; they travel with the checkout in an ignored folder, kept under 32 MiB.
GPU_WHEELS := .gpu-wheels
GPU_WHEEL_PACKAGES := 'pyzmq>=26' 'fastapi>=0.110' 'uvicorn>=0.29' 'pydantic>=2.6'
GPU_WHEEL_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 \
	manylinux_2_17_x86_64 manylinux2014_x86_64

.PHONY: gpu-wheels gpu-check

gpu-wheels:
	rm -rf $(GPU_WHEELS)
	$(PYTHON) -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
		$(addprefix --platform ,$(GPU_WHEEL_PLATFORMS)) -d $(GPU_WHEELS) $(GPU_WHEEL_PACKAGES)
	@size=$$(du -sm $(GPU_WHEELS) | cut -f1); echo "$(GPU_WHEELS): $$size MiB"; \
		test $$size -lt 32 || { echo "$(GPU_WHEELS) is over 32 MiB"; exit 1; }

gpu-check:
	bash bench/gpu_check.sh
