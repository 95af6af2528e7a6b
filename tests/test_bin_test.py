"""bin/test as the README states it: plain `bin/test` (what CI's .ci/run calls) runs every suite,
`bin/test --quick` the core suite only, without the slow tests. Read from `--plan`, which prints
what would run and runs nothing (no venv is touched)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE_SUITES = sorted(p.stem for p in (ROOT / "scripts" / "suites").glob("*.sh"))


def _plan(*args: str) -> tuple[list[str], str]:
    proc = subprocess.run([str(ROOT / "bin" / "test"), *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    return lines["suites"].split(), lines["core suite markers"]


@pytest.mark.parametrize("args, suites, markers", [
    (["--plan"], ["core", *ENGINE_SUITES], "not engine"),
    (["--plan", "--quick"], ["core"], "not engine and not slow"),
    (["--quick", "--plan"], ["core"], "not engine and not slow"),
    (["--quick", "--plan", "all"], ["core", *ENGINE_SUITES], "not engine and not slow"),
    (["--plan", "vllm"], ["vllm"], "not engine"),
])
def test_what_each_bin_test_command_runs(args, suites, markers):
    assert ENGINE_SUITES, "scripts/suites holds the engine suites"
    assert _plan(*args) == (suites, markers)


def test_ci_runs_plain_bin_test():
    """CI's entry point is plain `bin/test`: every suite (the --quick default does not reach CI)."""
    assert (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1] == "exec bin/test"


def test_the_usage_and_the_readme_say_what_quick_runs():
    usage = subprocess.run([str(ROOT / "bin" / "test"), "--help"], capture_output=True, text=True, timeout=60).stdout
    assert "bin/test --quick         core only" in usage and "everything" in usage
    readme = (ROOT / "README.md").read_text()
    assert "`bin/test --quick`: core\nonly" in readme or "`bin/test --quick` runs the core suite only" in readme


def test_an_unknown_option_is_refused_before_any_venv_is_made():
    proc = subprocess.run([str(ROOT / "bin" / "test"), "--quik"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("bin/test: unknown option --quik")
    assert "[setup]" not in proc.stderr
