"""scripts/gpu/lib.sh's run_limited, the limiter every GPU script runs its parts under.

Each test runs real bash and real processes: a part that finishes, one that outlives its limit (its
Python processes dump their stacks on SIGUSR1, then all are killed), and one that leaves processes
behind (in its own group and in a session of their own). A GPU call depends on this to come back
with stacks instead of a hang, and to start each part on a free card without touching another
part running beside it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "scripts" / "gpu" / "lib.sh"


def run_lib(script: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """``script`` in bash with lib.sh sourced, in tmp_path, with PYTHON the test's interpreter."""
    full_env = {**os.environ, "PYTHON": sys.executable, **env}
    full_env.pop("PYTHONPATH", None)
    return subprocess.run(["bash", "-c", f"source {LIB}\n{script}"], cwd=tmp_path, env=full_env,
                          capture_output=True, text=True, timeout=60)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie is dead, only not yet reaped by its (test) parent


def test_a_part_that_finishes_keeps_its_exit_status_and_output(tmp_path):
    res = run_lib('run_limited --gpumem mem.csv 30 part.log bash -c "echo from the part; echo to stderr >&2; exit 3"\n'
                  'echo "rc=$?"', tmp_path)
    assert res.stdout.strip() == "rc=3", res.stderr
    log = (tmp_path / "part.log").read_text()
    assert "from the part" in log and "to stderr" in log
    assert "reached its limit" not in log
    assert (tmp_path / "mem.csv").exists()  # empty without nvidia-smi, the sampler's rows with it


def test_a_part_past_its_limit_dumps_every_python_stack_then_is_killed_with_its_children(tmp_path):
    # a shell (which has no SIGUSR1 handler and must survive the dump) starts two Python processes
    # that would sleep for 5 minutes; their pids go to a file so the test can look for them after
    (tmp_path / "sleeper.py").write_text("import os, sys, time\n"
                                         "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
                                         "time.sleep(300)\n")
    (tmp_path / "part.sh").write_text('"$PYTHON" sleeper.py child.pid &\n'
                                      '"$PYTHON" sleeper.py main.pid\n'
                                      'echo the shell went on\n')
    t0 = time.monotonic()
    # through a pipe, as scripts/gpu/two_gpu_019.sh filters a part's output into its log
    res = run_lib("stack_dump_site site; export PYTHONPATH=$PWD/site\n"
                  "run_limited 6 /dev/stdout bash part.sh | sed -u 's/^/[part] /' > part.log\n"
                  'echo "rc=${PIPESTATUS[0]}"', tmp_path, RUN_DUMP_LEAD="4", RUN_DUMP_WAIT="2")
    elapsed = time.monotonic() - t0
    assert res.stdout.strip() == "rc=124", res.stderr
    assert 3 <= elapsed < 20
    log = (tmp_path / "part.log").read_text()
    assert "[part] [run_limited] bash reached its limit (6 s): the stacks of every process of it follow" in log
    assert log.count("most recent call first") == 2, log  # both Pythons, the shell between them kept alive
    assert "the shell went on" not in log
    for name in ("child.pid", "main.pid"):
        assert not alive(int((tmp_path / name).read_text())), name


def test_what_a_part_leaves_behind_is_killed_and_nothing_else(tmp_path):
    # left behind: a sleep in the part's process group and one in a session of its own (as an SGLang
    # server or a Ray node is), both orphaned when the part's shell exits; a bystander started
    # outside the part (a part running beside it) must live on
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / "part.sh").write_text("sleep 61 & echo $! > same_group.pid\n"
                                          "setsid bash -c 'echo $$ > own_session.pid; exec sleep 62' &\n"
                                          "sleep 2.5; echo the part ends\n")
        res = run_lib('run_limited 30 part.log bash part.sh\necho "rc=$?"', tmp_path)
        assert res.stdout.strip() == "rc=0", res.stderr
        assert "the part ends" in (tmp_path / "part.log").read_text()
        for name in ("same_group.pid", "own_session.pid"):
            assert not alive(int((tmp_path / name).read_text())), f"{name} outlived its part"
        assert bystander.poll() is None, "a process outside the part was killed"
    finally:
        bystander.kill()
        bystander.wait()


def test_a_part_dies_with_the_script_that_runs_it(tmp_path):
    # `timeout 600 bash scripts/gpu/...sh` on the device: timeout's signal reaches the script's process
    # group, not the part's own; the part must not hold the GPU into the next call
    (tmp_path / "part.sh").write_text("echo $$ > part.pid; exec sleep 63\n")
    script = 'run_limited 60 part.log bash part.sh; echo "returned rc=$?"'
    res = subprocess.run(["timeout", "2", "bash", "-c", f"source {LIB}\n{script}"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 124 and "returned" not in res.stdout
    part = int((tmp_path / "part.pid").read_text())
    deadline = time.monotonic() + 5
    while alive(part) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(part), "the part outlived the script that ran it"


def test_pip_target_returns_pips_status_not_its_filters(tmp_path):
    """``pip_target`` (the offline install every GPU script makes) leaves pip's "already exists"
    notices out, and returns pip's exit status: 0 when pip succeeded and printed nothing but such
    notices (a filter's own status would be 1 there, and a script's ``pip_target ... && touch
    MARKER`` under pipefail never wrote its marker), pip's failure when it failed. pip stands in
    as a ``python3`` on PATH that prints and exits as told, so nothing is installed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "python3"
    stub.write_text('#!/usr/bin/env bash\necho "$*" > args.txt\n'
                    'echo "WARNING: Target directory /tmp/x/pkg already exists."\n'
                    '[ -n "${STUB_ERROR:-}" ] && { echo "ERROR: no wheel"; exit 1; }\nexit 0\n')
    stub.chmod(0o755)
    path = f"{bin_dir}:{os.environ['PATH']}"
    script = 'set -o pipefail\npip_target --no-compile w.whl && echo "marker written"; echo "rc=$?"'
    ok = run_lib(script, tmp_path, PATH=path, SITE=str(tmp_path / "site"))
    assert ok.stdout.splitlines() == ["marker written", "rc=0"], ok.stdout + ok.stderr
    args = (tmp_path / "args.txt").read_text().split()
    assert args[:3] == ["-m", "pip", "install"] and {"--no-index", "--no-deps", "--upgrade"} <= set(args)
    assert args[args.index("--target") + 1] == str(tmp_path / "site") and args[-2:] == ["--no-compile", "w.whl"]
    failed = run_lib(script, tmp_path, PATH=path, STUB_ERROR="1")
    assert failed.stdout.splitlines() == ["ERROR: no wheel", "rc=1"], failed.stdout + failed.stderr
