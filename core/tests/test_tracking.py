"""Experiment trackers (rlcore/tracking/, docs/tracking.md): the ``tracker`` role, selected many at a
time, each built-in backend read back with its own reader after a real run, and no tracker able to
lose a run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from rlcore import PLUGIN_API, errors, hookimpl
from rlcore.cli import main
from rlcore.config import validate
from rlcore.run_output import MetricsWriter, read_metrics
from rlcore.stack import load_stack
from rlcore.tracking import TrackerWarning
from rlcore.tracking.selection import Trackers, importable, run_versions
from rlcore.types import TrackerSpec

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny.yaml")
RUN = ["training.steps=2", "rollout.n=2", "data.prompts_per_step=2", "output.plot=false", "output.progress=false",
       "output.checkpoint_every=0", "output.export_hf=never"]
BUILTIN = ("tensorboard", "mlflow", "wandb", "trackio")
INSTALLED = [b for b in BUILTIN if importable(b)]


@pytest.fixture(autouse=True)
def _no_plugins_from_the_shell(monkeypatch):
    monkeypatch.delenv("RLCORE_PLUGINS", raising=False)
    for var in ("MLFLOW_TRACKING_URI", "WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="session")
def trackio_store(tmp_path_factory):
    """trackio fixes its store when first imported: one store for every test of the session."""
    return tmp_path_factory.mktemp("trackio-store")


# ------------------------------------------------------------------------------ the role -----

class Recording:
    def __init__(self, run_dir, config, versions, fail_at=None):
        self.run_dir, self.config, self.versions, self.fail_at = run_dir, config, versions, fail_at
        self.logged: list[tuple[int, dict]] = []
        self.closed = 0

    def log(self, step, metrics):
        if step == self.fail_at:
            raise OSError(f"disk full at step {step}")
        self.logged.append((step, metrics))

    def close(self):
        self.closed += 1


def test_hook_tracker(rlcore_plugin_manager, register_plugin, tmp_path):
    """A plugin's tracker joins the built-ins; the role selects many (a list, in order); a run
    output's metrics reach it after the metrics.jsonl line."""
    made = []

    def start(run_dir, config, versions):
        made.append(Recording(run_dir, config, versions))
        return made[-1]

    mod = types.ModuleType("memtrack")
    mod.PLUGIN_API = PLUGIN_API

    @hookimpl
    def tracker():
        yield TrackerSpec(name="memory", factory=start, description="in memory")

    mod.tracker = tracker
    register_plugin(mod, "memtrack", distribution="acme-track", version="1.0")
    pm = rlcore_plugin_manager
    assert set(pm.trackers()) == {*BUILTIN, "memory"}
    assert TrackerSpec.selects == "many" and pm.trackers()["memory"].distribution == "acme-track 1.0"
    assert [s.name for s in pm.select_all("tracker", ["memory", "MLflow"], key="tracking.backends")] == ["memory",
                                                                                                        "mlflow"]
    with pytest.raises(ValueError, match="select_all"):
        pm.select("tracker", "memory", key="tracking.backends")
    with pytest.raises(ValueError, match="select\\("):
        pm.select_all("engine", ["hf"], key="engine.name")
    with pytest.raises(errors.ConfigError, match="'memory' listed more than once") as e:
        pm.select_all("tracker", ["memory", "memory"], key="tracking.backends")
    assert e.value.key == "tracking.backends"

    cfg = validate(OmegaConf.create({"tracking": {"backends": ["memory"]}}))
    writer = MetricsWriter(tmp_path, Trackers.start([pm.trackers()["memory"]], tmp_path, cfg, run_versions(pm)))
    writer.write({"step": 0, "loss": 0.5, "sync_verified": True, "nonfinite": math.nan, "stopped": "why"})
    writer.write({"step": 1, "loss": 0.25, "tokens": 12})
    writer.close()
    (rec,) = made
    assert rec.run_dir == tmp_path and rec.config.tracking.backends == ["memory"]
    assert rec.versions["plugin/memtrack"] == "acme-track 1.0" and "torch" in rec.versions
    assert rec.logged == [(0, {"loss": 0.5}), (1, {"loss": 0.25, "tokens": 12.0})]  # finite numbers, no step
    assert rec.closed == 1 and [r["step"] for r in read_metrics(tmp_path)] == [0, 1]


