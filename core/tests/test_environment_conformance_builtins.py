"""Core's environments against the environment conformance kit (the example plugin's ``guess``
runs the same kit in examples/third_party_plugin/tests)."""

from pathlib import Path

from rlcore.testing.environment_conformance import EnvironmentConformance

ROOT = Path(__file__).resolve().parents[2]


class TestSingleTurn(EnvironmentConformance):
    overrides = ["environment.name=single_turn"]


class TestTools(EnvironmentConformance):
    config_path = str(ROOT / "examples" / "tiny_tools.yaml")
    overrides = ["environment.tools=[calc]"]
