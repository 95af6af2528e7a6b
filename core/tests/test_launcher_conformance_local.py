"""The built-in ``local`` launcher against the launcher conformance suite (rlcore-ray runs the same
suite in plugins/ray/tests)."""

from rlcore.testing.launcher_conformance import LauncherConformance


class TestLocalLauncher(LauncherConformance):
    overrides = ["cluster.backend=local"]