def test_unknown_backend_names_the_key_and_a_listed_one_twice_too():
    with pytest.raises(errors.ConfigError, match=r"tracking.backends: 'mlfow' is not a known tracker.*mlflow, "
                                                 r"tensorboard, trackio, wandb.*Did you mean 'mlflow'") as e:
        load_stack(TINY, ["tracking.backends=[mlfow]"])
    assert e.value.key == "tracking.backends"
    with pytest.raises(errors.ConfigError, match="'wandb' listed more than once"):
        load_stack(TINY, ["tracking.backends=[wandb,wandb]"])
    with pytest.raises(errors.ConfigError, match="tracking.wandb.mode") as e:
        load_stack(TINY, ["tracking.wandb.mode=offlien"])
    assert e.value.key == "tracking.wandb.mode"


@pytest.mark.parametrize("backend", BUILTIN)
def test_a_missing_package_is_an_error_naming_the_pip_line(monkeypatch, backend):
    monkeypatch.setitem(sys.modules, backend, None)  # as without the package
    with pytest.raises(errors.ConfigError, match=rf"tracker '{backend}' .*needs {backend}, which is not installed: "
                                                 rf"pip install 'rlcore\[{backend}\]'") as e:
        load_stack(TINY, [f"tracking.backends=[{backend}]"])
    assert e.value.key == "tracking.backends"


def test_output_tensorboard_selects_the_tensorboard_tracker_softly(monkeypatch):
    assert [t.name for t in load_stack(TINY).trackers] == (["tensorboard"] if "tensorboard" in INSTALLED else [])
    assert load_stack(TINY, ["output.tensorboard=false"]).trackers == []
    both = load_stack(TINY, ["tracking.backends=[tensorboard]"])  # listed and on by default: one tracker
    assert [t.name for t in both.trackers] == ["tensorboard"]
    with pytest.raises(errors.ConfigError, match="output.tensorboard is false") as e:
        load_stack(TINY, ["tracking.backends=[tensorboard]", "output.tensorboard=false"])
    assert e.value.key == "output.tensorboard"
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    soft = load_stack(TINY)
    assert soft.trackers == [] and any("pip install 'rlcore[tensorboard]'" in n for n in soft.notes)


@pytest.mark.skipif(not INSTALLED, reason="no tracker package installed")
def test_rlcore_check_lists_the_trackers(capsys):
    assert main(["check", TINY, f"tracking.backends=[{','.join(INSTALLED)}]"]) == 0
    out = capsys.readouterr().out
    assert f"trackers         {INSTALLED[0]} (rlcore " in out and all(f"{b} (rlcore " in out for b in INSTALLED)
    assert main(["check", TINY, "--json", "output.tensorboard=false"]) == 0
    assert json.loads(capsys.readouterr().out)["trackers"] == []


# ------------------------------------------------------------------- the real backends -----

