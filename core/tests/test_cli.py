"""The rlcore CLI: --version, plugins (table, --json, --hook), check, and cheap startup."""

import json
import subprocess
import sys
import time

import pytest

from rlcore import __version__
from rlcore.cli import main

REQUIRED_KEYS = {"name", "distribution", "version", "status", "hooks", "provides"}


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"rlcore {__version__}"


def test_plugins_json_lists_builtins_with_hooks_and_provides(capsys):
    assert main(["plugins", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    by_name = {r["name"]: r for r in rows}
    for r in rows:
        assert REQUIRED_KEYS <= set(r)
    assert by_name["reference"]["status"] == "active"
    assert by_name["reference"]["hooks"] == ["forward_fn"]
    assert by_name["reference"]["provides"] == {"forward_fn": ["reference"]}
    assert by_name["local"]["provides"] == {"rollout_backend": ["local"]}
    assert by_name["inproc"]["distribution"] == "rlcore" and by_name["inproc"]["version"] == __version__


def test_plugins_hook_filter_and_config_marks_active(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("plugins: [example]\n")
    assert main(["plugins", "--json", "--hook", "postprocess", "--config", str(cfg)]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert "example" in rows and all("postprocess" in r["hooks"] for r in rows.values())
    assert rows["example"]["status"] == "active"
    assert all(r["status"] == "installed" for name, r in rows.items() if name != "example")  # e.g. replay
    assert "reference" not in rows  # no postprocess hook
    assert main(["plugins", "--json", "--hook", "postprocess"]) == 0
    assert {r["status"] for r in json.loads(capsys.readouterr().out)} == {"installed"}


def test_plugins_table(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "reference" in out and "active" in out and "rlcore-example-plugin" in out


def test_plugins_startup_imports_no_engine_and_is_fast():
    code = (
        "import sys, time; t = time.perf_counter()\n"
        "from rlcore.cli import main; import io, contextlib\n"
        "with contextlib.redirect_stdout(io.StringIO()): main(['plugins', '--json'])\n"
        "heavy = [m for m in ('torch', 'transformers', 'triton', 'vllm', 'sglang', 'megatron') if m in sys.modules]\n"
        "print(heavy, time.perf_counter() - t)\n"
    )
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    wall = time.perf_counter() - t0
    heavy, inner = out.rsplit("]", 1)
    assert heavy.strip() == "[", f"rlcore plugins imported heavy modules: {heavy}]"
    print(f"rlcore plugins --json: {wall:.3f} s wall including interpreter start ({float(inner):.3f} s inside)")


def test_check_prints_stack(capsys):
    assert main(["check", "examples/tiny.yaml", "rollout.n=4"]) == 0
    out = capsys.readouterr().out
    assert "forward_fn       reference" in out and "rollout_backend  local" in out and "config OK" in out
    assert "[entropy, mask_skips_compute, per_token_temperature" in out  # capabilities are not eaten as markup


def test_check_json(capsys):
    assert main(["check", "examples/tiny.yaml", "--json"]) == 0
    desc = json.loads(capsys.readouterr().out)
    assert desc["weight_sync"]["name"] == "inproc" and "verified" in desc["weight_sync"]["capabilities"]


def test_errors_exit_2_with_message(capsys):
    assert main(["check", "examples/tiny.yaml", "rollout.backend=vllmm"]) == 2
    err = capsys.readouterr().err
    assert "rlcore: error: rollout.backend: 'vllmm' is not a known rollout_backend. Choose one of: local" in err


def test_overrides_after_options_are_accepted(tmp_path, capsys):
    assert main(["train", "examples/tiny.yaml", "--output", str(tmp_path / "o"), "training.steps=2",
                 "rollout.n=2", "data.prompts_per_step=2", "output.plot=false"]) == 0
    assert (tmp_path / "o" / "metrics.jsonl").read_text().count("\n") == 2


def test_check_json_says_what_preflight_measured(capsys):
    """``checked``: what rlcore check measured beyond the config (rlcore.preflight)."""
    assert main(["check", "examples/tiny.yaml", "--json"]) == 0
    checked = json.loads(capsys.readouterr().out)["checked"]
    assert any(line.startswith("model tiny qwen2, ") for line in checked)
    assert any("<= 512 positions" in line for line in checked)
