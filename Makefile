# pdserve: `make serve` runs the main job on the default model; `make test` passes the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdserve-installed
# Known-good versions of everything `make install` installs (pyproject keeps ranges for library
# users); `make lock` resolves them anew, to the newest pip offers, with torch held at TORCH.
LOCK := requirements.lock
EXTRAS := test,mooncake,ray
TORCH := 2.13.0
LOCK_VENV := .venv-lock
# `make test-newest`: the newest versions pip offers today, torch included.
NEWEST_VENV := .venv-newest

.PHONY: install serve test test-fast test-stress test-newest lock bench download clean

install: $(STAMP)

$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(MAKE) --no-print-directory system-packages
	$(PY) -m pip install -c $(LOCK) -e '.[$(EXTRAS)]'
	$(PY) -P tests/lock_drift.py $(LOCK)
	touch $(STAMP)

lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q torch==$(TORCH)
	$(LOCK_VENV)/bin/python -m pip install -q '.[$(EXTRAS)]'
	{ echo "# make lock, $$(date -u +%Y-%m-%d), Python $$($(LOCK_VENV)/bin/python -c \
	'import platform; print(platform.python_version(), platform.machine())'): what make install"; \
	  echo "# installs (pip install -c $(LOCK) -e '.[$(EXTRAS)]'), torch held at $(TORCH)."; \
	  $(LOCK_VENV)/bin/python -m pip freeze --all --exclude pdserve --exclude pip \
	  --exclude setuptools --exclude wheel | sed -E 's/^([^=]+==[^+]+)\+.*/\1/'; } > $(LOCK)
	rm -rf $(LOCK_VENV)
	@echo "$(LOCK): $$(grep -c == $(LOCK)) packages"

# Debian packages pdserve uses where they exist: libibverbs1, which the mooncake KV transport's
# engine links (no RDMA device needed), and libtcmalloc-minimal4, the allocator CPU deployments
# run with (commands/allocator.py; docs/performance.md measures it). Installed with apt-get where
# missing on a Debian-like host, as root or through sudo; elsewhere a note.
SYSTEM_PACKAGES := libibverbs1 libtcmalloc-minimal4
.PHONY: system-packages
system-packages:
	@if [ "$$(uname -s)" != Linux ] || ! command -v dpkg >/dev/null; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then sudo=; elif command -v sudo >/dev/null; then sudo="sudo -n"; \
	else sudo=none; fi; \
	for package in $(SYSTEM_PACKAGES); do \
		if dpkg -s $$package >/dev/null 2>&1; then continue; fi; \
		if [ "$$sudo" != none ] && command -v apt-get >/dev/null && \
			{ $$sudo apt-get install -y -q $$package >/dev/null 2>&1 || \
			{ $$sudo apt-get update -q >/dev/null 2>&1 && \
			$$sudo apt-get install -y -q $$package >/dev/null 2>&1; }; }; then continue; fi; \
		echo "note: $$package is not installed (the Makefile's comment above system-packages says what needs it)"; \
	done

download: install
	$(VENV)/bin/pdserve download

serve: install
	$(VENV)/bin/pdserve serve

test: install
	$(PY) -P -m pytest -q --durations=20

# In-process tests only (no server, node or peer process; nothing that takes seconds): a few minutes.
test-fast: install
	$(PY) -P -m pytest -q -m "not processes and not slow and not default_model"

# The fault and end-to-end tests while a busy-looping process occupies every core (started
# before pytest, stopped after it whatever the outcome): they must hold on a loaded machine,
# with the default node timeout; the disaggregated == colocated comparison runs five rounds on
# every transport.
test-stress: install
	PDSERVE_TEST_ROUNDS=5 $(PY) -P -m pdserve.bench.cpu_hog -- $(PY) -P -m pytest -q tests/faults tests/e2e

# The fast tier and one `pdserve serve` request in an environment resolved to the newest versions
# pip offers today (not the lock), after a list of what differs from the lock: CI runs it, so a
# release that breaks pdserve is named at the next submission, not by a user.
test-newest:
	test -x $(NEWEST_VENV)/bin/python || $(PYTHON) -m venv $(NEWEST_VENV)
	$(MAKE) --no-print-directory system-packages
	$(NEWEST_VENV)/bin/python -m pip install -q --upgrade --upgrade-strategy eager \
		-e '.[$(EXTRAS)]'
	$(NEWEST_VENV)/bin/python -P tests/lock_drift.py $(LOCK)
	$(NEWEST_VENV)/bin/python -P -m pytest -q -p no:cacheprovider \
		-m "not processes and not slow and not default_model"
	$(NEWEST_VENV)/bin/python -P tests/serve_smoke.py

bench: install
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m pdserve.bench.offline

clean:
	rm -rf $(VENV) $(NEWEST_VENV) $(LOCK_VENV) .gpu-dryrun *.egg-info .pytest_cache

# The GPU check (README, "GPU check"; docs/operations.md): `make gpu-wheels` where pip reaches an index, then
# `make gpu-check` on the GPU machine, offline. The wheels are what that machine (Python 3.12,
# x86_64) lacks; they travel with the checkout in an ignored folder, kept under 32 MiB.
# `make gpu-dryrun` proves here, without a GPU, that everything the check imports is there:
# a venv of the GPU machine's own packages, and the same wheels for this Python, installed as
# the check installs them.
GPU_WHEELS := .gpu-wheels
GPU_WHEELS_PYTHON := 3.12
GPU_WHEEL_PACKAGES := 'pyzmq>=26' 'fastapi>=0.110' 'uvicorn>=0.29' 'httptools>=0.6' \
	'pydantic>=2.6' 'llguidance>=1.9.1,<2'
# llguidance's wheels are tagged manylinux_2_31.
GPU_WHEEL_PLATFORMS := manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
	manylinux_2_26_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
GPU_DRYRUN := .gpu-dryrun
GPU_DRYRUN_PY := $(GPU_DRYRUN)/venv/bin/python

.PHONY: gpu-wheels gpu-check gpu-dryrun

gpu-wheels:
	rm -rf $(GPU_WHEELS)
	$(PYTHON) -m pip download -q --only-binary=:all: --python-version $(GPU_WHEELS_PYTHON) \
		--implementation cp $(addprefix --platform ,$(GPU_WHEEL_PLATFORMS)) -d $(GPU_WHEELS) \
		$(GPU_WHEEL_PACKAGES)
	@size=$$(du -sm $(GPU_WHEELS) | cut -f1); echo "$(GPU_WHEELS): $$size MiB"; \
		test $$size -lt 32 || { echo "$(GPU_WHEELS) is over 32 MiB"; exit 1; }

gpu-check:
	bash bench/gpu_check.sh

gpu-dryrun:
	$(PYTHON) -P bench/gpu_image_venv.py $(GPU_DRYRUN)/venv
	$(MAKE) --no-print-directory gpu-wheels GPU_WHEELS=$(GPU_DRYRUN)/wheels \
		GPU_WHEELS_PYTHON=$$($(GPU_DRYRUN_PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
	$(GPU_DRYRUN_PY) -P bench/gpu_dryrun.py $(GPU_DRYRUN)