def _wandb_records(run_dir: Path) -> list[dict]:
    """The offline run's records, read by wandb's own reader (``wandb leet inspect --json``)."""
    (log,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    cli = Path(sys.executable).with_name("wandb")
    out = subprocess.run([str(cli), "leet", "inspect", "--json", str(log)], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


@pytest.mark.skipif(not INSTALLED, reason="no tracker package installed (pip install 'rlcore[mlflow]' ...)")
def test_every_installed_backend_at_once_in_a_real_run(tmp_path, trackio_store):
    run = tmp_path / "run"
    over = [*RUN, f"tracking.backends=[{','.join(INSTALLED)}]", "tracking.run_name=round-trip",
            f"tracking.trackio.dir={trackio_store}", "tracking.project=rlcore-test"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrackerWarning)  # none may fail
        assert main(["train", TINY, "--output", str(run), *over]) == 0
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1]
    want = [(r["step"], r["reward_mean"], r["loss"]) for r in rows]
    seen = {}

    if "tensorboard" in INSTALLED:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0})
        acc.Reload()
        seen["tensorboard"] = [(e.step, e.value) for e in acc.Scalars("loss")]
        assert [e.step for e in acc.Scalars("reward_mean")] == [0, 1]
        config_text = acc.Tensors("rlcore/config/text_summary")[0].tensor_proto.string_val[0].decode()
        assert "round-trip" in config_text and "backends:" in config_text
        assert "torch" in acc.Tensors("rlcore/versions/text_summary")[0].tensor_proto.string_val[0].decode()
        assert acc.Tensors("rlcore/run_dir/text_summary")[0].tensor_proto.string_val[0].decode() == str(run)

    if "mlflow" in INSTALLED:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow' / 'mlflow.db'}")  # the default store
        exp = client.get_experiment_by_name("rlcore-test")
        (mrun,) = client.search_runs([exp.experiment_id])
        assert mrun.info.run_name == "round-trip" and mrun.info.status == "FINISHED"
        params, tags = mrun.data.params, mrun.data.tags
        assert params["algorithm.name"] == "grpo" and params["rollout.n"] == "2"
        assert params["tracking.backends"] == str(INSTALLED)
        assert tags["rlcore.run_dir"] == str(run) and tags["rlcore.version.rlcore"] and tags["rlcore.version.torch"]
        seen["mlflow"] = [(m.step, m.value) for m in client.get_metric_history(mrun.info.run_id, "loss")]
        assert [m.step for m in client.get_metric_history(mrun.info.run_id, "reward_mean")] == [0, 1]
        assert {f.path for f in client.list_artifacts(mrun.info.run_id, "rlcore")} == {
            "rlcore/config.yaml", "rlcore/versions.json"}
        assert exp.artifact_location.startswith((run / "mlflow").as_uri())  # not ./mlruns in the cwd

    if "wandb" in INSTALLED:
        records = _wandb_records(run)
        (head,) = [r["run"] for r in records if r["type"] == "run"]
        assert head["project"] == "rlcore-test" and head["display_name"] == "round-trip"
        config = head["config"]["update"]
        assert config["algorithm"]["name"] == "grpo" and config["rlcore"]["run_dir"] == str(run)
        assert config["rlcore"]["versions"]["rlcore"] and config["rlcore"]["versions"]["torch"]
        history = [r["history"] for r in records if r["type"] == "history"]
        seen["wandb"] = [(h["step"]["num"] if h["step"] else 0, h["item"]["loss"]) for h in history]
        assert [h["item"]["_step"] for h in history] == [0, 1]

    if "trackio" in INSTALLED:
        from trackio.sqlite_storage import SQLiteStorage

        assert "round-trip" in SQLiteStorage.get_runs("rlcore-test")
        logs = SQLiteStorage.get_logs("rlcore-test", "round-trip")
        seen["trackio"] = [(log["step"], log["loss"]) for log in logs]
        config = SQLiteStorage.get_run_config("rlcore-test", "round-trip")
        assert config["algorithm"]["name"] == "grpo" and config["rlcore"]["run_dir"] == str(run)
        assert config["rlcore"]["versions"]["rlcore"]

    assert set(seen) == set(INSTALLED)
    for backend, points in seen.items():  # every backend has each step's value, as metrics.jsonl does
        assert [s for s, _ in points] == [s for s, _, _ in want], backend
        assert [v for _, v in points] == pytest.approx([loss for _, _, loss in want], rel=1e-6), backend


