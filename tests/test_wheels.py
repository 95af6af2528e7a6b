"""Packaging as users meet it: `bin/wheels` builds every distribution of the repository, and a
fresh venv (torch==2.13.0, the CPU build, installed first) gets each one with a plain
`pip install --find-links dist <name>` line, its rlcore dependency resolved from the same folder,
after which `rlcore plugins` lists every entry point with its distribution and version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "scripts" / "constraints.txt"


def _distribution_dirs() -> list[Path]:
    dirs = [ROOT / "core", *sorted(p.parent for p in (ROOT / "plugins").glob("*/pyproject.toml"))]
    return [*dirs, ROOT / "examples" / "third_party_plugin"]


def _project(d: Path) -> dict:
    return tomllib.loads((d / "pyproject.toml").read_text())["project"]


DISTRIBUTIONS = {_project(d)["name"]: _project(d) for d in _distribution_dirs()}


@pytest.fixture(scope="module")
def build_venv(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("build-venv") / "venv"


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory, build_venv) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([str(ROOT / "bin" / "wheels"), str(out)], check=True, capture_output=True, text=True,
                   env=dict(os.environ, RLCORE_BUILD_VENV=str(build_venv)))
    return out


def test_building_wheels_needs_only_the_build_tools(wheel_dir, build_venv):
    """Pure-Python wheels need pypa's build and the setuptools backend, not the 1.6 GB development
    venv with torch that bin/wheels used to create first."""
    size = sum(p.stat().st_size for p in build_venv.rglob("*") if p.is_file() and not p.is_symlink())
    site = next(build_venv.glob("lib/python*/site-packages"))
    assert (site / "build").is_dir(), "the wheels were built with pypa's build"
    assert not (site / "torch").exists(), "the build venv holds no torch"
    assert size < 100 * 2**20, f"the build venv is {size / 2**20:.0f} MiB"


def _wheel_for(wheel_dir: Path, dist: str) -> Path:
    stem = canonicalize_name(dist).replace("-", "_")
    found = [w for w in wheel_dir.glob("*.whl") if canonicalize_name(w.name.split("-")[0]) == canonicalize_name(stem)]
    assert len(found) == 1, f"expected one wheel for {dist} in {wheel_dir}, found {[w.name for w in found]}"
    return found[0]


def _metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return zf.read(name).decode()


def test_every_distribution_builds_one_wheel_with_its_version(wheel_dir):
    for dist, project in DISTRIBUTIONS.items():
        meta = _metadata(_wheel_for(wheel_dir, dist))
        assert f"\nVersion: {project['version']}\n" in meta, f"{dist}: wheel version differs from pyproject"


def test_plugins_depend_on_an_rlcore_range_that_admits_this_rlcore(wheel_dir):
    core_version = DISTRIBUTIONS["rlcore"]["version"]
    for dist in DISTRIBUTIONS:
        if dist == "rlcore":
            continue
        reqs = [Requirement(line.split(":", 1)[1].strip())
                for line in _metadata(_wheel_for(wheel_dir, dist)).splitlines() if line.startswith("Requires-Dist:")]
        on_core = [r for r in reqs if canonicalize_name(r.name) == "rlcore" and r.marker is None]
        assert on_core, f"{dist} does not declare the rlcore versions it supports"
        spec = on_core[0].specifier
        assert spec.contains(core_version), f"{dist} requires rlcore{spec}, which excludes this rlcore {core_version}"
        assert any(s.operator == "<" for s in spec), f"{dist}: rlcore{spec} has no upper bound (PLUGIN_API guards only the hooks)"


def test_the_core_wheel_ships_no_engine_and_no_stale_module(wheel_dir):
    with zipfile.ZipFile(_wheel_for(wheel_dir, "rlcore")) as zf:
        modules = [n for n in zf.namelist() if n.endswith(".py")]
    tracked = set(subprocess.run(["git", "ls-files", "core/src"], cwd=ROOT, check=True, capture_output=True,
                                 text=True).stdout.split())
    untracked = [m for m in modules if f"core/src/{m}" not in tracked]
    assert not untracked, f"the rlcore wheel ships modules that are not in core/src: {untracked}"
    engine_code = [m for m in modules if any(e in m for e in ("megatron", "vllm", "sglang"))]
    assert not engine_code, f"the rlcore wheel ships engine code: {engine_code}"


def test_the_core_wheel_ships_every_example_config(wheel_dir):
    """A user with the wheels only has the example configs (``rlcore init`` writes them): each of
    examples/*.yaml is in the core wheel as rlcore/examples/<name>, byte for byte, and nothing
    else of examples/ (the third-party plugin is its own distribution)."""
    with zipfile.ZipFile(_wheel_for(wheel_dir, "rlcore")) as zf:
        shipped = {n.removeprefix("rlcore/examples/"): zf.read(n) for n in zf.namelist()
                   if n.startswith("rlcore/examples/")}
    repo = {p.name: p.read_bytes() for p in (ROOT / "examples").glob("*.yaml")}
    assert sorted(shipped) == sorted(repo), "the core wheel's rlcore/examples differs from examples/*.yaml"
    assert all(shipped[name] == repo[name] for name in repo)


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "RLCORE_PLUGINS")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, **kw)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
def test_pip_install_from_wheels_into_a_fresh_venv(wheel_dir, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c", str(CONSTRAINTS)]
    _run([*pip, "torch==2.13.0"])                     # torch first, as the README says
    # the README's line (with the Ascend plugin: issue 13's proof; core with its tensorboard extra, as
    # the README installs it), then every other distribution's own line, each a separate pip call
    first = ["rlcore", "rlcore-fused", "rlcore-npu"]
    lines = [["rlcore[tensorboard]", *first[1:]], *[[d] for d in DISTRIBUTIONS if d not in first]]
    for names in lines:
        _run([*pip, "--find-links", str(wheel_dir), *names])
    listed = {row["name"]: row for row in json.loads(_run([str(venv / "bin" / "rlcore"), "plugins", "--json"]).stdout)}
    for dist, project in DISTRIBUTIONS.items():
        for entry_point in project.get("entry-points", {}).get("rlcore", {}):
            row = listed.get(entry_point)
            assert row is not None, f"rlcore plugins does not list {entry_point!r} from {dist}: {sorted(listed)}"
            assert (row["distribution"], row["version"]) == (dist, project["version"])
    # installed from the wheels, not from this checkout
    where = _run([py, "-c", "import rlcore, rlcore_fused; print(rlcore.__file__); print(rlcore_fused.__file__)"]).stdout
    assert all(str(venv) in line for line in where.split()), where
    _run([str(venv / "bin" / "rlcore"), "check", str(ROOT / "examples" / "tiny.yaml")], cwd=tmp_path)
    # without a checkout: the starter config comes from the wheel, checks and trains, and a run
    # installed by the README's line writes TensorBoard events without a note about them
    _run([str(venv / "bin" / "rlcore"), "init", "starter.yaml"], cwd=tmp_path)
    _run([str(venv / "bin" / "rlcore"), "check", "starter.yaml"], cwd=tmp_path)
    trained = _run([str(venv / "bin" / "rlcore"), "train", "starter.yaml", "--output", "run", "training.steps=2",
                    "rollout.n=2", "data.prompts_per_step=2", "output.checkpoint_every=0"], cwd=tmp_path)
    assert "done: 2 steps" in trained.stdout and "TensorBoard" not in trained.stdout, trained.stdout[-2000:]
    assert any((tmp_path / "run" / "tensorboard").iterdir()) and (tmp_path / "run" / "reward_curve.png").is_file()
    # rlcore-npu never pulls torch_npu (it breaks `import torch` where Ascend's CANN is absent), and
    # the stack resolves the npu platform without importing it, and `rlcore check` on this machine
    # (no Ascend device) refuses the device in one line, as `rlcore train` would
    probe = ("import importlib.util, torch; assert importlib.util.find_spec('torch_npu') is None; "
             "print(torch.__version__)")
    _run([py, "-c", probe])
    npu_cfg = tmp_path / "npu.yaml"
    npu_cfg.write_text("plugins: [npu]\nengine: {device: npu}\n")
    resolve = ("import json, sys; from rlcore.stack import load_stack; "
               "print(json.dumps(load_stack(sys.argv[1]).describe()['platform']))")
    shown = json.loads(_run([py, "-c", resolve, str(npu_cfg)], cwd=tmp_path).stdout)
    assert (shown["name"], shown["dist_backend"]) == ("npu", "hccl")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "RLCORE_PLUGINS")}
    refused = subprocess.run([str(venv / "bin" / "rlcore"), "check", str(npu_cfg)], cwd=tmp_path, env=env,
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "rlcore: error: engine.device=npu" in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "Traceback" not in refused.stderr
