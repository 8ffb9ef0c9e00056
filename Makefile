# swakv: `make serve` runs the main job, `make test` the tests. Both install what they need first.
PY ?= python3
# Ray stays on loopback and quiet on these machines (see docs/serving.md).
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_USAGE_STATS_ENABLED := 0
export GLOO_SOCKET_IFNAME := lo

.PHONY: install serve demo test loadtest bench cluster-up

# `ray up` config; the AWS example by default (see README, "Run it on a cluster").
CONFIG ?= ray_configs/cluster-aws-gpu.yaml

# torch first, pinned to the CPU build on local disk, so no dependency can pull a CUDA build.
install:
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"

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

cluster-up:
	ray up -y $(CONFIG)