def _tracking_config(tmp_path, **tracking):
    return validate(OmegaConf.create({"output": {"dir": str(tmp_path)}, "tracking": tracking}))


@pytest.mark.parametrize("store", ["file", "sqlite"])
def test_mlflow_stores_read_back(tmp_path, store):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from rlcore.tracking import mlflow as mlflow_tracker

    uri = (tmp_path / "mlruns").as_uri() if store == "file" else f"sqlite:///{tmp_path / 'store' / 'm.db'}"
    cfg = _tracking_config(tmp_path, backends=["mlflow"], mlflow={"tracking_uri": uri, "experiment": "exp",
                                                                  "run_name": "r1"})
    spec = TrackerSpec(name="mlflow", factory=mlflow_tracker.start)
    writer = MetricsWriter(tmp_path, Trackers.start([spec], tmp_path, cfg, {"rlcore": "0.1.0", "torch": "2.13"}))
    for step in range(3):
        writer.write({"step": step, "loss": 1.0 / (step + 1), "odd name[1]": float(step)})
    writer.close()
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert run.info.run_name == "r1" and run.data.params["tracking.mlflow.run_name"] == "r1"
    assert run.data.tags["rlcore.version.torch"] == "2.13"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [
        (0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    assert len(client.get_metric_history(run.info.run_id, "odd name_1_")) == 3  # MLflow's charset


# -------------------------------------------------------------- no tracker loses the run -----

FLAKY = """
from rlcore import PLUGIN_API, hookimpl
from rlcore.types import TrackerSpec

LOGGED = []

class AtStep:
    def __init__(self, fail_at):
        self.fail_at = fail_at
    def log(self, step, metrics):
        if step == self.fail_at:
            raise ConnectionError("the tracking server went away")
        LOGGED.append(step)
    def close(self):
        pass

def refuse(run_dir, config, versions):
    raise PermissionError("cannot write " + str(run_dir))

@hookimpl
def tracker():
    yield TrackerSpec(name="refuses", factory=refuse)
    yield TrackerSpec(name="breaks", factory=lambda run_dir, config, versions: AtStep(1))
"""


def test_a_failing_tracker_warns_once_and_the_run_completes(tmp_path, fake_distribution):
    fake_distribution("acme-flaky", "2.0", entry_points={"flaky": "flaky_trackers"}, modules={"flaky_trackers": FLAKY})
    run = tmp_path / "run"
    with pytest.warns(TrackerWarning) as caught:
        assert main(["train", TINY, "--output", str(run), *RUN, "training.steps=3", "plugins=[flaky]",
                     "tracking.backends=[refuses,breaks]", "output.tensorboard=false"]) == 0
    said = [str(w.message) for w in caught if issubclass(w.category, TrackerWarning)]
    assert len(said) == 2, said
    assert said[0].startswith("tracker 'refuses' (acme-flaky 2.0) did not start: PermissionError: cannot write")
    assert said[1].startswith("tracker 'breaks' (acme-flaky 2.0) failed at step 1: ConnectionError: the tracking "
                              "server went away")
    assert all("every metric is still in metrics.jsonl" in s for s in said)
    assert sys.modules["flaky_trackers"].LOGGED == [0]  # switched off after its failure, never called again
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2] and all("loss" in r for r in rows)


def test_a_builtin_backend_that_cannot_start_warns_and_the_run_completes(tmp_path):
    pytest.importorskip("mlflow")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    run = tmp_path / "run"
    with pytest.warns(TrackerWarning, match=r"tracker 'mlflow' \(rlcore [^)]+\) did not start"):
        assert main(["train", TINY, "--output", str(run), *RUN, "tracking.backends=[mlflow]",
                     f"tracking.mlflow.tracking_uri=sqlite:///{blocker}/sub/m.db", "output.tensorboard=false"]) == 0
    assert [r["step"] for r in read_metrics(run)] == [0, 1]
