"""The example's ``guess`` environment through rlcore's environment conformance kit, as any
third-party environment would be checked."""

from rlcore.testing.environment_conformance import EnvironmentConformance


class TestGuessEnvironment(EnvironmentConformance):
    overrides = ["plugins=[example]", "environment.name=guess", "environment.max_turns=3"]
