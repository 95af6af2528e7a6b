"""The ``npu`` platform against the torch_npu TEST DOUBLE (torch_npu cannot be imported on these
machines; see torch_npu_double.py for exactly what it stands in for)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from rlcore.errors import ConfigError
from rlcore.manager import PluginManager
from rlcore.platforms import dist_backend_for, platform_for, resolve_device


def _npu_manager() -> PluginManager:
    pm = PluginManager()
    pm.activate(["npu"])
    return pm


def test_listing_the_plugin_imports_neither_torch_npu_nor_mindspeed():
    code = ("import sys; from rlcore.manager import PluginManager; pm = PluginManager(); pm.activate(['npu']);"
            "specs = pm.platforms(); assert specs['npu'].dist_backend == 'hccl', specs;"
            "specs['npu'].available();"
            "bad = [m for m in ('torch_npu', 'mindspeed', 'megatron') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_torch_npu_names_the_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import raises ModuleNotFoundError
    pm = _npu_manager()
    with pytest.raises(ConfigError, match="needs torch_npu, which is not installed: pip install torch-npu") as err:
        resolve_device("npu", pm.platforms(), select=pm.select)
    assert err.value.key == "engine.device"


def test_torch_npu_without_cann_says_what_to_source(torch_npu_path):
    torch_npu_path(broken=True)
    pm = _npu_manager()
    assert pm.platforms()["npu"].available()  # installed (find_spec) ...
    with pytest.raises(ConfigError, match="does not import .*libhccl.so.*set_env.sh"):  # ... but unusable
        resolve_device("npu", pm.platforms(), select=pm.select)


def test_activation_imports_torch_npu_and_uses_torch_npu(torch_npu_path):
    torch_npu_path(count=2)
    pm = _npu_manager()
    assert "torch_npu" not in sys.modules
    ctx = type("Ctx", (), {"settings": OmegaConf.create({"mindspeed": "off"})})()
    got = resolve_device("npu:1", pm.platforms(), ctx=ctx, select=pm.select)
    import torch_npu

    assert torch_npu.IS_TEST_DOUBLE and got.device == torch.device("npu", 1)
    assert got.platform.dist_backend == "hccl" and dist_backend_for(got.device) == "hccl"
    assert platform_for("npu:0") is got.platform
    assert got.platform.device_count() == 2
    got.platform.set_device(1)
    got.platform.synchronize()
    assert torch.npu.current_device() == 1
    assert ("set_device", 1) in torch_npu.calls and ("synchronize",) in torch_npu.calls


def test_no_visible_npu_is_an_error(torch_npu_path):
    torch_npu_path(count=0)
    pm = _npu_manager()
    with pytest.raises(ConfigError, match="sees no NPU"):
        resolve_device("npu", pm.platforms(), select=pm.select)


def test_mindspeed_required_but_missing_names_the_install(torch_npu_path, monkeypatch):
    torch_npu_path(count=1)
    monkeypatch.setitem(sys.modules, "mindspeed", None)
    pm = _npu_manager()
    ctx = type("Ctx", (), {"settings": OmegaConf.create({"mindspeed": "required"})})()
    with pytest.raises(ConfigError, match="MindSpeed is not installed: pip install git"):
        resolve_device("npu", pm.platforms(), ctx=ctx, select=pm.select)


def test_check_shows_the_npu_platform_and_validates_its_section(tmp_path):
    from rlcore.stack import load_stack

    cfg = tmp_path / "npu.yaml"
    cfg.write_text("plugins: [npu]\nengine: {device: npu}\nnpu: {mindspeed: auto}\n")
    stack = load_stack(cfg)  # resolving never activates: no torch_npu needed for `rlcore check`
    shown = stack.describe()["platform"]
    assert (shown["name"], shown["dist_backend"], shown["distribution"].split()[0]) == ("npu", "hccl", "rlcore-npu")
    cfg.write_text("plugins: [npu]\nengine: {device: npu}\nnpu: {mindspeed: sometimes}\n")
    with pytest.raises(ConfigError, match="npu.mindspeed must be one of auto, required, off"):
        load_stack(cfg)


def test_the_distribution_does_not_depend_on_torch_npu():
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    every = [*project["dependencies"], *[r for rs in project.get("optional-dependencies", {}).values() for r in rs]]
    assert not [r for r in every if "torch-npu" in r.lower() or "torch_npu" in r.lower()], every
    assert {"rlcore-replay", "rlcore-megatron"} <= {r.split(">")[0].split("=")[0].split("<")[0] for r in every}
