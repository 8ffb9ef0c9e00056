# swakv: `make serve` runs the main job, `make test` the tests. Both install what they need first, once:
# into the active virtual environment, else into the project's own (.venv, created here; many systems'
# Python refuses installs, PEP 668). They install again only when pyproject.toml or this Makefile changed.
PYTHON ?= python3
VENV ?= $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),.venv)
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.swakv-installed
# Ray stays on loopback and quiet on these machines (see docs/serving.md).
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_USAGE_STATS_ENABLED := 0
export GLOO_SOCKET_IFNAME := lo

.PHONY: install serve demo test loadtest bench cluster-up

# `ray up` config; the AWS example by default (see README, "Run it on a cluster").
CONFIG ?= ray_configs/cluster-aws-gpu.yaml

$(PY):
	$(PYTHON) -m venv $(VENV) || { echo "could not create $(VENV): install Python's venv module (Debian/Ubuntu:" \
	    "apt install python3-venv), remove $(VENV) and retry; or activate a virtual environment first" >&2; exit 1; }

# torch first, pinned to the CPU build on local disk, so no dependency can pull a CUDA build.
$(INSTALLED): pyproject.toml Makefile | $(PY)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	@touch $@

install: $(INSTALLED)

# The main job: the bundled tiny hybrid model on 127.0.0.1:8000 (Ctrl-C stops everything).
serve: install
	$(PY) -m cluster serve

demo: install
	$(PY) -m cluster demo

test: install
	$(PY) -m pytest

loadtest: install
	$(PY) -m cluster loadtest

bench: install
	$(PY) bench/manager_overhead.py
	$(PY) bench/step_overhead.py --churn
	$(PY) bench/step_overhead.py --worker
	$(PY) bench/fanout.py
	$(PY) bench/sampling.py
	$(PY) bench/retention.py --quiet
	$(PY) bench/router.py

cluster-up: install
	$(VENV)/bin/ray up -y $(CONFIG)
