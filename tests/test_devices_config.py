"""One check of a device backend's config keys (devices/base.py), with the messages each backend gave."""

import re

import pytest

from jupyter_gpulease.devices import get_backend
from jupyter_gpulease.devices.base import check_config_keys


def test_unknown_keys_are_named_with_the_allowed_ones_in_the_order_given():
    check_config_keys("static", {"gpus": [], "node": "n1"}, ("gpus", "node"))
    with pytest.raises(ValueError) as e:
        check_config_keys("nvml", {"nodes": 1, "gpu": 2, "state_file": "x"}, ("node", "include_graphics"), passed_through=("gpus", "state_file"))
    assert str(e.value) == "nvml device backend: unknown config key(s) 'gpu', 'nodes'; allowed: 'node', 'include_graphics'"


@pytest.mark.parametrize("name,config,allowed", [
    ("static", {"gpus": [], "bogus": 1}, "'gpus', 'node'"),
    ("simulated", {"bogus": 1, "include_graphics": True}, "'gpus', 'node', 'state_file'"),  # nvml's key passes through 'auto'
    ("slurm", {"bogus": 1}, "'memory_mib', 'nodes_file', 'partitions', 'refresh_s', 'scontrol', 'slurm_conf', 'timeout_s'"),
    ("kubernetes", {"bogus": 1}, "'context', 'dra', 'dra_driver', 'kubeconfig', 'label_selector', 'lost_after_s', 'memory_mib', "
                                 "'nodes_file', 'refresh_s', 'request_timeout_s', 'resource_slices_file'"),
])
def test_each_backend_refuses_an_unknown_key_with_its_message(name, config, allowed):
    with pytest.raises(ValueError, match=re.escape(f"{name} device backend: unknown config key(s) 'bogus'; allowed: {allowed}")):
        get_backend(name, config)
