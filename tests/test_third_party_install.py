"""`pip install examples/third_party_plugin` makes `rlcore plugins --json` list it (a real pip
install into the project venv: uninstalled first, reinstalled by the test)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _plugins_json():
    out = subprocess.run([sys.executable, "-m", "rlcore.cli", "plugins", "--json"], capture_output=True, text=True, check=True)
    return {r["name"]: r for r in json.loads(out.stdout)}


def _pip(*args):
    subprocess.run([sys.executable, "-m", "pip", "-q", "--disable-pip-version-check", *args], check=True,
                   capture_output=True, text=True)


@pytest.mark.slow
def test_pip_install_makes_the_plugin_listed():
    _pip("uninstall", "-y", "rlcore-example-plugin")
    try:
        assert "example" not in _plugins_json()
    finally:
        _pip("install", "--no-deps", "--no-build-isolation", str(ROOT / "examples" / "third_party_plugin"))
    listed = _plugins_json()
    ex = listed["example"]
    assert ex["distribution"] == "rlcore-example-plugin" and ex["version"] == "0.3.0"
    assert ex["status"] == "installed"
    assert ex["hooks"] == ["algorithm", "engine", "environment", "forward_fn", "plugin_settings", "postprocess",
                           "rollout_backend", "step_end"]
    assert ex["provides"] == {"forward_fn": ["example-naive"], "rollout_backend": ["outsider-local"],
                              "engine": ["outsider-hf"], "algorithm": ["example-reinforce"],
                              "environment": ["guess"], "config_section": ["example"]}
    assert listed["reference"]["status"] == "active"  # beside the built-ins
