"""The configs in ray_configs/ pass Ray's own validation (no launch), and a broken one does not."""
from __future__ import annotations

import copy
import importlib
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.autoscaler.sdk import bootstrap_config
from ray.serve.schema import ServeDeploySchema

from cluster.engine.args import EngineArgs

CONFIGS = Path(__file__).resolve().parents[1] / "ray_configs"


def load(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


@pytest.mark.parametrize("name", ["cluster-aws-gpu.yaml", "cluster-local.yaml"])
def test_cluster_configs_pass_rays_schema(name):
    validate_config(prepare_config(load(name)))


def test_local_cluster_config_bootstraps_without_ssh():
    config = bootstrap_config(load("cluster-local.yaml"), no_config_cache=True)
    assert config["provider"]["type"] == "local"
    assert config["head_node_type"] == "local.cluster.node"


def test_a_cluster_config_with_a_misspelt_field_is_refused():
    broken = copy.deepcopy(load("cluster-aws-gpu.yaml"))
    broken["available_node_types"]["gpu_8x_h100"]["max_wokers"] = 4
    with pytest.raises(Exception, match="max_wokers"):
        validate_config(prepare_config(broken))


def test_serve_config_passes_serves_schema_and_names_a_real_builder():
    schema = ServeDeploySchema.model_validate(load("serve.yaml"))
    assert schema.http_options.host == "127.0.0.1"
    (app,) = schema.applications
    module, attr = app.import_path.split(":")
    assert callable(getattr(importlib.import_module(module), attr))
    # every arg is an EngineArgs field with a valid value (the builder makes one of them), or a serving option
    serving = {"max_body_bytes", "data_parallel_size", "router"}
    EngineArgs.from_dict({k: v for k, v in app.args.items() if k not in serving})
    assert set(app.args) & serving == {"data_parallel_size", "router"}


def test_a_serve_config_with_a_bad_field_is_refused():
    broken = load("serve.yaml")
    broken["http_options"]["port"] = "eighty"
    with pytest.raises(Exception, match="port"):
        ServeDeploySchema.model_validate(broken)


@pytest.mark.parametrize("args, message", [
    ({"router": "random"}, "router must be one of round-robin, least-loaded, prefix, ray-prefix-tree"),
    ({"data_parallel_size": 0}, "data_parallel_size must be an integer >= 1, got 0"),
    ({"data_parallel_size": "2"}, "data_parallel_size must be an integer >= 1, got '2'"),
])
def test_the_serve_builder_refuses_bad_serving_options_before_starting_anything(args, message):
    from cluster.serve.builder import build
    with pytest.raises(ValueError, match=message):
        build({"model": "default", **args})
