"""cluster.yaml is a valid Ray autoscaler config (Ray's own schema and checks) with what ray_ckpt needs."""
import os

import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cluster_yaml_validates_against_ray_schema():
    with open(os.path.join(ROOT, "cluster.yaml")) as f:
        config = yaml.safe_load(f)
    validate_config(prepare_config(config))
    assert config["provider"]["type"] == "aws"
    gpu = config["available_node_types"]["gpu_worker"]["node_config"]["InstanceType"]
    assert gpu.startswith(("g", "p"))  # a GPU instance family
    setup = " ".join(config["setup_commands"])
    assert "ray[train,default]>=2.60,<2.61" in setup and "ray_ckpt" in setup


def test_schema_check_catches_mistakes():
    import copy

    import jsonschema
    import pytest
    with open(os.path.join(ROOT, "cluster.yaml")) as f:
        config = yaml.safe_load(f)
    bad = copy.deepcopy(config)
    bad["available_node_types"]["gpu_worker"]["min_workers"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(bad))
    bad = copy.deepcopy(config)
    bad["head_node_type"] = "missing"
    with pytest.raises(ValueError):
        validate_config(prepare_config(bad))
