"""Device selection goes through the ``platform`` providers (built-in cpu and cuda)."""

import pytest
import torch
from rlcore import errors
from rlcore.platforms import (
    builtin_platforms,
    dist_backend_for,
    platform_for,
    resolve_device,
    select_platform,
)
from rlcore.stack import load_stack


def test_builtin_platforms_resolve_cpu_and_auto():
    got = resolve_device("cpu")
    assert got.device == torch.device("cpu") and got.platform.dist_backend == "gloo"
    assert got.platform.device_count() == 1
    auto = select_platform("auto")
    assert auto.name == ("cuda" if torch.cuda.is_available() else "cpu")
    assert dist_backend_for("cpu") == "gloo" and dist_backend_for(torch.device("cuda", 0)) == "nccl"


def test_unknown_device_type_without_a_manager_lists_the_known_ones():
    with pytest.raises(errors.ConfigError, match="no platform provides device type 'tpu'.*cpu, cuda"):
        resolve_device("tpu")
    with pytest.raises(errors.ConfigError, match="no platform is active for device type 'meta'"):
        platform_for("meta")


def test_auto_with_several_accelerators_asks_to_name_one():
    specs = builtin_platforms()
    from dataclasses import replace

    specs = {**specs, "cuda": replace(specs["cuda"], is_available=lambda: True),
             "xpu": replace(specs["cuda"], name="xpu", is_available=lambda: True)}
    with pytest.raises(errors.ConfigError, match="several accelerators"):
        select_platform("auto", specs)


def test_check_shows_the_platform_and_names_the_plugin_for_npu(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("engine: {device: cpu}\n")
    stack = load_stack(cfg)
    shown = stack.describe()["platform"]
    assert shown["name"] == "cpu" and shown["dist_backend"] == "gloo" and shown["distribution"].startswith("rlcore ")
    cfg.write_text("engine: {device: 'npu:0'}\n")
    with pytest.raises(errors.UnknownProviderError, match="engine.device.*npu.*pip install rlcore-npu|engine.device.*npu.*add npu"):
        load_stack(cfg)
