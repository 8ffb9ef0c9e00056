"""One local Ray runtime for the whole session (start-up costs ~5 s here), on loopback only."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"   # every Ray process binds 127.0.0.1
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("RAY_worker_niceness", "0")    # actors at the tests' priority, as the server runs them
# Ray's worker processes inherit this and import the project's packages from the checkout.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
# Without a GPU, Triton kernels can only run under the interpreter, which must be chosen before anything
# imports triton (transformers' model code does): so whichever test file runs first, the Triton tests work.
if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def ray_runtime():
    import ray
    from cluster.ray.engine_actor import NAMESPACE
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, namespace=NAMESPACE)
    try:
        yield ray
    finally:
        ray.shutdown()
