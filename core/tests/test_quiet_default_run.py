"""What a run says: the default run prints no note and no warning the user cannot act on (a
provider that declares a capability this machine or instance lacks is news only when the config
uses it), while a config that uses such a capability still gets its note or its error; the gaps
stay listed in ``rlcore check --json``."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from rich.console import Console

from rlcore import errors, hookimpl
from rlcore.cli import main
from rlcore.stack import load_config, resolve
from rlcore.types import Cap, RolloutBackendSpec

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny.yaml")
ONE_STEP = ["training.steps=1", "rollout.n=4", "data.prompts_per_step=4", "output.plot=false",
            "output.tensorboard=false"]


def test_the_default_run_prints_no_notes_and_no_warnings(tmp_path):
    """Exactly what a user sees: the CLI in a fresh interpreter with Python's default warning filters."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    proc = subprocess.run([sys.executable, "-c", "import sys; from rlcore.cli import main; sys.exit(main())",
                           "train", TINY, "--output", str(tmp_path / "run"), *ONE_STEP],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == "", f"the default run wrote to stderr:\n{proc.stderr}"
    assert "note:" not in proc.stdout and "lacks" not in proc.stdout, proc.stdout
    assert "done: 1 steps" in proc.stdout


def test_check_of_the_default_config_has_no_notes_and_json_keeps_the_gaps(capsys):
    assert main(["check", TINY]) == 0
    out = capsys.readouterr().out
    assert "note:" not in out and "config OK" in out, out
    assert main(["check", TINY, "--json"]) == 0
    desc = json.loads(capsys.readouterr().out)
    assert desc["notes"] == []
    assert desc["gaps"]["engine"] == {"mtp": "the tiny model has no MTP layers: set engine.model.tiny.mtp_layers >= 1"}


def test_a_config_that_uses_mtp_is_refused_naming_the_gap():
    cfg, pm = load_config(TINY, ["plugins=[mtp]"])
    with pytest.raises(errors.MissingCapabilityError) as e:
        resolve(cfg, pm)
    assert "declares it but cannot provide it here: the tiny model has no MTP layers: set " \
           "engine.model.tiny.mtp_layers >= 1" in str(e.value)


def _gappy_plugin():
    mod = types.ModuleType("gappy")
    mod.PLUGIN_API = 1

    def rollout_backend():
        yield RolloutBackendSpec(
            name="gappy", factory=lambda ctx: None,
            capabilities={Cap.LOGPROBS, Cap.RELEASE_KV_CACHE, Cap.RECEIVE_BUCKETS, Cap.WEIGHT_CHECKSUMS},
            platform_gaps=lambda cfg: {Cap.RELEASE_KV_CACHE: "no sleep mode on this CPU build"},
        )

    mod.rollout_backend = hookimpl(rollout_backend)
    return mod


def test_a_gap_is_a_note_only_when_the_config_uses_the_capability(rlcore_plugin_manager, register_plugin,
                                                                  rlcore_config):
    register_plugin(_gappy_plugin(), "gappy")
    auto = resolve(rlcore_config("rollout.backend=gappy"), rlcore_plugin_manager)  # release_kv_cache: auto
    assert "rollout_backend 'gappy' lacks 'release_kv_cache' here: no sleep mode on this CPU build" in auto.notes
    never = resolve(rlcore_config("rollout.backend=gappy", "rollout.release_kv_cache=never"), rlcore_plugin_manager)
    assert never.notes == [], "nothing in this config releases the KV cache"
    assert never.gaps["rollout_backend"] == {Cap.RELEASE_KV_CACHE: "no sleep mode on this CPU build"}
    assert never.describe()["gaps"]["rollout_backend"] == {Cap.RELEASE_KV_CACHE: "no sleep mode on this CPU build"}


def _narrow_plugin():
    """The local rollout, but the running instance lacks the KV-cache release it declares (as vLLM's
    CPU build does), and, as the local rollout without drafts, speculative decoding."""
    from rlcore.builtin import local

    mod = types.ModuleType("narrow")
    mod.PLUGIN_API = 1
    declared = next(iter(local.rollout_backend())).capabilities

    def build(ctx):
        from rlcore.rollout_local import build_local_rollout

        backend = build_local_rollout(ctx)
        full = backend.capabilities
        backend.capabilities = lambda: full() - {Cap.RELEASE_KV_CACHE}
        backend.lacking = lambda: {Cap.RELEASE_KV_CACHE: "no sleep mode in this build",
                                   Cap.SPECULATIVE: "no draft model loaded"}
        return backend

    def rollout_backend():
        yield RolloutBackendSpec(name="narrow", factory=build, capabilities=declared)

    mod.rollout_backend = hookimpl(rollout_backend)
    return mod


def test_a_running_backend_that_lacks_a_capability_the_config_uses_is_noted(
        rlcore_plugin_manager, register_plugin, rlcore_config, tmp_path):
    from rlcore.trainer import Trainer

    register_plugin(_narrow_plugin(), "narrow")
    stack = resolve(rlcore_config("rollout.backend=narrow", *ONE_STEP, f"output.dir={tmp_path / 'run'}"),
                    rlcore_plugin_manager)
    buf = io.StringIO()
    Trainer(stack, console=Console(file=buf, width=400, highlight=False, soft_wrap=True)).run()
    said = buf.getvalue()
    assert "note: rollout backend 'narrow' lacks 'release_kv_cache': no sleep mode in this build" in said, said
    assert "KV cache stays resident during weight sync" in said
    assert "speculative" not in said, "no draft_depths: nothing in this config uses speculative decoding"
