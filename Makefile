# swakv: `make serve` runs the main job, `make test` the tests. Both install what they need first.
PY ?= python3
# Ray stays on loopback and quiet on these machines (see docs/operations.md).
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_USAGE_STATS_ENABLED := 0
export GLOO_SOCKET_IFNAME := lo

.PHONY: install demo test bench

# torch first, pinned to the CPU build on local disk, so no dependency can pull a CUDA build.
install:
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"

demo: install
	$(PY) -m cluster demo

test: install
	$(PY) -m pytest

bench: install
	$(PY) bench/manager_overhead.py
